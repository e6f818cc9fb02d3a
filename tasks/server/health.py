"""Waiting for a launched server to serve, passing its log on meanwhile."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from subprocess import Popen
from typing import Protocol

from tasks.server.server_log import LogFollower
from tasks.sglang_api import ServerError, server_healthy

logger = logging.getLogger("eagle3.server")


class Starting(Protocol):
    """A server starting up, as launch.py's ServerHandle has it."""
    process: Popen
    url: str
    api_key: str | None
    log_path: Path

    def alive(self) -> bool: ...

    def log_tail(self, lines: int = 40) -> str: ...


# uvicorn's line when the HTTP port was taken while the server loaded; the
# server then neither serves nor exits.
BIND_FAILED = "error while attempting to bind on address"


class PortTaken(ServerError):
    """Another process bound the server's port before the server did."""


def _bind_failed(log_path: Path, log_start: int) -> bool:
    try:
        with open(log_path, "rb") as f:
            f.seek(log_start)
            return BIND_FAILED.encode() in f.read()
    except FileNotFoundError:
        return False


def wait_healthy(handle: Starting, timeout_s: float, follower: LogFollower | None = None,
                 log_start: int = 0) -> None:
    """Return once `handle`'s server answers /health; raise
    ServerError quoting its log's tail if it exits first or is not healthy
    within `timeout_s`, PortTaken as soon as its log (from `log_start`, where
    this launch's lines begin) says it could not bind."""
    deadline = time.monotonic() + timeout_s
    while True:
        if follower is not None:
            follower.forward(logger, everything=True)
        if _bind_failed(handle.log_path, log_start):
            raise PortTaken(f"{handle.url}: the port was taken by another process while the server started. "
                            f"Last lines of {handle.log_path}:\n{handle.log_tail()}")
        if not handle.alive():
            raise ServerError(
                f"SGLang server exited with code {handle.process.returncode} before it "
                f"became healthy. Last lines of {handle.log_path}:\n{handle.log_tail()}"
            )
        if server_healthy(handle.url, api_key=handle.api_key, timeout_s=10.0):
            return
        if time.monotonic() > deadline:
            raise ServerError(
                f"SGLang server not healthy after {timeout_s:.0f} s. Last lines of "
                f"{handle.log_path}:\n{handle.log_tail()}"
            )
        time.sleep(0.25)  # a refused connection costs nothing; a late "ready" costs every launch
