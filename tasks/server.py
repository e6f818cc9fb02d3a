"""Launch, health-check, probe and stop an SGLang capture server.

The server is stock SGLang: capture is switched on with its own flags
(`--enable-return-aux-hidden-states --speculative-algorithm EAGLE3`) and the
dump is written by our forward hook (`tasks.capture_hook`), loaded through
`--forward-hooks`. The prefix cache is off, because tokens it serves are not
recomputed and so never reach the hook.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

from tasks.cpu_shim import gpu_present, server_environment
from tasks.capture_client import capture_one
from tasks.dump import RID_PREFIX, CaptureError, remove_capture
from tasks.paths import REPO_ROOT

HOOK_FACTORY = "tasks.capture_hook:make_capture_hook"
# The LlamaModel decoder stack: it returns (final, aux) in capture mode.
HOOK_TARGET_MODULES = ["model"]


class ServerError(RuntimeError):
    """The server failed to start, died, or does not capture correctly."""


@dataclass
class ServerConfig:
    model_path: str
    dump_dir: Path
    aux_layer_ids: Sequence[int] | None = None  # SGLang convention; None = its default
    tp_size: int = 1
    max_total_tokens: int = 32768  # KV pool size; without it the CPU pool takes most of RAM
    chunked_prefill_size: int | None = None
    mem_fraction_static: float | None = None
    dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port
    rid_prefix: str = RID_PREFIX
    capture_all: bool = False
    cpu: bool | None = None  # None: decide from the hardware
    extra_args: Sequence[str] = field(default_factory=tuple)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def hook_spec(cfg: ServerConfig) -> list[dict]:
    return [{
        "name": "eagle3_capture",
        "target_modules": HOOK_TARGET_MODULES,
        "hook_factory": HOOK_FACTORY,
        "config": {
            "dump_dir": str(cfg.dump_dir),
            "rid_prefix": cfg.rid_prefix,
            "capture_all": cfg.capture_all,
        },
    }]


def build_command(cfg: ServerConfig, port: int, *, cpu: bool) -> list[str]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(cfg.model_path),
        "--host", cfg.host, "--port", str(port),
        "--dtype", cfg.dtype,
        "--tp-size", str(cfg.tp_size),
        "--max-total-tokens", str(cfg.max_total_tokens),
        "--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
        "--forward-hooks", json.dumps(hook_spec(cfg)),
        "--disable-radix-cache",
    ]
    if cfg.aux_layer_ids is not None:
        cmd += ["--return-aux-hidden-state-layer-ids", *map(str, cfg.aux_layer_ids)]
    if cfg.chunked_prefill_size is not None:
        cmd += ["--chunked-prefill-size", str(cfg.chunked_prefill_size)]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if not cpu:
        # Prefill CUDA graph replay skips Python forward hooks: no captures.
        cmd += ["--cuda-graph-backend-prefill", "disabled"]
    return cmd + list(cfg.extra_args)


@dataclass
class ServerHandle:
    config: ServerConfig
    process: subprocess.Popen
    url: str
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        stop_server(self, grace_s)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "(no server log)"
    return "\n".join(text.splitlines()[-lines:])


def launch_server(cfg: ServerConfig, log_path: Path, *, timeout_s: float = 600.0) -> ServerHandle:
    """Start the server in its own process group and wait until it serves.

    Raises ServerError quoting the server log's tail if it exits or is not
    healthy within `timeout_s`; no process is left behind then.
    """
    if cfg.tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {cfg.tp_size}")
    cpu = (not gpu_present()) if cfg.cpu is None else cfg.cpu
    port = cfg.port or free_port(cfg.host)
    Path(cfg.dump_dir).mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = server_environment(cpu=cpu)
    # The hook is imported inside the server's processes.
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
    cmd = build_command(cfg, port, cpu=cpu)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=str(REPO_ROOT), start_new_session=True,
        )
    handle = ServerHandle(cfg, process, f"http://{cfg.host}:{port}", log_path)
    try:
        wait_healthy(handle, timeout_s)
    except BaseException:
        stop_server(handle)
        raise
    return handle


def wait_healthy(handle: ServerHandle, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10.0) as client:
        while True:
            if not handle.alive():
                raise ServerError(
                    f"SGLang server exited with code {handle.process.returncode} before it "
                    f"became healthy. Last lines of {handle.log_path}:\n{handle.log_tail()}"
                )
            try:
                if client.get(f"{handle.url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerError(
                    f"SGLang server not healthy after {timeout_s:.0f} s. Last lines of "
                    f"{handle.log_path}:\n{handle.log_tail()}"
                )
            time.sleep(1.0)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def stop_server(handle: ServerHandle, grace_s: float = 20.0) -> None:
    """Stop the server and return only once no process of its group remains.

    SIGTERM to the leader first: SGLang then shuts its workers down itself
    (terminating a worker first makes it wait and dump crash diagnostics).
    Whatever is left after `grace_s` gets SIGKILL, group-wide.
    """
    pgid = handle.process.pid  # start_new_session: the leader's pid is the group id
    steps = ((lambda: handle.process.send_signal(signal.SIGTERM), grace_s),
             (lambda: os.killpg(pgid, signal.SIGKILL), 10.0))
    for send, wait_s in steps:
        try:
            send()
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            handle.process.poll()
            if not _group_members(pgid):
                return
            time.sleep(0.2)
    raise ServerError(f"processes {_group_members(pgid)} of the SGLang server survived SIGKILL")


def probe_capture(url: str, dump_dir: Path, *, num_tokens: int = 16, aux_layer_ids=None) -> dict:
    """Send one small request and check its capture round-trips: the dump
    holds exactly the ids sent, `prompt_tokens` equals their count, nothing
    came from the prefix cache, the values are finite. Returns a summary."""
    ids = list(range(1, num_tokens + 1))

    async def probe():
        async with httpx.AsyncClient(timeout=120.0) as client:
            return await capture_one(client, url, dump_dir, ids, tag="probe", aux_layer_ids=aux_layer_ids)

    try:
        capture = asyncio.run(probe())
    except (CaptureError, httpx.HTTPError) as e:
        raise ServerError(f"probe capture against {url} failed: {e}") from e
    remove_capture(capture)
    return {
        "tokens": capture.num_tokens,
        "aux_layer_ids": list(capture.aux_layer_ids),
        "hidden_size": int(capture.final_hidden_state.shape[-1]),
        "dtype": str(capture.final_hidden_state.dtype).removeprefix("torch."),
    }
