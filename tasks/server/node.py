"""Start one extraction node: a long-lived capture server and a Prefect worker
on the node's own work queue, whose flow runs find that server in their
environment (tasks/server/supervisor.py NODE_ENV). Ctrl-C (or SIGTERM) stops
the worker, then the server.

    python -m tasks.server.node --queue node-a --model /models/kimi-k2.5 --tp-size 8

A model loads once per node, not once per child run: on a 1T-parameter
target that is many minutes. The queue gets a concurrency limit of 1: the
node's server and dump dir serve one child run at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tasks.paths import REPO_ROOT, default_dump_root
from tasks.server.launch import ServerConfig, launch_server
from tasks.server.supervisor import API_KEY_ENV, NODE_ENV
from tasks.target.architectures import architecture_of
from tasks.target.layers import AuxLayers
from tasks.target.models import resolve_model

PREFECT = str(Path(sys.executable).with_name("prefect"))
HEARTBEAT_S = "30"  # Prefect's minimum; the zombie automation waits for 3 missed ones


def node_environment(server, base: dict | None = None) -> dict:
    """The worker's environment: how its flow runs reach this node's server."""
    env = dict(os.environ if base is None else base)
    env.update({NODE_ENV["server_url"]: server.url, NODE_ENV["dump_dir"]: str(server.config.dump_dir),
                NODE_ENV["server_rid_prefix"]: server.rid_prefix, API_KEY_ENV: server.api_key,
                "EAGLE3_REPO": str(REPO_ROOT)})
    env.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", HEARTBEAT_S)
    return env


def ensure_queue(pool: str, queue: str, env: dict) -> None:
    """The pool and the node's queue (limit 1), created if missing."""
    def prefect(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([PREFECT, *args], env=env, capture_output=True, text=True, check=check)

    if prefect("work-pool", "inspect", pool, check=False).returncode:
        prefect("work-pool", "create", pool, "--type", "process")
    if prefect("work-queue", "inspect", queue, "--pool", pool, check=False).returncode:
        prefect("work-queue", "create", queue, "--pool", pool, "--limit", "1")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.server.node", description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", required=True, help="this node's work queue (and its name in shard names)")
    parser.add_argument("--model", required=True, help="the target: a checkpoint folder or a known name")
    parser.add_argument("--pool", default="eagle3", help="the work pool (default: eagle3)")
    parser.add_argument("--aux-layer-ids", type=int, nargs="*", default=None,
                        help="SGLang 'output of layer i' ids; the runs must ask for the same (default: the model's)")
    parser.add_argument("--dump-dir", default=None, help="node-local dump dir (default: under /dev/shm)")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--max-total-tokens", type=int, default=65536)
    parser.add_argument("--chunked-prefill-size", type=int, default=None)
    parser.add_argument("--log-dir", default=None, help="server and worker logs (default: ./runs/node-<queue>)")
    parser.add_argument("--extra-server-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)

    model = resolve_model(args.model)
    config = json.loads((model / "config.json").read_text())
    arch = architecture_of(config)
    layers = AuxLayers.for_model(arch.sizes(config)["num_hidden_layers"], args.aux_layer_ids)
    log_dir = Path(args.log_dir or f"runs/node-{args.queue}").resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    cfg = ServerConfig(model_path=str(model), dump_dir=Path(args.dump_dir or default_dump_root() / f"node-{args.queue}"),
                       aux_layer_ids=arch.sglang_layer_ids(layers.sglang_ids), capture_module=arch.decoder_stack,
                       tp_size=args.tp_size, max_total_tokens=args.max_total_tokens,
                       chunked_prefill_size=args.chunked_prefill_size, extra_args=tuple(args.extra_server_args))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stop like Ctrl-C: worker first, then server
    with launch_server(cfg, log_dir / "sglang-server.log") as server:
        env = node_environment(server)
        ensure_queue(args.pool, args.queue, env)
        with open(log_dir / "prefect-worker.log", "ab") as log:
            worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", args.pool, "--work-queue", args.queue,
                                       "--name", f"node-{args.queue}"], env=env, cwd=REPO_ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        print(json.dumps({"queue": args.queue, "server_url": server.url, "server_pid": server.process.pid,
                          "worker_pid": worker.pid, "logs": str(log_dir)}), flush=True)
        try:
            worker.wait()
        except KeyboardInterrupt:
            pass
        finally:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGINT)  # it reports its runs' ends before it goes
                try:
                    worker.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(worker.pid, signal.SIGKILL)
                    worker.wait()


if __name__ == "__main__":
    main()
