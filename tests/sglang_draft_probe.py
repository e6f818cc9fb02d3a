"""A forward hook loaded into an SGLang speculative server (`--forward-hooks`):
it saves the drafter's parameters as SGLang loaded them (once), and the inputs
and outputs of each drafter forward, one file per forward, numbered in call
order:

    kind "extend"   the draft extends, which take the target's aux states
                    (after a prefill, and after each verify); SGLang's own
                    warm-up request makes some too
    kind "decode"   the draft decode steps k >= 1, which take the drafter's
                    own hidden state from the forward before

Each file holds input_ids, positions, hidden_in (the aux states or the hidden
state fed back), out (after the final norm: what the draft lm_head scores),
fed_back (what the next step is fed: the output before the final norm, or
with norm_output the same as out) and req_pool_indices (which
request's KV cache the forward reads and writes). With one request in flight,
a decode step follows the extend or decode just before it.
tests/test_drafter_in_sglang.py recomputes them with our drafter.
make_dflash_probe does the same for a DFlash drafter."""
from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import save_file

MAX_FORWARDS = 256


def _save(tensors: dict, out: Path, **metadata) -> None:
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(tensors, str(tmp), metadata={k: str(v) for k, v in metadata.items()})
    os.replace(tmp, out)


def _cpu(t):
    # A copy: with norm_output, what is fed back is the normed output itself.
    return t.detach().float().cpu().clone()


def make_probe(config: dict):
    out_dir = Path(config["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    calls = [0]

    def hook(module, args, output):
        # The target's LlamaModel matches the same pattern: only the drafter has fc.
        if not hasattr(module, "fc") or calls[0] >= MAX_FORWARDS:
            return
        input_ids, positions, forward_batch = args[0], args[1], args[2]
        hidden_in = forward_batch.spec_info.hidden_states
        if hidden_in is None or hidden_in.shape[0] == 0:
            return  # an idle batch
        if calls[0] == 0:
            _save({n: _cpu(p) for n, p in module.named_parameters()}, out_dir / "params.safetensors")
        # The drafter's LlamaModel returns (normed, [what the next step is fed]).
        normed, (fed_back,) = output
        kind = "extend" if hidden_in.shape[-1] == module.fc.weight.shape[1] else "decode"
        _save({"input_ids": input_ids.detach().cpu().long(), "positions": positions.detach().cpu().long(),
               "hidden_in": _cpu(hidden_in), "out": _cpu(normed), "fed_back": _cpu(fed_back),
               "req_pool_indices": forward_batch.req_pool_indices.detach().cpu().long()},
              out_dir / f"forward-{calls[0]:03d}.safetensors", kind=kind, mode=forward_batch.forward_mode)
        calls[0] += 1

    return hook


DFLASH_PROBE_MODULES = ["fc", "hidden_norm", "layers.?", "norm"]  # top-level names: none in the target


def make_dflash_probe(config: dict):
    """The same for a DFlash drafter (`DFlashDraftModel`), hooked on its
    `fc`, `hidden_norm`, `layers.?` and `norm` (DFLASH_PROBE_MODULES: SGLang
    calls the model's own forward directly, past any hook on the model
    itself). params.safetensors
    holds those modules' parameters by the model's names; then, in call
    order:

        kind "context"  fc's input: the target layers' states of the tokens
                        just committed (the prompt after prefill, then each
                        verify's accepted prefix), and ctx (hidden_norm's
                        output), what the draft KV cache's context is made of
        kind "block"    a draft block: input_ids, positions, the embeddings
                        the first layer is fed, req_pool_indices, and out
                        (after the final norm: what the target's head scores)
    """
    out_dir = Path(config["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    calls, pending, params = [0], {}, {}

    def record(tensors: dict, kind: str) -> None:
        if calls[0] < MAX_FORWARDS:
            _save(tensors, out_dir / f"forward-{calls[0]:03d}.safetensors", kind=kind)
            calls[0] += 1

    def hook(module, args, output):
        kind = type(module).__name__
        if kind == "DFlashDecoderLayer":  # (positions, hidden, forward_batch, residual)
            prefix = f"layers.{module.self_attn.attn.layer_id}."
            positions, hidden, forward_batch = args[:3]
            if hidden.numel() and "block" not in pending:  # the first layer: fed the block's embeddings
                pending["block"] = {"input_ids": forward_batch.input_ids.detach().cpu().long(),
                                    "positions": positions.detach().cpu().long(), "embeds": _cpu(hidden),
                                    "req_pool_indices": forward_batch.req_pool_indices.detach().cpu().long()}
        elif "Linear" in kind:  # fc
            prefix = "fc."
            pending["context"] = _cpu(args[0])
        elif isinstance(output, tuple):  # norm(hidden, residual): the block's output
            prefix = "norm."
            if "block" in pending:
                record({**pending.pop("block"), "out": _cpu(output[0])}, "block")
        else:  # hidden_norm(fc's output): ctx
            prefix = "hidden_norm."
            if "context" in pending:
                record({"target_hidden": pending.pop("context"), "ctx": _cpu(output)}, "context")
        for name, p in module.named_parameters():
            if prefix + name not in params:
                params[prefix + name] = _cpu(p)
        if not (out_dir / "params.safetensors").exists() and "norm.weight" in params:
            _save(params, out_dir / "params.safetensors")

    return hook
