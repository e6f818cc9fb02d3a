"""Which SGLang flags the launcher owns, and which break capture.

The launcher sets some of SGLang's options itself, from the launch spec and
its server section or always: one table (FLAGS) makes each server's command
line (tasks/server/launch.py build_command), says which flags extra_args may
not repeat and what to set instead, and which settings the run's log shows
(server_log.py). Given again in extra_args such a flag would silently win
or lose (SGLang keeps the last one), so the
server would not be the one the config, the flow's parameters and the store
describe: it is refused, naming what to set instead. Flags are matched as
SGLang's own parser reads them (aliases and abbreviations included).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

# Server flags that break capture: two-batch overlap captures only some
# layers (DeepSeek) or none (Qwen-MoE); attention context parallelism splits
# a request's tokens over ranks.
CAPTURE_INCOMPATIBLE_FLAGS = ("--enable-two-batch-overlap", "--attn-cp-size", "--attention-context-parallel-size")

# The flags the launcher owns, in one table: each server's command line is
# made from it (command_flags), a flag repeated in extra_args is refused
# naming what to set instead (refuse_owned_flags), and the run's log shows
# the settings it marks (server_log.py). `args`: the flag's arguments on this
# server's command line ([] a switch, None left out). `owned`: "set" while
# the launcher sets it, "always" (the secrets and the options file, the flags
# that would turn a server speculative behind its config, data-parallel
# attention), "capture" on a capture server.
@dataclass(frozen=True)
class Flag:
    flag: str
    instead: str
    args: Callable[[Decided], list[str] | None]
    owned: Literal["set", "always", "capture"] = "set"
    shown: bool = True

    @property
    def option(self) -> str:
        """SGLang's name for it (ServerArgs' field)."""
        return self.flag[2:].replace("-", "_")


@dataclass(frozen=True)
class Decided:
    """One server's launch as the table reads it: its spec (a LaunchSpec)
    and what the launcher decided beside it for this machine."""
    spec: Any
    port: int
    cpu: bool
    dtype: str
    attention_backend: str | None  # None: SGLang's default, or the user's own flag
    trust_remote_code: bool
    # A speculative server's draft backend where SGLang's default refuses the
    # drafter (tasks/train/layers/gpu_kernels.py draft_attention_backend); None: its default.
    draft_attention_backend: str | None = None


def _server(c: Decided):
    return c.spec.server


def _drafting(c: Decided, args) -> list[str] | None:
    return args() if c.spec.speculative else None


def _eagle_chain(c: Decided, args) -> list[str] | None:
    """EAGLE's chain settings; a DFlash server drafts one block a step."""
    return args() if c.spec.speculative and c.spec.algorithm == "EAGLE3" else None


def _if_set(value) -> list[str] | None:
    return None if value is None else [str(value)]


SPECULATE = ("nothing: only the evaluation's servers speculate, each with a trained drafter "
             "(SpeculativeSpec.draft_model_path)")
FLAGS: tuple[Flag, ...] = (
    Flag("--model-path", "server.model", lambda c: [str(_server(c).model)]),
    Flag("--host", "LaunchSpec.host", lambda c: [c.spec.host], shown=False),
    Flag("--port", "LaunchSpec.port", lambda c: [str(c.port)], shown=False),
    Flag("--dtype", "server.dtype", lambda c: [c.dtype]),
    Flag("--tp-size", "server.tp_size", lambda c: [str(_server(c).tp_size)]),
    Flag("--base-gpu-id", "LaunchSpec.base_gpu_id (a server beside training starts after its GPUs)",
         lambda c: _if_set(c.spec.base_gpu_id)),
    # Attention groups are SGLang's --attn-dp-size since 0.5.23 (its
    # --enable-dp-attention is deprecated); then there are no replicas.
    Flag("--dp-size", "server.dp_size", lambda c: [str(1 if _server(c).dp_attention else _server(c).dp_size)]),
    Flag("--attn-dp-size", "server.dp_size with server.dp_attention",
         lambda c: [str(_server(c).dp_size)] if _server(c).dp_attention else None, owned="always"),
    Flag("--enable-dp-attention", "server.dp_attention", lambda c: None, owned="always", shown=False),
    Flag("--max-total-tokens", "server.max_total_tokens", lambda c: [str(_server(c).max_total_tokens)]),
    # Tokens the prefix cache serves are not recomputed, so never reach the
    # hook; only a plain server answering turn by turn keeps it.
    Flag("--disable-radix-cache", "LaunchSpec.prefix_cache (regeneration's server keeps it; every other "
         "server runs without the prefix cache)", lambda c: None if c.spec.prefix_cache else []),
    Flag("--enable-return-aux-hidden-states", "CaptureSpec (a capture server)",
         lambda c: [] if c.spec.capture else None, owned="capture"),
    Flag("--speculative-algorithm", SPECULATE,
         lambda c: [c.spec.algorithm] if c.spec.speculative else ["EAGLE3"] if c.spec.capture else None,
         owned="always"),
    Flag("--return-aux-hidden-state-layer-ids", "capture.aux_layer_ids",
         lambda c: [*map(str, c.spec.aux_layer_ids)] if c.spec.capture and c.spec.aux_layer_ids is not None
         else None, owned="capture"),
    Flag("--speculative-draft-model-path", SPECULATE,
         lambda c: _drafting(c, lambda: [str(c.spec.draft_model_path)]), owned="always"),
    Flag("--speculative-num-steps", "evaluate.num_steps",
         lambda c: _eagle_chain(c, lambda: [str(c.spec.speculative_num_steps)]), owned="always"),
    Flag("--speculative-eagle-topk",
         "nothing: the evaluation serves a top-1 chain (SpeculativeSpec.speculative_eagle_topk)",
         lambda c: _eagle_chain(c, lambda: [str(c.spec.speculative_eagle_topk)]), owned="always"),
    Flag("--speculative-num-draft-tokens", "evaluate.num_steps (a top-1 chain verifies num_steps + 1 tokens)",
         lambda c: _eagle_chain(c, lambda: [str(c.spec.speculative_num_draft_tokens)]), owned="always"),
    Flag("--trust-remote-code", "--trust-remote-code spelt in full: the launcher then leaves its own out",
         lambda c: [] if c.trust_remote_code else None, shown=False),
    Flag("--attention-backend", "--attention-backend spelt in full: the launcher then leaves its own out",
         lambda c: _if_set(c.attention_backend)),
    Flag("--speculative-draft-attention-backend",
         "--speculative-draft-attention-backend spelt in full: the launcher then leaves its own out",
         lambda c: _if_set(c.draft_attention_backend)),
    Flag("--chunked-prefill-size", "server.chunked_prefill_size", lambda c: _if_set(_server(c).chunked_prefill_size)),
    Flag("--mem-fraction-static", "server.mem_fraction_static", lambda c: _if_set(_server(c).mem_fraction_static)),
    # SGLang's scheduler otherwise busy-polls a core while idle (bench/idle_cpu.py).
    Flag("--sleep-on-idle", "LaunchSpec.sleep_on_idle", lambda c: [] if c.spec.sleep_on_idle else None, shown=False),
    # Prefill CUDA graph replay skips Python forward hooks: no captures.
    Flag("--cuda-graph-backend-prefill", "nothing: prefill CUDA graph replay would skip the capture hook",
         lambda c: None if c.cpu else ["disabled"], shown=False),
    # The key and the hooks go in the private options file (run_secrets.py).
    Flag("--api-key", "nothing: the launcher gives each server its own key (to attach to a server you started, "
                      "server.api_key)", lambda c: None, owned="always"),
    Flag("--config", "the options themselves in extra_args: the launcher passes its own --config", lambda c: None,
         owned="always", shown=False),
    Flag("--forward-hooks", "CaptureSpec.capture_module: a capture server's hooks are the launcher's", lambda c: None,
         owned="capture", shown=False),
)
_BY_OPTION = {f.option: f for f in FLAGS}
# SGLang's settings the run's log shows from its start-up line (server_log.py).
SHOWN = ("device", *(f.option for f in FLAGS if f.shown))


def command_flags(decided: Decided) -> list[str]:
    """The launcher's flags on this server's command line, from the table."""
    out = []
    for f in FLAGS:
        args = f.args(decided)
        if args is not None:
            out += [f.flag, *args]
    return out


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


def gives_flag(args: Sequence[str], flag: str) -> bool:
    """Whether `args` give `flag` spelt in full (`--flag` or `--flag=value`)."""
    return any(a.split("=", 1)[0] == flag for a in args)


def refuse_capture_incompatible(extra_args: Sequence[str]) -> None:
    bad = [a for a in extra_args if a.split("=", 1)[0] in CAPTURE_INCOMPATIBLE_FLAGS]
    if bad:
        raise ValueError(f"{bad}: not supported on a capture server (two-batch overlap skips captured layers; "
                         "attention context parallelism splits requests over ranks)")


def refuse_owned_flags(extra_args: Sequence[str], launcher_args: Sequence[str], *, capture: bool) -> None:
    """Raise ValueError for a flag in `extra_args` that sets an option the
    launcher owns (one it set in `launcher_args`, or always owns)."""
    given = [a.split("=", 1)[0] for a in extra_args if a.startswith("--")]
    if not given:
        return
    owned = {_option_name(a) for a in launcher_args if a.startswith("--")}
    owned |= {f.option for f in FLAGS if f.owned == "always" or (capture and f.owned == "capture")}
    for flag in given:
        name = _option_name(flag)
        if name in owned:
            canonical = "--" + name.replace("_", "-")
            spelt = "" if flag == canonical else f" (SGLang reads it as {canonical})"
            raise ValueError(f"server.extra_args must not set {flag}{spelt}: the launcher sets it itself and "
                             f"SGLang would keep only one of the two. Use {_BY_OPTION[name].instead} instead")
