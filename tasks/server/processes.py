"""A launched server's processes: its process group, stopped whole, and the
pid record that lets the next launch stop a server a killed run left behind.

A server outlives a run that is SIGKILLed (it has its own session, so the
run's death takes nothing with it): GPU memory and the port stay taken.
Each launched server is recorded next to its log; the next launch with
that log (the next run on the same store or out_dir, which holds its lock,
so the recorded server's run is gone) stops it. A parent-death signal is
not used: Linux sends it when the *thread* that started the child ends,
and Prefect starts servers from worker threads that end before the run.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from pathlib import Path

from tasks.durable import replace_durably
from tasks.sglang_api import ServerError

logger = logging.getLogger("eagle3.server")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


# What stop_group waits after SIGKILL before it calls the group unkillable.
KILL_WAIT_S = 10.0


def stop_group(pgid: int, grace_s: float, reap=lambda: None) -> None:
    """Stop the process group led by `pgid` and return only once no process
    of it remains.

    SIGTERM to the leader first: SGLang then shuts its workers down itself
    (terminating a worker first makes it wait and dump crash diagnostics).
    Whatever is left after `grace_s` gets SIGKILL, group-wide. `reap` is
    called while waiting (the leader's poll, when it is our child).
    """
    steps = ((lambda: os.kill(pgid, signal.SIGTERM), grace_s), (lambda: os.killpg(pgid, signal.SIGKILL), KILL_WAIT_S))
    for send, wait_s in steps:
        try:
            send()
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            reap()
            if not group_members(pgid):
                return
            time.sleep(0.2)
    raise ServerError(f"processes {group_members(pgid)} of the SGLang server survived SIGKILL")


def pidfile_for(log_path: Path) -> Path:
    return Path(log_path).with_suffix(".pid")


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with the pid it
    names one process, not a later one that reused the pid."""
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def write_pidfile(path: Path, pid: int, port: int) -> None:
    record = {"pid": pid, "start_ticks": start_ticks(pid), "port": port, "host": socket.gethostname(),
              "started": time.time()}
    replace_durably(path, lambda tmp: tmp.write_text(json.dumps(record) + "\n"))


def reap_orphan(path: Path, grace_s: float = 20.0) -> int | None:
    """Stop the server `path` records if it is still running (same host,
    same process: pid and start time); returns its pid, or None."""
    try:
        record = json.loads(Path(path).read_text())
        pid = int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    reaped = None
    if (record.get("host") == socket.gethostname() and record.get("start_ticks") is not None
            and start_ticks(pid) == record["start_ticks"] and group_members(pid)):
        logger.warning("stopping SGLang server pid %d (port %s), left running by an earlier run that did not "
                       "stop it (recorded in %s)", pid, record.get("port"), path)
        stop_group(pid, grace_s)
        reaped = pid
    Path(path).unlink(missing_ok=True)
    return reaped
