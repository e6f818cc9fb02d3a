"""Extraction, as plain functions: plan, preflight, dump-dir reset, warm-up,
one batch, progress. The Prefect flow in flows/extract.py wires them up.

Progress, resume and verification all come from the ledger: a sample is done
when its shard is committed there, and at no other moment.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import httpx

from tasks.capture import canary
from tasks.capture.client import DUMP_WAIT_S, capture_many, probe_capture
from tasks.capture.config import CaptureConfig
from tasks.capture.dump import (
    CaptureError, CaptureRefused, RID_PREFIX, SUFFIX, TMP_PREFIX, check_rid_prefix, discard_rids,
)
from tasks.failures import Permanent
from tasks.paths import ensure_private_dir
from tasks.data.dataset import Rejected, Sample, prepare_samples, require_usable
from tasks.sglang_api import ServerStopped, server_down, server_healthy, was_in_flight
from tasks.store.handle import Store
from tasks.store.ledger.index import Ledger
from tasks.store.manifest import StoreError
from tasks.store.shards import BF16, ShardExists, bytes_per_token, remove_uncommitted, write_shard

logger = logging.getLogger("eagle3.extract")


class InsufficientSpace(Permanent, RuntimeError):
    """The plan's states do not fit where they must go (a retry finds the same space)."""


class ServerUnavailable(RuntimeError):
    """The server stopped answering mid-batch; the batch must be retried."""


@dataclass
class Plan:
    source: str
    todo: list[Sample]
    already_stored: int
    rejected: list[Rejected]
    total_samples: int

    @property
    def todo_tokens(self) -> int:
        return sum(s.num_tokens for s in self.todo)

    def batches(self, batch_size: int) -> list[list[Sample]]:
        return [self.todo[i: i + batch_size] for i in range(0, len(self.todo), batch_size)]


def plan_extraction(capture: CaptureConfig, tokenizer, ledger: Ledger, rows: Sequence[int] | None = None) -> Plan:
    """Tokenise the capture's dataset (or only its `rows`, captured in the
    order given: a stream run's training order) and keep only what the
    ledger does not hold yet. Rows that cannot be used go to the quarantine
    table with their reason."""
    source = str(Path(capture.dataset).resolve())
    samples, rejected = prepare_samples(Path(capture.dataset), tokenizer, max_length=capture.max_length,
                                        policy=capture.max_length_policy,
                                        rows=None if rows is None else frozenset(rows))
    if rows is None:
        require_usable(Path(capture.dataset), samples, rejected)
    stored = ledger.captured_ids()
    todo, seen = [], set()
    for s in samples:
        if s.sample_id not in stored and s.sample_id not in seen:  # duplicates are stored once
            seen.add(s.sample_id)
            todo.append(s)
    if rows is not None:
        position = {row: k for k, row in enumerate(rows)}
        todo.sort(key=lambda s: position[s.source_row])
    if rejected:
        ledger.quarantine([{"source": source, "source_row": r.source_row, "reason": r.reason} for r in rejected])
    return Plan(source, todo, len(samples) - len(todo), rejected, len(samples) + len(rejected))


def storage_preflight(plan: Plan, store: Path, dump_dir: Path | None, *, hidden_size: int, in_flight_tokens: int,
                      dtype: str = BF16) -> dict:
    """Bytes the plan will need where the store and the dump dir live; raise
    InsufficientSpace (needed, free, where) before any work if they cannot fit.
    No dump dir: the store alone (a many-node parent, for the whole plan;
    each node checks its own dump dir)."""
    per_token = bytes_per_token(hidden_size, dtype=dtype)
    need_store = plan.todo_tokens * per_token
    # A dump holds the model dtype (at most fp32) plus int64 ids, only while in flight.
    need_dump = in_flight_tokens * ((3 + 1) * hidden_size * 4 + 8)
    out = {"tokens": plan.todo_tokens, "bytes_per_token": per_token, "store_bytes": need_store, "dump_bytes": need_dump}
    places = [("store", store, need_store)] + ([("dump dir", dump_dir, need_dump)] if dump_dir is not None else [])
    for what, path, need in places:
        path = _existing_parent(Path(path))
        free = shutil.disk_usage(path).free
        out[f"{what.replace(' ', '_')}_free"] = free
        if need > free:
            raise InsufficientSpace(
                f"the {what} needs {_gib(need)} for {plan.todo_tokens:,} tokens but {path} has "
                f"{_gib(free)} free; free space there or choose another location")
    return out


def _existing_parent(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def reset_dump_dir(dump_dir: Path, *, rid_prefix: str = RID_PREFIX) -> int:
    """Remove dumps this pipeline wrote earlier (only its own files, and
    their temp files: rids under the capture server's `rid_prefix`, or under
    RID_PREFIX, which every prefix a launched server draws starts with, so an
    earlier run's orphans go too), check the directory is writable. Returns
    the number removed."""
    dump_dir = ensure_private_dir(Path(dump_dir))
    prefixes = tuple({check_rid_prefix(rid_prefix), RID_PREFIX})
    removed = 0
    for path in dump_dir.iterdir():
        name = path.name
        dump = name.endswith(SUFFIX) and name.startswith(prefixes)
        # write_chunk's temp files: .tmp-<rid>@<start>.safetensors.<pid>
        temp = name.startswith(TMP_PREFIX) and name[len(TMP_PREFIX):].startswith(prefixes) and SUFFIX in name
        if path.is_file() and (dump or temp):
            path.unlink(missing_ok=True)
            removed += 1
    probe = dump_dir / f"{TMP_PREFIX}write-check"
    try:
        probe.unlink(missing_ok=True)  # a planted symlink goes, its target untouched
        # O_NOFOLLOW | O_EXCL: never writes through a link someone planted.
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        probe.unlink()
    except OSError as e:
        raise PermissionError(f"dump dir {dump_dir} is not writable: {e}") from e
    return removed


def warm_up(endpoint: "Endpoint", requests: int = 3) -> dict:
    """A few probe captures of growing length: the first forwards on a fresh
    server are slow, and a capture that does not round-trip stops the run
    before any batch is sent."""
    summary = {}
    for k in range(requests):
        summary = probe_capture(endpoint.url, endpoint.dump_dir, api_key=endpoint.api_key,
                                rid_prefix=endpoint.rid_prefix, num_tokens=16 * (k + 1),
                                aux_layer_ids=endpoint.aux_layer_ids)
    return summary


class TooManyFailures(Permanent, RuntimeError):
    """So many captures failed that the run is not storing a dataset but
    quarantining it: something is wrong with the server or the capture."""


_CAPTURE = CaptureConfig.model_fields


class FailureGuard:
    """Counts capture outcomes across the batches of one run (from any
    thread) and stops the run when captures fail wholesale: after
    `max_consecutive` failed samples in a row, or when more than `max_ratio`
    of the samples tried so far failed (judged once `min_samples` were tried,
    and at the end of the run over everything). Without it, a run whose every
    capture fails ends Completed with nothing stored. Its limits are the
    capture section's (of_capture); the defaults, its defaults."""

    def __init__(self, *, max_ratio: float = _CAPTURE["max_quarantine_ratio"].default,
                 max_consecutive: int = _CAPTURE["max_consecutive_failures"].default,
                 min_samples: int = _CAPTURE["quarantine_min_tried"].default,
                 canaries: canary.CanaryTally | None = None):
        self.max_ratio, self.max_consecutive, self.min_samples = max_ratio, max_consecutive, min_samples
        self.canaries = canaries or canary.CanaryTally()
        self.failed_rids: dict[str, float] = {}  # rid -> when it failed (monotonic)
        self.stored = self.failed = self.streak = 0
        self.last_reason = ""
        self.tripped: str | None = None
        self._mutex = threading.Lock()

    @classmethod
    def of_capture(cls, capture: CaptureConfig) -> FailureGuard:
        return cls(max_ratio=capture.max_quarantine_ratio, max_consecutive=capture.max_consecutive_failures,
                   min_samples=capture.quarantine_min_tried, canaries=canary.CanaryTally.of_capture(capture))

    def check(self) -> None:
        """Raise TooManyFailures if the run was already stopped, CanaryDisagrees
        if its canaries failed beyond their limit."""
        self.canaries.check()
        if self.tripped:
            raise TooManyFailures(self.tripped)

    def record(self, outcomes: Sequence[bool], reason: str = "") -> None:
        """outcomes: per sample, in order, whether it was captured."""
        with self._mutex:
            for ok in outcomes:
                self.stored += ok
                self.failed += not ok
                self.streak = 0 if ok else self.streak + 1
                if self.streak >= self.max_consecutive and not self.tripped:
                    self.tripped = self._message(f"{self.streak} captures in a row failed")
            if reason:
                self.last_reason = reason
            if not self.tripped and self.stored + self.failed >= self.min_samples:
                self.tripped = self._ratio_exceeded()
        self.check()

    def sweep(self, dump_dir: Path, rids: Sequence[str] = ()) -> None:
        """Remember `rids` (failed requests) and remove any dump of the run's
        failed requests, in one listing of the dump dir: one can land after
        its request failed (a timeout while the server still ran it). A rid
        is forgotten LATE_DUMP_WINDOW_S after it failed, so the set stays as
        small as the failures of the last minutes."""
        now = time.monotonic()
        with self._mutex:
            self.failed_rids.update(dict.fromkeys(rids, now))
            for rid in [r for r, at in self.failed_rids.items() if now - at > LATE_DUMP_WINDOW_S]:
                del self.failed_rids[rid]
            recent = set(self.failed_rids)
        discard_rids(dump_dir, recent)

    def finish(self) -> None:
        """The ratio over the whole run, however few samples it had."""
        with self._mutex:
            self.tripped = self.tripped or self._ratio_exceeded()
        self.check()

    def _ratio_exceeded(self) -> str | None:
        tried = self.stored + self.failed
        if tried and self.failed / tried > self.max_ratio:
            return self._message(f"{self.failed} of {tried} samples tried failed their capture "
                                 f"({self.failed / tried:.0%} > {self.max_ratio:.0%} allowed)")
        return None

    def _message(self, what: str) -> str:
        return (f"{what}; stopping the run (last error: {self.last_reason or 'unknown'}). The {self.stored} "
                f"samples stored are kept and the failed ones are quarantined; fix the server or capture "
                f"problem and rerun, which retries them (limits: max_quarantine_ratio={self.max_ratio}, "
                f"max_consecutive_failures={self.max_consecutive})")


@dataclass
class BatchResult:
    shard: str | None
    samples: int
    tokens: int
    seconds: float
    quarantined: list[str] = field(default_factory=list)
    retried: int = 0
    canaries: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# A failed request's dump can land after it failed, while the server still
# runs it: at most a request timeout later (capture.request_timeout_s,
# default 600 s). Its rid is swept for this long.
LATE_DUMP_WINDOW_S = 900.0
# A sample in flight at this many server crashes is quarantined as their
# cause. Once in flight at one, it is sent alone, so a second crash names it.
CRASH_LIMIT = 2


@dataclass(frozen=True)
class Endpoint:
    """A capture server as its client sees it: where requests go, with which
    API key and rid prefix, which aux layers it captures and where its dumps
    land. `on_down` makes it serve again when it stops answering (a run's
    supervisor relaunching it), or raises; `transport` answers in place of
    the network (tests, benchmarks). `checkpoint` is the target the server
    is meant to serve: its head scores the canaries (none without it)."""

    url: str
    dump_dir: Path
    aux_layer_ids: Sequence[int]
    checkpoint: Path | None = None
    api_key: str | None = None
    rid_prefix: str = RID_PREFIX
    on_down: Callable[[], None] | None = None
    transport: httpx.AsyncBaseTransport | None = None
    dump_wait_s: float = DUMP_WAIT_S


class _BatchCapture:
    """The captures of one batch: what was captured, what failed and why,
    what was quarantined, and the crash accounting when the server goes
    down under the batch's requests."""

    def __init__(self, endpoint: Endpoint, store: Store, source: str, capture: CaptureConfig,
                 store_workers: int | None):
        self.endpoint, self.store, self.source, self.cfg = endpoint, store, source, capture
        self.store_workers = store_workers
        self.captured: dict[str, dict] = {}
        self.errors: dict[str, str] = {}
        self.quarantined: list[str] = []
        self.disagreeing: list[tuple[Sample, int]] = []  # canaries that failed every try (try_all)
        self.retried = 0
        self.failed_rids: list[str] = []
        self.canaries: set[str] = set()
        self.head: canary.Head | None = None
        self.history: list[list[float]] = []

    def choose_canaries(self, pending: list[Sample]) -> None:
        """The batch's canaries (a seeded share, at least one), the target's
        head and the run's earlier canary profiles, read once per batch."""
        if self.endpoint.checkpoint is None or self.cfg.canary_fraction <= 0 or not pending:
            return
        self.canaries = canary.pick_canaries([s.sample_id for s in pending], self.cfg.canary_fraction)
        self.head = canary.load_head(str(self.endpoint.checkpoint))
        earlier = self.store.ledger.canaries(latest=canary.PROFILE_HISTORY)
        self.history = [[float(v) for v in p.split(",")] for p in earlier.profile if p]

    def _canary_for(self, s: Sample):
        return canary.checker(self.head, sample_id=s.sample_id, positions=self.cfg.canary_positions,
                              storage_dtype=self.store.dtype, history=self.history)

    def send(self, group: list[Sample], width: int) -> list:
        """Capture a group; if the server went down meanwhile, count a crash
        against the samples that were in flight, and stop the batch."""
        def keep(i, capture, batch=group):
            s = batch[i]
            return {"sample_id": s.sample_id, "source_row": s.source_row, "input_ids": s.input_ids,
                    "loss_mask": s.loss_mask, "aux_hidden_states": capture.aux_hidden_states,
                    "final_hidden_state": capture.final_hidden_state, "canary": capture.canary}

        e = self.endpoint
        canaries = {i: self._canary_for(s) for i, s in enumerate(group) if s.sample_id in self.canaries}
        outs = capture_many(e.url, e.dump_dir, [s.input_ids.tolist() for s in group], keep, api_key=e.api_key,
                            rid_prefix=e.rid_prefix, concurrency=width, aux_layer_ids=e.aux_layer_ids,
                            read_workers=self.store_workers, transport=e.transport, dump_wait_s=e.dump_wait_s,
                            timeout_s=self.cfg.request_timeout_s, canaries=canaries, failed=self.failed_rids)
        down = [o for o in outs if isinstance(o, Exception) and server_down(o)]
        if down and not server_healthy(e.url, api_key=e.api_key):
            in_flight = [s.sample_id for s, o in zip(group, outs) if isinstance(o, Exception) and was_in_flight(o)]
            crash = lambda: self.store.ledger.record_crash(in_flight) if in_flight else {}  # noqa: E731
            try:
                if e.on_down is not None:
                    e.on_down()
            except ServerStopped:
                raise  # its run stopped it: the requests it cut short are no sample's crash
            except Exception:
                crash()
                raise
            counts = crash()
            suspects = ", ".join(f"{i} (crash {n})" for i, n in counts.items()) or "none"
            raise ServerUnavailable(
                f"SGLang server at {e.url} stopped answering mid-batch ({down[0]!r}); the batch will be retried. "
                f"Samples in flight, sent alone from now on: {suspects}") from down[0]
        for s, out in zip(group, outs):
            if not isinstance(out, Exception):
                self.captured[s.sample_id] = out
        return outs

    def quarantine(self, failed: list[tuple[Sample, int]], why: str = "") -> None:
        """Quarantine samples (each with its attempts) for their last error."""
        if not failed:
            return
        self.store.ledger.quarantine([{"source": self.source, "source_row": s.source_row, "sample_id": s.sample_id,
                                       "reason": self.errors[s.sample_id], "attempts": n} for s, n in failed])
        for s, n in failed:
            logger.error("quarantined sample %s (row %d)%s: %s", s.sample_id, s.source_row,
                         why or f" after {n} attempt{'s' * (n != 1)}", self.errors[s.sample_id])
        self.quarantined += [s.sample_id for s, _ in failed]

    def try_all(self, pending: list[Sample]) -> None:
        """Up to sample_attempts tries each, each under a fresh rid; what a
        server refuses as such is not retried (the same request gets the
        same answer)."""
        refused: list[tuple[Sample, int]] = []
        for attempt in range(1, self.cfg.sample_attempts + 1):
            if not pending:
                break
            if attempt > 1:
                self.retried += len(pending)
                logger.warning("retrying %d samples (attempt %d of %d)", len(pending), attempt,
                               self.cfg.sample_attempts)
            failed = []
            for s, out in zip(pending, self.send(pending, self.cfg.concurrency)):
                if not isinstance(out, Exception):
                    continue
                self.errors[s.sample_id] = f"{type(out).__name__}: {out}"
                (refused.append((s, attempt)) if isinstance(out, CaptureRefused) else failed.append(s))
                if not isinstance(out, (CaptureError, httpx.HTTPError)):
                    logger.error("sample %s (row %d): %r", s.sample_id, s.source_row, out)
            pending = failed
        self.quarantine(refused)
        # A canary that disagreed on every try rejects the whole batch, which
        # is retried: its quarantine waits for the batch's outcome
        # (extract_batch), or a stream trainer waiting for it would stop on a
        # row the retry then clears by storing it.
        self.disagreeing = [(s, self.cfg.sample_attempts) for s in pending
                            if self.errors[s.sample_id].startswith(canary.CanaryMismatch.__name__)]
        self.quarantine([(s, self.cfg.sample_attempts) for s in pending
                         if not self.errors[s.sample_id].startswith(canary.CanaryMismatch.__name__)])

    def tally_canaries(self, tally: canary.CanaryTally) -> list[str]:
        """Count each canary sample once: passed (its last try), or failed
        (quarantined for disagreeing with the server's logprobs on every
        try); returns the failed ones' reasons."""
        failed = []
        for sample_id in sorted(self.canaries):
            if sample_id in self.captured:
                result = self.captured[sample_id]["canary"]
                tally.passed(result)
                if result.profile_outlier:
                    logger.warning("canary %s: its aux profile stands out from the run's: %s", sample_id,
                                   result.profile_outlier)
            elif self.errors.get(sample_id, "").startswith(canary.CanaryMismatch.__name__):
                failed.append(f"sample {sample_id}: {self.errors[sample_id]}")
                tally.mismatched(failed[-1])
        return failed

    def commit(self, samples: list[Sample], writer: str) -> tuple[str | None, list[dict]]:
        """The captured samples, in batch order, as one shard committed to
        the index; (its name, its items)."""
        items = [self.captured[s.sample_id] for s in samples if s.sample_id in self.captured]
        if not items:
            return None, items
        store = self.store
        write = partial(write_shard, store.path, items, source=self.source, dtype=store.dtype,
                        workers=self.store_workers, writer=writer)
        try:
            shard_info, rows = write()
        except ShardExists as e:
            if store.ledger.has_shard(e.name):
                raise
            # An interrupted run wrote this batch but never committed it.
            logger.warning("replacing %s: left uncommitted by an interrupted run", e.path)
            remove_uncommitted(store.path, e.name)
            shard_info, rows = write()
        canaries = [it["canary"].record(shard_info.name) for it in items if it["canary"] is not None]
        try:
            store.ledger.commit_shard(shard_info, rows, canaries)
        except StoreError:
            # Another writer committed some of these samples first (a node
            # taken for dead that was not): ours stays out of the store, and a
            # retry of the batch re-reads the ledger and stores only the rest.
            if not store.ledger.has_shard(shard_info.name):
                remove_uncommitted(store.path, shard_info.name)
            raise
        return shard_info.name, items


def extract_batch(endpoint: Endpoint, store: Store, source: str, samples: list[Sample],
                  capture: CaptureConfig = CaptureConfig(), *, guard: FailureGuard | None = None, writer: str = "",
                  store_workers: int | None = None, last_try: bool = True) -> BatchResult:
    """Capture one batch, write it as one shard, commit it to the store's
    index.

    Each sample gets up to `capture.sample_attempts` tries, each under a
    fresh rid; a sample whose dump is missing, foreign, short or non-finite
    every time is quarantined with the reason, and the rest of the batch is
    stored. If the server itself stops answering, ServerUnavailable is
    raised (after `endpoint.on_down`) so the task is retried as a whole; a
    sample in flight at CRASH_LIMIT crashes is quarantined as their cause.
    A seeded share of the samples are canaries (tasks/capture/canary.py):
    one that disagrees with the server's logprobs on every try is
    quarantined and the batch is not stored (CanaryBatchRejected, retried
    as a whole; CanaryDisagrees, which stops the run, once they fail
    wholesale); with `last_try` False (the task retries a rejected batch)
    the disagreeing canary is quarantined only if the run stops.
    `store_workers` threads read the dumps back and write the shard
    (default: one per core, at most 8). With a `guard`, the batch does not
    start once the run has been stopped, and records its outcomes after
    committing what it captured (raising TooManyFailures if the run must
    stop). `writer` names this node in a store many nodes write (its shards
    carry the name: tasks/store/shards.py shard_name).
    """
    if guard is not None:
        guard.check()
    t0 = time.perf_counter()
    stored = store.ledger.captured_among([s.sample_id for s in samples])
    pending = [s for s in samples if s.sample_id not in stored]
    if len(pending) < len(samples):
        logger.info("%d of %d samples of this batch are already stored", len(samples) - len(pending), len(samples))
    batch = _BatchCapture(endpoint, store, source, capture, store_workers)
    batch.choose_canaries(pending)
    if guard is not None:
        guard.sweep(endpoint.dump_dir)  # late dumps of the run's earlier failed requests
    try:
        crashes = store.ledger.crash_counts()
        culprits = [s for s in pending if crashes.get(s.sample_id, 0) >= CRASH_LIMIT]
        for s in culprits:
            batch.errors[s.sample_id] = (f"in flight at {crashes[s.sample_id]} SGLang server crashes, the last while "
                                         f"sent alone: taken to crash the server (see its log)")
        batch.quarantine([(s, crashes[s.sample_id]) for s in culprits], why=" as a server crash's cause")
        pending = [s for s in pending if crashes.get(s.sample_id, 0) < CRASH_LIMIT]
        # Samples in flight at an earlier crash go first, one at a time: if one
        # of them brings the server down, it alone is counted again.
        for s in [s for s in pending if crashes.get(s.sample_id, 0) >= 1]:
            batch.send([s], 1)
        batch.try_all([s for s in pending if s.sample_id not in batch.captured])
        tally = guard.canaries if guard is not None else canary.CanaryTally()
        disagree = batch.tally_canaries(tally)
        if disagree:
            try:
                tally.check()  # stops the run when canaries fail wholesale
            except canary.CanaryDisagrees:
                batch.quarantine(batch.disagreeing)
                raise
            if last_try:  # no retry will store them: quarantined now
                batch.quarantine(batch.disagreeing)
            # Its captures came from the same server in the same moments as the
            # canary's: none is stored; the retry captures them all afresh.
            raise canary.CanaryBatchRejected(f"batch not stored: {disagree[0]}; the batch is retried as a whole")
        shard, items = batch.commit(samples, writer)
        if guard is not None:
            failed = set(batch.quarantined)
            guard.record([s.sample_id not in failed for s in samples if s.sample_id not in stored],
                         batch.errors[batch.quarantined[-1]] if batch.quarantined else "")
        return BatchResult(shard, len(items), sum(len(it["input_ids"]) for it in items), time.perf_counter() - t0,
                           batch.quarantined, batch.retried, sum(it["canary"] is not None for it in items))
    finally:
        if guard is not None:
            guard.sweep(endpoint.dump_dir, batch.failed_rids)
        else:
            discard_rids(endpoint.dump_dir, set(batch.failed_rids))


@dataclass
class ProgressMeter:
    """Progress computed from the ledger, never from logs or listings."""

    ledger: Ledger
    planned_tokens: int
    planned_samples: int
    start: dict = field(init=False)
    t0: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.start = self.ledger.summary()

    def read(self) -> dict:
        now = self.ledger.summary()
        tokens = now["tokens"] - self.start["tokens"]
        samples = now["samples"] - self.start["samples"]
        elapsed = time.perf_counter() - self.t0
        rate = tokens / elapsed if elapsed > 0 else 0.0
        left = max(self.planned_tokens - tokens, 0)
        return {"samples": samples, "planned_samples": self.planned_samples, "tokens": tokens,
                "planned_tokens": self.planned_tokens, "tokens_per_s": rate,
                "eta_s": left / rate if rate > 0 else None, "quarantined": now["quarantined"],
                "percent": 100.0 * tokens / self.planned_tokens if self.planned_tokens else 100.0}

    @staticmethod
    def describe(p: dict) -> str:
        eta = "?" if p["eta_s"] is None else f"{p['eta_s'] / 60:.1f} min"
        return (f"{p['samples']}/{p['planned_samples']} samples, {p['tokens']:,}/{p['planned_tokens']:,} tokens "
                f"({p['percent']:.1f}%), {p['tokens_per_s']:.0f} tok/s, ETA {eta}, quarantined {p['quarantined']}")
