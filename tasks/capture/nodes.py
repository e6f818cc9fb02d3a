"""Extraction across many nodes: the parent run's share-out of the dataset to
node work queues, and the child runs it watches there.

One node = one Prefect worker on its own work queue, beside one long-lived
capture server (tasks/server/node.py starts both). The parent plans once,
cuts the plan into shares of rows and hands them out one share per node at a
time; each share runs as a child flow run of the `extract` deployment sent to
that node's queue (`run_deployment(..., work_queue_name=)`), which captures on
the node's own server and commits shards to the shared store. No router sits
in front of the servers: a dump must be read on the node that wrote it, and a
router's retry could capture a sample twice on another one.

A share whose child run does not complete (Failed, Crashed, Cancelled, or
never started by a worker) goes back to the front of the line for the other
nodes; the ledger, not the child's report, says what it had stored, and the
next child stores only the rest. A node that fails `max_node_failures` shares
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
class Share:
    """One child run's share: dataset rows, with their planned size."""

    index: int
    rows: tuple[int, ...]
    samples: int
    tokens: int


class Dispatcher:
    """Hands shares of the plan to nodes, one at a time per node, and takes
    back the shares whose run failed. Thread-safe: each node is served by
    its own thread (a Prefect task of the parent run).

    Shares shrink as the plan runs out (guided self-scheduling): each is
    half of what is left per healthy node, in whole batches, and never less
    than `min_share` samples. A child run costs a fixed start-up (a process,
    imports, its plan, attaching and warming up: ~10 s, bench/many_nodes.py),
    so early shares are large to make it negligible, and the last ones small
    so that no node is left with a long tail while the others idle."""

    def __init__(self, samples: list, nodes: list[str], max_node_failures: int, *, min_share: int,
                 batch_size: int = 1):
        if not nodes:
            raise ValueError("no node queues to send work to: give at least one work queue")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"node queues must be distinct, got {nodes}")
        self._pending = deque(samples)
        self._returned: deque[Share] = deque()
        self._cut_so_far = 0
        self._in_flight = 0
        self._cond = threading.Condition()
        self.nodes = list(nodes)
        self.min_share, self.batch_size = max(1, min_share), max(1, batch_size)
        self.max_node_failures = max_node_failures
        self.failures_in_a_row = {n: 0 for n in nodes}
        self.done: dict[str, list[Share]] = {n: [] for n in nodes}
        self.drained: dict[str, str] = {}

    def _cut(self) -> Share:
        healthy = len(self.nodes) - len(self.drained)
        size = max(self.min_share, -(-len(self._pending) // (2 * healthy)))
        size = -(-size // self.batch_size) * self.batch_size
        share = [self._pending.popleft() for _ in range(min(size, len(self._pending)))]
        self._cut_so_far += 1
        return Share(self._cut_so_far - 1, tuple(s.source_row for s in share), len(share),
                     sum(s.num_tokens for s in share))

    def take(self, node: str) -> Share | None:
        """The next share for `node`; None once there is none left for it
        (all done, or the node drained). While other nodes still run shares
        that may come back, it waits."""
        with self._cond:
            while True:
                if node in self.drained:
                    return None
                if self._returned or self._pending:
                    self._in_flight += 1
                    return self._returned.popleft() if self._returned else self._cut()
                if self._in_flight == 0:
                    return None
                self._cond.wait()

    def finished(self, node: str, share: Share, error: str | None) -> None:
        """`node` finished `share`: completed (error None) or not (why)."""
        with self._cond:
            self._in_flight -= 1
            if error is None:
                self.failures_in_a_row[node] = 0
                self.done[node].append(share)
            else:
                self.failures_in_a_row[node] += 1
                self._returned.appendleft(share)  # first in line for a healthy node
                if self.failures_in_a_row[node] >= self.max_node_failures:
                    self.drained[node] = (f"{self.failures_in_a_row[node]} shares failed in a row there, "
                                          f"the last: {error}")
            self._cond.notify_all()

    @property
    def left(self) -> int:
        """Samples no node completed (every node drained before they ran)."""
        with self._cond:
            return sum(g.samples for g in self._returned) + len(self._pending)


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
