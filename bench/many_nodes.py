"""Extraction on 1 node vs 2 nodes, and what the fan-out costs, in one run.

    .venv/bin/python bench/many_nodes.py --model smollm2-135m-instruct --samples 192

The stack of tests/test_many_nodes.py: PostgreSQL (the index and Prefect's
database), a Prefect server on it, two nodes (`python -m flows.node`:
a capture server and a worker on the node's queue). The same dataset is
extracted by `extract_across_nodes` on queue node-a alone, then on node-a
and node-b, each into a new store. Prints:
  - wall time of each and the ratio (on a 2-core machine both servers share
    the same two cores: it will not double);
  - per child run, from Prefect's own records: the span of its batches
    (first extract-batch start to last end) and everything else from the moment the
    parent created it to its end (queueing, process start, imports, plan of
    its rows, attach and warm-up, Postgres commits of the plan) = the
    fan-out overhead, as a fraction of the batch time, for this run's
    batches per child and for the flow's default.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.pg_server import start as start_postgres  # noqa: E402
from tests.prefect_stack import cli, prefect_database, prefect_server, start_node, stop, stop_node, wait_node  # noqa: E402


def seconds(a: str, b: str) -> float:
    return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()


def group_rss_gib(pgid: int) -> float:
    """Resident memory of every process in process group `pgid`."""
    import psutil

    total = 0
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid:
                total += proc.memory_info().rss
        except (psutil.Error, ProcessLookupError):
            continue
    return total / 2**30


def extract(env: dict, root: Path, name: str, queues: list[str], dataset: Path, model: str, args) -> float:
    out = root / f"{name}.out"
    argv = [sys.executable, "-m", "flows.extract_nodes", "--queues", " ".join(queues), "--store.path",
            str(root / name), "--store.ledger-url", "env", "--capture.dataset", str(dataset), "--model", model,
            "--capture.batch-size", str(args.batch_size), "--batches-per-child", str(args.batches_per_child),
            "--capture.max-length", str(args.max_length), "--no-verify"]
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env, stdout=open(out, "w"), stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"{name} failed: {out.read_text()[-3000:]}")
    return wall


def child_costs(api, store: str) -> list[dict]:
    runs = [r for r in api.call("POST", "/flow_runs/filter", {"flow_runs": {"name": {"like_": "node-"}}})
            if r["parameters"].get("store", {}).get("path") == store]
    costs = []
    for r in runs:
        batches = [t for t in api.task_runs(r["id"]) if t["name"].startswith("extract-batch")]
        # Batches overlap (two in flight): their span, not the sum of their times.
        span = seconds(min(t["start_time"] for t in batches), max(t["end_time"] for t in batches))
        total = seconds(r["created"], r["end_time"])
        costs.append({"store": Path(store).name, "run": r["name"], "batches": len(batches), "batch_s": span, "overhead_s": total - span})
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--samples", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches-per-child", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=1024)
    args = parser.parse_args()

    from flows.extract_nodes import extract_across_nodes
    from tasks.data.dataset import DEMO_DATASET
    from tests.tiny_models import resolve_model_or_tiny

    default_per_child = extract_across_nodes.parameters.properties["batches_per_child"]["default"]
    model = str(resolve_model_or_tiny(args.model))
    root = Path(tempfile.mkdtemp(prefix="bench-nodes-"))
    dataset = root / "data.jsonl"
    dataset.write_text("".join(DEMO_DATASET.read_text().splitlines(keepends=True)[:args.samples]))
    pg = start_postgres()
    nodes, server = [], None
    try:
        server, api, env = prefect_server(root / "prefect-home", root / "prefect-server.log",
                                          database_url=prefect_database(pg.url))
        env["EAGLE3_LEDGER_URL"] = pg.url
        cli(["work-pool", "create", "eagle3", "--type", "process"], env)
        cli(["--no-prompt", "deploy", "--name", "extract-node"], env)
        nodes = [wait_node(*start_node(q, model, env, root, "--server.max-total-tokens", "32768"), timeout_s=900)
                 for q in ("node-a", "node-b")]
        memory = {n["queue"]: (group_rss_gib(n["server_pid"]), group_rss_gib(n["worker_pid"])) for n in nodes}
        one = extract(env, root, "one-node", ["node-a"], dataset, model, args)
        two = extract(env, root, "two-nodes", ["node-a", "node-b"], dataset, model, args)
        costs = child_costs(api, str(root / "one-node")) + child_costs(api, str(root / "two-nodes"))
    finally:
        for n in reversed(nodes):
            stop_node(n)
        if server is not None:
            stop(server)
        pg.stop()
    # One node alone: what a batch takes on a node's own cores.
    alone = [c for c in costs if c["store"] == "one-node"]
    batch_s = sum(c["batch_s"] for c in alone) / sum(c["batches"] for c in alone)
    overhead_s = sum(c["overhead_s"] for c in costs) / len(costs)
    print(f"model {args.model}, {args.samples} samples, batch size {args.batch_size}, "
          f"{args.batches_per_child} batches per child, {len(costs)} child runs")
    print(f"1 node: {one:.0f} s   2 nodes: {two:.0f} s   speed-up x{one / two:.2f} (both nodes share this "
          f"machine's cores)")
    print(f"per batch: {batch_s:.1f} s; fan-out overhead per child run: {overhead_s:.1f} s = "
          f"{100 * overhead_s / (args.batches_per_child * batch_s):.1f}% of its batches at "
          f"{args.batches_per_child} per child, {100 * overhead_s / (default_per_child * batch_s):.1f}% at the "
          f"default {default_per_child} per child")
    for queue, (server_gib, worker_gib) in memory.items():
        print(f"{queue}: capture server {server_gib:.2f} GiB resident, worker {worker_gib:.2f} GiB (idle)")
    for c in costs:
        print(f"  {c['store']} {c['run']}: {c['batches']} batches in {c['batch_s']:.1f} s, "
              f"overhead {c['overhead_s']:.1f} s")


if __name__ == "__main__":
    main()
