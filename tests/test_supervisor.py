"""The supervisor of a run's server, in attach mode (the launched mode runs
on real servers in test_faults_auth.py, test_faults_crash_loop.py and
test_stop_signals.py): a batch waits for an attached server its owner
relaunches (a node does: test_many_nodes.py), up to attach_wait_s, and a
server its run has stopped is never waited for or relaunched."""
from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest

from tasks.failures import EndsRun
from tasks.server.config import ServerConfig
from tasks.server.supervisor import ServerSupervisor
from tasks.sglang_api import ServerError, ServerStopped


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_health_after(port: int, delay_s: float) -> http.server.HTTPServer:
    """A server answering /health on `port`, from `delay_s` on (a relaunch)."""
    holder = {}

    def run():
        time.sleep(delay_s)
        holder["server"] = http.server.HTTPServer(("127.0.0.1", port), Health)
        holder["server"].serve_forever(poll_interval=0.1)

    threading.Thread(target=run, daemon=True).start()
    return holder


def test_a_batch_waits_for_an_attached_server_that_comes_back(tmp_path):
    port = free_port()
    holder = serve_health_after(port, 1.5)
    supervisor = ServerSupervisor(ServerConfig(url=f"http://127.0.0.1:{port}", attach_wait_s=30))
    try:
        t0 = time.monotonic()
        supervisor.recover()
        assert 1.5 <= time.monotonic() - t0 < 30
    finally:
        while "server" not in holder:
            time.sleep(0.1)
        holder["server"].shutdown()


def test_an_attached_server_that_stays_down_fails_after_the_wait():
    port = free_port()
    supervisor = ServerSupervisor(ServerConfig(url=f"http://127.0.0.1:{port}", attach_wait_s=2))
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"is not answering \(waited 2 s\); restart it") as gone:
        supervisor.recover()
    assert time.monotonic() - t0 >= 2
    # No batch of the run can succeed without it: the run ends at the first (flows/batches.py drain).
    assert isinstance(gone.value, EndsRun)
    # Without a wait it fails at once, as before nodes relaunched servers.
    with pytest.raises(ServerError, match="no healthy SGLang server"):
        ServerSupervisor(ServerConfig(url=f"http://127.0.0.1:{port}")).start()


def test_a_server_its_run_stopped_is_not_waited_for():
    port = free_port()
    supervisor = ServerSupervisor(ServerConfig(url=f"http://127.0.0.1:{port}", attach_wait_s=60))
    supervisor.stop()
    t0 = time.monotonic()
    with pytest.raises(ServerStopped, match="was stopped by its run"):
        supervisor.recover()
    assert time.monotonic() - t0 < 5
