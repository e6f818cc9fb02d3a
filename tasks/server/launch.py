"""Launch, health-check and stop an SGLang server: a capture server, or a
plain or EAGLE-3 speculative one for generation and serving checks.

The server is stock SGLang: capture is switched on with its own flags
(`--enable-return-aux-hidden-states --speculative-algorithm EAGLE3`) and the
dump is written by our forward hook (`tasks/capture/hook.py`), loaded through
`--forward-hooks` on the target architecture's decoder stack. The prefix
cache is off, because tokens it serves are not recomputed and so never reach
the hook.

Each server gets its own random API key (SGLang's `--api-key`: every request
but its health and metrics endpoints needs `Authorization: Bearer KEY`) and,
for capture, its own random rid prefix, so no other local process can use the
server or make the hook write. Both go to SGLang in a private options file
(`--config`), not on the command line, which any local user can read in
/proc; the server log, where SGLang prints them, is private too, and every
line of it we pass on has the key blanked.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

from tasks.capture.dump import check_rid_prefix, new_rid_prefix
from tasks.durable import replace_durably
from tasks.paths import REPO_ROOT, ensure_private_dir
from tasks.server.cpu_shim import gpu_present, resolve_dtype, server_environment
from tasks.target.architectures import Architecture, architecture_at
from tasks.target.fingerprint import weights_fingerprint

logger = logging.getLogger("eagle3.server")

# Imported inside the server's scheduler process (the repository root is on
# its PYTHONPATH).
HOOK_FACTORY = "tasks.capture.hook:make_capture_hook"
BATCH_HOOK_FACTORY = "tasks.capture.hook:make_batch_hook"
CAPTURE_HOOK_NAME = "eagle3_capture"
# Server flags that break capture: two-batch overlap captures only some
# layers (DeepSeek) or none (Qwen-MoE); attention context parallelism splits
# a request's tokens over ranks.
CAPTURE_INCOMPATIBLE_FLAGS = ("--enable-two-batch-overlap", "--attn-cp-size", "--attention-context-parallel-size")


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
    dtype: str = "auto"  # compute dtype; "auto" = the checkpoint's, or float32 on a CPU without fast bf16
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port
    capture: bool = True  # False: a plain server (baselines, generation)
    # With capture=False: serve EAGLE-3 speculative decoding with this drafter
    # (an SGLang LlamaForCausalLMEagle3 directory).
    draft_model_path: str | None = None
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 4
    # Rids the capture hook captures, and the key every request must carry.
    # None: launch_server draws fresh random ones for this server
    # (with_run_secrets); a relaunch from the same config keeps them.
    rid_prefix: str | None = None
    api_key: str | None = field(default=None, repr=False)
    capture_all: bool = False
    # The module the capture hook attaches to; None: the decoder stack of
    # the model's architecture (tasks/target/architectures.py).
    capture_module: str | None = None
    cpu: bool | None = None  # None: decide from the hardware
    # SGLang's scheduler otherwise busy-polls a core at 100% while idle
    # (bench/idle_cpu.py); with it, it waits on its sockets and wakes at once.
    sleep_on_idle: bool = True
    # More SGLang --forward-hooks specs (probes, fault injection), after ours.
    extra_hooks: Sequence[dict] = field(default_factory=tuple)
    extra_args: Sequence[str] = field(default_factory=tuple)


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """Built once: httpx builds a new one (loading every CA certificate) per
    client otherwise, which cost 10% of the pipeline's client time."""
    return ssl.create_default_context()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """SGLang would start, load the model and only then fail to bind, or a
    health check could find whatever else answers there; refuse first."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServerError(f"port {port} on {host} is taken by another process ({e.strerror}): choose another "
                              "port, or leave it unset for a free one") from None


def _architecture(cfg: ServerConfig) -> Architecture | None:
    """The target's entry, or None for a path that is no checkpoint or an
    architecture the table lacks: SGLang refuses or serves those with its own
    words (launch_server quotes them), which say more than a guess here."""
    try:
        return architecture_at(cfg.model_path)
    except (OSError, ValueError):
        return None


def capture_module(cfg: ServerConfig) -> str:
    if cfg.capture_module:
        return cfg.capture_module
    arch = _architecture(cfg)
    return arch.decoder_stack if arch else "model"


def server_dtype(cfg: ServerConfig, *, cpu: bool) -> str:
    """The --dtype to start with: cfg.dtype resolved for this machine, within
    what the target's class can run in."""
    arch = _architecture(cfg)
    only = arch.only_dtype if arch else None
    if only and cfg.dtype == "auto":
        return only
    if only and cfg.dtype != only:
        raise ValueError(f"{arch.name} runs in {only} only in SGLang (its attention weights stay {only}; "
                         f"--dtype {cfg.dtype} fails at the first forward): use dtype 'auto' or {only!r}")
    return resolve_dtype(cfg.dtype, cpu=cpu)


def cpu_attention_backend(cfg: ServerConfig) -> str | None:
    """On a CPU: the attention backend this server needs (None: SGLang's
    default). Speculative decoding and MLA targets need intel_amx, which runs
    on the operators of tasks/server/cpu_spec_ops.py here."""
    if cfg.draft_model_path is not None:
        return "intel_amx"
    arch = _architecture(cfg)
    return arch.cpu_attention_backend if arch else None


def hook_spec(cfg: ServerConfig) -> list[dict]:
    """The capture hook on the decoder stack, and the hook on its first
    layer that hands it the forward batch (tasks/capture/hook.py)."""
    stack = capture_module(cfg)
    return [
        {"name": "eagle3_batch", "target_modules": [f"{stack}.layers.0"], "hook_factory": BATCH_HOOK_FACTORY,
         "config": {}},
        {"name": CAPTURE_HOOK_NAME, "target_modules": [stack], "hook_factory": HOOK_FACTORY,
         "config": {"dump_dir": str(cfg.dump_dir), "rid_prefix": cfg.rid_prefix, "capture_all": cfg.capture_all}},
        *cfg.extra_hooks,
    ]


def with_run_secrets(cfg: ServerConfig) -> ServerConfig:
    """`cfg` with a fresh random rid prefix and API key where it has none."""
    return dataclasses.replace(
        cfg, rid_prefix=new_rid_prefix() if cfg.rid_prefix is None else check_rid_prefix(cfg.rid_prefix),
        api_key=cfg.api_key or new_api_key())


def new_api_key() -> str:
    """A random key SGLang's parser takes as a value: its options file becomes
    `--api-key KEY` arguments, and a key starting with '-' (1 in 64 of
    token_urlsafe's) reads as an option, so the server would not start."""
    return "k" + secrets.token_urlsafe(32)


def auth_headers(api_key: str | None) -> dict:
    """What every request to a server started with `--api-key` must carry."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def client_options(api_key: str | None, transport=None) -> dict:
    """httpx client arguments for talking to a server: its API key on every
    request, and our one TLS context, or `transport` in place of the network
    (tests, benchmarks)."""
    network = {"transport": transport} if transport is not None else {"verify": ssl_context()}
    return {"headers": auth_headers(api_key), **network}


def redact(text: str, hidden: Sequence[str | None]) -> str:
    for secret in hidden:
        if secret:
            text = text.replace(secret, "<redacted>")
    return text


def secret_options(cfg: ServerConfig) -> dict:
    """The options that go to SGLang through the private options file: the
    API key and, on a capture server, the hooks (whose config holds the rid
    prefix)."""
    if cfg.api_key is None or cfg.rid_prefix is None:
        raise ValueError("this server config has no API key or rid prefix yet: launch it with launch_server, "
                         "which draws them (with_run_secrets)")
    options = {"api-key": cfg.api_key}
    if cfg.capture:
        options["forward-hooks"] = json.dumps(hook_spec(cfg))
    return options


def write_options_file(cfg: ServerConfig) -> Path:
    """secret_options(cfg) in a new file only this user can read, in the form
    SGLang's `--config` takes (YAML; JSON is YAML). The caller deletes it once
    the server has read it."""
    fd, path = tempfile.mkstemp(prefix="eagle3-sglang-", suffix=".yaml")  # mode 0600
    with os.fdopen(fd, "w") as f:
        json.dump(secret_options(cfg), f)
    return Path(path)


# Flags build_command sets from ServerConfig fields (or always), by SGLang's
# own name for the option, and what to use instead. Given again in extra_args
# such a flag would silently win or lose (SGLang keeps the last one), so the
# server would not be the one the config, the flow's parameters and the store
# describe.
_USE_INSTEAD = {
    "model_path": "ServerConfig.model_path (flow parameter model)",
    "host": "ServerConfig.host",
    "port": "ServerConfig.port",
    "dtype": "ServerConfig.dtype",
    "tp_size": "ServerConfig.tp_size (flow parameter tp_size)",
    "max_total_tokens": "ServerConfig.max_total_tokens (flow parameter max_total_tokens)",
    "disable_radix_cache": "nothing: every server the launcher starts runs without the prefix cache",
    "enable_return_aux_hidden_states": "ServerConfig.capture",
    "return_aux_hidden_state_layer_ids": "ServerConfig.aux_layer_ids (flow parameter aux_layer_ids)",
    "forward_hooks": "ServerConfig.capture_module: a capture server's hooks are the launcher's",
    "speculative_algorithm": "ServerConfig.draft_model_path",
    "speculative_draft_model_path": "ServerConfig.draft_model_path",
    "speculative_num_steps": "ServerConfig.speculative_num_steps",
    "speculative_eagle_topk": "ServerConfig.speculative_eagle_topk",
    "speculative_num_draft_tokens": "ServerConfig.speculative_num_draft_tokens",
    "api_key": "nothing: the launcher gives each server its own key (ServerConfig.api_key; to attach to a "
               "server you started, flow parameter server_api_key)",
    "config": "the options themselves in extra_args: the launcher passes its own --config",
    "chunked_prefill_size": "ServerConfig.chunked_prefill_size (flow parameter chunked_prefill_size)",
    "mem_fraction_static": "ServerConfig.mem_fraction_static",
    "sleep_on_idle": "ServerConfig.sleep_on_idle",
    "cuda_graph_backend_prefill": "nothing: prefill CUDA graph replay would skip the capture hook",
    "attention_backend": "--attention-backend spelt in full: the launcher then leaves its own out",
    "trust_remote_code": "--trust-remote-code spelt in full: the launcher then leaves its own out",
}
# Owned whatever this config sets: the secrets and the options file, and the
# flags that would turn a server into a speculative one behind its config.
_ALWAYS_OWNED = ("api_key", "config", "speculative_algorithm", "speculative_draft_model_path",
                 "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
_CAPTURE_OWNED = ("forward_hooks", "enable_return_aux_hidden_states", "return_aux_hidden_state_layer_ids")


@functools.cache
def _sglang_options() -> dict[str, str]:
    """SGLang's option strings (aliases included) -> the option's name."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return {s: a.dest for a in parser._actions for s in a.option_strings}


def _option_name(flag: str) -> str | None:
    """The SGLang option `flag` sets, as its parser reads it: exact, or an
    unambiguous abbreviation (argparse's allow_abbrev); None if neither."""
    options = _sglang_options()
    if flag in options:
        return options[flag]
    matches = [s for s in options if s.startswith(flag)]
    return options[matches[0]] if len(matches) == 1 else None


def refuse_owned_flags(cfg: ServerConfig, launcher_args: Sequence[str]) -> None:
    """Raise ValueError for a flag in cfg.extra_args that sets an option the
    launcher sets (in `launcher_args`, or always its own)."""
    given = [a.split("=", 1)[0] for a in cfg.extra_args if a.startswith("--")]
    if not given:
        return
    owned = {_option_name(a) for a in launcher_args if a.startswith("--")} | set(_ALWAYS_OWNED)
    if cfg.capture:
        owned |= set(_CAPTURE_OWNED)
    for flag in given:
        name = _option_name(flag)
        if name in owned:
            canonical = "--" + name.replace("_", "-")
            spelt = "" if flag == canonical else f" (SGLang reads it as {canonical})"
            raise ValueError(f"extra_args (flow parameter extra_server_args) must not set {flag}{spelt}: the "
                             f"launcher sets it itself and SGLang would keep only one of the two. Use "
                             f"{_USE_INSTEAD.get(name, 'its ServerConfig field')} instead")


def build_command(cfg: ServerConfig, port: int, *, cpu: bool) -> list[str]:
    """The server's command line, less the API key and the capture hooks:
    launch_server adds those as `--config` and a private file
    (write_options_file)."""
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(cfg.model_path),
        "--host", cfg.host, "--port", str(port),
        "--dtype", server_dtype(cfg, cpu=cpu),
        "--tp-size", str(cfg.tp_size),
        "--max-total-tokens", str(cfg.max_total_tokens),
        "--disable-radix-cache",
    ]
    if cfg.capture and cfg.draft_model_path is not None:
        raise ValueError("a capture server cannot also serve a drafter: its EAGLE3 mode is capture-only "
                         "(set capture=False to serve speculative decoding)")
    if cfg.capture:
        bad = [a for a in cfg.extra_args if a.split("=", 1)[0] in CAPTURE_INCOMPATIBLE_FLAGS]
        if bad:
            raise ValueError(f"{bad}: not supported on a capture server (two-batch overlap skips captured layers; "
                             "attention context parallelism splits requests over ranks)")
        cmd += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]
        if cfg.aux_layer_ids is not None:
            cmd += ["--return-aux-hidden-state-layer-ids", *map(str, cfg.aux_layer_ids)]
    if cfg.draft_model_path is not None:
        cmd += [
            "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", str(cfg.draft_model_path),
            "--speculative-num-steps", str(cfg.speculative_num_steps),
            "--speculative-eagle-topk", str(cfg.speculative_eagle_topk),
            "--speculative-num-draft-tokens", str(cfg.speculative_num_draft_tokens),
        ]
    arch = _architecture(cfg)
    if arch and arch.remote_code and "--trust-remote-code" not in cfg.extra_args:
        cmd += ["--trust-remote-code"]
    backend = cpu_attention_backend(cfg) if cpu else None
    if backend and not any(a.split("=", 1)[0] == "--attention-backend" for a in cfg.extra_args):
        # SGLang's only CPU backend for EAGLE and for MLA; the operators it
        # needs come from tasks/server/cpu_spec_ops.py (see server_environment).
        cmd += ["--attention-backend", backend]
    if cfg.chunked_prefill_size is not None:
        cmd += ["--chunked-prefill-size", str(cfg.chunked_prefill_size)]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.sleep_on_idle:
        cmd += ["--sleep-on-idle"]
    if not cpu:
        # Prefill CUDA graph replay skips Python forward hooks: no captures.
        cmd += ["--cuda-graph-backend-prefill", "disabled"]
    refuse_owned_flags(cfg, cmd)
    return cmd + list(cfg.extra_args)


@dataclass
class ServerHandle:
    config: ServerConfig
    process: subprocess.Popen
    url: str
    log_path: Path

    @property
    def api_key(self) -> str | None:
        return self.config.api_key

    @property
    def rid_prefix(self) -> str | None:
        return self.config.rid_prefix

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines, hidden=(self.config.api_key,))

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        stop_server(self, grace_s)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def log_tail(path: Path, lines: int = 40, hidden: Sequence[str | None] = ()) -> str:
    """The last lines of a server log, with the `hidden` strings blanked
    (SGLang prints its arguments, API key included, when it starts)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "(no server log)"
    return redact("\n".join(text.splitlines()[-lines:]), hidden)


def launch_server(cfg: ServerConfig, log_path: Path, *, timeout_s: float = 600.0,
                  follower: LogFollower | None = None) -> ServerHandle:
    """Start the server in its own process group and wait until it serves.
    The handle's config holds the rid prefix and API key the server was
    started with (drawn at random unless cfg gives them).

    Raises ServerError quoting the server log's tail if it exits or is not
    healthy within `timeout_s`; no process is left behind then.
    """
    cfg = with_run_secrets(cfg)
    if cfg.tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {cfg.tp_size}")
    cpu = (not gpu_present()) if cfg.cpu is None else cfg.cpu
    port = cfg.port or free_port(cfg.host)
    check_port_free(cfg.host, port)
    if cfg.capture:
        ensure_private_dir(cfg.dump_dir)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = server_environment(cpu=cpu, cpu_ops=cpu_attention_backend(cfg) == "intel_amx" or cfg.tp_size > 1,
                             ranks=cfg.tp_size)
    # The hook (and, for speculative serving on a CPU, tasks/server/cpu_spec_ops.py) is
    # imported inside the server's processes.
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
    cmd = build_command(cfg, port, cpu=cpu)
    pidfile = pidfile_for(log_path)
    reap_orphan(pidfile)
    if follower is not None:
        follower.hide(cfg.api_key)
    options_file = write_options_file(cfg)
    try:
        cmd += ["--config", str(options_file)]
        # Private: SGLang prints its arguments, the API key among them, into it.
        with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            os.fchmod(log.fileno(), 0o600)
            log.write(f"$ {redact(' '.join(cmd), [cfg.api_key])}\n".encode())
            log.flush()
            log_start = log.tell()
            process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=str(REPO_ROOT), start_new_session=True,
            )
        handle = ServerHandle(cfg, process, f"http://{cfg.host}:{port}", log_path)
        write_pidfile(pidfile, process.pid, port)
        try:
            wait_healthy(handle, timeout_s, follower)
            if cfg.capture:
                check_hook_attached(handle, log_start)
        except BaseException:
            stop_server(handle)
            raise
    finally:
        # SGLang reads it once, at start-up; a relaunch writes a new one.
        options_file.unlink(missing_ok=True)
    return handle


def check_hook_attached(handle: ServerHandle, log_start: int) -> None:
    """SGLang matches `--forward-hooks` targets by exact module name and
    only warns when nothing matches; a capture server whose hook attached to
    nothing would serve and never dump. Its own log line for a registered
    hook is the confirmation."""
    with open(handle.log_path, "rb") as f:
        f.seek(log_start)
        text = f.read().decode("utf-8", "replace")
    if f"Registered forward hook '{CAPTURE_HOOK_NAME}'" not in text:
        raise ServerError(
            f"the capture hook attached to no module: SGLang found no module named {capture_module(handle.config)!r} "
            f"in {handle.config.model_path} (see 'No modules matched' in {handle.log_path}). The decoder stack's name "
            "comes from tasks/target/architectures.py: fix the entry for this architecture, or pass capture_module.")


class LogFollower:
    """Reads the lines a server log gained since the last call, so a person
    watching the run sees the server's own words (warnings, errors, start-up)."""

    def __init__(self, path: Path):
        self.path, self.pos = Path(path), 0
        self.hidden: set[str] = set()

    def hide(self, secret: str | None) -> None:
        """Blank `secret` in every line passed on (SGLang logs its API key)."""
        if secret:
            self.hidden.add(secret)

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # only whole lines
        self.pos += end
        return redact(data[:end].decode("utf-8", "replace"), sorted(self.hidden)).splitlines()

    def forward(self, log: logging.Logger, *, everything: bool = False) -> None:
        for line in self.new_lines():
            if any(w in line for w in ("ERROR", "Error", "Traceback", "WARNING", "Warning")):
                log.warning("sglang: %s", line)
            elif everything:
                log.info("sglang: %s", line)


def wait_healthy(handle: ServerHandle, timeout_s: float, follower: LogFollower | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if follower is not None:
            follower.forward(logger, everything=True)
        if not handle.alive():
            raise ServerError(
                f"SGLang server exited with code {handle.process.returncode} before it "
                f"became healthy. Last lines of {handle.log_path}:\n{handle.log_tail()}"
            )
        if server_healthy(handle.url, api_key=handle.api_key, timeout_s=10.0):
            return
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
    # start_new_session: the leader's pid is the group id
    _stop_group(handle.process.pid, grace_s, reap=handle.process.poll)
    pidfile_for(handle.log_path).unlink(missing_ok=True)


def _stop_group(pgid: int, grace_s: float, reap=lambda: None) -> None:
    steps = ((lambda: os.kill(pgid, signal.SIGTERM), grace_s), (lambda: os.killpg(pgid, signal.SIGKILL), 10.0))
    for send, wait_s in steps:
        try:
            send()
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            reap()
            if not _group_members(pgid):
                return
            time.sleep(0.2)
    raise ServerError(f"processes {_group_members(pgid)} of the SGLang server survived SIGKILL")


# A server outlives a run that is SIGKILLed (it has its own session, so the
# run's death takes nothing with it): GPU memory and the port stay taken.
# Each launched server is recorded next to its log; the next launch with
# that log (the next run on the same store or out_dir, which holds its lock,
# so the recorded server's run is gone) stops it. A parent-death signal is
# not used: Linux sends it when the *thread* that started the child ends,
# and Prefect starts servers from worker threads that end before the run.

def pidfile_for(log_path: Path) -> Path:
    return Path(log_path).with_suffix(".pid")


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with the pid it
    names one process, not a later one that reused the pid."""
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def write_pidfile(path: Path, pid: int, port: int) -> None:
    record = {"pid": pid, "start_ticks": _start_ticks(pid), "port": port, "host": socket.gethostname(),
              "started": time.time()}
    replace_durably(path, lambda tmp: tmp.write_text(json.dumps(record) + "\n"))


def reap_orphan(path: Path, grace_s: float = 20.0) -> int | None:
    """Stop the server `path` records if it is still running (same host,
    same process: pid and start time); returns its pid, or None."""
    try:
        record = json.loads(Path(path).read_text())
        pid = int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    reaped = None
    if (record.get("host") == socket.gethostname() and record.get("start_ticks") is not None
            and _start_ticks(pid) == record["start_ticks"] and _group_members(pid)):
        logger.warning("stopping SGLang server pid %d (port %s), left running by an earlier run that did not "
                       "stop it (recorded in %s)", pid, record.get("port"), path)
        _stop_group(pid, grace_s)
        reaped = pid
    Path(path).unlink(missing_ok=True)
    return reaped


def check_serves(url: str, model_path: Path, *, api_key: str | None = None) -> None:
    """Refuse a server that serves another model than the run's target (an
    attached server started on something else, or --model-path overridden):
    its states would go into the store as the target's. Its own /model_info
    says what it serves; a path elsewhere is accepted when it holds the same
    config and weights (a copy)."""
    try:
        with httpx.Client(timeout=30.0, **client_options(api_key)) as client:
            served = client.get(f"{url}/model_info").json()["model_path"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ServerError(f"{url}/model_info did not say which model it serves ({e!r}): is it an SGLang "
                          "server?") from None
    ours, theirs = Path(model_path).resolve(), Path(served).expanduser()
    if theirs.resolve() == ours:
        return
    try:
        same = ((theirs / "config.json").read_bytes() == (ours / "config.json").read_bytes()
                and weights_fingerprint(theirs) == weights_fingerprint(ours))
    except OSError:
        same = False
    if not same:
        raise ServerError(f"the SGLang server at {url} serves {served}, not the target {ours}: its states are "
                          f"not the target's. Attach to a server started on {ours}, or leave server_url unset "
                          "to launch one.")


def server_healthy(url: str, *, api_key: str | None = None, timeout_s: float = 30.0) -> bool:
    """Whether the server answers /health. SGLang serves /health without the
    key, but every request we make carries it: one rule, nothing to keep
    track of per endpoint."""
    try:
        with httpx.Client(timeout=timeout_s, **client_options(api_key)) as client:
            return client.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False
