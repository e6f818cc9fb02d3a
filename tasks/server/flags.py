"""Which SGLang flags the launcher owns, and which break capture.

The launcher sets some of SGLang's options itself, from the launch spec and
its server section or always (tasks/server/launch.py build_command). Given again in extra_args
such a flag would silently win or lose (SGLang keeps the last one), so the
server would not be the one the config, the flow's parameters and the store
describe: it is refused, naming what to set instead. Flags are matched as
SGLang's own parser reads them (aliases and abbreviations included).
"""
from __future__ import annotations

import functools
from typing import Sequence

# Server flags that break capture: two-batch overlap captures only some
# layers (DeepSeek) or none (Qwen-MoE); attention context parallelism splits
# a request's tokens over ranks.
CAPTURE_INCOMPATIBLE_FLAGS = ("--enable-two-batch-overlap", "--attn-cp-size", "--attention-context-parallel-size")

# By SGLang's own name for the option: what to set instead, in the run's
# config (server.*, capture.*, serve.*) or, for what the caller decides, the
# LaunchSpec.
_USE_INSTEAD = {
    "model_path": "server.model",
    "host": "LaunchSpec.host",
    "port": "LaunchSpec.port",
    "dtype": "server.dtype",
    "tp_size": "server.tp_size",
    "dp_size": "server.dp_size",
    "attn_dp_size": "server.dp_size with server.dp_attention",
    "enable_dp_attention": "server.dp_attention",
    "max_total_tokens": "server.max_total_tokens",
    "disable_radix_cache": "nothing: every server the launcher starts runs without the prefix cache",
    "enable_return_aux_hidden_states": "LaunchSpec.capture",
    "return_aux_hidden_state_layer_ids": "capture.aux_layer_ids",
    "forward_hooks": "LaunchSpec.capture_module: a capture server's hooks are the launcher's",
    "speculative_algorithm": "nothing: only the evaluation's servers speculate, each with a trained drafter "
                             "(LaunchSpec.draft_model_path)",
    "speculative_draft_model_path": "nothing: only the evaluation's servers speculate, each with a trained "
                                    "drafter (LaunchSpec.draft_model_path)",
    "speculative_num_steps": "evaluate.num_steps",
    "speculative_eagle_topk": "nothing: the evaluation serves a top-1 chain (LaunchSpec.speculative_eagle_topk)",
    "speculative_num_draft_tokens": "evaluate.num_steps (a top-1 chain verifies num_steps + 1 tokens)",
    "api_key": "nothing: the launcher gives each server its own key (to attach to a server you started, "
               "server.api_key)",
    "config": "the options themselves in extra_args: the launcher passes its own --config",
    "chunked_prefill_size": "server.chunked_prefill_size",
    "mem_fraction_static": "server.mem_fraction_static",
    "sleep_on_idle": "LaunchSpec.sleep_on_idle",
    "cuda_graph_backend_prefill": "nothing: prefill CUDA graph replay would skip the capture hook",
    "attention_backend": "--attention-backend spelt in full: the launcher then leaves its own out",
    "trust_remote_code": "--trust-remote-code spelt in full: the launcher then leaves its own out",
}
# Owned whatever the launcher's command holds: the secrets and the options
# file, the flags that would turn a server into a speculative one behind its
# config, and data-parallel attention, which server.dp_attention decides.
_ALWAYS_OWNED = ("api_key", "config", "speculative_algorithm", "speculative_draft_model_path",
                 "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                 "attn_dp_size", "enable_dp_attention")
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
    launcher sets (in `launcher_args`, or always its own)."""
    given = [a.split("=", 1)[0] for a in extra_args if a.startswith("--")]
    if not given:
        return
    owned = {_option_name(a) for a in launcher_args if a.startswith("--")} | set(_ALWAYS_OWNED)
    if capture:
        owned |= set(_CAPTURE_OWNED)
    for flag in given:
        name = _option_name(flag)
        if name in owned:
            canonical = "--" + name.replace("_", "-")
            spelt = "" if flag == canonical else f" (SGLang reads it as {canonical})"
            instead = _USE_INSTEAD.get(name, "its LaunchSpec or server setting")
            raise ValueError(f"server.extra_args must not set {flag}{spelt}: the launcher sets it itself and "
                             f"SGLang would keep only one of the two. Use {instead} instead")
