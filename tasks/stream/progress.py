"""A stream run's progress: the capture's log line after each part, and
both sides in one line for the progress artifact the pipeline's run shows
(flows/stream.py watch_task), read from the files each side writes beside
the store (tasks/stream/state.py record_progress), so a trainer running as
torchrun's ranks, which have no Prefect context, shows too."""
from __future__ import annotations

import logging
import time
from pathlib import Path

from tasks.stream.parts import Part
from tasks.stream.plan import StreamPlan
from tasks.stream.spool import spooled_bytes
from tasks.stream.state import capture_state, progress, record_progress, trainer_state

logger = logging.getLogger("eagle3.stream")


def log_captured(root: Path, plan: StreamPlan, part: Part, captured: int, started: float, paused: float, peak: int,
                 room: int | None) -> None:
    """The capture's progress once `part` is stored: for the progress
    artifact and the log."""
    record_progress(root, "captured", epoch=part.epoch, epochs=len(plan.epochs), samples=part.taken, of=part.of,
                    tokens=captured, started=started, paused_s=paused)
    logger.info("stream capture: epoch %d/%d, %d of %d samples; %s tokens at %.0f tok/s%s", part.epoch + 1,
                len(plan.epochs), part.taken, part.of, f"{captured:,}", captured / max(1e-9, time.time() - started),
                f"; spool {spooled_bytes(root) / 2**20:.1f} of {room / 2**20:.1f} MiB (peak {peak / 2**20:.1f})"
                f"{cached_note(plan)}" if room is not None else "")


def cached_note(plan: StreamPlan) -> str:
    return (f"; {len(plan.cached)} samples ({plan.cached_bytes / 2**20:.1f} MiB) kept for every epoch"
            if plan.cached else "")


def describe_progress(store: Path, spool_budget: int | None) -> tuple[float, str]:
    """(percent of the training's steps done, what each side has done: its
    samples or steps, tokens and tokens/s, the trainer's ETA, the spool's
    fill)."""
    cap, tr = progress(store, "captured"), progress(store, "trained")
    line = [f"capture {capture_state(store)['state']}"]
    if cap:
        line[0] += (f": epoch {cap['epoch'] + 1}/{cap['epochs']}, {cap['samples']:,} of {cap['of']:,} samples, "
                    f"{cap['tokens']:,} tokens at {_rate(cap['tokens'], cap):,.0f} tok/s")
        if cap["paused_s"]:
            line[0] += f", paused {cap['paused_s']:,.0f} s for room"
    if tr:
        eta = (tr["total_steps"] - tr["step"]) / max(1e-9, _rate(tr["steps"], tr, 2))
        line.append(f"trainer {trainer_state(store)}: epoch {tr['epoch'] + 1}/{tr['epochs']}, step {tr['step']:,} of "
                    f"{tr['total_steps']:,}, {tr['tokens']:,} tokens at {_rate(tr['tokens'], tr):,.0f} tok/s, "
                    f"ETA {_duration(eta)}")
    else:
        line.append(f"trainer {trainer_state(store)}: no step yet (held-out evaluation, draft vocabulary)")
    if spool_budget is not None:
        line.append(f"spool {_size(spooled_bytes(store))} of {_size(spool_budget)}")
    return (100.0 * tr["step"] / max(1, tr["total_steps"]) if tr else 0.0), "; ".join(line)


def _rate(count: int, counts: dict, column: int = 1) -> float:
    """Per second over the records of the last RATE_WINDOW_S (tokens, or
    with column 2 steps), or since the start while there is one record."""
    window = counts.get("window", [])
    if len(window) >= 2 and counts["at"] > window[0][0]:
        return (count - window[0][column]) / (counts["at"] - window[0][0])
    return count / max(1e-9, counts["at"] - counts["started"])


def _duration(seconds: float) -> str:
    h, m = divmod(int(seconds) // 60, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {int(seconds) % 60:02d} s"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
