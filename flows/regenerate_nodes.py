"""Flow `regenerate_across_nodes`: plan once -> one `node` task per node queue,
each running the node's shares as child `regenerate_answers` runs there, on
the node's own server -> check every conversation answered or quarantined,
from the index -> verify. The share-out is the capture's
(tasks/capture/nodes.py): a share whose child does not complete goes to
the other nodes, and a node that keeps failing is drained. The answers'
index is in PostgreSQL (regenerate.index_url), which every node writes.

    python -m flows.regenerate_nodes --help
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
from flows.node_runs import node_task, report_nodes
from flows.regenerate import verify_answers_task
from tasks.capture import nodes
from tasks.data.dataset import DEMO_DATASET
from tasks.regeneration.answer_index import SqliteIndex
from tasks.regeneration.answer_store import AnswerStore
from tasks.regeneration.config import RegenerateConfig
from tasks.regeneration.provenance import provenance
from tasks.regeneration.stage import Progress, plan_regeneration
from tasks.regeneration.turns import pin_date
from tasks.server.config import ServerConfig
from tasks.server.supervisor import FROM_NODE
from tasks.store.lock import hold_lock
from tasks.target.architectures import load_tokenizer
from tasks.target.models import resolve_model

MAX_NODES = 64  # node tasks each hold a thread of the run until the plan is done
SERVER_MODEL = ServerConfig.model_fields["model"]  # the target: the nodes' servers serve it


@flow(name="regenerate_across_nodes", task_runner=ThreadPoolTaskRunner(max_workers=MAX_NODES))
@described
def regenerate_across_nodes(
    queues: Annotated[list[str], Field(description="the work queues of the nodes (one worker and one server each: "
                                                   "python -m flows.node); at most 64", min_length=1,
                                       max_length=MAX_NODES)],
    model: Annotated[str, SERVER_MODEL] = SERVER_MODEL.default,
    regenerate: RegenerateConfig = RegenerateConfig(),
    dataset: Annotated[str, Field(description="the conversations to answer: JSONL, JSON or Parquet rows of messages "
                                              "or conversations")] = str(DEMO_DATASET),
    deployment: Annotated[str, Field(description="the deployment the child runs use")] = "regenerate_answers/regenerate-node",
    batches_per_child: Annotated[int, Field(description="the smallest share a child run gets, in batches (shares start at half of what is left per node and shrink to this)", ge=1)] = 16,
    max_node_failures: Annotated[int, Field(description="drain a node after this many failed child runs in a row", ge=1)] = 2,
    start_timeout_s: Annotated[float, Field(description="cancel a child run no worker starts within this many seconds (its node is gone)", gt=0)] = 600.0,
) -> dict:
    """A dataset's answers written again by the target on many nodes' servers,
    into one verified answers directory (resumable: a rerun answers only the rest)."""
    log = get_run_logger()
    if not regenerate.out:
        raise ValueError("regenerate.out is not set: give the directory the answers go to (on storage every node "
                         "mounts at the same path)")
    out = Path(regenerate.out).resolve()
    regenerate = regenerate.model_copy(update={"out": str(out)})
    dataset = str(Path(dataset).resolve())
    model_path = resolve_model(model)
    run_id = flow_run.get_id()
    # The parent holds the answers; its children on other hosts write under it.
    with hold_lock(out, f"regenerate_across_nodes of {dataset}", run=run_id):
        tokenizer = load_tokenizer(model_path)
        regenerate = pin_date(regenerate, tokenizer, out)
        store = AnswerStore(out, provenance(Path(dataset), model_path, regenerate, tokenizer), regenerate.index_url)
        if isinstance(store.index, SqliteIndex) and len(queues) > 1:
            raise ValueError(f"the answers in {out} keep their index in SQLite, which many hosts must not write (not "
                             f"over NFS): use a new regenerate.out with regenerate.index_url, a PostgreSQL URL (or "
                             f"'env' for $EAGLE3_LEDGER_URL)")
        plan = plan_regeneration(Path(dataset), store, regenerate, tokenizer)
        dispatcher = nodes.Dispatcher(plan.todo, queues, max_node_failures,
                                      min_share=regenerate.batch_size * batches_per_child,
                                      batch_size=regenerate.batch_size)
        log.info("%d conversations in %s: %d answered before, %d to answer over %d nodes (%s) in shares of at least "
                 "%d; %d rows rejected", plan.rows, dataset, plan.answered, len(plan.todo), len(queues),
                 ", ".join(queues), regenerate.batch_size * batches_per_child, len(plan.rejected))
        # Each child attaches to its node's own server (server.url "env").
        child = {"server": ServerConfig(model=model, url=FROM_NODE).model_dump(mode="json"),
                 "regenerate": regenerate.model_dump(mode="json"), "dataset": dataset, "verify": False,
                 "parent_run": run_id}
        progress = Progress(store, plan)
        artifact = create_progress_artifact(progress=0.0, key=artifact_key("regeneration-progress", str(out)),
                                            description=f"regeneration into {out} on {len(queues)} nodes")
        reports = [f.result() for f in [node_task.submit(q, dispatcher, deployment, child, start_timeout_s, progress,
                                                         artifact) for q in queues]]
        report_nodes(reports, log, out, "regeneration", "conversations")
        # The index, not the children's reports, says what is answered.
        answered = store.answered_ids() | store.dropped_ids()
        quarantined = {r[0] for r in store.quarantined()}
        lost = [c.source_row for c in plan.todo if c.row_id not in answered and c.row_id not in quarantined]
        # Files of killed children; one taken for dead that goes on is refused at its commit.
        leaked = store.remove_unindexed()
        if leaked:
            log.warning("removed %d answer files no commit names (children killed mid-batch)", len(leaked))
        if lost:
            raise RuntimeError(f"{len(lost)} conversations (rows {lost[:10]}) are neither answered nor quarantined "
                               f"after every node was drained ({'; '.join(f'{q}: {why}' for q, why in dispatcher.drained.items())}): "
                               f"rerun the flow; the answered ones are kept")
        return {"out": str(out), "nodes": reports, **verify_answers_task(str(out))}


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(regenerate_across_nodes, "python -m flows.regenerate_nodes")
