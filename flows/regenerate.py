"""Flow `regenerate_answers`: plan -> launch (or attach) a plain server -> answer
batches (mapped, retried) -> verify. The answers land in regenerate.out as
shards with an index (tasks/regeneration/answer_store.py), which the capture
reads as its dataset; a rerun answers only what is missing.

    python -m flows.regenerate --dataset data.jsonl --regenerate.out runs/x/answers
"""
from __future__ import annotations

import secrets
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Annotated, Optional

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff
from pydantic import Field

from flows.artifacts import artifact_key
from flows.batches import drain
from flows.config import described
from flows.retries import unless_permanent
from flows.verify import VerificationFailed
from tasks.data.dataset import DEMO_DATASET
from tasks.regeneration.answer_store import AnswerStore
from tasks.regeneration.answers import Asker
from tasks.regeneration.config import RegenerateConfig
from tasks.regeneration.pool import AnswerPool
from tasks.regeneration.provenance import provenance, sampled_without_determinism, served_flags
from tasks.regeneration.turns import pin_date
from tasks.regeneration.stage import (
    Progress, answer_batch, answer_server, batch_workers, plan_regeneration, served_ranks,
)
from tasks.server.config import ServerConfig
from tasks.server.launch import check_serves
from tasks.server.supervisor import ServerSupervisor, node_server
from tasks.store.lock import check_held_by, hold_lock
from tasks.target.architectures import load_tokenizer
from tasks.target.models import resolve_model


def server_log(out: Path) -> Path:
    """A launched server's log (and its orphan record) sit with the answers,
    which the run holds locked: two runs never share one."""
    return out / "logs" / "regenerate-server.log"


@task(name="answer-batch", cache_policy=NO_CACHE, retry_condition_fn=unless_permanent)
def answer_batch_task(batch: list, asker: Asker, out: str, server: ServerSupervisor, pool: AnswerPool,
                      parent_run: str | None = None) -> dict:
    log = get_run_logger()
    if parent_run:  # a node's child of regenerate_across_nodes: only while its parent holds the answers
        check_held_by(Path(out), parent_run)
    result = answer_batch(asker, AnswerStore(Path(out)), batch, pool, on_down=server.recover)
    server.forward_log(log)
    log.info("batch of %d: %d answered (%d cut at max_new_tokens), %s tokens in %.1f s -> %s; dropped %d, "
             "quarantined %d; %d of %d in flight", len(batch), result.rows, result.cut, f"{result.answer_tokens:,}",
             result.seconds, result.shard, result.dropped, len(result.quarantined), pool.in_flight, pool.width)
    return {"shard": result.shard, "rows": result.rows, "quarantined": result.quarantined}


@task(name="verify-answers", cache_policy=NO_CACHE)
def verify_answers_task(out: str) -> dict:
    store = AnswerStore(Path(out))
    reports = store.verify()
    create_table_artifact(table=[{**r, "problems": "; ".join(r["problems"])} for r in reports],
                          key=artifact_key("answers-verification", out), description=f"verification of {out}")
    bad = [r for r in reports if not r["ok"]]
    summary = store.summary()
    if bad:
        raise VerificationFailed(f"{len(bad)} of {len(reports)} answer shards in {out} differ from their index: "
                                 + "; ".join(f"{r['shard']}: {', '.join(r['problems'])}" for r in bad[:5]))
    get_run_logger().info("answers verified: %d shards, %d conversations (%d with their last answer cut at "
                          "max_new_tokens), %s generated tokens; %d dropped for a cut answer, %d quarantined",
                          len(reports), summary["rows"], summary["cut"], f"{summary['answer_tokens']:,}",
                          summary["dropped"], summary["quarantined"])
    return summary


# Batch tasks only wait on the run's answer pool (tasks/regeneration/pool.py):
# enough of them keep its width full (stage.batch_workers).
MAX_BATCH_WORKERS = 64


@flow(name="regenerate_answers", task_runner=ThreadPoolTaskRunner(max_workers=MAX_BATCH_WORKERS))
@described
def regenerate_answers(
    server: ServerConfig = ServerConfig(),
    regenerate: RegenerateConfig = RegenerateConfig(),
    dataset: Annotated[str, Field(description="the conversations to answer: JSONL, JSON or Parquet rows of messages "
                                              "or conversations")] = str(DEMO_DATASET),
    rows: Annotated[Optional[list[int]], Field(description="only these dataset rows (0-based): a node's share, "
                                                           "given by regenerate_across_nodes")] = None,
    parent_run: Annotated[Optional[str], Field(description="the regenerate_across_nodes run holding the answers, "
                                                           "which this child answers for")] = None,
    node: Annotated[str, Field(description="the node this child runs on (its work queue)")] = "",
    verify: Annotated[bool, Field(description="verify every answer shard at the end (a node's child leaves it to "
                                              "its parent)")] = True,
) -> dict:
    """The dataset's answers written again by the target, into regenerate.out (resumable)."""
    log = get_run_logger()
    if not regenerate.out:
        raise ValueError("regenerate.out is not set: give the directory the answers go to (a rerun into it answers "
                         "only what is missing)")
    out = Path(regenerate.out).resolve()
    model_path = resolve_model(server.model)
    tokenizer = load_tokenizer(model_path)
    # A node's child writes beside its siblings while the parent holds the lock.
    held = (nullcontext(check_held_by(out, parent_run)) if parent_run else
            hold_lock(out, f"regenerate {dataset}", run=flow_run.get_id()))
    with held, ExitStack() as stack:
        # A node's child opens what its parent made and checked (no hash of
        # a dataset of many GB per share), refused if its own target,
        # template or settings differ (a child rerun from the UI, edited).
        regenerate = pin_date(regenerate, tokenizer, out)  # a child's: its parent's, in its provenance
        if parent_run:
            store = AnswerStore(out)
            store.check_made_from(provenance(None, model_path, regenerate, tokenizer))
        else:
            store = AnswerStore(out, provenance(Path(dataset), model_path, regenerate, tokenizer, server),
                                regenerate.index_url)
        plan = plan_regeneration(Path(dataset), store, regenerate, tokenizer, rows)
        log.info("%d conversations in %s: %d answered before, %d to answer in batches of %d; %d rows rejected%s",
                 plan.rows, dataset, plan.answered, len(plan.todo), regenerate.batch_size, len(plan.rejected),
                 f" (e.g. row {plan.rejected[0].source_row}: {plan.rejected[0].reason})" if plan.rejected else "")
        if plan.todo:
            if server.url:
                supervisor = ServerSupervisor(node_server(server))
            else:
                supervisor = ServerSupervisor(answer_server(server, model_path), server_log(out))
            stack.callback(supervisor.stop)
            log.info("SGLang server for the answers at %s%s", supervisor.start(), f" (node {node})" if node else "")
            check_serves(supervisor.url, model_path, api_key=supervisor.api_key)
            differs = store.check_served(served_flags(supervisor.url, supervisor.api_key), supervisor.url)
            if differs:
                log.warning(differs)
            # A prefix of this run's own: a request a killed run left on the
            # server never shares a rid with this one's.
            asker = Asker(supervisor.url, tokenizer, regenerate, api_key=supervisor.api_key,
                          rid_prefix=f"regen-{secrets.token_hex(4)}-")
            ranks = served_ranks(supervisor.url, supervisor.api_key)  # a node's server: its own, not the section's
            _answer_all(plan, asker, out, supervisor, regenerate, ranks, parent_run)
        summary = {"out": str(out), **(verify_answers_task(str(out)) if verify else store.summary())}
        note = sampled_without_determinism(regenerate, server)
        if note:
            log.warning(note)
            summary["note"] = note
        return summary


def _answer_all(plan, asker: Asker, out: Path, supervisor: ServerSupervisor, regenerate: RegenerateConfig,
                ranks: int, parent_run: str | None) -> None:
    log = get_run_logger()
    width = regenerate.concurrency * ranks
    if batch_workers(width, regenerate.batch_size) > MAX_BATCH_WORKERS:
        log.warning("%d batch tasks at once cannot keep %d conversations in flight in batches of %d: raise "
                    "regenerate.batch_size to at least %d", MAX_BATCH_WORKERS, width, regenerate.batch_size,
                    -(-width // (MAX_BATCH_WORKERS - 1)))
    log.info("answering %d conversations, %d in flight (%d per data-parallel rank x %d), committed in batches "
             "of %d", len(plan.todo), width, regenerate.concurrency, ranks, regenerate.batch_size)
    with AnswerPool(width, api_key=asker.api_key, timeout_s=regenerate.request_timeout_s) as pool:
        _answer_batches(plan, asker, out, supervisor, regenerate, pool, parent_run)


def _answer_batches(plan, asker: Asker, out: Path, supervisor: ServerSupervisor, regenerate: RegenerateConfig,
                    pool: AnswerPool, parent_run: str | None) -> None:
    log = get_run_logger()
    batch_task = answer_batch_task.with_options(retries=regenerate.batch_retries, retry_jitter_factor=0.5,
                                                retry_delay_seconds=exponential_backoff(backoff_factor=10))
    progress = Progress(AnswerStore(out), plan)
    artifact = create_progress_artifact(progress=0.0, key=artifact_key("regeneration-progress", str(out)),
                                        description=f"regeneration into {out}")
    futures = batch_task.map(plan.batches(regenerate.batch_size), unmapped(asker), unmapped(str(out)),
                             unmapped(supervisor), unmapped(pool), unmapped(parent_run))

    def after_each() -> None:
        now = progress.read()
        update_progress_artifact(artifact, progress=min(now["percent"], 100.0),
                                 description=f"regeneration into {out}: {progress.describe(now)}")
        log.info("progress: %s; %.1f conversations in flight on average (width %d)", progress.describe(now),
                 pool.mean_in_flight(), pool.width)
        progress.check(regenerate.max_quarantine_ratio)

    failures = drain(futures, after_each)
    if failures:
        raise RuntimeError(f"{len(failures)} batches failed after their retries: " + "; ".join(failures[:5])
                           + " (rerun the flow: the answered conversations are kept)")


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(regenerate_answers, "python -m flows.regenerate")
