"""The Prefect API of a command-line run that names none: a temporary
server, as Prefect's own ephemeral mode starts, but in a session of its own.

Prefect's ephemeral server shares the terminal's process group, so Ctrl-C
kills it together with the run: the run then cannot record its end or stop
its tasks through it, and its log workers retry for minutes against a dead
port (seen: 110 s until SIGKILL). This one survives the signal, is drained
and stopped by the run on its way out, and dies with the run's process if
that is killed outright (a parent-death signal, set by the server itself,
bound to the main thread that starts it and lives as long as the run).

    python -m flows.local_api PORT RUN_PID    # what the run starts; not for people
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

import httpx

START_TIMEOUT_S = 60.0
# What a run waits, at its end, for its last logs and events to reach the
# API before the server goes: Prefect's workers otherwise wait unbounded.
DRAIN_S = 5.0
# What it then waits for the server to exit on SIGTERM before SIGKILL.
API_STOP_S = 10.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_prefect_api() -> Iterator[str | None]:
    """Within: PREFECT_API_URL names a running API. One already configured
    is used as it is (None is yielded); otherwise a temporary server is
    started for the block and stopped after it, once the logs are sent."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield None
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    process = subprocess.Popen([sys.executable, "-m", "flows.local_api", str(port), str(os.getpid())],
                               start_new_session=True,
                               env={**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                                    "PREFECT__SERVER_FINAL": "1"})
    try:
        _wait_healthy(url, process)
        with temporary_settings({PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                _drain()
    finally:
        process.terminate()
        try:
            process.wait(timeout=API_STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_healthy(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the temporary Prefect server exited with code {process.returncode} before it "
                               f"served; set PREFECT_API_URL to a running Prefect server instead")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the temporary Prefect server at {url} did not answer within {START_TIMEOUT_S:.0f} s; "
                       "set PREFECT_API_URL to a running Prefect server instead")


def _drain() -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=DRAIN_S)
    EventsWorker.drain_all(timeout=DRAIN_S)


def _serve(port: int, run_pid: int) -> None:
    import ctypes

    import uvicorn

    PR_SET_PDEATHSIG = 1
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != run_pid:  # the run died before the signal was set
        return
    uvicorn.run("prefect.server.api.server:create_app", factory=True, host="127.0.0.1", port=port,
                log_level="error", lifespan="on")


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
