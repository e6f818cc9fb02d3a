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

from tasks.server.config import ServerConfig
from tasks.server.launch import CaptureSpec, launch_server
from tasks.server.processes import group_members, pidfile_for, reap_orphan, start_ticks
from tests.test_extract_flow import servers_logging_to

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_record_of_another_process_or_host_stops_nothing(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        record = {"pid": sleeper.pid, "start_ticks": start_ticks(sleeper.pid), "port": 1,
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
from tasks.server.config import ServerConfig
from tasks.server.launch import CaptureSpec, launch_server
launch_server(CaptureSpec(ServerConfig(model={str(tiny_model)!r}, max_total_tokens=4096), dump_dir=Path({str(dumps)!r})),
              Path({str(log)!r}), timeout_s=600)
os.kill(os.getpid(), signal.SIGKILL)
"""], cwd=ROOT, timeout=900)
    assert run.returncode == -signal.SIGKILL
    orphans = servers_logging_to(log)
    assert len(orphans) == 1 and pidfile_for(log).exists()  # the server outlived its run
    cfg = CaptureSpec(ServerConfig(model=str(tiny_model), max_total_tokens=4096), dump_dir=dumps)
    with caplog.at_level("WARNING", logger="eagle3.server"):
        server = launch_server(cfg, log, timeout_s=600)
    with server:
        assert not group_members(orphans[0])  # the orphan's whole process group is gone
        assert servers_logging_to(log) == [server.process.pid]
        assert f"stopping SGLang server pid {orphans[0]}" in caplog.text
    assert not servers_logging_to(log) and not pidfile_for(log).exists()


@pytest.mark.server
def test_two_extractions_into_sibling_stores_keep_their_own_servers(tiny_model, prefect_api, tmp_path):
    """Seen before: a second run into stores/b took stores/a's live server
    for an orphan (both kept their record in stores/logs) and killed it. Each
    store now owns its server's log and record: both runs, at once, complete.
    b's run is the pipeline with regeneration: one server (one model load)
    answers the conversations and then captures them."""
    from tests.conftest import demo_rows, wait_for, write_jsonl

    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(24))
    stores = tmp_path / "stores"
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    runs = {}
    pipeline = ["-m", "flows.pipeline", "--regenerate.enabled", "true", "--regenerate.max-new-tokens", "8",
                "--evaluate.enabled", "false", "--train.out-dir", str(tmp_path / "train"), "--train.epochs", "1",
                "--train.draft-vocab-size", "512", "--train.tokens-per-batch", "1024"]
    for name in ("a", "b"):
        runs[name] = subprocess.Popen(
            [sys.executable, *(pipeline if name == "b" else ["-m", "flows.extract"]), "--server.model",
             str(tiny_model), "--server.max-total-tokens", "8192", "--capture.dataset", str(dataset),
             "--capture.batch-size", "8", "--capture.max-length", "256", "--store.path", str(stores / name)],
            cwd=ROOT, env=env, stdout=open(tmp_path / f"{name}.out", "w"), stderr=open(tmp_path / f"{name}.err", "w"))
        if name == "a":  # b starts once a's server runs (its pid record is written at launch)
            wait_for(pidfile_for(stores / "a" / "logs" / "sglang-server.log").exists, runs["a"], tmp_path / "a.err",
                     timeout_s=300)
    for p in runs.values():
        p.wait(timeout=900)
    for name, p in runs.items():
        out, err = (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text()
        assert p.returncode == 0, out[-2000:] + err[-3000:]
        assert "left running by an earlier run" not in err
        log = (stores / name / "logs" / "sglang-server.log").read_text()
        assert log.count("The server is fired up and ready to roll") == 1, name  # its own server, once
        result = json.loads(out[out.index("{"):])
        if name == "a":
            assert result["samples"] == 24 and result["verification"]["ok"]
        else:
            assert result["regenerated"]["rows"] == 24 and result["heldout_tau"] is not None, result
            assert "SGLang server for the answers at" in err and not (stores / "b" / "regenerated" / "logs").exists()
    assert not (stores / "logs").exists()


def test_pipelines_on_sibling_stores_regenerate_into_their_own_stores(tmp_path):
    """The pipeline's regenerated answers and their server's log and pid
    record sat in <store>/.. too: each now lies in its own store, which its
    run holds locked."""
    from flows.pipeline import answers_dir
    from flows.regenerate import server_log

    a, b = (tmp_path / "stores" / name for name in ("a", "b"))
    (data_a, log_a), (data_b, log_b) = ((answers_dir(s), server_log(answers_dir(s))) for s in (a, b))
    assert {data_a, log_a, pidfile_for(log_a)}.isdisjoint({data_b, log_b, pidfile_for(log_b)})
    assert all(p.is_relative_to(a) for p in (data_a, log_a, pidfile_for(log_a)))
