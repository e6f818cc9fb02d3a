"""A run SIGKILLed while its SGLang server runs leaves the server behind (it
has its own session). The next launch with the same log (the next run on the
same store or out_dir) stops it; a record that names another process (a
reused pid) or another host stops nothing."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from tasks.server.launch import ServerConfig, _group_members, _start_ticks, launch_server, pidfile_for, \
    reap_orphan
from tests.test_extract_flow import servers_logging_to

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_record_of_another_process_or_host_stops_nothing(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        record = {"pid": sleeper.pid, "start_ticks": _start_ticks(sleeper.pid), "port": 1,
                  "host": socket.gethostname(), "started": 0}
        for changed in ({"start_ticks": record["start_ticks"] + 1}, {"host": "elsewhere"}):
            path = tmp_path / "server.pid"
            path.write_text(json.dumps({**record, **changed}))
            assert reap_orphan(path) is None and not path.exists()  # stale record dropped
            assert sleeper.poll() is None  # and the process it no longer names left alone
        path.write_text(json.dumps(record))
        assert reap_orphan(path, grace_s=5) == sleeper.pid
        sleeper.wait(timeout=10)
    finally:
        sleeper.kill()


@pytest.mark.server
def test_a_server_orphaned_by_a_killed_run_is_stopped_by_the_next_launch(tiny_model, tmp_path, caplog):
    dumps, log = tmp_path / "dumps", tmp_path / "logs" / "sglang-server.log"
    # The "run": launches a server, then dies by SIGKILL, as a killed flow does.
    run = subprocess.run([sys.executable, "-c", f"""
import os, signal
from pathlib import Path
from tasks.server.launch import ServerConfig, launch_server
launch_server(ServerConfig(model_path={str(tiny_model)!r}, dump_dir=Path({str(dumps)!r}), max_total_tokens=4096),
              Path({str(log)!r}), timeout_s=600)
os.kill(os.getpid(), signal.SIGKILL)
"""], cwd=ROOT, timeout=900)
    assert run.returncode == -signal.SIGKILL
    orphans = servers_logging_to(log)
    assert len(orphans) == 1 and pidfile_for(log).exists()  # the server outlived its run
    cfg = ServerConfig(model_path=str(tiny_model), dump_dir=dumps, max_total_tokens=4096)
    with caplog.at_level("WARNING", logger="eagle3.server"):
        server = launch_server(cfg, log, timeout_s=600)
    with server:
        assert not _group_members(orphans[0])  # the orphan's whole process group is gone
        assert servers_logging_to(log) == [server.process.pid]
        assert f"stopping SGLang server pid {orphans[0]}" in caplog.text
    assert not servers_logging_to(log) and not pidfile_for(log).exists()
