"""The pipeline's `mode: stream`: capture and training at once, in one run.

    plan the training order -> capture in that order (a submitted task)
                            || train_drafter with train.stream
                            || the progress artifact (a submitted task) -> all done

The trainer plans the batches an offline run over the finished store would
(tasks/train/stream.py), so the weights are the same; the wall time is the
longer of the two sides instead of their sum. With `train.spool_bytes` each
epoch is captured again into a spool the trainer empties shard by shard, and
the capture waits while the spool is full: the disk holds a budget, not the
dataset; with `train.cache_epochs` the first samples of the first epoch,
as many as the budget holds beside the spool, are kept for every epoch. A
progress artifact shows both sides.
"""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from pathlib import Path

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from flows.artifacts import artifact_key
from flows.extract import default_dump_dir, extract_hidden_states, launch_task
from flows.train import train_drafter
from tasks.capture.config import CaptureConfig
from tasks.server.config import ServerConfig
from tasks.store.config import StoreConfig
from tasks.target.checkpoint import Target
from tasks.target.models import resolve_model
from tasks.train.config import TrainConfig
from tasks.train.stream import (StreamPlan, epoch_store, mark_capture, mark_trainer, plan_stream, read_position,
                                record_progress, spool_bytes, trainer_state, trainer_stopped, trainer_waiting)
from tasks.train.stream_progress import describe_progress

logger = logging.getLogger("eagle3.stream")

WAIT_S = 0.5
LOG_EVERY_S = 30.0
PROGRESS_EVERY_S = 5.0
# Both sides waiting on each other this long is a deadlock: the trainer
# cannot step without its sample, nor free room without a step. Long enough
# for any one step or checkpoint (the loader waits ahead of the step).
DEADLOCK_S = 600.0


class TrainerStopped(RuntimeError):
    """The trainer of a stream run stopped: the capture stops with it (a
    spooled one would otherwise wait for room for ever)."""


class SpoolDeadlock(RuntimeError):
    """The trainer waits for a sample the capture cannot store until the
    trainer frees room: the spool is too small for this run."""


@task(name="plan-stream-order", cache_policy=NO_CACHE)
def stream_plan_task(model: str, capture: CaptureConfig, train: TrainConfig, store: str) -> StreamPlan:
    plan = plan_stream(model, capture, train, Path(store))
    logger.info("stream: %d held-out samples, then %d epoch(s) of %d batches captured in the order training reads "
                "them%s", len(plan.heldout), len(plan.epochs), len(plan.epochs[0]),
                f"; spool {train.spool_bytes / 2**30:.2f} GiB ({plan.bytes_per_token:,} bytes per token)"
                if train.spool_bytes is not None else "; every shard kept in the store")
    return plan


@task(name="capture-for-training", cache_policy=NO_CACHE)
def capture_task(server: ServerConfig, capture: CaptureConfig, store: StoreConfig, train: TrainConfig,
                 plan: StreamPlan) -> dict:
    """Capture in the plan's order; its end (completed or failed) is
    recorded for the trainer, which otherwise waits for what it needs."""
    mark_capture(Path(store.path), "running")
    try:
        result = capture_in_order(server, capture, store, train, plan)
    except BaseException as e:
        mark_capture(Path(store.path), "failed", f"{type(e).__name__}: {e}"[:500])
        raise
    mark_capture(Path(store.path), "completed")
    return result


def capture_in_order(server: ServerConfig, capture: CaptureConfig, store: StoreConfig, train: TrainConfig,
                     plan: StreamPlan) -> dict:
    """Held-out samples (and the rows to quarantine) into the store, then the
    training samples in parts, in training order: without a spool the first
    epoch's into the store; with one, every epoch's into its spool store,
    each part once the spool has room for it, from the trainer's last
    checkpointed position on (what it trained since is captured again).
    Between parts, a trainer that stopped stops the capture. One server for
    all of it, launched here or attached."""
    root, spooled = Path(store.path), train.spool_bytes is not None
    with ExitStack() as stack:
        if not server.url:  # launch once; each part of the capture attaches to it
            dump_dir = Path(capture.dump_dir) if capture.dump_dir else default_dump_dir(root)
            target = Target.load(str(resolve_model(server.model)), capture.aux_layer_ids)
            live = launch_task(target, server, dump_dir, root / "logs" / "sglang-server.log")
            stack.callback(live.stop)
            server = server.model_copy(update={"url": live.url, "api_key": live.api_key,
                                               "rid_prefix": live.rid_prefix})
            capture = capture.model_copy(update={"dump_dir": str(dump_dir)})
        extract_hidden_states(server=server, capture=capture, store=store, verify=False,
                              rows=plan.heldout + plan.rejected)
        first_epoch, done = read_position(root) if spooled else (0, 0)
        peak, captured, paused, started = spool_bytes(root), 0, 0.0, time.time()
        # With a spool, two batches a part (as many as one extraction has in
        # flight): the spool holds little more than the trainer needs.
        # Without, larger parts: each costs a plan and a warm-up.
        size = (2 if spooled else 32) * capture.batch_size
        cached = set(plan.cached)  # train.cache_epochs: captured once, into the store, with the held-out ones
        room = plan.spool_room(train.spool_bytes or 0)
        cache = f"; {len(cached)} samples ({plan.cached_bytes / 2**20:.1f} MiB) kept for every epoch" if cached else ""
        for e in range(first_epoch, len(plan.epochs)):
            rows = [r for b in plan.epochs[e][done if e == first_epoch else 0:] for r in b]
            spool = (store.model_copy(update={"path": str(epoch_store(root, e)), "ledger_url": None}) if spooled
                     else store)
            # The cached rows are a prefix of the first epoch's order: they come first.
            segments = [(store, [r for r in rows if r in cached]), (spool, [r for r in rows if r not in cached])]
            taken = 0
            for into, segment in segments:
                for k in range(0, len(segment), size):
                    piece = segment[k:k + size]
                    if trainer_stopped(root):
                        raise TrainerStopped(f"the stream trainer stopped; the capture into {root} stops too, "
                                             f"keeping what it stored: run the pipeline again and both resume")
                    if spooled and into is spool:
                        paused += wait_for_room(root, plan.shard_bytes(piece, capture.batch_size), room, e)
                    extract_hidden_states(server=server, capture=capture, store=into, verify=False, rows=piece)
                    peak = max(peak, spool_bytes(root))
                    captured += sum(plan.tokens[r] for r in piece)
                    taken += len(piece)
                    record_progress(root, "captured", epoch=e, epochs=len(plan.epochs), samples=taken, of=len(rows),
                                    tokens=captured, started=started, paused_s=paused)
                    logger.info("stream capture: epoch %d/%d, %d of %d samples; %s tokens at %.0f tok/s%s", e + 1,
                                len(plan.epochs), taken, len(rows), f"{captured:,}",
                                captured / max(1e-9, time.time() - started),
                                f"; spool {spool_bytes(root) / 2**20:.1f} of {room / 2**20:.1f} MiB (peak "
                                f"{peak / 2**20:.1f}){cache}" if spooled else "")
    if spooled:
        logger.info("stream capture done: spool peak %.1f of %.1f MiB, paused %.0f s while it was full%s",
                    peak / 2**20, room / 2**20, paused, cache)
    return {"store": str(root), "tokens": captured, "spool_peak_bytes": peak, "spool_bytes": train.spool_bytes,
            "cached_bytes": plan.cached_bytes, "paused_s": paused}


def wait_for_room(root: Path, need: int, budget: int, epoch: int, deadlock_s: float = DEADLOCK_S) -> float:
    """Back-pressure: until the spool can take `need` more bytes (or is
    empty: a part larger than the budget still goes, alone). Seconds waited.
    Refused (SpoolDeadlock) once the trainer has waited deadlock_s for a
    sample while this waits: neither would ever move."""
    since, last = time.time(), 0.0
    while (held := spool_bytes(root)) and held + need > budget:
        if trainer_stopped(root):
            raise TrainerStopped(f"the stream trainer stopped, so the spool of {root} will not empty; the capture "
                                 f"stops too, keeping what it stored: run the pipeline again and both resume")
        now = time.time()
        stuck = [w for w in trainer_waiting(root) if now - max(w["since"], since) >= deadlock_s]
        if stuck:
            raise SpoolDeadlock(
                f"the stream trainer has waited {now - stuck[0]['since']:.0f} s for {stuck[0]['waiting_for']} while "
                f"the capture waits for room in the spool of {root} ({held:,} of {budget:,} bytes held, the next "
                f"part needs {need:,}): the samples the trainer holds at once do not fit beside the next part. Run "
                f"again with a larger train.spool_bytes; the checkpoint and what was captured are kept")
        if time.time() - last >= LOG_EVERY_S:
            last = time.time()
            logger.info("stream capture paused %.0f s before epoch %d's next part: spool %.1f of %.1f MiB, the part "
                     "needs %.1f", last - since, epoch + 1, held / 2**20, budget / 2**20, need / 2**20)
        time.sleep(WAIT_S)
    return time.time() - since


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


def capture_and_train(server: ServerConfig, capture: CaptureConfig, store: StoreConfig,
                      train: TrainConfig) -> dict:
    """Both sides of a stream run, and a progress artifact showing both,
    inside the pipeline's flow; the train_drafter result."""
    train = train.model_copy(update={"stream": True})
    plan = stream_plan_task(server.model, capture, train, store.path)
    mark_trainer(Path(store.path), "running")
    captured = capture_task.submit(server, capture, store, train, plan)
    room = None if train.spool_bytes is None else plan.spool_room(train.spool_bytes)
    watching = watch_task.submit(store.path, room)
    try:
        trained = train_drafter(store=store.path, train=train)
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
