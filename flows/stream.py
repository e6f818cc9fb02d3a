"""The pipeline's `mode: stream`: capture and training at once, in one run.

    plan the training order -> capture in that order (a submitted task: on the
                               server, or by capture nodes leasing its parts)
                            || train_drafter with train.stream
                            || the progress artifact (a submitted task) -> all done

The trainer plans the batches an offline run over the finished store would
(tasks/stream/), so the weights are the same; the wall time is the
longer of the two sides instead of their sum. With `train.spool_bytes` each
epoch is captured again into a spool the trainer empties shard by shard, and
the capture waits while the spool is full: the disk holds a budget, not the
dataset; with `train.cache_epochs` the first samples of the first epoch,
as many as the budget holds beside the spool, are kept for every epoch. A
progress artifact shows both sides.
"""
from __future__ import annotations

import contextvars
import logging
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows.artifacts import artifact_key
from flows.node_runs import run_on_node
from flows.extract import create_store, extract_hidden_states, one_server
from flows.train import train_drafter
from tasks.capture.config import CaptureConfig
from tasks.server.config import ServerConfig
from tasks.store.config import StoreConfig
from tasks.store.lock import hold_lock
from tasks.target.checkpoint import Target
from tasks.target.models import resolve_model
from tasks.stream.parts import HELD_OUT, PartQueue, capture_parts, rewound_parts, trim_spool
from tasks.stream.plan import StreamPlan, plan_stream, require_shared_index
from tasks.stream.progress import cached_note, describe_progress, log_captured
from tasks.stream.spool import SpoolBudget, TrainerRestarted, TrainerStopped, read_position, spooled_bytes
from tasks.stream.state import mark_capture, mark_trainer, trainer_state, trainer_stopped
from tasks.train.config import TrainConfig

logger = logging.getLogger("eagle3.stream")

NODES_POLL_S = 2.0
# The capture nodes' loops (flows/stream_node.py), one child run per node.
STREAM_NODE = "stream_capture_node/stream-node"
START_TIMEOUT_S = 600.0  # a node loop no worker starts within this is cancelled: its node is gone
PROGRESS_EVERY_S = 5.0


@task(name="plan-stream-order", cache_policy=NO_CACHE)
def stream_plan_task(model: str, capture: CaptureConfig, train: TrainConfig, store: StoreConfig,
                     served_prompts: int = 0) -> StreamPlan:
    root = Path(store.path)
    plan = plan_stream(model, capture, train, root, dtype=store.dtype, served_prompts=served_prompts)
    if train.spool_bytes is not None and (trimmed := trim_spool(root, plan)):
        epoch, done = read_position(root)
        logger.info("stream: resuming at epoch %d, batch %d: %.1f MiB spooled after the first sample missing from "
                    "there removed, to be captured again in its turn", epoch + 1, done, trimmed / 2**20)
    logger.info("stream: %d held-out samples, then %d epoch(s) of %d batches captured in the order training reads "
                "them%s", len(plan.heldout), len(plan.epochs), len(plan.epochs[0]),
                f"; spool {train.spool_bytes / 2**30:.2f} GiB ({plan.bytes_per_token:,} bytes per token)"
                if train.spool_bytes is not None else "; every shard kept in the store")
    return plan


@task(name="capture-for-training", cache_policy=NO_CACHE)
def capture_task(server: ServerConfig, capture: CaptureConfig, store: StoreConfig, train: TrainConfig,
                 plan: StreamPlan, nodes: tuple[str, ...] = ()) -> dict:
    """Capture in the plan's order, on the server section's server or on
    capture nodes; its end (completed or failed) is recorded for the
    trainer, which otherwise waits for what it needs."""
    mark_capture(Path(store.path), "running")
    try:
        result = (capture_on_nodes(list(nodes), server.model, capture, store, train, plan) if nodes
                  else capture_in_order(server, capture, store, train, plan))
    except BaseException as e:
        mark_capture(Path(store.path), "failed", f"{type(e).__name__}: {e}"[:500])
        raise
    mark_capture(Path(store.path), "completed")
    return result


def capture_in_order(server: ServerConfig, capture: CaptureConfig, store: StoreConfig, train: TrainConfig,
                     plan: StreamPlan) -> dict:
    """The plan's parts (tasks/stream/parts.py) in order: held-out
    samples (and the rows to quarantine) into the store, then the training
    samples in training order: without a spool the first epoch's into the
    store; with one, every epoch's into its spool store, each part once the
    spool has room for it, from the trainer's last checkpointed position on
    (what it trained since is captured again). Between parts, a trainer
    that stopped stops the capture. One server for all of it, launched here
    or attached."""
    root = Path(store.path)
    parts = capture_parts(plan, capture.batch_size, root, train.spool_bytes)
    budget = SpoolBudget(root, plan.spool_room(train.spool_bytes))
    with ExitStack() as stack:
        if not server.url:  # launch once; each part of the capture attaches to it
            server, capture = stack.enter_context(one_server(server, capture, root))
        peak, captured, paused, started = budget.held(), 0, 0.0, time.time()
        while parts:
            if trainer_stopped(root):
                raise TrainerStopped(f"the stream trainer stopped; the capture into {root} stops too, keeping what "
                                     f"it stored: run the pipeline again and both resume")
            try:
                if budget.restarted():
                    raise TrainerRestarted()
                if parts[0].need:
                    paused += budget.wait_for_room(parts[0].need, parts[0].epoch)
            except TrainerRestarted:
                parts = rewound_parts(plan, capture.batch_size, root, train.spool_bytes)
                logger.info("stream capture: the trainer started again from its checkpoint (epoch %d, batch %d): "
                            "rewound to it, %d parts to go", *read_position(root), len(parts))
                continue
            part = parts.pop(0)
            # A spool store's index is where the store's is: PostgreSQL when
            # trainer ranks on other nodes read it (require_shared_index).
            into = store.model_copy(update={"path": str(part.store(root))}) if part.into else store
            extract_hidden_states(server=server, capture=capture, store=into, verify=False, rows=list(part.rows))
            if part.epoch != HELD_OUT:
                peak, captured = max(peak, budget.held()), captured + part.tokens
                log_captured(root, plan, part, captured, started, paused, peak, budget.room)
    if budget.room is not None:
        logger.info("stream capture done: spool peak %.1f of %.1f MiB, paused %.0f s while it was full%s",
                    peak / 2**20, budget.room / 2**20, paused, cached_note(plan))
    return {"store": str(root), "tokens": captured, "spool_peak_bytes": peak, "spool_bytes": train.spool_bytes,
            "cached_bytes": plan.cached_bytes, "paused_s": paused}


def capture_on_nodes(nodes: list[str], model: str, capture: CaptureConfig, store: StoreConfig, train: TrainConfig,
                     plan: StreamPlan) -> dict:
    """The plan's parts captured by capture nodes (`python -m flows.node`),
    each running one stream_capture_node child run on its work queue that
    leases the parts in order from the store's index
    (tasks/stream/parts.py). This run holds the store and its spool
    stores (the children write under its lock), creates them (their
    indexes in PostgreSQL, which every node reaches), shows the capture's
    progress, and returns once every part is done: a node that dies leaves
    its part to the others once its lease runs out."""
    if not store.ledger_url:  # (refused before the plan: require_shared_index)
        raise ValueError("capture nodes write the store's index from their own hosts: set store.ledger_url to a "
                         "PostgreSQL URL (or 'env' for $EAGLE3_LEDGER_URL)")
    root = Path(store.path)
    parts = capture_parts(plan, capture.batch_size, root, train.spool_bytes)
    room = plan.spool_room(train.spool_bytes)
    target = Target.load(str(resolve_model(model)), capture.aux_layer_ids)
    tokenizer = target.tokenizer()
    with ExitStack() as stack:
        run = stack.enter_context(hold_lock(root, f"stream capture of {capture.dataset}",
                                            run=flow_run.get_id() or f"local-{uuid.uuid4().hex}")).get("run")
        if run is None:
            raise RuntimeError(f"{root} is held by this run without its flow run id, which the capture nodes check: "
                               f"hold it with hold_lock(..., run=flow_run.get_id())")
        queue = PartQueue(create_store(target, tokenizer, capture, store).ledger)
        for into in sorted({p.into for p in parts if p.into}):
            stack.enter_context(hold_lock(root / into, f"stream capture of {capture.dataset}", run=run))
            create_store(target, tokenizer, capture, store.model_copy(update={"path": str(root / into)}))
        queue.plan(parts)
        child = {"model": model, "capture": capture.model_dump(mode="json"), "store": store.model_dump(mode="json"),
                 "parent_run": run, "room": room}
        ended: dict[str, str] = {}

        def watch(queue_name: str) -> None:
            try:
                child_run = run_on_node(STREAM_NODE, {**child, "node": queue_name}, queue_name,
                                        start_timeout_s=START_TIMEOUT_S, name=f"{queue_name}-stream",
                                        idempotency_key=f"{run}-{flow_run.run_count}-{queue_name}-stream")
                ended[queue_name] = f"{child_run.name} ended {child_run.state.name}: {child_run.state.message}"
            except Exception as e:  # noqa: BLE001 - reported below, with the parts left
                ended[queue_name] = f"watching its run failed: {type(e).__name__}: {e}"

        # Each thread in a copy of this context: the Prefect client settings and run travel with it.
        for q in nodes:
            threading.Thread(target=contextvars.copy_context().run, args=(watch, q), name=f"stream-{q}",
                             daemon=True).start()
        logger.info("stream capture on %d nodes (%s): %d parts, leased in order from the index of %s", len(nodes),
                    ", ".join(nodes), len(parts), root)
        peak, started, logged = spooled_bytes(root), time.time(), 0
        budget = SpoolBudget(root, room)
        while True:
            if budget.restarted():  # from its checkpoint: what it trained since is captured again
                trim_spool(root, plan)
                parts = capture_parts(plan, capture.batch_size, root, train.spool_bytes)
                queue.plan(parts)  # a node's lease of the old plan can no longer mark a part done
                logged = 0
                logger.info("stream capture: the trainer started again from its checkpoint (epoch %d, batch %d): "
                            "the nodes' parts planned again from it, %d parts", *read_position(root), len(parts))
            now = queue.progress()
            peak = max(peak, spooled_bytes(root))
            if now["last"] is not None and now["done"] > logged:
                logged = now["done"]
                log_captured(root, plan, parts[now["last"]], now["tokens"], started, 0.0, peak, room)
            if now["done"] == now["parts"]:
                break
            if trainer_stopped(root):
                raise TrainerStopped("the stream trainer stopped; the capture nodes' runs stop too, keeping what "
                                     "they stored: run the pipeline again and both resume")
            # (Read again: the last node may have ended just after its last part.)
            if len(ended) == len(nodes) and (now := queue.progress())["done"] < now["parts"]:
                raise RuntimeError(f"every capture node's run ended with {now['parts'] - now['done']} of "
                                   f"{now['parts']} parts not captured "
                                   f"({'; '.join(f'{q}: {why}' for q, why in ended.items())}): run the pipeline "
                                   f"again; what was stored is kept")
            time.sleep(NODES_POLL_S)
        by_node = queue.done_by_node()
    logger.info("stream capture done on %d nodes: parts per node %s; spool peak %.1f MiB (sampled)", len(nodes),
                by_node, peak / 2**20)
    return {"store": str(root), "tokens": now["tokens"], "spool_peak_bytes": peak, "spool_bytes": train.spool_bytes,
            "cached_bytes": plan.cached_bytes, "paused_s": 0.0, "parts_by_node": by_node}


@task(name="stream-progress", cache_policy=NO_CACHE)
def watch_task(store: str, spool_budget: int | None) -> str:
    """The run's progress artifact, both sides in its description, every
    PROGRESS_EVERY_S until the trainer ends; the last description."""
    root, artifact = Path(store), None
    while True:
        ended = trainer_state(root) in ("stopped", "finished")
        percent, text = describe_progress(root, spool_budget)
        try:
            if artifact is None:
                artifact = create_progress_artifact(percent, key=artifact_key("stream-progress", root),
                                                    description=text)
            else:
                update_progress_artifact(artifact, percent, description=text)
        except Exception as e:  # noqa: BLE001 - the API blinked: the run goes on, the next update catches up
            logger.warning("stream progress artifact not updated (%s: %s); trying again in %.0f s",
                           type(e).__name__, e, PROGRESS_EVERY_S)
        if ended:
            return text
        time.sleep(PROGRESS_EVERY_S)


def capture_and_train(server: ServerConfig, capture: CaptureConfig, store: StoreConfig, train: TrainConfig,
                      nodes: tuple[str, ...] = (), served_prompts: int = 0) -> dict:
    """Both sides of a stream run (the capture on the server section's
    server, or on the capture `nodes`), and a progress artifact showing
    both, inside the pipeline's flow; the train_drafter result.
    `served_prompts`: held-out prompts the evaluation serves after it."""
    train = train.model_copy(update={"stream": True})
    require_shared_index(train, store.ledger_url, nodes)
    plan = stream_plan_task(server.model, capture, train, store, served_prompts)
    mark_trainer(Path(store.path), "running")
    captured = capture_task.submit(server, capture, store, train, plan, tuple(nodes))
    room = plan.spool_room(train.spool_bytes)
    watching = watch_task.submit(store.path, room)
    try:
        trained = train_drafter(store=store.path, train=train, server=server)
    except BaseException:
        mark_trainer(Path(store.path), "stopped")
        raise
    else:
        mark_trainer(Path(store.path), "finished")
    finally:
        # The trainer's failure first if both failed: the capture's is in
        # the trainer's message (it waited for a sample it did not store).
        captured.wait()
        watching.wait()
    trained["capture"] = captured.result()
    return trained
