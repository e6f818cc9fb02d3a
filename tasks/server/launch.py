"""Launch an SGLang server and stop it: a capture server (CaptureSpec), or a
plain (LaunchSpec) or EAGLE-3 speculative one (SpeculativeSpec) for
generation and serving checks.

The server is stock SGLang: capture is switched on with its own flags
(`--enable-return-aux-hidden-states --speculative-algorithm EAGLE3`) and the
dump is written by our forward hook (`tasks/capture/hook.py`), loaded through
`--forward-hooks` on the target architecture's decoder stack. The prefix
cache is off, because tokens it serves are not recomputed and so never reach
the hook.

Beside this module: the flags the launcher owns (flags.py), each server's
own API key and rid prefix, kept off the command line (run_secrets.py), its
process group and pid record (processes.py), waiting until it serves
(health.py) and passing its log on (server_log.py).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Sequence

from tasks.paths import REPO_ROOT, ensure_private_dir
from tasks.server.config import ServerConfig
from tasks.server.cpu.shim import checkpoint_classes, gpu_present, resolve_dtype, server_environment
from tasks.server.flags import Decided, command_flags, gives_flag, refuse_capture_incompatible, refuse_owned_flags
from tasks.server.health import PortTaken, wait_healthy
from tasks.server.processes import pidfile_for, reap_orphan, stop_group, write_pidfile
from tasks.server.run_secrets import redact, run_secrets, write_options_file
from tasks.server.server_log import LogFollower, log_tail
from tasks.sglang_api import ServerError, server_says
from tasks.target.architectures import Architecture, architecture_at
from tasks.target.fingerprint import weights_fingerprint

logger = logging.getLogger("eagle3.server")

# Imported inside the server's scheduler process (the repository root is on
# its PYTHONPATH).
HOOK_FACTORY = "tasks.capture.hook:make_capture_hook"
BATCH_HOOK_FACTORY = "tasks.capture.hook:make_batch_hook"
CAPTURE_HOOK_NAME = "eagle3_capture"
# What a stop waits for SGLang to shut itself down on SIGTERM before SIGKILL.
STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class LaunchSpec:
    """A plain server to launch (baselines, generation): the user's server
    section, its model a checkpoint folder (tasks/target/models.py
    resolve_model), and what the caller decides beside it. A capture server
    is a CaptureSpec, a speculative one a SpeculativeSpec: neither has the
    other's fields, so neither can be asked for both."""
    capture: ClassVar[bool] = False
    speculative: ClassVar[bool] = False

    server: ServerConfig
    # Rids the capture hook captures, and the key every request must carry.
    # None: launch_server draws fresh random ones for this server
    # (with_secrets); a relaunch from the same spec keeps them.
    rid_prefix: str | None = None
    api_key: str | None = field(default=None, repr=False)
    cpu: bool | None = None  # None: decide from the hardware
    # SGLang's scheduler otherwise busy-polls a core at 100% while idle
    # (bench/idle_cpu.py); with it, it waits on its sockets and wakes at once.
    sleep_on_idle: bool = True
    # More SGLang --forward-hooks specs (probes, fault injection), after ours.
    extra_hooks: Sequence[dict] = ()
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port
    # The first GPU of the server's (SGLang's --base-gpu-id): a server beside
    # a training run takes the GPUs after the ones training holds.
    base_gpu_id: int | None = None
    # SGLang's prefix (radix) cache: off on every server but the ones that
    # answer conversations turn by turn (regeneration), where turn k would
    # otherwise prefill every earlier turn again. A capture must see every
    # token computed; the evaluation's sweep sends a prompt more than once.
    prefix_cache: bool = False

    def __post_init__(self):
        if self.prefix_cache and (self.capture or self.speculative):
            raise ValueError("prefix_cache is for a plain server: a capture server must compute every token it "
                             "captures, and the evaluation measures speculative servers without it")
        if self.server.url is not None:
            raise ValueError(f"server.url is {self.server.url!r}: that server is attached to, not launched "
                             "(ServerSupervisor takes the section alone); unset it to launch one")

    @property
    def ranks(self) -> int:
        """The server's processes that run the model (ServerConfig.ranks)."""
        return self.server.ranks

    def with_secrets(self) -> "LaunchSpec":
        """This spec with a fresh random rid prefix and API key where it has none."""
        rid_prefix, api_key = run_secrets(self.rid_prefix, self.api_key)
        return dataclasses.replace(self, rid_prefix=rid_prefix, api_key=api_key)


@dataclass(frozen=True, kw_only=True)
class CaptureSpec(LaunchSpec):
    """A capture server: its hook writes each captured request into dump_dir."""
    capture: ClassVar[bool] = True

    dump_dir: Path
    aux_layer_ids: Sequence[int] | None = None  # SGLang convention; None = its default
    # The module the capture hook attaches to; None: the decoder stack of
    # the model's architecture (tasks/target/architectures.py).
    capture_module: str | None = None
    capture_all: bool = False


@dataclass(frozen=True, kw_only=True)
class SpeculativeSpec(LaunchSpec):
    """A server of speculative decoding with a trained drafter: EAGLE-3 (an
    exported LlamaForCausalLMEagle3 or Eagle3DeepseekV2ForCausalLM
    directory), or DFlash (a DFlashDraftModel one)."""
    speculative: ClassVar[bool] = True

    draft_model_path: str
    # EAGLE3, or DFLASH (a DFlash drafter, tasks/train/dflash/export.py: one
    # block a step, of the drafter's block_size; the three below are EAGLE's).
    algorithm: Literal["EAGLE3", "DFLASH"] = "EAGLE3"
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 4

    @classmethod
    def chain(cls, server, draft_model_path, num_steps: int, **kw) -> "SpeculativeSpec":
        """One chain of `num_steps` drafts a verify step (top-1: the bonus
        token and the drafts, num_steps + 1 tokens verified), as this
        project evaluates drafters and trains them to be served."""
        return cls(server, draft_model_path=str(draft_model_path), speculative_num_steps=num_steps,
                   speculative_eagle_topk=1, speculative_num_draft_tokens=num_steps + 1, **kw)

    @classmethod
    def dflash(cls, server, draft_model_path, **kw) -> "SpeculativeSpec":
        """A DFlash drafter, served with the block size it was trained with."""
        return cls(server, draft_model_path=str(draft_model_path), algorithm="DFLASH", **kw)


# Below the kernel's ephemeral range (where bind(0) and every outgoing
# connection take their ports) and below SGLang's own picks (22000-29999):
# the server binds its port only once its model is loaded, and a port from
# bind(0) was seen taken by then (two nodes starting beside a Prefect server).
PORT_RANGE = (10000, 21999)


def free_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    for port in random.sample(range(PORT_RANGE[0], PORT_RANGE[1] + 1), attempts):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
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


def _architecture(spec: LaunchSpec) -> Architecture | None:
    """The target's entry, or None for a path that is no checkpoint or an
    architecture the table lacks: SGLang refuses or serves those with its own
    words (launch_server quotes them), which say more than a guess here."""
    try:
        return architecture_at(spec.server.model)
    except (OSError, ValueError):
        return None


def capture_module(spec: LaunchSpec) -> str:
    if spec.capture_module:
        return spec.capture_module
    arch = _architecture(spec)
    return arch.decoder_stack if arch else "model"


def server_dtype(spec: LaunchSpec, *, cpu: bool) -> str:
    """The --dtype to start with: server.dtype resolved for this machine,
    within what the target's class can run in."""
    dtype = spec.server.dtype
    arch = _architecture(spec)
    only = arch.only_dtype if arch else None
    if only and dtype == "auto":
        return only
    if only and dtype != only:
        raise ValueError(f"{arch.name} runs in {only} only in SGLang (its attention weights stay {only}; "
                         f"--dtype {dtype} fails at the first forward): set server.dtype to 'auto' or {only!r}")
    return resolve_dtype(dtype, cpu=cpu)


def cpu_attention_backend(spec: LaunchSpec) -> str | None:
    """On a CPU: the attention backend this server needs (None: SGLang's
    default). Speculative decoding and MLA targets need intel_amx, which runs
    on the operators of tasks/server/cpu/spec_ops.py here."""
    if spec.speculative:
        return "intel_amx"
    arch = _architecture(spec)
    return arch.cpu_attention_backend if arch else None


# A drafter config.json's architecture for the MLA layout (tasks/train/eagle3/export.py).
MLA_DRAFTER = "Eagle3DeepseekV2ForCausalLM"


def draft_attention_backend(target_is_mla: bool, drafter_is_mla: bool, capability: tuple[int, int] | None
                            ) -> str | None:
    """--speculative-draft-attention-backend a speculative EAGLE-3 server
    needs (None: SGLang's default serves). An EAGLE-3 draft runs on the
    target's backend unless told otherwise
    (model_executor/model_runner_components/attention_backend_setup.py:203).
    On Blackwell that is trtllm_mla for DeepSeek-V3 and Kimi-K2.5
    (arg_groups/model_overrides/deepseek_v2.py:179-188), which refuses a
    draft that is not MLA (attention_registry.py:94-97), and flashinfer or
    trtllm_mha for a GQA target (arg_groups/model_override_base.py:312-333),
    the latter refusing an MLA draft (attention_registry.py:277-280): a
    drafter whose layout is not its target's gets flashinfer, which builds
    either (tasks/train/layers/gpu_kernels.py). On Hopper all run on fa3."""
    if target_is_mla != drafter_is_mla and capability is not None and capability[0] >= 10:
        return "flashinfer"
    return None


def draft_backend(spec: LaunchSpec) -> str | None:
    """draft_attention_backend for this speculative server on this node's GPU."""
    if not spec.speculative or spec.algorithm != "EAGLE3":
        return None
    import json

    import torch

    if not torch.cuda.is_available():
        return None
    arch = _architecture(spec)
    target = arch.sizes(json.loads((Path(spec.server.model) / "config.json").read_text())) if arch else {}
    drafter = json.loads((Path(spec.draft_model_path) / "config.json").read_text())
    return draft_attention_backend(bool(target.get("kv_lora_rank")), drafter.get("architectures") == [MLA_DRAFTER],
                                   torch.cuda.get_device_capability())


def hook_spec(spec: LaunchSpec) -> list[dict]:
    """The capture hook on the decoder stack, and the hook on its first
    layer that hands it the forward batch (tasks/capture/hook.py)."""
    stack = capture_module(spec)
    return [
        {"name": "eagle3_batch", "target_modules": [f"{stack}.layers.0"], "hook_factory": BATCH_HOOK_FACTORY,
         "config": {}},
        {"name": CAPTURE_HOOK_NAME, "target_modules": [stack], "hook_factory": HOOK_FACTORY,
         "config": {"dump_dir": str(spec.dump_dir), "rid_prefix": spec.rid_prefix, "capture_all": spec.capture_all}},
        *spec.extra_hooks,
    ]


def build_command(spec: LaunchSpec, port: int, *, cpu: bool) -> list[str]:
    """The server's command line, less the API key and the capture hooks:
    launch_server adds those as `--config` and a private file
    (write_options_file). Its flags come from the launcher's table
    (flags.py FLAGS), then the user's extra_args."""
    server = spec.server
    if spec.capture:
        refuse_capture_incompatible(server.extra_args)
    arch = _architecture(spec)
    # A backend or remote code the user gives in full replaces the launcher's.
    decided = Decided(spec, port, cpu, server_dtype(spec, cpu=cpu),
                      attention_backend=(cpu_attention_backend(spec) if cpu and not gives_flag(
                          server.extra_args, "--attention-backend") else None),
                      trust_remote_code=(bool(arch and arch.remote_code)
                                         and not gives_flag(server.extra_args, "--trust-remote-code")),
                      draft_attention_backend=(None if cpu or gives_flag(
                          server.extra_args, "--speculative-draft-attention-backend") else draft_backend(spec)))
    cmd = [sys.executable, "-m", "sglang.launch_server", *command_flags(decided)]
    refuse_owned_flags(server.extra_args, cmd, capture=spec.capture)
    return cmd + list(server.extra_args)


@dataclass
class ServerHandle:
    spec: LaunchSpec  # as launched: with its rid prefix and API key
    process: subprocess.Popen
    url: str
    log_path: Path

    @property
    def api_key(self) -> str | None:
        return self.spec.api_key

    @property
    def rid_prefix(self) -> str | None:
        return self.spec.rid_prefix

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines, hidden=(self.spec.api_key,))

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        stop_server(self, grace_s)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_server(spec: LaunchSpec, log_path: Path, *, timeout_s: float = 600.0,
                  follower: LogFollower | None = None) -> ServerHandle:
    """Start the server in its own process group and wait until it serves.
    The handle's spec holds the rid prefix and API key the server was
    started with (drawn at random unless spec gives them).

    Raises ServerError quoting the server log's tail if it exits or is not
    healthy within `timeout_s`; no process is left behind then.
    """
    spec = spec.with_secrets()
    for _ in range(2 if spec.port is None else 0):  # a port the user gave is theirs: no other is tried
        try:
            return _launch(spec, log_path, free_port(spec.host), timeout_s, follower)
        except PortTaken:
            logger.warning("the SGLang server's port was taken while it started; launching it on another")
    return _launch(spec, log_path, spec.port or free_port(spec.host), timeout_s, follower)


def _launch(spec: LaunchSpec, log_path: Path, port: int, timeout_s: float,
            follower: LogFollower | None) -> ServerHandle:
    cpu = (not gpu_present()) if spec.cpu is None else spec.cpu
    check_port_free(spec.host, port)
    if spec.capture:
        ensure_private_dir(spec.dump_dir)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    checkpoints = [spec.server.model, *([spec.draft_model_path] if spec.speculative else [])]
    env = server_environment(cpu=cpu, cpu_ops=cpu_attention_backend(spec) == "intel_amx" or spec.ranks > 1,
                             ranks=spec.ranks, dtype=server_dtype(spec, cpu=cpu), classes=checkpoint_classes(*checkpoints))
    # The server's processes import the capture hook, and on a CPU the
    # operators of tasks/server/cpu/spec_ops.py, from the repository root.
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
    cmd = build_command(spec, port, cpu=cpu)
    pidfile = pidfile_for(log_path)
    reap_orphan(pidfile)
    if follower is not None:
        follower.hide(spec.api_key)
    hooks = hook_spec(spec) if spec.capture else (list(spec.extra_hooks) or None)
    options_file = write_options_file(spec.api_key, hooks)
    try:
        cmd += ["--config", str(options_file)]
        # Private: SGLang prints its arguments, the API key among them, into it.
        with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            os.fchmod(log.fileno(), 0o600)
            log.write(f"$ {redact(' '.join(cmd), [spec.api_key])}\n".encode())
            log.flush()
            log_start = log.tell()
            process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=str(REPO_ROOT), start_new_session=True,
            )
        handle = ServerHandle(spec, process, f"http://{spec.host}:{port}", log_path)
        write_pidfile(pidfile, process.pid, port)
        try:
            wait_healthy(handle, timeout_s, follower, log_start)
            if spec.capture:
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
            f"the capture hook attached to no module: SGLang found no module named {capture_module(handle.spec)!r} "
            f"in {handle.spec.server.model} (see 'No modules matched' in {handle.log_path}). The decoder stack's "
            "name comes from tasks/target/architectures.py: fix the entry for this architecture, or set "
            "LaunchSpec.capture_module.")


def stop_server(handle: ServerHandle, grace_s: float = STOP_GRACE_S) -> None:
    """Stop the server's whole process group (processes.stop_group) and drop
    its pid record."""
    # start_new_session: the leader's pid is the group id
    stop_group(handle.process.pid, grace_s, reap=handle.process.poll)
    pidfile_for(handle.log_path).unlink(missing_ok=True)


def check_serves(url: str, model_path: Path, *, api_key: str | None = None) -> None:
    """Refuse a server that serves another model than the run's target (an
    attached server started on something else, or --model-path overridden):
    its states would go into the store as the target's. Its own /model_info
    says what it serves; a path elsewhere is accepted when it holds the same
    config and weights (a copy)."""
    served = server_says(url, "/model_info", "model_path", "which model it serves", api_key=api_key)
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
                          f"not the target's. Attach to a server started on {ours}, or leave server.url unset "
                          "to launch one.")

