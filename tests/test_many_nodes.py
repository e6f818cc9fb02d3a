"""Extraction across nodes, for real on one machine: PostgreSQL (the store's
index and Prefect's database), a Prefect server on it, and two "nodes", each
`python -m flows.node`: a real CPU SGLang server (tiny model, its own
dump dir) and a real Prefect worker on its own work queue. The parent flow
runs from the command line, as `python -m flows.extract_nodes`.

The second test kills one node (its server, then its worker and the worker's
flow-run process) while it runs a share: the run finishes on the other node,
every sample is stored exactly once, and the dead node's child run ends
Crashed through the heartbeat automation, not Running forever.

The third stops the Prefect server for 20 s under a running node and starts
it again: the run finishes, nothing lost or doubled.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ARTIFACTS, CHUNKED_PREFILL, demo_rows, write_jsonl
from tests.prefect_stack import (REPO, cli, log_tail, prefect_database, prefect_server, start_node, start_prefect_server,
                                 stop, stop_node, wait_node)

pytestmark = pytest.mark.server
LOGS = ARTIFACTS / "many-nodes"
QUEUES = ("node-a", "node-b")
ZOMBIE_AFTER_S = 45  # heartbeats every 30 s (Prefect's minimum)


@pytest.fixture(scope="module")
def stack(postgres_url, tiny_model, tmp_path_factory):
    server, api, env = prefect_server(tmp_path_factory.mktemp("prefect-home"), LOGS / "prefect-server.log",
                                      database_url=prefect_database(postgres_url))
    env["EAGLE3_LEDGER_URL"] = postgres_url
    env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = "30"
    nodes = {}
    try:
        cli(["work-pool", "create", "eagle3", "--type", "process"], env)
        cli(["--no-prompt", "deploy", "--name", "extract-node"], env)
        done = subprocess.run([sys.executable, "-c", "from tasks.capture.nodes import ensure_zombie_automation as z; "
                               f"print(z({ZOMBIE_AFTER_S}))"], cwd=REPO, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        started = {q: start_node(q, str(tiny_model), env, LOGS, "--server.max-total-tokens", "16384",
                                 "--server.chunked-prefill-size", str(CHUNKED_PREFILL)) for q in QUEUES}
        nodes = {q: {"proc": proc} for q, (proc, _) in started.items()}
        for q, (proc, out) in started.items():  # both servers start at once
            nodes[q] = wait_node(proc, out)
        stack = {"api": api, "env": env, "nodes": nodes, "model": str(tiny_model), "server": server}
        yield stack
        server = stack["server"]  # the outage test starts it again
    finally:
        for node in nodes.values():
            stop_node(node)
        stop(server)


def run_parent(stack, d: Path, rows: int, *argv: str, queues=QUEUES) -> subprocess.Popen:
    """The parent from the command line: a run file (as configs/nodes.yaml),
    then the test's own keys."""
    dataset = write_jsonl(d / "data.jsonl", demo_rows(rows))
    run_file = d / "nodes.yaml"
    run_file.write_text(yaml.safe_dump({"queues": list(queues), "model": stack["model"],
                                        "capture": {"dataset": str(dataset), "max_length": 512},
                                        "store": {"path": str(d / "store"), "ledger_url": "env"}}))
    return subprocess.Popen([sys.executable, "-m", "flows.extract_nodes", "--config", str(run_file), *argv],
                            cwd=REPO, env=stack["env"],
                            stdout=open(d / "parent.out", "w"), stderr=subprocess.STDOUT, text=True)


def parent_result(proc: subprocess.Popen, out: Path, timeout_s: float) -> dict:
    assert proc.wait(timeout=timeout_s) == 0, log_tail(out, 80)
    text = out.read_text()
    return json.loads(text[text.rindex("\n{") + 1:])


def children(api, parent_id: str | None = None) -> list[dict]:
    runs = api.call("POST", "/flow_runs/filter", {"flow_runs": {"name": {"like_": "node-"}}})
    return [r for r in runs if parent_id is None or r["parameters"].get("parent_run") == parent_id]


def processes_of_run(run_id: str) -> list[int]:
    """The process groups of the processes running flow run `run_id` (the
    worker starts each flow run in a process of its own)."""
    groups = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"PREFECT__FLOW_RUN_ID={run_id}".encode() in environ.read_bytes().split(b"\0"):
                groups.add(os.getpgid(int(environ.parent.name)))
        except (OSError, ProcessLookupError):
            continue
    assert groups, f"no process runs flow run {run_id}"
    return sorted(groups)


def stored(store: Path) -> list[str]:
    from tasks.store.ledger.open import open_ledger

    return list(open_ledger(store).samples().sample_id)


def test_a_dataset_spread_over_two_nodes_is_stored_once_and_verified(stack, tmp_path, monkeypatch):
    # ...while node-a's server is SIGKILLed under one of its runs: the node
    # relaunches it (same port, key and rid prefix) and its run waits for it.
    monkeypatch.setenv("EAGLE3_LEDGER_URL", stack["env"]["EAGLE3_LEDGER_URL"])
    api, node_a = stack["api"], stack["nodes"]["node-a"]
    proc = run_parent(stack, tmp_path, 16, "--capture.batch-size", "2", "--batches-per-child", "2")
    store = str(tmp_path / "store")
    deadline = time.monotonic() + 600
    while not [r for r in children(api) if r["parameters"]["store"]["path"] == store
               and r["work_queue_name"] == "node-a" and r["state_type"] == "RUNNING"]:
        assert proc.poll() is None and time.monotonic() < deadline, log_tail(tmp_path / "parent.out", 80)
        time.sleep(0.5)
    os.killpg(node_a["server_pid"], signal.SIGKILL)
    result = parent_result(proc, tmp_path / "parent.out", 900)
    node_log = Path(node_a["logs"]).parent / "node-a.out"
    assert "SGLang server relaunched at " + node_a["server_url"] in node_log.read_text(), log_tail(node_log)
    assert not [r["queue"] for r in result["nodes"] if r["drained"]]

    assert result["verification"]["ok"], result["verification"]
    ids = stored(tmp_path / "store")
    assert len(ids) == len(set(ids)) == 16
    runs = [r for r in children(stack["api"]) if r["parameters"]["store"]["path"] == str(tmp_path / "store")]
    assert {r["state_type"] for r in runs} == {"COMPLETED"}
    assert {r["work_queue_name"] for r in runs} == set(QUEUES)  # both nodes worked
    assert all(r["parent_task_run_id"] for r in runs)  # the UI shows them under the parent's node tasks
    # Each node wrote shards under its own name; the index names exactly those files.
    names = {p.stem for p in (tmp_path / "store" / "shards").glob("shard-*.safetensors")}
    assert {n.split("-", 2)[2] for n in names} == set(QUEUES)
    assert {r["queue"]: r["samples"] > 0 for r in result["nodes"]} == {q: True for q in QUEUES}
    assert sum(r["samples"] for r in result["nodes"]) == 16
    # No capture left behind in a node's (RAM-backed, in production) dump dir, not even the one of the
    # request node-a's server died under: each failure path discards its request's dumps.
    assert not [p.name for q in QUEUES for p in (LOGS / f"dumps-{q}").glob("*.safetensors")]


def test_a_node_killed_mid_run_loses_nothing_and_its_run_ends_crashed(stack, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_LEDGER_URL", stack["env"]["EAGLE3_LEDGER_URL"])
    api, victim = stack["api"], stack["nodes"]["node-b"]
    proc = run_parent(stack, tmp_path, 24, "--capture.batch-size", "2", "--batches-per-child", "1",
                      "--max-node-failures", "1")
    store = str(tmp_path / "store")

    # Kill node-b while one of its child runs is Running and has sent a heartbeat.
    deadline, running = time.monotonic() + 600, None
    while running is None:
        assert proc.poll() is None and time.monotonic() < deadline, log_tail(tmp_path / "parent.out", 80)
        for r in children(api):
            if r["parameters"]["store"]["path"] == store and r["work_queue_name"] == "node-b" and r["state_type"] == "RUNNING":
                beats = api.call("POST", "/events/filter", {"filter": {
                    "event": {"name": ["prefect.flow-run.heartbeat"]},
                    "any_resource": {"id": [f"prefect.flow-run.{r['id']}"]}}})
                if beats["events"]:
                    running = r
        time.sleep(0.5)
    # The node dies at once: nothing of it may report its run's end.
    os.killpg(victim["server_pid"], signal.SIGKILL)
    for group in {victim["worker_pid"], *processes_of_run(running["id"])}:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:  # the same group, already gone
            pass

    result = parent_result(proc, tmp_path / "parent.out", 900)
    assert result["verification"]["ok"], result["verification"]
    ids = stored(tmp_path / "store")
    assert len(ids) == len(set(ids)) == 24  # nothing lost, nothing twice
    crashed = api.flow_run(running["id"])
    assert crashed["state_type"] == "CRASHED"
    assert "no heartbeat" in crashed["state"]["message"]  # the automation's doing, not the run's own report
    out = (tmp_path / "parent.out").read_text()
    assert "node node-b drained" in out, log_tail(tmp_path / "parent.out", 80)
    by_node = {r["queue"]: r for r in result["nodes"]}
    assert by_node["node-b"]["drained"] and not by_node["node-a"]["drained"]
    # The UI shows why: the parent's nodes table.
    from flows.artifacts import artifact_key

    table = api.call("POST", "/artifacts/filter", {"artifacts": {"key": {"any_": [artifact_key("nodes", store)]}}})
    rows = {r["node"]: r["status"] for r in json.loads(table[0]["data"])}
    assert rows["node-a"] == "OK" and rows["node-b"].startswith("drained: 1 shares failed in a row there")
    assert not [r for r in children(api) if r["parameters"]["store"]["path"] == store
                and r["state_type"] not in ("COMPLETED", "CRASHED", "CANCELLED")]


OUTAGE_S = 20


def test_the_prefect_api_gone_for_20_s_under_a_running_node_loses_and_doubles_nothing(stack, tmp_path, monkeypatch):
    """The Prefect server (every run's API: the parent's, the child's, the
    worker's) stopped while node-a runs a share, started again 20 s later on
    the same port and database. Last in the module: it replaces the stack's
    server (and node-b is gone: the test before killed it)."""
    monkeypatch.setenv("EAGLE3_LEDGER_URL", stack["env"]["EAGLE3_LEDGER_URL"])
    api = stack["api"]
    proc = run_parent(stack, tmp_path, 6, "--capture.batch-size", "2", "--batches-per-child", "1",
                      queues=["node-a"])
    store = str(tmp_path / "store")
    deadline = time.monotonic() + 600
    while not [r for r in children(api) if r["parameters"]["store"]["path"] == store and r["state_type"] == "RUNNING"]:
        assert proc.poll() is None and time.monotonic() < deadline, log_tail(tmp_path / "parent.out", 80)
        time.sleep(0.5)
    stop(stack["server"])
    time.sleep(OUTAGE_S)
    stack["server"] = start_prefect_server(stack["env"], LOGS / "prefect-server.log")
    assert proc.poll() is None, log_tail(tmp_path / "parent.out", 80)  # the outage was under the running run

    result = parent_result(proc, tmp_path / "parent.out", 900)
    assert result["verification"]["ok"], result["verification"]
    ids = stored(tmp_path / "store")
    assert len(ids) == len(set(ids)) == 6  # nothing lost, nothing twice
    assert not [r for r in children(api) if r["parameters"]["store"]["path"] == store
                and r["state_type"] not in ("COMPLETED", "CRASHED", "CANCELLED", "FAILED")]
