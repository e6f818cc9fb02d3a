"""Training while the capture runs (`train.stream`): the samples a run will
train on, and each epoch's batches, are known before any is captured (the
dataset's tokenisation gives every sample id and token count), so the
trainer plans exactly what an offline run over the finished store would,
and reads each sample as soon as its shard is committed.

The capture side captures in `stream_order` (held-out samples first: the
untrained drafter is evaluated on them before the first step; then the first
epoch's batches in training order, whose first positions also count the
draft vocabulary) and, when it ends, says so in `capture_state`: a trainer
waiting for a sample the capture did not store stops naming it instead of
waiting for ever.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np

from tasks.data.dataset import Sample, prepare_samples
from tasks.store.handle import Store
from tasks.store.manifest import manifest_path, write_json_atomic
from tasks.store.reader import StoreReader
from tasks.target.architectures import load_tokenizer
from tasks.train.config import TrainConfig, TrainingError
from tasks.train.data import plan_batches, split

logger = logging.getLogger("eagle3.training")

CAPTURE_STATE = "stream-capture.json"


def planned_samples(sources: list[str], tokenizer, *, max_length: int, policy: str) -> list[Sample]:
    """Every sample the capture of these sources will store (once per id, in
    row order), from their tokenisation alone."""
    out, seen = [], set()
    for source in sources:
        samples, _ = prepare_samples(Path(source), tokenizer, max_length=max_length, policy=policy)
        for s in samples:
            if s.sample_id not in seen:
                seen.add(s.sample_id)
                out.append(s)
    return out


def stream_order(samples: list[Sample], cfg: TrainConfig) -> list[Sample]:
    """The order a stream run captures in: the held-out samples, then the
    training samples in the first epoch's batch order."""
    ids = [s.sample_id for s in samples]
    train_idx, held_idx = split(ids, cfg.heldout_fraction)
    lengths = np.array([s.num_tokens for s in samples], dtype=np.int64)
    first_epoch = [i for b in plan_batches(lengths, train_idx, cfg.tokens_per_batch, cfg.seed, 0) for i in b]
    return [samples[int(i)] for i in [*held_idx, *first_epoch]]


def mark_capture(store: Path, state: str, detail: str = "") -> None:
    """The capture side's state for a stream trainer: running, completed or
    failed (with why)."""
    write_json_atomic(Path(store) / CAPTURE_STATE, {"state": state, "detail": detail, "at": time.time(),
                                                    "pid": os.getpid()})


def capture_state(store: Path) -> dict:
    try:
        return json.loads((Path(store) / CAPTURE_STATE).read_text())
    except FileNotFoundError:
        return {"state": "not started", "detail": ""}


class StreamReader:
    """A StoreReader's interface over the samples a capture will store,
    before they are stored: `sample_ids` and `num_tokens` come from the
    dataset's tokenisation, `reader[i]` waits until sample i is committed and
    reads it checked against its committed checksum. Its stored tokens are
    those its id was computed from, so a sample stored is the one planned."""

    def __init__(self, store: Path, *, poll_s: float = 0.5, log_every_s: float = 30.0):
        self.store, self.poll_s, self.log_every_s = Path(store), poll_s, log_every_s
        self.manifest = self._wait_for_store().manifest
        tokenizer = load_tokenizer(self.manifest["target_path"])
        planned = planned_samples(self.manifest["sources"], tokenizer, max_length=self.manifest["max_length"],
                                  policy=self.manifest["max_length_policy"])
        self.sample_ids = [s.sample_id for s in planned]
        self._rows = {s.sample_id: s.source_row for s in planned}
        self.num_tokens = np.array([s.num_tokens for s in planned], dtype=np.int64)
        self.num_loss_tokens = np.array([int(s.loss_mask.sum()) for s in planned], dtype=np.int64)
        self._reader: StoreReader | None = None
        self._where: dict[str, int] = {}
        self.waited_s = 0.0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.sample_ids)

    def _wait_for_store(self) -> Store:
        while not manifest_path(self.store).exists():  # the capture's plan creates it
            self._check_capture("anything")
            time.sleep(self.poll_s)
        return Store.open(self.store)

    def _check_capture(self, what: str, state: dict | None = None) -> None:
        state = state or capture_state(self.store)
        if state["state"] in ("completed", "failed"):
            raise TrainingError(
                f"stream training: the capture into {self.store} ended ({state['state']}"
                f"{': ' + state['detail'] if state['detail'] else ''}) without storing {what}; the checkpoint is "
                f"kept: run the pipeline again (the capture takes only what is missing), or train offline on the "
                f"store as it is")

    def __getitem__(self, i: int) -> dict:
        sid = self.sample_ids[i]
        with self._lock:  # the loader thread and the evaluation share the reader
            started = last_log = time.time()
            while sid not in self._where:
                # Read before the index: a capture that says it ended had
                # committed everything it stored by then.
                state = capture_state(self.store)
                self._reader = StoreReader(self.store, verify_checksums=True)
                self._where = {s: k for k, s in enumerate(self._reader.sample_ids)}
                if sid in self._where:
                    break
                self._check_capture(f"sample {sid} (row {self._rows[sid]})", state)
                if time.time() - last_log >= self.log_every_s:
                    last_log = time.time()
                    logger.info("stream: waiting %.0f s for sample %s (row %d); %d of %d samples stored so far",
                                last_log - started, sid, self._rows[sid], len(self._where), len(self))
                time.sleep(self.poll_s)
            self.waited_s += time.time() - started
            return self._reader[self._where[sid]]
