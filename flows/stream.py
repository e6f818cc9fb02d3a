"""The pipeline's `mode: stream`: capture and training at once, in one run.

    plan the training order -> capture in that order (a submitted task
    running extract_hidden_states)  ||  train_drafter with train.stream
    (each sample read as its shard is committed) -> both done

The trainer plans the batches an offline run over the finished store would
(tasks/train/stream.py), so the weights are the same; the wall time is the
longer of the two sides instead of their sum.
"""
from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.extract import extract_hidden_states
from flows.train import train_drafter
from tasks.capture.config import CaptureConfig
from tasks.server.config import ServerConfig
from tasks.store.config import StoreConfig
from tasks.target.architectures import load_tokenizer
from tasks.target.models import resolve_model
from tasks.train.config import TrainConfig
from tasks.train.stream import mark_capture, planned_samples, stream_order


@task(name="plan-stream-order", cache_policy=NO_CACHE)
def stream_rows_task(model: str, capture: CaptureConfig, train: TrainConfig) -> list[int]:
    """The dataset rows in the order the trainer will need them."""
    samples = planned_samples([str(Path(capture.dataset).resolve())], load_tokenizer(resolve_model(model)),
                              max_length=capture.max_length, policy=capture.max_length_policy)
    order = stream_order(samples, train)
    get_run_logger().info("stream: %d samples to capture in the order training reads them (held-out ones first, "
                          "then the first epoch's batches)", len(order))
    return [s.source_row for s in order]


@task(name="capture-for-training", cache_policy=NO_CACHE)
def capture_task(server: ServerConfig, capture: CaptureConfig, store: StoreConfig, rows: list[int]) -> dict:
    """extract_hidden_states over `rows` in their order; its end (completed
    or failed) is recorded for the trainer, which otherwise waits for the
    samples it still needs."""
    mark_capture(Path(store.path), "running")
    try:
        result = extract_hidden_states(server=server, capture=capture, store=store, verify=False, rows=rows)
    except BaseException as e:
        mark_capture(Path(store.path), "failed", f"{type(e).__name__}: {e}"[:500])
        raise
    mark_capture(Path(store.path), "completed")
    return result


def capture_and_train(server: ServerConfig, capture: CaptureConfig, store: StoreConfig,
                      train: TrainConfig) -> dict:
    """Both sides of a stream run, inside the pipeline's flow; the
    train_drafter result."""
    rows = stream_rows_task(server.model, capture, train)
    captured = capture_task.submit(server, capture, store, rows)
    try:
        trained = train_drafter(store=store.path, train=train.model_copy(update={"stream": True}))
    finally:
        # The trainer's failure first if both failed: the capture's is
        # in the trainer's message (it waited for a sample it did not store).
        captured.wait()
    captured.result()
    return trained
