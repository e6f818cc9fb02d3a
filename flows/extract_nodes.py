"""Flow `extract_across_nodes`: plan once -> one `node` task per node queue,
each running the node's shares as child `extract` runs there -> re-plan from
the index -> verify. How the share-out works: tasks/capture/nodes.py.

    python -m flows.extract_nodes --help
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal, Optional

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field

from flows import params
from flows.artifacts import artifact_key
from flows.cli import described
from flows.extract import plan_task
from flows.verify import verify_task
from tasks.capture import extraction, nodes
from tasks.store.ledger import SqliteLedger, open_ledger
from tasks.store.lock import hold_lock
from tasks.store.shards import WRITER_NAME, remove_leaked_temps

MAX_NODES = 64  # node tasks each hold a thread of the run until the plan is done


@task(name="node", cache_policy=NO_CACHE, task_run_name="node-{queue}")
def node_task(queue: str, dispatcher: nodes.Dispatcher, deployment: str, child: dict, start_timeout_s: float,
              meter: extraction.ProgressMeter, artifact) -> dict:
    """Feed one node its shares, one child run at a time, until none is left
    for it."""
    log = get_run_logger()
    parent = child["parent_run"]
    samples = tokens = runs = 0
    while (share := dispatcher.take(queue)) is not None:
        runs += 1
        t0 = time.monotonic()
        run = nodes.run_on_node(deployment, {**child, "rows": list(share.rows), "node": queue}, queue,
                                start_timeout_s=start_timeout_s, name=f"{queue}-share-{share.index}",
                                idempotency_key=f"{parent}-{queue}-{runs}")
        seconds = time.monotonic() - t0
        error = None if run.state.is_completed() else f"{run.name} ended {run.state.name}: {run.state.message}"
        dispatcher.finished(queue, share, error)
        if error is None:
            samples, tokens = samples + share.samples, tokens + share.tokens
            log.info("share %d on %s: %d samples, %s tokens in %.0f s (%.0f tok/s) [%s]", share.index, queue,
                     share.samples, f"{share.tokens:,}", seconds, share.tokens / max(seconds, 1e-9), run.name)
        else:
            log.warning("share %d on %s did not complete (%s); it goes back to the queue", share.index, queue,
                        error)
        if queue in dispatcher.drained:
            log.error("node %s drained: %s. Its shares go to the other nodes", queue, dispatcher.drained[queue])
        progress = meter.read()
        update_progress_artifact(artifact, progress=min(progress["percent"], 100.0))
        log.info("progress, all nodes: %s", meter.describe(progress))
    return {"queue": queue, "samples": samples, "tokens": tokens, "drained": dispatcher.drained.get(queue)}


@flow(name="extract_across_nodes", task_runner=ThreadPoolTaskRunner(max_workers=MAX_NODES))
@described
def extract_across_nodes(
    queues: Annotated[list[str], Field(description="the work queues of the nodes (one worker and one capture server "
                                                   "each: tasks/server/node.py); at most 64, one thread of this "
                                                   "run each", min_length=1, max_length=MAX_NODES)],
    store: Annotated[str, Field(description="store directory on storage every node mounts at this path")],
    dataset: params.Dataset = params.DEFAULT_DATASET,
    model: params.Model = params.DEFAULT_MODEL,
    ledger_url: params.LedgerUrl = "env",
    deployment: Annotated[str, Field(description="the deployment the child runs use")] = "extract_hidden_states/extract-node",
    batch_size: params.BatchSize = 32,
    batches_per_child: Annotated[int, Field(description="the smallest share a child run gets, in batches (shares start at half of what is left per node and shrink to this)", ge=1)] = 64,
    concurrency: Annotated[int, Field(description="requests in flight per batch on a node", ge=1)] = 8,
    max_length: params.MaxLength = 2048,
    max_length_policy: Annotated[Literal["truncate", "skip"], Field(description="what to do with a longer sample")] = "truncate",
    aux_layer_ids: Annotated[Optional[list[int]], Field(description="SGLang 'output of layer i' ids; the nodes' servers must capture these")] = None,
    store_dtype: params.StoreDtype = "bfloat16",
    batch_retries: Annotated[int, Field(description="retries of a failed batch inside a child run", ge=0)] = 3,
    max_node_failures: Annotated[int, Field(description="drain a node after this many failed child runs in a row", ge=1)] = 2,
    start_timeout_s: Annotated[float, Field(description="cancel a child run no worker starts within this many seconds (its node is gone)", gt=0)] = 600.0,
    verify: Annotated[bool, Field(description="verify the store at the end")] = True,
) -> dict:
    """Capture EAGLE-3 hidden states on many nodes into one verified store:
    the nodes' work queues each get child `extract` runs for their share."""
    # Queue names name the nodes' shards: refused here, not by every child.
    bad = [q for q in queues if not WRITER_NAME.match(q)]
    if bad:
        raise ValueError(f"node queue names {bad}: use 1-40 of a-z, 0-9 and '-', starting with a letter or digit "
                         f"(they name the shards each node writes)")
    log = get_run_logger()
    store = str(Path(store).resolve())
    run_id = flow_run.get_id()
    # The parent holds the store; its children on other hosts write under it.
    with hold_lock(Path(store), f"extract_across_nodes of {dataset}", run=run_id):
        plan, _, _, _, _ = plan_task(dataset, model, store, max_length, max_length_policy, aux_layer_ids,
                                     store_dtype, ledger_url)
        ledger = open_ledger(Path(store))
        if isinstance(ledger, SqliteLedger) and len(queues) > 1:
            raise ValueError(f"{store} keeps its index in SQLite, which many hosts must not write (not over NFS): "
                             f"use a new store with ledger_url, a PostgreSQL URL (or 'env' for $EAGLE3_LEDGER_URL)")
        dispatcher = nodes.Dispatcher(plan.todo, queues, max_node_failures,
                                      min_share=batch_size * batches_per_child, batch_size=batch_size)
        log.info("%d samples (%s tokens) over %d nodes (%s), in shares of half what is left per node, at least "
                 "%d samples", len(plan.todo), f"{plan.todo_tokens:,}", len(queues), ", ".join(queues),
                 batch_size * batches_per_child)
        child = {"dataset": dataset, "model": model, "store": store, "server_url": "env", "dump_dir": "env",
                 "server_rid_prefix": "env", "batch_size": batch_size, "concurrency": concurrency,
                 "max_length": max_length, "max_length_policy": max_length_policy, "aux_layer_ids": aux_layer_ids,
                 "store_dtype": store_dtype, "batch_retries": batch_retries, "verify": False, "parent_run": run_id}
        meter = extraction.ProgressMeter(ledger, plan.todo_tokens, len(plan.todo))
        artifact = create_progress_artifact(progress=0.0, key=artifact_key("extraction-progress", store),
                                            description=f"extraction into {store} on {len(queues)} nodes")
        reports = [f.result() for f in [node_task.submit(q, dispatcher, deployment, child, start_timeout_s, meter,
                                                         artifact) for q in queues]]
        for r in reports:
            log.info("node %s: %d samples, %s tokens%s", r["queue"], r["samples"], f"{r['tokens']:,}",
                     f"; drained: {r['drained']}" if r["drained"] else "")
        create_table_artifact(table=[{"node": r["queue"], "samples": r["samples"], "tokens": r["tokens"],
                                      "status": "drained: " + r["drained"] if r["drained"] else "OK"}
                                     for r in reports],
                              key=artifact_key("nodes", store), description=f"nodes of the extraction into {store}")
        # The index, not the children's reports, says what is stored.
        stored = ledger.stored_ids()
        missing = [s for s in plan.todo if s.sample_id not in stored]
        # Temps of killed children (every child has ended: nobody writes one).
        leaked = remove_leaked_temps(Path(store))
        if leaked:
            log.warning("removed %d unfinished shard temp files of killed child runs", len(leaked))
        if missing:
            quarantined = set(ledger.quarantined().sample_id.dropna())
            lost = [s for s in missing if s.sample_id not in quarantined]
            if lost:
                raise RuntimeError(f"{len(lost)} samples are not stored and not quarantined after every node was "
                                   f"drained ({'; '.join(f'{q}: {why}' for q, why in dispatcher.drained.items())}): "
                                   f"rerun the flow; stored samples are kept")
        result = {"store": store, "nodes": reports, **ledger.summary()}
        if verify:
            result["verification"] = verify_task(store)
        return result


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(extract_across_nodes, "python -m flows.extract_nodes")
