"""A forward hook loaded into an SGLang speculative server (`--forward-hooks`):
it saves the drafter's parameters as SGLang loaded them (once), and the inputs
and output of each drafter forward that takes the target's aux states (draft
extends; SGLang's own warm-up request makes some too), one file per forward.
tests/test_drafter_in_sglang.py recomputes one of them with our drafter."""
from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import save_file

MAX_FORWARDS = 256


def _save(tensors: dict, out: Path, **metadata) -> None:
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(tensors, str(tmp), metadata={k: str(v) for k, v in metadata.items()})
    os.replace(tmp, out)


def make_probe(config: dict):
    out_dir = Path(config["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    calls = [0]

    def hook(module, args, output):
        # The target's LlamaModel matches the same pattern: only the drafter has fc.
        if not hasattr(module, "fc") or calls[0] >= MAX_FORWARDS:
            return
        input_ids, positions, forward_batch = args[0], args[1], args[2]
        aux = forward_batch.spec_info.hidden_states
        if aux is None or aux.shape[-1] != module.fc.in_features:
            return  # a draft decode step: it takes the drafter's own hidden state
        if calls[0] == 0:
            _save({n: p.detach().float().cpu().contiguous() for n, p in module.named_parameters()},
                  out_dir / "params.safetensors")
        _save({"input_ids": input_ids.detach().cpu().long(), "positions": positions.detach().cpu().long(),
               "aux": aux.detach().float().cpu().contiguous(), "out": output[0].detach().float().cpu().contiguous()},
              out_dir / f"forward-{calls[0]}.safetensors", mode=forward_batch.forward_mode)
        calls[0] += 1

    return hook
