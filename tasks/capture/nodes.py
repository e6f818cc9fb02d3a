"""Extraction across many nodes: the parent run's share-out of the dataset to
node work queues, and the child runs it watches there.

One node = one Prefect worker on its own work queue, beside one long-lived
capture server (tasks/server/node.py starts both). The parent plans once,
cuts the plan into groups of rows and hands them out one group per node at a
time; each group runs as a child flow run of the `extract` deployment sent to
that node's queue (`run_deployment(..., work_queue_name=)`), which captures on
the node's own server and commits shards to the shared store. No router sits
in front of the servers: a dump must be read on the node that wrote it, and a
router's retry could capture a sample twice on another one.

A group whose child run does not complete (Failed, Crashed, Cancelled, or
never started by a worker) goes back to the front of the line for the other
nodes; the ledger, not the child's report, says what it had stored, and the
next child stores only the rest. A node that fails `max_node_failures` groups
in a row is drained: given nothing more, with the reason logged. A child on
a node that died stays Running in Prefect unless something marks it Crashed:
flow-run heartbeats and the automation `ensure_zombie_automation` creates.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

ZOMBIE_AUTOMATION = "eagle3: crash flow runs that stop sending heartbeats"


@dataclass(frozen=True)
class Group:
    """One child run's share: dataset rows, with their planned size."""

    index: int
    rows: tuple[int, ...]
    samples: int
    tokens: int


def make_groups(samples, group_size: int) -> list[Group]:
    """Cut the plan's samples (in plan order) into groups of `group_size`."""
    return [Group(i // group_size, tuple(s.source_row for s in samples[i: i + group_size]),
                  len(samples[i: i + group_size]), sum(s.num_tokens for s in samples[i: i + group_size]))
            for i in range(0, len(samples), group_size)]


class Dispatcher:
    """Hands groups to nodes, one at a time per node, and takes back the
    groups whose run failed. Thread-safe: each node is served by its own
    thread (a Prefect task of the parent run)."""

    def __init__(self, groups: list[Group], nodes: list[str], max_node_failures: int):
        if not nodes:
            raise ValueError("no node queues to send work to: give at least one work queue")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"node queues must be distinct, got {nodes}")
        self._todo = deque(groups)
        self._in_flight = 0
        self._cond = threading.Condition()
        self.max_node_failures = max_node_failures
        self.failures_in_a_row = {n: 0 for n in nodes}
        self.done: dict[str, list[Group]] = {n: [] for n in nodes}
        self.drained: dict[str, str] = {}

    def take(self, node: str) -> Group | None:
        """The next group for `node`; None once there is none left for it
        (all done, or the node drained). While other nodes still run groups
        that may come back, it waits."""
        with self._cond:
            while True:
                if node in self.drained:
                    return None
                if self._todo:
                    self._in_flight += 1
                    return self._todo.popleft()
                if self._in_flight == 0:
                    return None
                self._cond.wait()

    def finished(self, node: str, group: Group, error: str | None) -> None:
        """`node` finished `group`: completed (error None) or not (why)."""
        with self._cond:
            self._in_flight -= 1
            if error is None:
                self.failures_in_a_row[node] = 0
                self.done[node].append(group)
            else:
                self.failures_in_a_row[node] += 1
                self._todo.appendleft(group)  # first in line for a healthy node
                if self.failures_in_a_row[node] >= self.max_node_failures:
                    self.drained[node] = (f"{self.failures_in_a_row[node]} groups failed in a row there, "
                                          f"the last: {error}")
            self._cond.notify_all()

    @property
    def left(self) -> list[Group]:
        """Groups no node completed (every node drained before they ran)."""
        with self._cond:
            return list(self._todo)


def run_on_node(deployment: str, parameters: dict, queue: str, *, start_timeout_s: float,
                idempotency_key: str, name: str, poll_s: float = 2.0):
    """Run one child of `deployment` on work queue `queue` and wait for its
    end; returns the child's FlowRun in its final state. A child that no
    worker starts within `start_timeout_s` (the node's worker is gone) is
    cancelled, so it can never start later beside its replacement."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.states import Cancelled

    run = run_deployment(deployment, parameters=parameters, work_queue_name=queue, timeout=0,
                         idempotency_key=idempotency_key, flow_run_name=name)
    created = time.monotonic()
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(run.id)
            state = run.state
            if state is not None and state.is_final():
                return run
            waiting = state is None or state.type in (StateType.SCHEDULED, StateType.PENDING)
            if waiting and time.monotonic() - created > start_timeout_s:
                client.set_flow_run_state(run.id, Cancelled(
                    message=f"no worker on queue {queue!r} started it within {start_timeout_s:.0f} s"), force=True)
            time.sleep(poll_s)


def ensure_zombie_automation(within_s: float = 90.0) -> str:
    """Create (once) the automation that marks a flow run Crashed when its
    heartbeats stop for `within_s` (its node died). Workers' flow runs must
    send heartbeats more often: PREFECT_FLOWS_HEARTBEAT_FREQUENCY (>= 30 s).
    Prefect Cloud has this built in; a self-hosted server needs it made."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    try:
        return str(Automation.read(name=ZOMBIE_AUTOMATION).id)
    except ValueError:
        pass
    automation = Automation(
        name=ZOMBIE_AUTOMATION,
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, name="Crashed",
                                    message=f"no heartbeat for {within_s:.0f} s: its node is taken for dead")],
    ).create()
    return str(automation.id)
