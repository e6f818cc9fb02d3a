"""Flow `extract_across_nodes`: plan once -> one `node` task per node queue,
each running the node's shares as child `extract` runs there -> re-plan from
the index -> verify. How the share-out works: tasks/capture/nodes.py.

    python -m flows.extract_nodes --help
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field

from flows.artifacts import artifact_key
from flows.config import described
from flows.extract import plan_task
from flows.node_runs import node_task, report_nodes
from flows.run_record import keep_run_config
from flows.verify import VerifyAtEnd, verify_task
from tasks.capture import bookkeeping, nodes, planning
from tasks.capture.config import CaptureConfig
from tasks.server.config import ServerConfig
from tasks.server.supervisor import FROM_NODE
from tasks.store.config import StoreConfig
from tasks.store.ledger.sqlite import SqliteLedger
from tasks.store.lock import hold_lock
from tasks.store.shards import WRITER_NAME, remove_leaked_temps

MAX_NODES = 64  # node tasks each hold a thread of the run until the plan is done
# The target: the server section's own declaration (the nodes' servers serve it).
SERVER_MODEL = ServerConfig.model_fields["model"]


@flow(name="extract_across_nodes", task_runner=ThreadPoolTaskRunner(max_workers=MAX_NODES))
@described
def extract_across_nodes(
    queues: Annotated[list[str], Field(description="the work queues of the nodes (one worker and one capture server "
                                                   "each: python -m flows.node); at most 64, one thread of this "
                                                   "run each", min_length=1, max_length=MAX_NODES)],
    model: Annotated[str, SERVER_MODEL] = SERVER_MODEL.default,
    capture: CaptureConfig = CaptureConfig(),
    store: StoreConfig = StoreConfig(),
    deployment: Annotated[str, Field(description="the deployment the child runs use")] = "extract_hidden_states/extract-node",
    batches_per_child: Annotated[int, Field(description="the smallest share a child run gets, in batches (shares start at half of what is left per node and shrink to this)", ge=1)] = 64,
    max_node_failures: Annotated[int, Field(description="drain a node after this many failed child runs in a row", ge=1)] = 2,
    start_timeout_s: Annotated[float, Field(description="cancel a child run no worker starts within this many seconds (its node is gone)", gt=0)] = 600.0,
    busy_limit_s: Annotated[float, Field(description="drain a node still busy with an earlier child run (a stopped or hung one that holds its dump dir) after this many seconds; tried again every quarter of it, at most every 30 s, until then", gt=0)] = 600.0,
    verify: VerifyAtEnd = True,
) -> dict:
    """Capture EAGLE-3 hidden states on many nodes into one verified store:
    the nodes' work queues each get child `extract` runs for their share,
    on the nodes' own capture servers (whose settings the nodes were started
    with: the capture section's aux_layer_ids must be theirs)."""
    # Queue names name the nodes' shards: refused here, not by every child.
    bad = [q for q in queues if not WRITER_NAME.match(q)]
    if bad:
        raise ValueError(f"node queue names {bad}: use 1-40 of a-z, 0-9 and '-', starting with a letter or digit "
                         f"(they name the shards each node writes)")
    log = get_run_logger()
    path = Path(store.path).resolve()
    store = store.model_copy(update={"path": str(path)})
    run_id = flow_run.get_id()
    # The parent holds the store; its children on other hosts write under it.
    with hold_lock(path, f"extract_across_nodes of {capture.dataset}", run=run_id):
        keep_run_config(path / "runs", "extract_across_nodes", path)
        planned = plan_task(model, capture, store)
        plan, ledger = planned.plan, planned.store.ledger
        if isinstance(ledger, SqliteLedger) and len(queues) > 1:
            raise ValueError(f"{path} keeps its index in SQLite, which many hosts must not write (not over NFS): "
                             f"use a new store with store.ledger_url, a PostgreSQL URL (or 'env' for "
                             f"$EAGLE3_LEDGER_URL)")
        # The whole plan, before any child: each child checks only its share,
        # which fits long after the plan has stopped fitting.
        space = planning.storage_preflight(plan, path, None, hidden_size=planned.target.hidden_size,
                                             in_flight_tokens=0, dtype=planned.store.dtype)
        log.info("storage: the whole plan needs %.3f GiB in the store (%.1f GiB free at %s)",
                 space["store_bytes"] / 2**30, space["store_free"] / 2**30, path)
        dispatcher = nodes.Dispatcher(plan.todo, queues, max_node_failures,
                                      min_share=capture.batch_size * batches_per_child, batch_size=capture.batch_size,
                                      busy_limit_s=busy_limit_s)
        log.info("%d samples (%s tokens) over %d nodes (%s), in shares of half what is left per node, at least "
                 "%d samples", len(plan.todo), f"{plan.todo_tokens:,}", len(queues), ", ".join(queues),
                 capture.batch_size * batches_per_child)
        # The children run the extract flow on this run's sections, each on
        # its node's own server (server.url "env": tasks/server/supervisor.py).
        child = {"server": ServerConfig(model=model, url=FROM_NODE).model_dump(mode="json"),
                 "capture": capture.model_dump(mode="json"), "store": store.model_dump(mode="json"),
                 "verify": False, "parent_run": run_id}
        meter = bookkeeping.ProgressMeter(ledger, plan.todo_tokens, len(plan.todo))
        artifact = create_progress_artifact(progress=0.0, key=artifact_key("extraction-progress", path),
                                            description=f"extraction into {path} on {len(queues)} nodes")
        reports = [f.result() for f in [node_task.submit(q, dispatcher, deployment, child, start_timeout_s, meter,
                                                         artifact) for q in queues]]
        report_nodes(reports, log, path, "extraction", "samples")
        # The index, not the children's reports, says what is stored.
        stored = ledger.stored_ids()
        missing = [s for s in plan.todo if s.sample_id not in stored]
        # Temps of killed children (every child has ended: nobody writes one).
        leaked = remove_leaked_temps(path)
        if leaked:
            log.warning("removed %d unfinished shard temp files of killed child runs", len(leaked))
        if missing:
            quarantined = set(ledger.quarantined().sample_id.dropna())
            lost = [s for s in missing if s.sample_id not in quarantined]
            if lost:
                raise RuntimeError(f"{len(lost)} samples are not stored and not quarantined after every node was "
                                   f"drained ({'; '.join(f'{q}: {why}' for q, why in dispatcher.drained.items())}): "
                                   f"rerun the flow; stored samples are kept")
        result = {"store": str(path), "nodes": reports, **ledger.summary()}
        if verify:
            result["verification"] = verify_task(str(path))
        return result


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(extract_across_nodes, "python -m flows.extract_nodes")
