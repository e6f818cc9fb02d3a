"""Each side's state for the other, in small files beside the store (a
trainer running as torchrun's ranks has no Prefect context): the capture's
(running, completed, failed), the trainer's (running, stopped, finished),
what a trainer process waits for, and each side's progress."""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path

from tasks.store.manifest import write_json_atomic

CAPTURE_STATE = "stream-capture.json"
TRAINER_STATE = "stream-trainer.json"
WAITING = "stream-waiting"  # stream-waiting-<host>-<pid>-<id>.json: a trainer process waiting for a sample
STARTS = "stream-trainer-starts.json"
RATE_WINDOW_S = 60.0  # the progress artifact's rates are over this much of the recent past

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
    if state == "running":  # a run's trainer, before it starts: what a killed one waited for is moot
        for path in Path(store).glob(f"{WAITING}-*.json"):
            path.unlink(missing_ok=True)
        write_json_atomic(Path(store) / STARTS, {"starts": 0, "at": time.time()})
    write_json_atomic(Path(store) / TRAINER_STATE, {"state": state, "at": time.time()})


def mark_trainer_started(store: Path) -> int:
    """A trainer (rank 0) starts, or starts again from its checkpoint (a
    Prefect retry after a rank died): from its second start in a run
    (mark_trainer running), the capture, which captured on past what it
    trained since, rewinds to the checkpointed position. Starts so far."""
    starts = trainer_starts(store) + 1
    write_json_atomic(Path(store) / STARTS, {"starts": starts, "at": time.time()})
    return starts


def trainer_starts(store: Path) -> int:
    return _read_state(Path(store) / STARTS).get("starts", 0)


def mark_waiting(store: Path, what: str | None) -> bool:
    """This trainer process waits for `what` (a sample), or no longer
    (None); whether it now waits."""
    path = Path(store) / f"{WAITING}-{_process_name()}.json"
    if what is None:
        path.unlink(missing_ok=True)
        return False
    write_json_atomic(path, {"waiting_for": what, "since": time.time()})
    return True


_NAME: tuple[int, str] | None = None


def _process_name() -> str:
    """This process among every trainer process of the run: ranks on other
    hosts, or in containers, share pid numbers (each container's first
    process is pid 1), and a host name alone may be shared too."""
    global _NAME
    if _NAME is None or _NAME[0] != os.getpid():  # a forked child is another process
        _NAME = (os.getpid(), f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return _NAME[1]


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
    (tasks/stream/progress.py), with the (time, tokens, steps) of its
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

