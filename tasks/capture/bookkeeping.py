"""What a run's batches add up to, counted across them from the ledger
and their outcomes, never from logs or listings: the guard that stops a run
whose captures fail wholesale, and the progress a person watching reads."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tasks.capture import canary
from tasks.capture.config import CaptureConfig
from tasks.capture.dump import discard_rids
from tasks.failures import Permanent
from tasks.store.ledger.index import Ledger

# A failed request's dump can land after it failed, while the server still
# runs it: at most a request timeout later (capture.request_timeout_s,
# default 600 s). Its rid is swept for this long.
LATE_DUMP_WINDOW_S = 900.0

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
