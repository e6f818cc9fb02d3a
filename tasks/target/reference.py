"""An independent forward pass with HF transformers, to check captures against.

SGLang's "output of layer i" is HF's `hidden_states[i + 1]`; HF's last
`hidden_states` entry is after the final norm, like SGLang's final state.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import torch

from tasks.target.architectures import architecture_of, read_config
from tasks.target.layers import AuxLayers


def load_reference_model(model_path: str, dtype: torch.dtype):
    """Load in the dtype the server computed in, so the comparison measures
    the capture and not rounding. A multimodal wrapper (Kimi-K2.5) is
    checked against its text model alone: HF's causal LM class for
    `text_config`, given the wrapper's text weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = read_config(Path(model_path))
    arch = architecture_of(config)
    if arch.text_config is None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    text = dict(config[arch.text_config])
    text_config = AutoConfig.for_model(text.pop("model_type"), **text)
    # from_pretrained, not load_state_dict: it also converts the checkpoint's
    # per-expert tensors into transformers' fused expert layout.
    prefix = re.escape(arch.weights_prefix)
    model, info = AutoModelForCausalLM.from_pretrained(model_path, config=text_config, dtype=dtype,
                                                       key_mapping={f"^{prefix}": ""}, output_loading_info=True)
    if info["missing_keys"]:  # left at random init: the reference would be wrong, not the capture
        raise ValueError(f"{model_path}: no weights under {arch.weights_prefix!r} for "
                         f"{sorted(info['missing_keys'])[:5]} of {type(model).__name__}")
    return model.eval()


@torch.inference_mode()
def reference_states(model, input_ids: Sequence[int], layers: AuxLayers) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [n, N, H], final [n, H]) for one prompt."""
    ids = torch.as_tensor([list(input_ids)], dtype=torch.long)
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    aux = torch.stack([hidden[i][0] for i in layers.hf_hidden_state_indices], dim=1)
    return aux, hidden[-1][0]


def per_token_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
