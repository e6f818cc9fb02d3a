"""Child flow runs on a node's work queue, one node's feed of them (the
`node` task of a parent run: extraction's and regeneration's), and the
heartbeat automation that marks a dead node's runs Crashed: Prefect's side
of the work spread over nodes (the share-out itself is tasks/capture/nodes.py;
a stream run's part queue, tasks/stream/parts.py).

Every call to the Prefect API while a child runs is retried for
API_PATIENCE_S (a server restart, a network blip) before the child is given
up on and its work handed back.
"""
from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Callable

import httpx
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact, update_progress_artifact
from prefect.automations import Automation
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification
from prefect.runtime import flow_run
from prefect.states import Cancelled

from flows.artifacts import artifact_key

from tasks.capture import nodes

ZOMBIE_AUTOMATION = "eagle3: crash flow runs that stop sending heartbeats"
API_PATIENCE_S = 300.0


@task(name="node", cache_policy=NO_CACHE, task_run_name="node-{queue}")
def node_task(queue: str, dispatcher: nodes.Dispatcher, deployment: str, child: dict, start_timeout_s: float,
              meter, artifact) -> dict:
    """Feed one node its shares, one child run of `deployment` at a time
    (`child`: its parameters, less the share's rows and the node's name),
    until none is left for it. `meter`: the parent's progress, read() from
    the index and describe()d."""
    log = get_run_logger()
    parent = child["parent_run"]
    # A retry of the parent keeps its id: the attempt keeps its children's
    # keys apart from the earlier attempts' (Prefect would hand those back).
    attempt = flow_run.run_count

    def run_share(share: nodes.Share, n: int) -> tuple[str | None, str]:
        run = run_on_node(deployment, {**child, "rows": list(share.rows), "node": queue}, queue,
                          start_timeout_s=start_timeout_s, name=f"{queue}-share-{share.index}",
                          idempotency_key=f"{parent}-{attempt}-{queue}-{n}")
        return (None if run.state.is_completed() else f"{run.name} ended {run.state.name}: {run.state.message}",
                run.name)

    def on_progress() -> None:
        progress = meter.read()
        update_progress_artifact(artifact, progress=min(progress["percent"], 100.0))
        log.info("progress, all nodes: %s", meter.describe(progress))

    return nodes.feed_node(queue, dispatcher, run_share, log, on_progress)


def report_nodes(reports: list[dict], log, path, what: str, unit: str) -> None:
    """Each node's part of a parent run (node_task's reports: `unit` is
    what its shares held) in its log and in the run's nodes table."""
    for r in reports:
        tokens = f", {r['tokens']:,} tokens" if r["tokens"] else ""
        log.info("node %s: %d %s%s%s", r["queue"], r["samples"], unit, tokens,
                 f"; drained: {r['drained']}" if r["drained"] else "")
    create_table_artifact(table=[{"node": r["queue"], unit: r["samples"], "tokens": r["tokens"],
                                  "status": "drained: " + r["drained"] if r["drained"] else "OK"} for r in reports],
                          key=artifact_key("nodes", path), description=f"nodes of the {what} into {path}")


def run_on_node(deployment: str, parameters: dict, queue: str, *, start_timeout_s: float,
                idempotency_key: str, name: str, poll_s: float = 2.0):
    """Run one child of `deployment` on work queue `queue` and wait for its
    end; returns the child's FlowRun in its final state. A child that no
    worker starts within `start_timeout_s` (the node's worker is gone) is
    cancelled, so it can never start later beside its replacement."""
    # The same idempotency key on every try: a retried call gets the child
    # the first one created, never a second one.
    run = patiently(lambda: run_deployment(deployment, parameters=parameters, work_queue_name=queue, timeout=0,
                                           idempotency_key=idempotency_key, flow_run_name=name), what="start")
    created = time.monotonic()
    with get_client(sync_client=True) as client:
        while True:
            run = patiently(lambda: client.read_flow_run(run.id), what=f"watch {run.name}")
            state = run.state
            if state is not None and state.is_final():
                return run
            waiting = state is None or state.type in (StateType.SCHEDULED, StateType.PENDING)
            if waiting and time.monotonic() - created > start_timeout_s:
                patiently(lambda: client.set_flow_run_state(run.id, Cancelled(
                    message=f"no worker on queue {queue!r} started it within {start_timeout_s:.0f} s"), force=True),
                    what=f"cancel {run.name}")
            time.sleep(poll_s)


def patiently(call: Callable, *, what: str, patience_s: float | None = None):
    """`call()`, retried with growing pauses while the Prefect API cannot be
    reached or answers 5xx, for at most `patience_s` (API_PATIENCE_S)."""
    deadline = time.monotonic() + (API_PATIENCE_S if patience_s is None else patience_s)
    pause = 1.0
    while True:
        try:
            return call()
        except (httpx.TransportError, httpx.HTTPStatusError, OSError) as e:
            status = getattr(getattr(e, "response", None), "status_code", 500)
            if status < 500 or time.monotonic() + pause > deadline:
                raise RuntimeError(f"could not {what}: the Prefect API failed for "
                                   f"{API_PATIENCE_S if patience_s is None else patience_s:.0f} s ({e!r})") from e
            logging.getLogger("eagle3.nodes").warning("the Prefect API failed (%r); trying to %s again in %.0f s",
                                                      e, what, pause)
            time.sleep(pause)
            pause = min(pause * 2, 30.0)


def ensure_zombie_automation(within_s: float = 90.0) -> str:
    """Create (once) the automation that marks a flow run Crashed when its
    heartbeats stop for `within_s` (its node died). Workers' flow runs must
    send heartbeats more often: PREFECT_FLOWS_HEARTBEAT_FREQUENCY (>= 30 s).
    Prefect Cloud has this built in; a self-hosted server needs it made."""
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
