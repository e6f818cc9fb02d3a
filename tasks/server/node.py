"""One extraction node: a long-lived capture server and a Prefect worker on
the node's own work queue, whose flow runs find that server in their
environment (tasks/server/supervisor.py NODE_ENV). Ctrl-C (or SIGTERM)
stops the worker, then the server. Its command line: `python -m flows.node`.

A model loads once per node, not once per child run: on a 1T-parameter
target that is many minutes. The queue gets a concurrency limit of 1: the
node's server and dump dir serve one child run at a time.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from tasks.paths import REPO_ROOT, default_dump_root
from tasks.server.config import API_KEY_ENV, ServerConfig
from tasks.server.launch import CaptureSpec
from tasks.server.supervisor import NODE_ENV, ServerSupervisor
from tasks.target.checkpoint import Target

PREFECT = str(Path(sys.executable).with_name("prefect"))
HEARTBEAT_S = "30"  # Prefect's minimum; the zombie automation waits for 3 missed ones
# How often the node looks at its server and worker; and what a run's batch
# waits beyond the server's start timeout for a relaunch (the stop first).
WATCH_S = 2.0
RELAUNCH_MARGIN_S = 60.0


def node_environment(server: ServerSupervisor, base: dict | None = None) -> dict:
    """The worker's environment: how its flow runs reach this node's server,
    and how long they wait for it while the node relaunches it."""
    env = dict(os.environ if base is None else base)
    env.update({NODE_ENV["url"]: server.url, NODE_ENV["dump_dir"]: str(server.spec.dump_dir),
                NODE_ENV["rid_prefix"]: server.rid_prefix, API_KEY_ENV: server.api_key,
                NODE_ENV["wait_s"]: str(server.timeout_s + RELAUNCH_MARGIN_S), "EAGLE3_REPO": str(REPO_ROOT)})
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


def node_launch(queue: str, server: ServerConfig, aux_layer_ids: Sequence[int] | None = None,
                dump_dir: str | None = None) -> CaptureSpec:
    """The node's capture server: the section's settings on its target, the
    aux layers the runs sent to it capture."""
    target = Target.load(server.model, aux_layer_ids)
    return CaptureSpec(server.model_copy(update={"model": str(target.path)}),
                       dump_dir=Path(dump_dir or default_dump_root() / f"node-{queue}"),
                       aux_layer_ids=target.served_layer_ids, capture_module=target.arch.decoder_stack)


def run_node(queue: str, spec: CaptureSpec, pool: str, log_dir: Path) -> None:
    """Serve the node until its worker ends or the process is told to stop;
    prints one JSON line (queue, server_url, server_pid, worker_pid, logs)
    once both are up.

    The node supervises its server: one that dies is relaunched on the same
    port with the same rid prefix and API key (at most server.max_restarts
    times), and the run then on the node waits for it (attach_wait_s)
    instead of failing its share. Past the restarts the node stops, so its
    queue takes no more shares and the parent moves them elsewhere."""
    log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stop like Ctrl-C: worker first, then server
    # Started in the background of a script (`&`: SIGINT ignored, and Python
    # then leaves it so), a node would ignore SIGINT, and so would its worker,
    # which inherits the disposition: each stop then waited out its timeout
    # and ended in SIGKILL. A handler of our own is reset to the default in
    # the processes we start.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    server = ServerSupervisor(spec, log_dir / "sglang-server.log")
    server.start()
    worker = None
    try:
        env = node_environment(server)
        ensure_queue(pool, queue, env)
        with open(log_dir / "prefect-worker.log", "ab") as log:
            worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", pool, "--work-queue", queue,
                                       "--name", f"node-{queue}"], env=env, cwd=REPO_ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        print(json.dumps({"queue": queue, "server_url": server.url, "server_pid": server.handle.process.pid,
                          "worker_pid": worker.pid, "logs": str(log_dir)}), flush=True)
        while worker.poll() is None:
            try:
                worker.wait(timeout=WATCH_S)
            except subprocess.TimeoutExpired:
                pass
            if not server.handle.alive():
                server.recover()  # ServerError past its restarts: the node stops
    except KeyboardInterrupt:
        pass
    finally:
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGINT)  # it reports its runs' ends before it goes
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
        server.stop()
