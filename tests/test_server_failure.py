import time

import pytest

from tasks.server.config import ServerConfig
from tasks.server.launch import LaunchSpec, launch_server
from tasks.server.processes import group_members
from tasks.sglang_api import ServerError


def test_bad_model_path_fails_fast_with_log_tail_and_leaves_no_process(tmp_path, monkeypatch):
    started = {}
    import subprocess

    real_popen = subprocess.Popen

    def spy(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started["proc"] = proc
        return proc

    monkeypatch.setattr("tasks.server.launch.subprocess.Popen", spy)
    cfg = LaunchSpec(ServerConfig(model=str(tmp_path / "no-such-model")), dump_dir=tmp_path / "dumps")
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
