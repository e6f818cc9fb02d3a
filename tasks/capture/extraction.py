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

from tasks.capture.client import DUMP_WAIT_S, capture_many, probe_capture
from tasks.capture.dump import CaptureError, CaptureRefused, RID_PREFIX, SUFFIX, TMP_PREFIX, check_rid_prefix
from tasks.paths import ensure_private_dir
from tasks.data.dataset import Rejected, Sample, prepare_samples
from tasks.server.launch import server_healthy
from tasks.store.ledger import Ledger, open_ledger
from tasks.store.manifest import StoreError, read_manifest
from tasks.store.shards import BF16, ShardExists, bytes_per_token, remove_uncommitted, write_shard

logger = logging.getLogger("eagle3.extract")


class InsufficientSpace(RuntimeError):
    pass


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


def plan_extraction(dataset: Path, tokenizer, ledger: Ledger, *, max_length: int, policy: str,
                    rows: Sequence[int] | None = None) -> Plan:
    """Tokenise the dataset (or only its `rows`) and keep only what the
    ledger does not hold yet. Rows that cannot be used go to the quarantine
    table with their reason."""
    source = str(Path(dataset).resolve())
    samples, rejected = prepare_samples(dataset, tokenizer, max_length=max_length, policy=policy,
                                        rows=None if rows is None else frozenset(rows))
    stored = ledger.stored_ids()
    todo, seen = [], set()
    for s in samples:
        if s.sample_id not in stored and s.sample_id not in seen:  # duplicates are stored once
            seen.add(s.sample_id)
            todo.append(s)
    if rejected:
        ledger.quarantine([{"source": source, "source_row": r.source_row, "reason": r.reason} for r in rejected])
    return Plan(source, todo, len(samples) - len(todo), rejected, len(samples) + len(rejected))


def storage_preflight(plan: Plan, store: Path, dump_dir: Path, *, hidden_size: int, in_flight_tokens: int,
                      storage: str = BF16) -> dict:
    """Bytes the plan will need where the store and the dump dir live; raise
    InsufficientSpace (needed, free, where) before any work if they cannot fit."""
    per_token = bytes_per_token(hidden_size, storage=storage)
    need_store = plan.todo_tokens * per_token
    # A dump holds the model dtype (at most fp32) plus int64 ids, only while in flight.
    need_dump = in_flight_tokens * ((3 + 1) * hidden_size * 4 + 8)
    out = {"tokens": plan.todo_tokens, "bytes_per_token": per_token, "store_bytes": need_store, "dump_bytes": need_dump}
    for what, path, need in (("store", store, need_store), ("dump dir", dump_dir, need_dump)):
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


def warm_up(url: str, dump_dir: Path, *, aux_layer_ids: Sequence[int], api_key: str | None = None,
            rid_prefix: str = RID_PREFIX, requests: int = 3) -> dict:
    """A few probe captures of growing length: the first forwards on a fresh
    server are slow, and a capture that does not round-trip stops the run
    before any batch is sent."""
    summary = {}
    for k in range(requests):
        summary = probe_capture(url, dump_dir, api_key=api_key, rid_prefix=rid_prefix, num_tokens=16 * (k + 1),
                                aux_layer_ids=aux_layer_ids)
    return summary


class TooManyFailures(RuntimeError):
    """So many captures failed that the run is not storing a dataset but
    quarantining it: something is wrong with the server or the capture."""


class FailureGuard:
    """Counts capture outcomes across the batches of one run (from any
    thread) and stops the run when captures fail wholesale: after
    `max_consecutive` failed samples in a row, or when more than `max_ratio`
    of the samples tried so far failed (judged once `min_samples` were tried,
    and at the end of the run over everything). Without it, a run whose every
    capture fails ends Completed with nothing stored."""

    def __init__(self, *, max_ratio: float = 0.05, max_consecutive: int = 20, min_samples: int = 100):
        self.max_ratio, self.max_consecutive, self.min_samples = max_ratio, max_consecutive, min_samples
        self.stored = self.failed = self.streak = 0
        self.last_reason = ""
        self.tripped: str | None = None
        self._mutex = threading.Lock()

    def check(self) -> None:
        """Raise TooManyFailures if the run was already stopped."""
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

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _server_down(error: Exception) -> bool:
    return isinstance(error, httpx.TransportError)


def _was_in_flight(error: Exception) -> bool:
    """The request reached the server before it went down (a refused
    connection never did)."""
    return _server_down(error) and not isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout))


# A sample in flight at this many server crashes is quarantined as their
# cause. Once in flight at one, it is sent alone, so a second crash names it.
CRASH_LIMIT = 2


def extract_batch(
    url: str,
    dump_dir: Path,
    store: Path,
    source: str,
    samples: list[Sample],
    *,
    aux_layer_ids: Sequence[int],
    api_key: str | None = None,
    rid_prefix: str = RID_PREFIX,
    concurrency: int = 8,
    sample_attempts: int = 3,
    on_server_down: Callable[[], None] | None = None,
    store_workers: int | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    dump_wait_s: float = DUMP_WAIT_S,
    guard: FailureGuard | None = None,
    request_timeout_s: float = 600.0,
    writer: str = "",
) -> BatchResult:
    """Capture one batch, write it as one shard, commit it to the ledger.

    `api_key` and `rid_prefix` are the capture server's. Each sample gets up
    to `sample_attempts` tries, each under a fresh rid; a sample whose dump
    is missing, foreign, short or non-finite every time is quarantined with
    the reason, and the rest of the batch is stored. If the server itself
    stops answering, ServerUnavailable is raised (after calling
    `on_server_down`, e.g. the run's supervisor relaunching it) so the task
    is retried as a whole. `store_workers` threads read the dumps back and
    write the shard (default: one per core, at most 8); `transport` answers
    the HTTP requests instead of a server (benchmarks). With a `guard`, the
    batch does not start once the run has been stopped, and records its
    outcomes after committing what it captured (raising TooManyFailures if
    the run must stop). A request not answered within `request_timeout_s`
    fails its sample's attempt (a server that stops answering /health as
    well counts as down). `writer` names this node in a store many nodes
    write (its shards carry the name: tasks/store/shards.py shard_name).
    """
    if guard is not None:
        guard.check()
    t0 = time.perf_counter()
    ledger = open_ledger(store)
    stored = ledger.stored_ids()
    pending = [s for s in samples if s.sample_id not in stored]
    if len(pending) < len(samples):
        logger.info("%d of %d samples of this batch are already stored", len(samples) - len(pending), len(samples))
    captured: dict[str, dict] = {}
    errors: dict[str, str] = {}
    retried = 0
    quarantined = []
    crashes = ledger.crash_counts()
    culprits = [s for s in pending if crashes.get(s.sample_id, 0) >= CRASH_LIMIT]
    if culprits:
        for s in culprits:
            errors[s.sample_id] = (f"in flight at {crashes[s.sample_id]} SGLang server crashes, the last while "
                                   f"sent alone: taken to crash the server (see its log)")
        ledger.quarantine([{"source": source, "source_row": s.source_row, "sample_id": s.sample_id,
                            "reason": errors[s.sample_id], "attempts": crashes[s.sample_id]} for s in culprits])
        for s in culprits:
            logger.error("quarantined sample %s (row %d): in flight at %d server crashes", s.sample_id,
                         s.source_row, crashes[s.sample_id])
        quarantined = [s.sample_id for s in culprits]
        pending = [s for s in pending if crashes.get(s.sample_id, 0) < CRASH_LIMIT]

    def capture(group: list[Sample], width: int) -> list:
        """Capture a group; if the server went down meanwhile, count a crash
        against the samples that were in flight, and stop the batch."""
        def keep(i, capture, batch=group):
            s = batch[i]
            return {"sample_id": s.sample_id, "source_row": s.source_row, "input_ids": s.input_ids,
                    "loss_mask": s.loss_mask, "aux_hidden_states": capture.aux_hidden_states,
                    "final_hidden_state": capture.final_hidden_state}

        outs = capture_many(url, dump_dir, [s.input_ids.tolist() for s in group], keep, api_key=api_key,
                            rid_prefix=rid_prefix, concurrency=width, aux_layer_ids=aux_layer_ids,
                            read_workers=store_workers, transport=transport, dump_wait_s=dump_wait_s,
                            timeout_s=request_timeout_s)
        down = [o for o in outs if isinstance(o, Exception) and _server_down(o)]
        if down and not server_healthy(url, api_key=api_key):
            in_flight = [s.sample_id for s, o in zip(group, outs) if isinstance(o, Exception) and _was_in_flight(o)]
            counts = ledger.record_crash(in_flight) if in_flight else {}
            if on_server_down is not None:
                on_server_down()
            suspects = ", ".join(f"{i} (crash {n})" for i, n in counts.items()) or "none"
            raise ServerUnavailable(
                f"SGLang server at {url} stopped answering mid-batch ({down[0]!r}); the batch will be retried. "
                f"Samples in flight, sent alone from now on: {suspects}") from down[0]
        return outs

    # Samples in flight at an earlier crash go first, one at a time: if one
    # of them brings the server down, it alone is counted again.
    alone = [s for s in pending if crashes.get(s.sample_id, 0) >= 1]
    for s in alone:
        out = capture([s], 1)[0]
        if not isinstance(out, Exception):
            captured[s.sample_id] = out
    pending = [s for s in pending if s.sample_id not in captured]

    refused: list[tuple[Sample, int]] = []
    for attempt in range(1, sample_attempts + 1):
        if not pending:
            break
        if attempt > 1:
            retried += len(pending)
            logger.warning("retrying %d samples (attempt %d of %d)", len(pending), attempt, sample_attempts)
        outs = capture(pending, concurrency)
        failed = []
        for s, out in zip(pending, outs):
            if isinstance(out, Exception):
                errors[s.sample_id] = f"{type(out).__name__}: {out}"
                if isinstance(out, CaptureRefused):
                    refused.append((s, attempt))  # the same request gets the same answer: not retried
                else:
                    failed.append(s)
                if not isinstance(out, (CaptureError, httpx.HTTPError)):
                    logger.error("sample %s (row %d): %r", s.sample_id, s.source_row, out)
            else:
                captured[s.sample_id] = out
        pending = failed

    if refused:
        ledger.quarantine([{"source": source, "source_row": s.source_row, "sample_id": s.sample_id,
                            "reason": errors[s.sample_id], "attempts": tries} for s, tries in refused])
        for s, _ in refused:
            logger.error("quarantined sample %s (row %d): %s", s.sample_id, s.source_row, errors[s.sample_id])
        quarantined += [s.sample_id for s, _ in refused]
    if pending:
        ledger.quarantine([{"source": source, "source_row": s.source_row, "sample_id": s.sample_id,
                            "reason": errors[s.sample_id], "attempts": sample_attempts} for s in pending])
        for s in pending:
            logger.error("quarantined sample %s (row %d) after %d attempts: %s",
                         s.sample_id, s.source_row, sample_attempts, errors[s.sample_id])
        quarantined += [s.sample_id for s in pending]

    items = [captured[s.sample_id] for s in samples if s.sample_id in captured]
    shard = None
    if items:
        # The storage dtype is the store's, fixed in its manifest when it was created.
        storage = read_manifest(store).get("dtype", BF16)
        write = partial(write_shard, store, items, source=source, storage=storage, workers=store_workers,
                        writer=writer)
        try:
            shard_info, rows = write()
        except ShardExists as e:
            if ledger.has_shard(e.name):
                raise
            # An interrupted run wrote this batch but never committed it.
            logger.warning("replacing %s: left uncommitted by an interrupted run", e.path)
            remove_uncommitted(store, e.name)
            shard_info, rows = write()
        try:
            ledger.commit_shard(shard_info, rows)
        except StoreError:
            # Another writer committed some of these samples first (a node
            # taken for dead that was not): ours stays out of the store, and a
            # retry of the batch re-reads the ledger and stores only the rest.
            if not ledger.has_shard(shard_info.name):
                remove_uncommitted(store, shard_info.name)
            raise
        shard = shard_info.name
    tokens = sum(len(it["input_ids"]) for it in items)
    if guard is not None:
        failed_ids = set(quarantined)
        guard.record([s.sample_id not in failed_ids for s in samples if s.sample_id not in stored],
                     errors[quarantined[-1]] if quarantined else "")
    return BatchResult(shard, len(items), tokens, time.perf_counter() - t0, quarantined, retried)


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
