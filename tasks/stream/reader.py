"""The trainer's side of a stream run: a reader that waits for each planned
sample's shard, and (with a spool) frees each spooled shard once its every
sample is trained."""
from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from tasks.store.handle import Store
from tasks.store.manifest import manifest_path
from tasks.store.reader import StoreReader
from tasks.data.chat import store_chat
from tasks.stream.plan import planned_columns, planned_samples, read_planned, without_quarantined
from tasks.stream.spool import drop_spooled_shard, epoch_store, write_position
from tasks.stream.state import capture_state, mark_trainer_started, mark_waiting, record_progress
from tasks.target.architectures import load_tokenizer
from tasks.train.config import TrainConfig, TrainingError
from tasks.train.data import split

logger = logging.getLogger("eagle3.training")

QUARANTINE_CHECK_S = 2.0  # how often a trainer waiting for a sample looks for it among the quarantined

class StreamReader:
    """A StoreReader's interface over the samples a capture will store,
    before they are stored: `sample_ids` and `num_tokens` come from the
    dataset's tokenisation, `reader[i]` waits until sample i is committed and
    reads it checked against its committed checksum. Its stored tokens are
    those its id was computed from, so a sample stored is the one planned.

    With a spool, training samples are read from the current epoch's store
    (`epoch`), and `consumed` removes each of its shards once every sample
    in it was trained on this epoch."""

    def __init__(self, store: Path, cfg: TrainConfig, *, poll_s: float = 0.5, log_every_s: float = 30.0):
        self.store, self.poll_s, self.log_every_s = Path(store), poll_s, log_every_s
        self.spooled = cfg.spool_bytes is not None
        # train.cache_epochs: a training sample is in the store (kept from
        # the first capture) or in its epoch's spool store; which one, the
        # capture's plan says, so both are looked in.
        self.cached = self.spooled and cfg.cache_epochs
        self.manifest = self._wait_for_store().manifest
        planned = read_planned(self.store, self.manifest)
        self.planned_from = "file" if planned is not None else "tokenised"
        if planned is None:
            tokenizer = load_tokenizer(self.manifest["target_path"])
            samples, _ = planned_samples(self.manifest["sources"], tokenizer, max_length=self.manifest["max_length"],
                                         policy=self.manifest["max_length_policy"], chat=store_chat(self.manifest))
            planned = planned_columns(without_quarantined(samples, self.store))
        self.sample_ids = list(planned["sample_id"])
        self._rows = dict(zip(self.sample_ids, (int(r) for r in planned["source_row"])))
        self.num_tokens = np.asarray(planned["num_tokens"], dtype=np.int64)
        self.num_loss_tokens = np.asarray(planned["num_loss_tokens"], dtype=np.int64)
        self._held = {self.sample_ids[i] for i in split(self.sample_ids, cfg.heldout_fraction)[1]}
        self.epoch = 0
        self._readers: dict[Path, StoreReader] = {}
        self._rows_of: dict[tuple[Path, str], tuple] = {}  # (home, sample id) -> its ledger row
        self._consumed: set[str] = set()
        # The current epoch's spooled shards met in `consumed`: their samples.
        self._shard_of: dict[str, str] = {}
        self._members: dict[str, list[str]] = {}
        # The current epoch's spooled shards this rank looked up: their samples.
        self._looked_up: dict[str, list[str]] = {}
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

    def _ledger(self, home: Path):
        """`home`'s index, through its open reader where there is one."""
        reader = self._readers.get(home)
        return reader.ledger if reader is not None else Store.open(home).ledger

    def _check_quarantine(self, sid: str, homes: list[Path], what: str) -> None:
        """A sample the capture quarantined (it crashed the server, or its
        batch failed for good) will never be stored: the planned batches
        cannot be formed, so the trainer stops now, naming it, instead of
        waiting for the capture's end."""
        for home in homes:
            if not manifest_path(home).exists():
                continue
            q = self._ledger(home).quarantined()
            hit = q[q.sample_id == sid]
            if len(hit):
                raise TrainingError(
                    f"stream training: the capture quarantined {what} ({hit.reason.iloc[0]}); the stream's planned "
                    f"batches hold it, so the trainer stops. Run the pipeline again: its plan leaves the store's "
                    f"quarantined samples out, as offline (this run's checkpoint, cut from the old split, is refused "
                    f"unless train.on_store_change is replan, which starts its epoch again); or train offline on "
                    f"the store")

    def _home(self, sid: str) -> Path:
        return epoch_store(self.store, self.epoch) if self.spooled and sid not in self._held else self.store

    def __getitem__(self, i: int) -> dict:
        sid = self.sample_ids[i]
        with self._lock:  # the loader thread and the evaluation share the reader
            home = self._home(sid)
        homes = [self.store, home] if self.cached and home != self.store else [home]
        started = last_log = time.time()
        last_quarantine_check = 0.0
        waiting = False
        try:
            while True:
                # Read before the index: a capture that says it ended had
                # committed everything it stored by then.
                state = capture_state(self.store)
                # The lock is held for the look-up only, never while waiting:
                # the step's thread frees what it trained meanwhile (a budget
                # near its minimum needs that room for this very sample).
                with self._lock:
                    found = next((h for h in homes if (h, sid) in self._rows_of or self._look_up(h, sid)), None)
                    if found is not None:
                        sample_id, shard, offset, tokens, _, _, checksum = self._rows_of[found, sid]
                        reader = self._readers[found]
                        break
                what = f"sample {sid} (row {self._rows[sid]}) in {home}"
                self._check_capture(what, state)
                if time.time() - last_quarantine_check >= QUARANTINE_CHECK_S:
                    last_quarantine_check = time.time()
                    self._check_quarantine(sid, homes, what)
                if not waiting:  # for the capture: waiting for room while this waits is a deadlock
                    waiting = mark_waiting(self.store, what)
                if time.time() - last_log >= self.log_every_s:
                    last_log = time.time()
                    logger.info("stream: waiting %.0f s for %s", last_log - started, what)
                time.sleep(self.poll_s)
        finally:
            if waiting:
                mark_waiting(self.store, None)
        return reader.read_row(sample_id, shard, offset, tokens, checksum)

    def _look_up(self, home: Path, sid: str) -> bool:
        """Whether `sid` is committed in `home`; if so, the rows of its
        whole shard are kept (the next samples read are mostly its)."""
        if home not in self._readers:
            if not manifest_path(home).exists():  # the capture's first part creates it
                return False
            self._readers[home] = StoreReader(home, verify_checksums=True, index=False)
        rows = self._readers[home].ledger.shard_index(sid)
        self._rows_of.update(((home, r[0]), r) for r in rows)
        if rows and home == epoch_store(self.store, self.epoch):
            self._looked_up[rows[0][1]] = [r[0] for r in rows]
        return bool(rows)

    def start_epoch(self, epoch: int) -> None:
        """Read the training samples of `epoch` from now on; this rank's
        maps of the spool's earlier epochs, all trained, are closed."""
        with self._lock:
            if epoch != self.epoch:  # (rank 0 counted the draft vocabulary on epoch 0's shards before it starts)
                self._looked_up = {}
            self.epoch, self._consumed, self._shard_of, self._members = epoch, set(), {}, {}
            if self.spooled:
                for e in range(epoch):
                    home = epoch_store(self.store, e)
                    self._readers.pop(home, None)
                    self._rows_of = {k: r for k, r in self._rows_of.items() if k[0] != home}

    def remove_earlier_epochs(self) -> None:
        """Rank 0, once every rank started the current epoch: the spool's
        stores of the epochs before it are removed."""
        for e in range(self.epoch):
            home = epoch_store(self.store, e)
            if not home.exists():
                continue
            ledger = self._ledger(home) if manifest_path(home).exists() else None
            # The files first: a store found without its index is refused
            # (PostgreSQL), never read as empty.
            shutil.rmtree(home, ignore_errors=True)
            if ledger is not None:
                ledger.drop()

    def release(self, sample_ids: list[str]) -> None:
        """These samples' steps are done on every rank (the step's gradients
        were reduced across them): this rank's maps of the spooled shards
        whose every sample is now trained are closed. Every rank does this
        before rank 0 removes them (`remove_consumed`): a removed file that
        any process still maps keeps its blocks on the disk (NFS, Lustre and
        GPFS too), which no count of the index sees. A rank knows the whole
        of every shard it looked up (`_look_up` keeps its rows)."""
        if not self.spooled:
            return
        with self._lock:
            self._consumed.update(sample_ids)
            home = epoch_store(self.store, self.epoch)
            reader = self._readers.get(home)
            if reader is None:
                return
            for shard, ids in list(self._looked_up.items()):
                if self._consumed.issuperset(ids):
                    reader.close_shard(shard)
                    del self._looked_up[shard]
                    for sid in ids:
                        self._rows_of.pop((home, sid), None)

    def remove_consumed(self, sample_ids: list[str]) -> None:
        """Rank 0, after every rank released them: remove the spooled
        shards whose every sample is trained this epoch."""
        if not self.spooled:
            return
        with self._lock:
            self._consumed.update(sample_ids)
            home = epoch_store(self.store, self.epoch)
            if not manifest_path(home).exists():
                return
            ledger = self._ledger(home)
            # Only these samples' shards can have become fully trained: each
            # looked up once (not the epoch's whole index every step, which
            # at 300k samples an epoch is a second a step on PostgreSQL).
            touched = set()
            for sid in sample_ids:
                if sid not in self._shard_of:
                    rows = ledger.shard_index(sid)  # [] for a sample not spooled (held out, cached, removed)
                    for r in rows:
                        self._shard_of[r[0]] = r[1]
                    if rows:
                        self._members[rows[0][1]] = [r[0] for r in rows]
                if sid in self._shard_of:
                    touched.add(self._shard_of[sid])
            for shard in sorted(touched):
                ids = self._members.get(shard)
                if ids is not None and self._consumed.issuperset(ids):
                    drop_spooled_shard(ledger, home, shard)
                    del self._members[shard]


class Spool:
    """The trainer's side of a stream run: each epoch read from its own
    store; with a spool, after every step each rank closes its maps of the
    shards the step finished, then rank 0 removes them, and writes each
    checkpoint's position for the capture side; on rank 0, its progress
    written after every step for the run's progress artifact
    (flows/stream.py). Offline, it does nothing."""

    def __init__(self, run, store: Path):
        cfg = run.cfg
        self.stream, self.epochs = cfg.stream, cfg.epochs
        self.reporting = cfg.stream and run.rank == 0
        self.spooled = cfg.stream and cfg.spool_bytes is not None
        self.removing = self.spooled and run.rank == 0
        self.world = run.world
        self.reader, self.store = run.reader, Path(store)
        self.started, self.tokens, self.steps = time.time(), 0, 0
        if self.removing:  # a start again (a retry) rewinds the capture to the checkpoint this one resumes from
            mark_trainer_started(self.store)

    def start_epoch(self, epoch: int, done: list[list[int]]) -> None:
        """Epoch `epoch`, whose batches `done` a checkpoint already holds."""
        if self.stream:
            self.reader.start_epoch(epoch)
            if self.spooled:
                self._barrier()
                if self.removing:
                    self.reader.remove_earlier_epochs()
            self._consumed(done)

    def stepped(self, epoch: int, step: int, total_steps: int, batches: list[list[int]]) -> None:
        """A step over `batches` (every rank's) is done on every rank."""
        self._consumed(batches)
        if not self.reporting:
            return
        self.tokens += int(sum(self.reader.num_tokens[i] for b in batches for i in b))
        self.steps += 1
        record_progress(self.store, "trained", epoch=epoch, epochs=self.epochs, step=step, total_steps=total_steps,
                        steps=self.steps, tokens=self.tokens, started=self.started)

    def _consumed(self, batches: list[list[int]]) -> None:
        if not self.spooled:
            return
        ids = [self.reader.sample_ids[i] for b in batches for i in b]
        self.reader.release(ids)
        self._barrier()  # every rank's maps closed before any file is removed
        if self.removing:
            self.reader.remove_consumed(ids)

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed

            torch.distributed.barrier()

    def checkpointed(self, epoch: int, batches_done: int) -> None:
        if self.removing:
            write_position(self.store, epoch, batches_done)

    def finish(self, epochs: int) -> None:
        if self.spooled:  # every epoch trained: the spool's stores go
            self.start_epoch(epochs, [])
