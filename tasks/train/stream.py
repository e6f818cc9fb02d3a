"""Training while the capture runs (`train.stream`): the samples a run will
train on, and each epoch's batches, are known before any is captured (the
dataset's tokenisation gives every sample id and token count), so the
trainer plans exactly what an offline run over the finished store would,
and reads each sample as soon as its shard is committed.

The capture side (flows/stream.py) captures in the plan's order
(`plan_stream`: held-out samples first, the untrained drafter is evaluated
on them before the first step; then each epoch's batches in training order,
whose first positions also count the draft vocabulary) and, when it ends,
says so (`mark_capture`): a trainer waiting for a sample the capture did
not store stops naming it instead of waiting for ever.

With a spool (`train.spool_bytes`), each epoch's training samples are
captured again into a store of their own under <store>/spool/, the trainer
removes each shard once every sample in it is trained (`Spool`), and writes
its checkpointed position for a capture started again (`read_position`).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tasks.capture.config import CaptureConfig
from tasks.data.dataset import Rejected, Sample, prepare_samples
from tasks.durable import replace_durably
from tasks.failures import Permanent
from tasks.store.handle import Store
from tasks.store.manifest import StoreError, manifest_path, write_json_atomic
from tasks.store.reader import StoreReader
from tasks.store.shards import bytes_per_token, shard_path
from tasks.target.architectures import load_tokenizer
from tasks.target.checkpoint import Target
from tasks.target.models import resolve_model
from tasks.train.config import TrainConfig, TrainingError
from tasks.train.data import plan_batches, split

logger = logging.getLogger("eagle3.training")

CAPTURE_STATE = "stream-capture.json"
TRAINER_STATE = "stream-trainer.json"
WAITING = "stream-waiting"  # stream-waiting-<pid>.json: a trainer process waiting for a sample
SPOOL = "spool"
POSITION = "position.json"
RATE_WINDOW_S = 60.0  # the progress artifact's rates are over this much of the recent past
QUARANTINE_CHECK_S = 2.0  # how often a trainer waiting for a sample looks for it among the quarantined
# The planned samples (id, row, token and loss-token counts), written by the
# plan once: every trainer rank reads them instead of tokenising the
# dataset again (600k samples: minutes of CPU per rank, 8 ranks a node).
PLANNED = "stream-samples.parquet"


def planned_samples(sources: list[str], tokenizer, *, max_length: int,
                    policy: str) -> tuple[list[Sample], list[Rejected]]:
    """Every sample the capture of these sources will store (once per id, in
    row order), from their tokenisation alone, and the rows it will
    quarantine instead."""
    out, rejected, seen = [], [], set()
    for source in sources:
        samples, unusable = prepare_samples(Path(source), tokenizer, max_length=max_length, policy=policy)
        rejected += unusable
        for s in samples:
            if s.sample_id not in seen:
                seen.add(s.sample_id)
                out.append(s)
    return out, rejected


def without_quarantined(samples: list[Sample], store: Path) -> list[Sample]:
    """The samples, less those the store has quarantined (an earlier run's
    capture failed them for good): they are left out of a stream run's plan
    as an offline run over the store leaves them out, so a run started
    again trains on the offline batches (its trainer's checkpoint, cut from
    the old split, is refused unless train.on_store_change is replan)."""
    if not manifest_path(store).exists():
        return samples
    gone = set(Store.open(store).ledger.quarantined().sample_id.dropna())
    kept = [s for s in samples if s.sample_id not in gone]
    if len(kept) < len(samples):
        logger.info("stream: %d samples the store %s quarantined are left out of the plan, as offline",
                    len(samples) - len(kept), store)
    return kept


def planned_columns(samples: list[Sample]) -> dict[str, list]:
    """What a trainer needs of each planned sample, as columns."""
    return {"sample_id": [s.sample_id for s in samples], "source_row": [s.source_row for s in samples],
            "num_tokens": [s.num_tokens for s in samples],
            "num_loss_tokens": [int(s.loss_mask.sum()) for s in samples]}


def _planned_key(sources: list[str], target_path: str, max_length: int, policy: str) -> str:
    """What the planned samples depend on: the sources (by path, size and
    mtime: one changed in place is planned again), the tokenizer's model and
    the length policy."""
    files = sorted(str(Path(s).resolve()) for s in sources)
    return json.dumps({"sources": [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files],
                       "target": str(Path(target_path).resolve()), "max_length": max_length, "policy": policy})


def write_planned(store: Path, samples: list[Sample], sources: list[str], target_path: str, *, max_length: int,
                  policy: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(planned_columns(samples)).replace_schema_metadata(
        {"eagle3_key": _planned_key(sources, target_path, max_length, policy)})
    Path(store).mkdir(parents=True, exist_ok=True)
    replace_durably(Path(store) / PLANNED, lambda tmp: pq.write_table(table, tmp))


def read_planned(store: Path, manifest: dict):
    """The planned samples the plan wrote for this store's manifest (a
    DataFrame), or None: none written, or written for other sources, model
    or length policy."""
    import pyarrow.parquet as pq

    path = Path(store) / PLANNED
    try:
        table = pq.read_table(path)
        key = _planned_key(manifest["sources"], manifest["target_path"], manifest["max_length"],
                           manifest["max_length_policy"])
    except FileNotFoundError:
        return None
    if (table.schema.metadata or {}).get(b"eagle3_key", b"").decode() != key:
        logger.info("stream: %s was planned from other sources or settings than the store's: tokenising", path)
        return None
    return table.to_pandas()


class SpoolTooSmall(Permanent, ValueError):
    """The spool cannot hold what training reads before its first step."""


@dataclass(frozen=True)
class StreamPlan:
    """Dataset rows in the order training reads them: held out, then each
    epoch's batches (as rows), with the token counts the spool is sized by."""
    heldout: list[int]
    rejected: list[int]  # rows that give no sample: quarantined, as offline
    epochs: list[list[list[int]]]
    tokens: dict[int, int]  # row -> tokens
    bytes_per_token: int
    # Training rows captured once, into the store, and read there in every
    # epoch (train.cache_epochs): a prefix of the first epoch's order.
    cached: list[int] = field(default_factory=list)
    cached_bytes: int = 0
    minimum: int = 0  # bytes the spool must hold at once (spool_minimum)

    def spool_room(self, spool_bytes: int | None) -> int | None:
        """The spool's share of the budget (None: no spool): what
        train.cache_epochs keeps in the store is not in it."""
        return None if spool_bytes is None else spool_bytes - self.cached_bytes

    def shard_bytes(self, rows: list[int], batch_size: int) -> int:
        """At most what these rows take as shards of batch_size samples:
        their tensors, and per shard a header of its sample ids and offsets."""
        return self.shard_bytes_of(sum(self.tokens[r] for r in rows), -(-len(rows) // batch_size), batch_size)

    def shard_bytes_of(self, tokens: int, shards: int, batch_size: int) -> int:
        return tokens * self.bytes_per_token + shards * (16384 + 80 * batch_size)


def plan_stream(model: str, capture: CaptureConfig, train: TrainConfig, store: Path | None = None) -> StreamPlan:
    """What a stream run captures, in the order training reads it (refused,
    with a spool too small to reach the first step); with `store`, the
    planned samples are written there for the trainer's ranks."""
    target = Target.load(str(resolve_model(model)), capture.aux_layer_ids)
    dataset = str(Path(capture.dataset).resolve())
    samples, unusable = planned_samples([dataset], target.tokenizer(), max_length=capture.max_length,
                                        policy=capture.max_length_policy)
    if store is not None:
        samples = without_quarantined(samples, Path(store))
        write_planned(store, samples, [dataset], target.path, max_length=capture.max_length,
                      policy=capture.max_length_policy)
    ids = [s.sample_id for s in samples]
    train_idx, held_idx = split(ids, train.heldout_fraction)
    lengths = np.array([s.num_tokens for s in samples], dtype=np.int64)
    rows = [s.source_row for s in samples]
    epochs = range(train.epochs if train.spool_bytes is not None else 1)
    plan = StreamPlan(
        heldout=[rows[i] for i in held_idx],
        # The capture's first part takes them: it quarantines them with their
        # reasons, as an offline run does.
        rejected=[r.source_row for r in unusable],
        epochs=[[[rows[i] for i in b] for b in plan_batches(lengths, train_idx, train.tokens_per_batch, train.seed, e)]
                for e in epochs],
        tokens={s.source_row: s.num_tokens for s in samples},
        bytes_per_token=bytes_per_token(target.hidden_size, len(target.layers.sglang_ids)))
    if train.spool_bytes is not None:
        need = spool_minimum(plan, samples, capture, train)
        plan = replace(plan, minimum=need)
        if train.spool_bytes < need:
            raise SpoolTooSmall(
                f"train.spool_bytes {train.spool_bytes:,} cannot hold what training reads before its first steps: "
                f"{need:,} bytes (the first train.vocab_positions {train.vocab_positions:,} loss positions count "
                f"the draft vocabulary, then a step's batches and the loader's look-ahead): raise it, or lower "
                f"train.vocab_positions")
        if train.cache_epochs:
            plan = cache_first_capture(plan, train.spool_bytes - need, capture.batch_size)
    return plan


def cache_first_capture(plan: StreamPlan, room: int, batch_size: int) -> StreamPlan:
    """The plan with the first epoch's first training rows kept for every
    epoch, as many as `room` bytes hold (what the budget leaves beside the
    spool's working set); later epochs capture only the others."""
    cached, tokens = [], 0
    for row in (r for b in plan.epochs[0] for r in b):
        if plan.shard_bytes_of(tokens + plan.tokens[row], -(-(len(cached) + 1) // batch_size), batch_size) > room:
            break
        cached.append(row)
        tokens += plan.tokens[row]
    kept = set(cached)
    later = [[[r for r in b if r not in kept] for b in epoch] for epoch in plan.epochs[1:]]
    return replace(plan, epochs=plan.epochs[:1] + later, cached=cached,
                               cached_bytes=plan.shard_bytes(cached, batch_size) if cached else 0)


def spool_minimum(plan: StreamPlan, samples: list[Sample], capture: CaptureConfig, train: TrainConfig) -> int:
    """Bytes the trainer holds before it can free any: the samples counting
    the draft vocabulary (they come first) or, if more, a step's batches and
    the loader's look-ahead (4), per device; and room for the capture's
    next part beside them."""
    loss = {s.source_row: int(s.loss_mask.sum()) for s in samples}
    counted = tokens = 0
    for row in (r for b in plan.epochs[0] for r in b):
        if counted >= train.vocab_positions:
            break
        counted += loss[row]
        tokens += plan.tokens[row]
    ahead = (4 + train.accumulate) * train.devices * train.nnodes * train.tokens_per_batch
    longest = sorted(plan.tokens.values())[-2 * capture.batch_size:]  # and one part of the capture beside them
    return max(tokens, ahead) * plan.bytes_per_token + plan.shard_bytes_of(sum(longest), 2, capture.batch_size)


def mark_capture(store: Path, state: str, detail: str = "") -> None:
    """The capture side's state for a stream trainer: running, completed or
    failed (with why)."""
    Path(store).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(store) / CAPTURE_STATE, {"state": state, "detail": detail, "at": time.time(),
                                                    "pid": os.getpid()})


def mark_trainer(store: Path, state: str) -> None:
    """The training side's state for the capture: running, stopped (a
    capture waiting for room in the spool would otherwise wait for ever) or
    finished."""
    Path(store).mkdir(parents=True, exist_ok=True)
    if state == "running":  # a trainer started again: what a killed one waited for is moot
        for path in Path(store).glob(f"{WAITING}-*.json"):
            path.unlink(missing_ok=True)
    write_json_atomic(Path(store) / TRAINER_STATE, {"state": state, "at": time.time()})


def mark_waiting(store: Path, what: str | None) -> bool:
    """This trainer process waits for `what` (a sample), or no longer
    (None); whether it now waits."""
    path = Path(store) / f"{WAITING}-{os.getpid()}.json"
    if what is None:
        path.unlink(missing_ok=True)
        return False
    write_json_atomic(path, {"waiting_for": what, "since": time.time()})
    return True


def trainer_waiting(store: Path) -> list[dict]:
    """What the stream trainer's processes wait for now, and since when."""
    out = []
    for path in Path(store).glob(f"{WAITING}-*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except FileNotFoundError:  # it stopped waiting
            pass
    return out


def trainer_state(store: Path) -> str:
    return _read_state(Path(store) / TRAINER_STATE).get("state", "not started")


def trainer_stopped(store: Path) -> bool:
    return trainer_state(store) == "stopped"


def capture_state(store: Path) -> dict:
    return _read_state(Path(store) / CAPTURE_STATE) or {"state": "not started", "detail": ""}


def record_progress(store: Path, side: str, *, now: float | None = None, **counts) -> None:
    """A side's counts (`side`: captured, by the capture after each part;
    trained, by rank 0 after each step), for the run's progress artifact
    (tasks/train/stream_progress.py), with the (time, tokens, steps) of its
    records of the last RATE_WINDOW_S: the rates shown are recent ones, not
    means since the start (a capture paused for room, or one that resumed
    past stored parts in seconds, would skew a mean for hours)."""
    now = time.time() if now is None else now
    last = progress(store, side)
    window = last.get("window", []) if last.get("started") == counts.get("started") else []
    window = [w for w in window if now - w[0] <= RATE_WINDOW_S]
    if window and now - window[-1][0] < 1.0:  # one record a second at most: a fast trainer writes a small file
        window.pop()
    window.append([now, counts.get("tokens", 0), counts.get("steps", 0)])
    write_json_atomic(Path(store) / f"stream-{side}.json", {**counts, "at": now, "window": window})


def progress(store: Path, side: str) -> dict:
    """What record_progress last wrote for `side` ({} before it did)."""
    return _read_state(Path(store) / f"stream-{side}.json")


def _read_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def epoch_store(store: Path, epoch: int) -> Path:
    """Where a spooled run captures epoch `epoch`'s training samples (the
    held-out ones stay in `store` itself, for every evaluation)."""
    return Path(store) / SPOOL / f"epoch-{epoch:04d}"


def spool_bytes(store: Path) -> int:
    """Bytes of the shards the spool's indexes hold now (from the ledgers,
    not a directory listing: a shard is in the spool once committed)."""
    total = 0
    for d in sorted((Path(store) / SPOOL).glob("epoch-*")):
        try:
            total += Store.open(d).ledger.summary()["bytes"]
        except (StoreError, OSError):
            if manifest_path(d).exists():  # not one being removed (all trained) or made now: a real failure
                raise
    return total


def write_position(store: Path, epoch: int, batches_done: int) -> None:
    """The trainer's last checkpointed position: a capture (re)started
    takes the batches from there on."""
    write_json_atomic(Path(store) / SPOOL / POSITION, {"epoch": epoch, "batches_done": batches_done})


def read_position(store: Path) -> tuple[int, int]:
    try:
        p = json.loads((Path(store) / SPOOL / POSITION).read_text())
    except FileNotFoundError:
        return 0, 0
    return p["epoch"], p["batches_done"]


def drop_spooled_shard(ledger, home: Path, shard: str) -> None:
    """Remove a shard from a spool store: the index first, so a crash in
    between leaves an orphan file, never an entry without its data."""
    ledger.replace_shard(shard, None, [])
    shard_path(home, shard).unlink(missing_ok=True)


def trim_spool(store: Path, plan: StreamPlan) -> int:
    """A spooled run started again, before either side starts: its spool
    cut back to what the trainer reads first, in order, from its
    checkpointed position, up to the first sample missing (trained after
    the checkpoint, so removed, or not yet captured when the run stopped).
    Every shard spooled after that is removed, to be captured again in its
    turn: each was let in while the parts before it were held, and kept it
    could fill the room those need now, each side then waiting on the
    other. Bytes removed."""
    epoch, done = read_position(store)
    cached = set(plan.cached)  # into the store, not the spool
    order = [(e, r) for e in range(epoch, len(plan.epochs))
             for b in plan.epochs[e][done if e == epoch else 0:] for r in b if r not in cached]
    homes = {e: epoch_store(store, e) for e in range(epoch, len(plan.epochs))}
    ledgers = {e: Store.open(home).ledger for e, home in homes.items() if manifest_path(home).exists()}
    shard_of = {(e, int(row)): shard for e, ledger in ledgers.items()
                for row, shard in ledger.samples()[["source_row", "shard"]].itertuples(index=False)}
    before, later = spool_bytes(store), True
    while later:  # a shard holding samples on both sides of the cut moves the cut before it
        cut = next((k for k, key in enumerate(order) if key not in shard_of), len(order))
        later = {(key[0], shard_of[key]) for key in order[cut:] if key in shard_of}
        for e, shard in sorted(later):
            drop_spooled_shard(ledgers[e], homes[e], shard)
        shard_of = {key: shard for key, shard in shard_of.items() if (key[0], shard) not in later}
    return before - spool_bytes(store)


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
                                         policy=self.manifest["max_length_policy"])
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
                while not any((h, sid) in self._rows_of for h in homes):
                    # Read before the index: a capture that says it ended had
                    # committed everything it stored by then.
                    state = capture_state(self.store)
                    if any(self._look_up(h, sid) for h in homes):
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
            home = next(h for h in homes if (h, sid) in self._rows_of)
            sample_id, shard, offset, tokens, _, _, checksum = self._rows_of[home, sid]
            return self._readers[home].read_row(sample_id, shard, offset, tokens, checksum)

    def _look_up(self, home: Path, sid: str) -> bool:
        """Whether `sid` is committed in `home`; if so, the rows of its
        whole shard are kept (the next samples read are mostly its)."""
        if home not in self._readers:
            if not manifest_path(home).exists():  # the capture's first part creates it
                return False
            self._readers[home] = StoreReader(home, verify_checksums=True, index=False)
        rows = self._readers[home].ledger.shard_index(sid)
        self._rows_of.update(((home, r[0]), r) for r in rows)
        return bool(rows)

    def start_epoch(self, epoch: int) -> None:
        """Read the training samples of `epoch` from now on; the spool's
        earlier epochs, all trained, are removed."""
        with self._lock:
            self.epoch, self._consumed, self._shard_of, self._members = epoch, set(), {}, {}
            if self.spooled:
                for e in range(epoch):
                    home = epoch_store(self.store, e)
                    ledger = self._ledger(home) if manifest_path(home).exists() else None
                    # The files first: a store found without its index is
                    # refused (PostgreSQL), never read as empty.
                    shutil.rmtree(home, ignore_errors=True)
                    if ledger is not None:
                        ledger.drop()
                    self._readers.pop(home, None)
                    self._rows_of = {k: r for k, r in self._rows_of.items() if k[0] != home}

    def consumed(self, sample_ids: list[str]) -> None:
        """These samples' steps are done on every rank (the step's gradients
        were reduced across them): remove the spooled shards whose every
        sample is trained this epoch."""
        if not self.spooled:
            return
        with self._lock:
            self._consumed.update(sample_ids)
            home = epoch_store(self.store, self.epoch)
            if not manifest_path(home).exists():
                return
            reader, ledger = self._readers.get(home), self._ledger(home)
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
                    if reader is not None:  # (an unindexed reader has len 0)
                        reader.close_shard(shard)
                    drop_spooled_shard(ledger, home, shard)
                    del self._members[shard]
                    for sid in ids:
                        self._rows_of.pop((home, sid), None)


class Spool:
    """The trainer's side of a stream run: each epoch read from its own
    store; on rank 0, its progress written after every step for the run's
    progress artifact (flows/stream.py) and, with a spool, the shards each
    step finished removed and each checkpoint's position written for the
    capture side (offline, it does nothing)."""

    def __init__(self, run, store: Path):
        cfg = run.cfg
        self.stream, self.epochs = cfg.stream, cfg.epochs
        self.reporting = cfg.stream and run.rank == 0
        self.active = self.reporting and cfg.spool_bytes is not None
        self.reader, self.store = run.reader, Path(store)
        self.started, self.tokens, self.steps = time.time(), 0, 0

    def start_epoch(self, epoch: int, done: list[list[int]]) -> None:
        """Epoch `epoch`, whose batches `done` a checkpoint already holds."""
        if self.stream:
            self.reader.start_epoch(epoch)
            self._consumed(done)

    def stepped(self, epoch: int, step: int, total_steps: int, batches: list[list[int]]) -> None:
        """A step over `batches` is done on every rank."""
        if not self.reporting:
            return
        self._consumed(batches)
        self.tokens += int(sum(self.reader.num_tokens[i] for b in batches for i in b))
        self.steps += 1
        record_progress(self.store, "trained", epoch=epoch, epochs=self.epochs, step=step, total_steps=total_steps,
                        steps=self.steps, tokens=self.tokens, started=self.started)

    def _consumed(self, batches: list[list[int]]) -> None:
        if self.active:
            self.reader.consumed([self.reader.sample_ids[i] for b in batches for i in b])

    def checkpointed(self, epoch: int, batches_done: int) -> None:
        if self.active:
            write_position(self.store, epoch, batches_done)

    def finish(self, epochs: int) -> None:
        if self.active:
            self.reader.start_epoch(epochs)  # every epoch trained: the spool's stores go
