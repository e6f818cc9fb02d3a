import time

import pytest

from tasks.server.config import ServerConfig
from tasks.server.launch import CaptureSpec, launch_server
from tasks.server.processes import group_members
from tasks.sglang_api import ServerError


@pytest.mark.server  # real SGLang, which fails on the path
def test_bad_model_path_fails_fast_with_log_tail_and_leaves_no_process(tmp_path, monkeypatch):
    started = {}
    import subprocess

    real_popen = subprocess.Popen

    def spy(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started["proc"] = proc
        return proc

    monkeypatch.setattr("tasks.server.launch.subprocess.Popen", spy)
    cfg = CaptureSpec(ServerConfig(model=str(tmp_path / "no-such-model")), dump_dir=tmp_path / "dumps")
    t0 = time.monotonic()
    with pytest.raises(ServerError) as err:
        launch_server(cfg, tmp_path / "server.log", timeout_s=300)
    assert time.monotonic() - t0 < 300
    message = str(err.value)
    assert "exited with code" in message and "no-such-model" in message
    assert "Last lines of" in message and str(tmp_path / "server.log") in message
    proc = started["proc"]
    assert proc.poll() is not None
    assert group_members(proc.pid) == []


class _Loading:
    """A server process still loading: alive, not serving, writing its log."""

    def __init__(self, log_path, process):
        self.log_path, self.process, self.url, self.api_key = log_path, process, "http://127.0.0.1:9", None

    def alive(self):
        return self.process.poll() is None

    def log_tail(self, lines=40):
        return self.log_path.read_text()


def test_a_port_taken_while_the_server_loads_is_seen_at_once_and_an_earlier_launchs_is_not(tmp_path):
    import subprocess

    from tasks.server.health import PortTaken, wait_healthy

    log = tmp_path / "server.log"
    # uvicorn's own line, as a 0.5.23 server printed it when its port was taken (it then neither serves nor exits).
    earlier = ("[2026-12-01 19:59:18] ERROR:    [Errno 98] error while attempting to bind on address "
               "('127.0.0.1', 38499): address already in use\n")
    log.write_text("$ an earlier launch\n" + earlier)
    start = log.stat().st_size
    with subprocess.Popen(["sleep", "60"]) as process:
        try:
            t0 = time.monotonic()
            with pytest.raises(ServerError) as not_this_one:  # the earlier launch's line is not this one's
                wait_healthy(_Loading(log, process), 2.0, log_start=start)
            assert not isinstance(not_this_one.value, PortTaken)
            with open(log, "a") as f:
                f.write("$ this launch\n" + earlier.replace("38499", "38500"))
            t0 = time.monotonic()
            with pytest.raises(PortTaken, match="taken by another process"):
                wait_healthy(_Loading(log, process), 600.0, log_start=start)
            assert time.monotonic() - t0 < 5  # not the 600 s timeout
        finally:
            process.kill()


def test_a_launch_whose_port_was_taken_is_retried_on_another_port_unless_the_port_was_given(tmp_path, monkeypatch):
    import tasks.server.launch as launch
    from tasks.server.health import PortTaken

    tried = []

    def taken_once(spec, log_path, port, timeout_s, follower):
        tried.append(port)
        if len(tried) == 1:
            raise PortTaken("taken")
        return f"served on {port}"

    monkeypatch.setattr(launch, "_launch", taken_once)
    spec = CaptureSpec(ServerConfig(model="m"), dump_dir=tmp_path)
    assert launch.launch_server(spec, tmp_path / "log") == f"served on {tried[1]}"
    assert len(tried) == 2 and launch.PORT_RANGE[0] <= tried[0] <= launch.PORT_RANGE[1]
    tried.clear()
    import dataclasses

    with pytest.raises(PortTaken):  # a port the user chose is theirs: no other is tried
        launch.launch_server(dataclasses.replace(spec, port=12345), tmp_path / "log")
    assert tried == [12345]
