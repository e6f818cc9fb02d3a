"""Extraction, as plain functions: dump-dir reset, warm-up, one batch. The
plan and its preflight are tasks/capture/planning.py, the counts across
batches (failure guard, progress) tasks/capture/bookkeeping.py; the Prefect
flow in flows/extract.py wires them up.

Progress, resume and verification all come from the ledger: a sample is done
when its shard is committed there, and at no other moment.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import httpx

from tasks.capture import canary
from tasks.capture.bookkeeping import FailureGuard
from tasks.capture.client import DUMP_WAIT_S, capture_many, probe_capture
from tasks.capture.config import CaptureConfig
from tasks.capture.dump import (
    CaptureError, CaptureRefused, RID_PREFIX, SUFFIX, TMP_PREFIX, check_rid_prefix, discard_rids,
)
from tasks.paths import ensure_private_dir
from tasks.data.dataset import Sample
from tasks.sglang_api import ServerStopped, server_down, server_healthy, was_in_flight
from tasks.store.handle import Store
from tasks.store.manifest import StoreError
from tasks.store.shards import ShardExists, remove_uncommitted, write_shard

logger = logging.getLogger("eagle3.extract")


class ServerUnavailable(RuntimeError):
    """The server stopped answering mid-batch; the batch must be retried."""


def reset_dump_dir(dump_dir: Path, *, rid_prefix: str = RID_PREFIX, orphans: bool = True) -> int:
    """Remove dumps this pipeline wrote earlier (only its own files, and
    their temp files: rids under the capture server's `rid_prefix`, or with
    `orphans` under RID_PREFIX, which every prefix a launched server draws
    starts with, so an earlier run's orphans go too), check the directory is
    writable. Returns the number removed."""
    dump_dir = ensure_private_dir(Path(dump_dir))
    prefixes = tuple({check_rid_prefix(rid_prefix)} | ({RID_PREFIX} if orphans else set()))
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


