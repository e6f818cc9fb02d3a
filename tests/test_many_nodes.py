"""Extraction across nodes, for real on one machine: PostgreSQL (the store's
index and Prefect's database), a Prefect server on it, and two "nodes", each
`python -m flows.node`: a real CPU SGLang server (tiny model, its own
dump dir) and a real Prefect worker on its own work queue. The parent flow
runs from the command line, as `python -m flows.extract_nodes`.

The tests, in order (each fault injected for real):
- a dataset over both nodes, node-a's server SIGKILLed under a share;
- a stream run's capture on both nodes feeding one trainer, node-a's loop
  SIGKILLed in the middle of a part;
- a regeneration over both nodes' servers, node-b's child SIGKILLed in the
  middle of its share;
- both nodes silent at once under a share: node-b killed (server, worker,
  its child's process), node-a's child SIGSTOPped, then SIGCONTed;
- the parent retried by Prefect after a failed first attempt;
- the parent SIGKILLed, then a new parent run;
- the Prefect server stopped for 20 s under a running node, then started
  again (last: it replaces the stack's server).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.pg_server import PASSWORD
from tests.conftest import ARTIFACTS, CHUNKED_PREFILL, demo_rows, wait_for, write_jsonl
from tests.node_flow_runs import (QUEUES, children, node_api_key, parent_result, pids_of_run, processes_of_run,
                                 run_parent, running_child, signal_all, stored)
from tests.prefect_stack import (REPO, secrets_found, cli, log_tail, prefect_database, prefect_server, run_processes, start_node,
                                 start_prefect_server, stop, stop_node, wait_node)

pytestmark = pytest.mark.server
LOGS = ARTIFACTS / "many-nodes"
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
        cli(["--no-prompt", "deploy", "--name", "extract-node", "--name", "stream-node", "--name", "regenerate-node"],
            env)
        done = subprocess.run([sys.executable, "-c", "from flows.node_runs import ensure_zombie_automation as z; "
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


def test_a_dataset_spread_over_two_nodes_is_stored_once_and_verified(stack, tmp_path, monkeypatch):
    # ...while node-a's server is SIGKILLed under one of its runs: the node
    # relaunches it (same port, key and rid prefix) and its run waits for it.
    monkeypatch.setenv("EAGLE3_LEDGER_URL", stack["env"]["EAGLE3_LEDGER_URL"])
    api, node_a = stack["api"], stack["nodes"]["node-a"]
    proc = run_parent(stack, tmp_path, 16, "--capture.batch-size", "2", "--batches-per-child", "2")
    store = str(tmp_path / "store")
    wait_for(lambda: running_child(api, store, "node-a"), proc, tmp_path / "parent.out")
    os.killpg(node_a["server_pid"], signal.SIGKILL)
    result = parent_result(proc, tmp_path / "parent.out", 900)
    node_log = Path(node_a["logs"]).parent / "node-a.out"
    assert "SGLang server relaunched at " + node_a["server_url"] in node_log.read_text(), log_tail(node_log)
    assert not [r["queue"] for r in result["nodes"] if r["drained"]]

    assert result["verification"]["ok"], result["verification"]
    ids = stored(tmp_path / "store")
    assert len(ids) == len(set(ids)) == 16
    runs = children(api, store=store)
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


def test_two_capture_nodes_feed_one_stream_trainer_through_postgres(stack, tiny_model, tmp_path, monkeypatch):
    """A spooled stream run whose capture runs on both nodes, each a loop
    leasing parts in training order from the store's PostgreSQL index; the
    trainer (here, this process) reads them through it. Node-a's loop is
    SIGKILLed in the middle of a part, once it has stored one (its processes
    stopped first, so the part is seen leased to it; node-b's worker is
    held until then, so node-a surely has): its lease runs out, node-b
    captures the part,
    and the trainer still takes every planned batch, in order, within the
    spool's budget. The spool's indexes (PostgreSQL schemas) go with it."""
    import psycopg
    import pandas as pd
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.stream import capture_task
    from tasks.capture.config import CaptureConfig
    from tasks.server.config import ServerConfig
    from tasks.store.config import StoreConfig
    from tasks.store.handle import Store
    from tasks.train.config import TrainConfig
    from tasks.train.loop import train
    from tasks.stream.plan import PLANNED, plan_stream
    from tasks.stream.spool import spooled_bytes
    from tasks.stream.state import mark_trainer
    from tasks.stream.parts import PartQueue

    url = stack["env"]["EAGLE3_LEDGER_URL"]
    monkeypatch.setenv("EAGLE3_LEDGER_URL", url)
    root = tmp_path / "store"
    capture = CaptureConfig(dataset=str(write_jsonl(tmp_path / "data.jsonl", demo_rows(40))), batch_size=4,
                            max_length=256)
    store = StoreConfig(path=str(root), ledger_url="env")
    cfg = TrainConfig(out_dir=str(tmp_path / "train"), draft_vocab_size=64, ttt_steps=1, epochs=2,
                      tokens_per_batch=512, heldout_fraction=0.1, eval_max_samples=2, vocab_positions=300,
                      stream=True)
    whole = plan_stream(stack["model"], capture, cfg)
    budget = whole.shard_bytes([r for b in whole.epochs[0] for r in b], capture.batch_size)  # of two epochs' data
    cfg = cfg.model_copy(update={"spool_bytes": budget})
    plan = plan_stream(stack["model"], capture, cfg, root)

    def schemas() -> int:
        with psycopg.connect(url) as db:
            return db.execute("SELECT count(*) FROM information_schema.schemata WHERE schema_name LIKE "
                              "'eagle3_%'").fetchone()[0]

    before = schemas()
    reports, failures, steps, held, killed = [], [], [], [], {}
    keys = [node_api_key(stack["nodes"][q]["worker_pid"]) for q in QUEUES]

    def capture_side() -> None:
        try:
            with temporary_settings({PREFECT_API_URL: stack["api"].url}):
                reports.append(capture_task.fn(ServerConfig(model=stack["model"]), capture, store, cfg, plan,
                                               nodes=QUEUES))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            failures.append(e)

    def kill_node_a_mid_part() -> None:
        try:
            api, queue = stack["api"], None
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not killed:
                time.sleep(0.5)
                child = running_child(api, str(root), "node-a")
                if child is None or not (root / "manifest.json").exists():
                    continue
                queue = queue or PartQueue(Store.open(root).ledger)
                pids = pids_of_run(child["id"])
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                parts = queue.parts()
                mine = parts[parts.node == "node-a"]
                leased = mine[(mine.state == "leased") & (mine.epoch >= 0)]
                if len(leased) and (mine.state == "done").any():  # once it has stored a part
                    killed.update(seq=int(leased.seq.iloc[0]), run=child["id"])
                for pid in pids:
                    os.kill(pid, signal.SIGKILL if killed else signal.SIGCONT)
            os.kill(stack["nodes"]["node-b"]["worker_pid"], signal.SIGCONT)
            # As the heartbeat automation would, 45 s on (the two-silent-nodes test shows it does).
            api.call("POST", f"/flow_runs/{killed['run']}/set_state",
                     {"state": {"type": "CRASHED", "message": "killed by the test"}, "force": True})
        except BaseException as e:  # noqa: BLE001 - surfaced below
            failures.append(e)
            os.kill(stack["nodes"]["node-b"]["worker_pid"], signal.SIGCONT)

    # Node-b's worker held until node-a is killed: node-a alone stores the first parts.
    os.kill(stack["nodes"]["node-b"]["worker_pid"], signal.SIGSTOP)
    mark_trainer(root, "running")
    sides = [threading.Thread(target=capture_side), threading.Thread(target=kill_node_a_mid_part)]
    for side in sides:
        side.start()
    try:
        result = train(cfg, root, on_step=lambda s: (steps.append(s), held.append(spooled_bytes(root))))
    finally:
        os.kill(stack["nodes"]["node-b"]["worker_pid"], signal.SIGCONT)
        mark_trainer(root, "finished")
        for side in sides:
            side.join()
    assert not failures, failures
    report, = reports

    ids = dict(zip(*pd.read_parquet(root / PLANNED, columns=["source_row", "sample_id"]).to_dict("list").values()))
    assert [s["sample_ids"] for s in steps] == [[ids[r] for r in b] for epoch in plan.epochs for b in epoch]
    assert result.steps == len(steps)
    parts = PartQueue(Store.open(root).ledger).parts()
    assert set(parts.state) == {"done"}
    assert parts.set_index("seq").node[killed["seq"]] == "node-b"  # the part node-a died under
    assert report["parts_by_node"].keys() == set(QUEUES)  # both captured
    assert 0 < max(held) <= budget and report["spool_peak_bytes"] <= budget, (held, report, budget)
    stored_ids = stored(root)
    assert len(stored_ids) == len(set(stored_ids)) == len(plan.heldout)  # the held-out samples stay, once each
    assert not list((root / "spool").glob("epoch-*")) and schemas() == before + 1  # the store's own schema
    # The ledger's password and the nodes' keys reached every process by
    # reference (the environment): no run's parameters, artifact, log line
    # or kept file holds them.
    assert not secrets_found(stack["api"], [PASSWORD, *keys], tmp_path)


def test_a_regeneration_over_two_nodes_answers_every_row_once_though_a_child_is_killed(stack, tmp_path,
                                                                                        monkeypatch):
    """`regenerate_across_nodes` (flows/regenerate_nodes.py), run here on the
    run file's settings: the dataset's conversations
    answered in shares on both nodes' capture servers (outside their rid
    prefix: served, not captured), into one answers directory whose index
    is in PostgreSQL. Node-b's child is SIGKILLed once it has committed
    part of its share (its processes stopped first, so it is caught
    mid-share) and marked Crashed, as the heartbeat automation would: its
    share goes back whole to node-a, which did not fail it; the rows it
    committed stay answered, and node-a answers the rest. Every row answered
    once, verified."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.cli import config_from_argv
    from flows.regenerate_nodes import regenerate_across_nodes
    from tasks.regeneration.answer_store import AnswerStore

    url = stack["env"]["EAGLE3_LEDGER_URL"]
    monkeypatch.setenv("EAGLE3_LEDGER_URL", url)
    api, answers = stack["api"], tmp_path / "answers"
    run_file = tmp_path / "regenerate.yaml"
    run_file.write_text(yaml.safe_dump({
        "queues": list(QUEUES), "model": stack["model"],
        "dataset": str(write_jsonl(tmp_path / "data.jsonl", demo_rows(ROWS))),
        # One conversation a batch, one in flight: a share of 4 takes four waves, and the
        # child runs only in the 0.1 s between two looks at it (stopped for each look).
        "regenerate": {"out": str(answers), "index_url": "env", "batch_size": 1, "concurrency": 1,
                       "max_new_tokens": 8, "turns": "last"},
        "batches_per_child": 4}))
    # The parent in a thread of this process (its command line is the capture parents' and
    # tests/test_cli.py's): a process of its own would take seconds to start.
    config, _ = config_from_argv(regenerate_across_nodes, ["--config", str(run_file)])
    results: list = []

    def parent() -> None:
        try:
            with temporary_settings({PREFECT_API_URL: api.url}):
                results.append(regenerate_across_nodes(**config))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            results.append(e)

    running = threading.Thread(target=parent)
    running.start()

    def regenerating(queue: str) -> dict | None:
        runs = api.call("POST", "/flow_runs/filter", {"flow_runs": {"name": {"like_": f"{queue}-share-"}}})
        return next((r for r in runs if r["state_type"] == "RUNNING"
                     and r["parameters"].get("regenerate", {}).get("out") == str(answers)), None)

    def stopped_mid_share() -> dict | None:
        child = regenerating("node-b")
        if child is None or not (answers / "index.json").exists():
            return None
        pids = run_processes(child["id"])
        signal_all(pids, signal.SIGSTOP)
        rows = set(child["parameters"]["rows"])
        done = {r for r, _ in AnswerStore(answers).read(rows)}
        if pids and 0 < len(done) < len(rows):
            signal_all(pids, signal.SIGKILL)
            return {"run": child}
        signal_all(pids, signal.SIGCONT)
        return None

    deadline, killed = time.monotonic() + 600, None
    while not (killed := stopped_mid_share()):
        assert running.is_alive() and time.monotonic() < deadline, results
        time.sleep(0.1)
    api.call("POST", f"/flow_runs/{killed['run']['id']}/set_state",
             {"state": {"type": "CRASHED", "message": "killed by the test"}, "force": True})
    running.join(900)
    (result,) = results
    assert isinstance(result, dict), result

    store = AnswerStore(answers)
    rows = [r for r, _ in store.read()]
    assert rows == list(range(ROWS)) and result["rows"] == ROWS and not store.quarantined()
    reports = store.verify()
    assert all(r["ok"] for r in reports) and sum(r["rows"] for r in reports) == ROWS  # no row in two shards
    runs = [r for q in QUEUES for r in api.call("POST", "/flow_runs/filter",
                                                 {"flow_runs": {"name": {"like_": f"{q}-share-"}}})
            if r["parameters"].get("regenerate", {}).get("out") == str(answers)]
    # The killed share ran again, whole, on node-a (its committed rows skipped there).
    again = [r for r in runs if r["parameters"]["rows"] == killed["run"]["parameters"]["rows"]
             and r["id"] != killed["run"]["id"]]
    assert [(r["work_queue_name"], r["state_type"]) for r in again] == [("node-a", "COMPLETED")], again
    assert {r["queue"]: (r["samples"], r["drained"]) for r in result["nodes"]} == {"node-a": (ROWS, None),
                                                                                   "node-b": (0, None)}
    assert not [p.name for q in QUEUES for p in (LOGS / f"dumps-{q}").glob("*.safetensors")]  # served, not captured


ROWS = 8


START_TIMEOUT_S = 30


def test_two_nodes_falling_silent_at_once_lose_and_double_nothing(stack, tmp_path, monkeypatch):
    """Both nodes fall silent under a running share at once (one wait for
    the heartbeat automation serves both), each its own way:
    - node-b dies: its server, its worker and its child's process
      SIGKILLed. The automation marks the child Crashed; node-b's next share
      is never started (no worker), so it is cancelled after start_timeout_s
      and runs on node-a; node-b is drained at its second failure in a row
      (the default max_node_failures), and the nodes table says why.
    - node-a's child is stopped (SIGSTOP) but lives. The automation marks
      it Crashed too; node-a's next child is refused at the node's dump dir,
      which the stopped child still holds (NodeBusy): it writes nothing
      beside it, and node-a is tried again, not drained. Once the stopped
      child goes on (SIGCONT), node-a stores the rest.
    Every sample stored once, verified; every child run in a final state."""
    from flows.artifacts import artifact_key
    from tasks.capture.nodes import NODE_BUSY
    from tasks.store.ledger.open import open_ledger

    monkeypatch.setenv("EAGLE3_LEDGER_URL", stack["env"]["EAGLE3_LEDGER_URL"])
    api, out, victim = stack["api"], tmp_path / "parent.out", stack["nodes"]["node-b"]
    # Two first shares of 32 samples (seconds of capture each: both are caught running). node-a may
    # stay busy far longer than node-b's next child waits for a worker: its child may be stopped
    # before its first batch, and a whole share takes ~40 s on a slow machine once it goes on.
    proc = run_parent(stack, tmp_path, 64, "--capture.batch-size", "2", "--batches-per-child", "16",
                      "--start-timeout-s", str(START_TIMEOUT_S), "--busy-limit-s", "600")
    store = str(tmp_path / "store")

    def both_running() -> dict | None:
        runs = {q: running_child(api, store, q, beating=True) for q in QUEUES}
        return runs if all(runs.values()) else None

    first = wait_for(both_running, proc, out)
    stopped = pids_of_run(first["node-a"]["id"])
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    # node-b dies at once: nothing of it may report its run's end.
    os.killpg(victim["server_pid"], signal.SIGKILL)
    for group in {victim["worker_pid"], *processes_of_run(first["node-b"]["id"])}:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:  # the same group, already gone
            pass
    try:
        wait_for(lambda: "node-a is still busy" in out.read_text(), proc, out, timeout_s=300)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    result = parent_result(proc, out, 900)
    assert result["verification"]["ok"], result["verification"]
    ids = stored(tmp_path / "store")
    assert len(ids) == len(set(ids)) == 64  # nothing lost, nothing twice
    for queue, run in first.items():  # the automation's doing, not the runs' own reports
        assert "Crashed" in api.flow_run_states(run["id"]), queue
    dead = api.flow_run(first["node-b"]["id"])
    assert dead["state_type"] == "CRASHED" and "no heartbeat" in dead["state"]["message"]

    runs = children(api, store=store)
    later_b = [r for r in runs if r["work_queue_name"] == "node-b" and r["id"] != first["node-b"]["id"]]
    cancelled = f"no worker on queue 'node-b' started it within {START_TIMEOUT_S} s"
    assert later_b and all(r["state_type"] == "CANCELLED" and cancelled in r["state"]["message"]
                           for r in later_b), [r["state"] for r in later_b]
    refused = [r for r in runs if NODE_BUSY in (r["state"]["message"] or "")]
    assert refused and {(r["work_queue_name"], r["state_type"]) for r in refused} == {("node-a", "FAILED")}
    by_node = {r["queue"]: r for r in result["nodes"]}
    assert by_node["node-b"]["drained"].startswith("2 shares failed in a row there, the last: ")
    assert by_node["node-a"]["drained"] is None and by_node["node-a"]["samples"] == 64
    table = api.call("POST", "/artifacts/filter", {"artifacts": {"key": {"any_": [artifact_key("nodes", store)]}}})
    rows = {r["node"]: r["status"] for r in json.loads(table[0]["data"])}
    assert rows["node-a"] == "OK" and rows["node-b"].startswith("drained: 2 shares failed in a row there")
    assert not [r for r in runs if r["state_type"] not in ("COMPLETED", "CRASHED", "CANCELLED", "FAILED")]
    # Every shard file in the store is one the index names: the refused children wrote none.
    names = {p.name for p in (tmp_path / "store" / "shards").iterdir()}
    assert names == {f"{n}.safetensors" for n in open_ledger(tmp_path / "store").shards().name}
    assert not [p.name for p in (LOGS / "dumps-node-a").glob("*.safetensors")]


def test_a_parent_retried_by_prefect_runs_only_the_missing_shares(stack, tmp_path, monkeypatch):
    """Prefect retries the parent (set up as the deployment's job variables
    set it up) after its first attempt failed: node-a's queue was paused
    once its first child ran, so the next was never started and node-a was
    drained. The second attempt re-plans from the index: its children (keys
    of attempt 2: never attempt 1's runs handed back) take only the rows
    not stored."""
    monkeypatch.setenv("EAGLE3_LEDGER_URL", stack["env"]["EAGLE3_LEDGER_URL"])
    api, out = stack["api"], tmp_path / "parent.out"
    proc = run_parent(stack, tmp_path, 4, "--capture.batch-size", "2", "--batches-per-child", "1",
                      "--max-node-failures", "1", "--start-timeout-s", "15", queues=["node-a"],
                      env={"PREFECT_FLOWS_DEFAULT_RETRIES": "1", "PREFECT_FLOWS_DEFAULT_RETRY_DELAY_SECONDS": "1"})
    store = str(tmp_path / "store")
    first = wait_for(lambda: running_child(api, store, "node-a"), proc, out)
    api.call("PATCH", "/work_pools/eagle3/queues/node-a", {"is_paused": True})  # as the UI's Pause
    try:
        wait_for(lambda: "node node-a drained" in out.read_text(), proc, out, timeout_s=300)
    finally:
        api.call("PATCH", "/work_pools/eagle3/queues/node-a", {"is_paused": False})
    result = parent_result(proc, out, 900)
    assert result["verification"]["ok"], result["verification"]
    ids = stored(tmp_path / "store")
    assert len(ids) == len(set(ids)) == 4

    parent = first["parameters"]["parent_run"]
    assert "AwaitingRetry" in api.flow_run_states(parent) and api.flow_run(parent)["state_type"] == "COMPLETED"
    runs = children(api, parent_id=parent)
    attempt = {r["id"]: int(r["idempotency_key"].removeprefix(f"{parent}-").split("-")[0]) for r in runs}
    done = {a: [row for r in runs if attempt[r["id"]] == a and r["state_type"] == "COMPLETED"
                for row in r["parameters"]["rows"]] for a in (1, 2)}
    assert done[1] and done[2], [(attempt[r["id"]], r["state_type"], r["parameters"]["rows"]) for r in runs]
    assert sorted(done[1] + done[2]) == list(range(4))  # each row in one completed child, of either attempt
    assert {r["state_type"] for r in runs if attempt[r["id"]] == 1} == {"COMPLETED", "CANCELLED"}


def test_a_parent_killed_mid_run_is_finished_by_a_new_one(stack, tmp_path, monkeypatch):
    """The parent SIGKILLed while node-a's child runs: the child stops before
    its next batch (its parent's lock names a dead process, or the new
    parent), and a new parent run takes the store over and stores only the
    rest."""
    monkeypatch.setenv("EAGLE3_LEDGER_URL", stack["env"]["EAGLE3_LEDGER_URL"])
    api = stack["api"]
    proc = run_parent(stack, tmp_path, 12, "--capture.batch-size", "2", "--batches-per-child", "6",
                      queues=["node-a"], out="killed.out")
    store = str(tmp_path / "store")
    orphan = wait_for(lambda: running_child(api, store, "node-a"), proc, tmp_path / "killed.out")
    proc.kill()
    proc.wait()

    again = run_parent(stack, tmp_path, 12, "--capture.batch-size", "2", "--batches-per-child", "6",
                       queues=["node-a"])
    result = parent_result(again, tmp_path / "parent.out", 900)
    assert result["verification"]["ok"], result["verification"]
    ids = stored(tmp_path / "store")
    assert len(ids) == len(set(ids)) == 12
    ended = api.flow_run(orphan["id"])
    assert ended["state_type"] == "FAILED" and "start the parent flow again" in ended["state"]["message"], ended["state"]
    assert not [r for r in children(api, store=store) if r["state_type"] not in ("COMPLETED", "FAILED")]


OUTAGE_S = 20


def test_the_prefect_api_gone_for_20_s_under_a_running_node_loses_and_doubles_nothing(stack, tmp_path, monkeypatch):
    """The Prefect server (every run's API: the parent's, the child's, the
    worker's) stopped while node-a runs a share, started again 20 s later on
    the same port and database. Last in the module: it replaces the stack's
    server (and node-b is gone: an earlier test killed it)."""
    monkeypatch.setenv("EAGLE3_LEDGER_URL", stack["env"]["EAGLE3_LEDGER_URL"])
    api = stack["api"]
    proc = run_parent(stack, tmp_path, 6, "--capture.batch-size", "2", "--batches-per-child", "1",
                      queues=["node-a"])
    store = str(tmp_path / "store")
    wait_for(lambda: running_child(api, store, "node-a"), proc, tmp_path / "parent.out")
    stop(stack["server"])
    time.sleep(OUTAGE_S)
    stack["server"] = start_prefect_server(stack["env"], LOGS / "prefect-server.log")
    assert proc.poll() is None, log_tail(tmp_path / "parent.out", 80)  # the outage was under the running run

    result = parent_result(proc, tmp_path / "parent.out", 900)
    assert result["verification"]["ok"], result["verification"]
    ids = stored(tmp_path / "store")
    assert len(ids) == len(set(ids)) == 6  # nothing lost, nothing twice
    assert not [r for r in children(api, store=store) if r["state_type"] not in ("COMPLETED", "CRASHED", "CANCELLED", "FAILED")]
