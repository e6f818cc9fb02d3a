"""The many-nodes tests' handles on flow runs (tests/test_many_nodes.py):
the parent started from the command line on a run file and its result, the
child runs of the nodes' queues (running ones, their processes and process
groups), signals to them, what a store's index holds, and a node's server
key as its worker's environment holds it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import demo_rows, write_jsonl
from tests.prefect_stack import REPO, log_tail, run_processes

QUEUES = ("node-a", "node-b")


def run_parent(stack, d: Path, rows: int, *argv: str, queues=QUEUES, out: str = "parent.out",
               env: dict | None = None) -> subprocess.Popen:
    """The parent from the command line: a run file (as configs/nodes.yaml),
    then the test's own keys."""
    dataset = write_jsonl(d / "data.jsonl", demo_rows(rows))
    run_file = d / "nodes.yaml"
    run_file.write_text(yaml.safe_dump({"queues": list(queues), "model": stack["model"],
                                        "capture": {"dataset": str(dataset), "max_length": 512},
                                        "store": {"path": str(d / "store"), "ledger_url": "env"}}))
    return subprocess.Popen([sys.executable, "-m", "flows.extract_nodes", "--config", str(run_file), *argv],
                            cwd=REPO, env={**stack["env"], **(env or {})},
                            stdout=open(d / out, "w"), stderr=subprocess.STDOUT, text=True)


def parent_result(proc: subprocess.Popen, out: Path, timeout_s: float) -> dict:
    assert proc.wait(timeout=timeout_s) == 0, log_tail(out, 80)
    text = out.read_text()
    return json.loads(text[text.rindex("\n{") + 1:])


def children(api, parent_id: str | None = None, store: str | None = None) -> list[dict]:
    """Child runs of the extraction parents (with `store`, of that store's;
    the regeneration's children have none)."""
    runs = api.call("POST", "/flow_runs/filter", {"flow_runs": {"name": {"like_": "node-"}}})
    return [r for r in runs if (parent_id is None or r["parameters"].get("parent_run") == parent_id)
            and (store is None or r["parameters"].get("store", {}).get("path") == store)]


def running_child(api, store: str, queue: str, beating: bool = False) -> dict | None:
    """A Running child of `queue` writing `store` (with `beating`, one that has
    sent a heartbeat: the automation can take it for dead once they stop)."""
    for r in children(api, store=store):
        if r["work_queue_name"] == queue and r["state_type"] == "RUNNING":
            if not beating or api.call("POST", "/events/filter", {"filter": {
                    "event": {"name": ["prefect.flow-run.heartbeat"]},
                    "any_resource": {"id": [f"prefect.flow-run.{r['id']}"]}}})["events"]:
                return r
    return None


def pids_of_run(run_id: str) -> list[int]:
    pids = run_processes(run_id)
    assert pids, f"no process runs flow run {run_id}"
    return pids


def processes_of_run(run_id: str) -> list[int]:
    """The process groups of the processes running flow run `run_id`."""
    groups = set()
    for pid in pids_of_run(run_id):
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    return sorted(groups)


def stored(store: Path) -> list[str]:
    from tasks.store.ledger.open import open_ledger

    return list(open_ledger(store).samples().sample_id)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # its run ended meanwhile
            pass


def node_api_key(worker_pid: int) -> str:
    """The key of a node's server, as its worker's environment holds it."""
    env = dict(v.split("=", 1) for v in Path(f"/proc/{worker_pid}/environ").read_text().split("\0") if "=" in v)
    return env["EAGLE3_API_KEY"]
