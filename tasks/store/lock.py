"""One run at a time on a directory (a store, a training out_dir).

    <dir>/run.lock        flock'ed for the whole run; holds a JSON record of
                          the holder: pid, host, start time, what it runs

The kernel drops a flock when its process dies, however it dies (SIGKILL
included), so a stale lock left on this host is taken over at once, with a
warning naming the dead holder. A filesystem shared between hosts may not
carry flocks from one host to another (old NFS, some FUSE mounts), so a
record left by another host that was not released cleanly is never broken
here: the run stops and says who held it; whoever knows that holder is gone
removes the file (or passes `break_foreign=True`).

A run fanned out over many nodes (flows/extract_nodes.py) holds the lock in
its parent flow run, whose id the record keeps (`run`); its child runs on
other hosts write under it after `check_held_by` finds that id there.

Re-entrant along one call chain (a pipeline flow holding a store and calling
the extract flow on it as a subflow): the held locks travel in a context
variable, which Prefect copies into subflows and task threads. Another run
in the same process does not inherit it and is refused like any other.
"""
from __future__ import annotations

import contextvars
import fcntl
import json
import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tasks.failures import Permanent

logger = logging.getLogger("eagle3.lock")

LOCK_NAME = "run.lock"

# Paths this call chain holds (resolved), for re-entrance.
_held: contextvars.ContextVar[frozenset] = contextvars.ContextVar("eagle3_held_locks", default=frozenset())
# Paths this process holds, with their open lock files: a second open() and
# flock() of the same file in one process would also conflict, but the
# record then names our own pid, which this map explains better.
_process_locks: dict[str, dict] = {}
_process_mutex = threading.Lock()


class LockHeld(Permanent, RuntimeError):
    """Another run holds the directory."""


def lock_path(directory: Path) -> Path:
    return Path(directory) / LOCK_NAME


def read_holder(directory: Path) -> dict | None:
    """The holder record in the lock file (None if there is none or it is
    unreadable: a holder killed while writing it)."""
    try:
        text = lock_path(directory).read_text()
        record = json.loads(text) if text.strip() else None
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def describe(record: dict | None) -> str:
    if not record:
        return "an unknown holder (no record)"
    started = record.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return (f"pid {record.get('pid')} on host {record.get('host')}, started {when}"
            f" ({record.get('purpose') or 'unknown run'})")


def _this_host() -> str:
    return socket.gethostname()


@contextmanager
def hold_lock(directory: Path, purpose: str, *, break_foreign: bool = False,
              run: str | None = None) -> Iterator[dict]:
    """Hold `directory` exclusively for the body; raise LockHeld naming the
    holder if another run has it. Yields this holder's record, which names
    `run` (a Prefect flow run id) when given."""
    directory = Path(directory).resolve()
    key = str(directory)
    if key in _held.get():
        yield _process_locks[key]["record"]
        return
    directory.mkdir(parents=True, exist_ok=True)
    with _process_mutex:
        if key in _process_locks:
            raise LockHeld(f"{directory} is held by another run in this process: "
                           f"{describe(_process_locks[key]['record'])}; wait for it to finish")
        fd = os.open(lock_path(directory), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            record = _acquire(fd, directory, purpose, break_foreign, run)
        except BaseException:
            os.close(fd)
            raise
        _process_locks[key] = {"fd": fd, "record": record}
    token = _held.set(_held.get() | {key})
    try:
        yield record
    finally:
        _held.reset(token)
        with _process_mutex:
            _process_locks.pop(key, None)
            try:
                # An empty file says "released cleanly": the next run, on any
                # host, takes it without question.
                os.ftruncate(fd, 0)
                os.fsync(fd)
            finally:
                os.close(fd)  # drops the flock


def _acquire(fd: int, directory: Path, purpose: str, break_foreign: bool, run: str | None) -> dict:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise LockHeld(f"{directory} is in use by another run: {describe(read_holder(directory))}. "
                       f"Wait for it to finish or stop it; two runs must not write one directory") from None
    except OSError as e:  # ENOLCK and kin: a filesystem that cannot lock
        raise LockHeld(f"cannot lock {lock_path(directory)} ({e}): this filesystem does not support locks; "
                       f"put the store or out_dir on a local or POSIX filesystem") from e
    previous = read_holder(directory)
    if previous:
        if previous.get("host") != _this_host() and not break_foreign:
            fcntl.flock(fd, fcntl.LOCK_UN)
            raise LockHeld(
                f"{directory} was locked by {describe(previous)} and never released. That host's lock "
                f"may not be visible from here, so it is not broken automatically: if that run is gone, "
                f"delete {lock_path(directory)} (or pass break_foreign=True) and start again")
        # On this host the flock would still be held if its process lived.
        logger.warning("taking over the lock on %s from %s: that process is gone (killed?)",
                       directory, describe(previous))
    record = {"pid": os.getpid(), "host": _this_host(), "started": time.time(), "purpose": purpose}
    if run:
        record["run"] = run
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    os.fsync(fd)
    return record


def check_held_by(directory: Path, run: str) -> dict:
    """Raise LockHeld unless `directory`'s lock is held for flow run `run`:
    a child run writes a store only while its parent holds it (a child that
    outlived a crashed or finished parent must not write beside a new run).
    Children check it before each batch, so they stop within one once a new
    parent has the lock, or, on the parent's host, once its process is gone."""
    record = read_holder(Path(directory))
    if not record or record.get("run") != run:
        raise LockHeld(f"{directory} is not held by run {run}, which this child run works for, but by "
                       f"{describe(record)}: the parent run has ended; start the parent flow again")
    # The pid, not a flock probe: a probe would hold the lock for an instant
    # and could refuse a new parent taking it over.
    if record.get("host") == _this_host() and not _alive(record.get("pid")):
        raise LockHeld(f"{directory} is held for run {run}, which this child run works for, but its process "
                       f"(pid {record.get('pid')}) is gone: the parent run died; start the parent flow again "
                       "(what is stored is kept)")
    return record


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # another user's process, or no pid to judge by
    return True
