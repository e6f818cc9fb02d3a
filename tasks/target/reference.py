"""An independent forward pass with HF transformers, to check captures against.

SGLang's "output of layer i" is HF's `hidden_states[i + 1]`; HF's last
`hidden_states` entry is after the final norm, like SGLang's final state.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tasks.capture.dump import Capture
from tasks.target.layers import AuxLayers


def load_reference_model(model_path: str, dtype: torch.dtype):
    """Load in the dtype the server computed in, so the comparison measures
    the capture and not rounding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def reference_states(model, input_ids: Sequence[int], layers: AuxLayers) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [n, 3, H], final [n, H]) for one prompt."""
    ids = torch.as_tensor([list(input_ids)], dtype=torch.long)
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    aux = torch.stack([hidden[i][0] for i in layers.hf_hidden_state_indices], dim=1)
    return aux, hidden[-1][0]


def per_token_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def compare_with_reference(capture: Capture, ref_aux: torch.Tensor, ref_final: torch.Tensor) -> dict:
    """Worst per-token cosine and largest absolute difference, aux and final."""
    if capture.aux_hidden_states.shape != ref_aux.shape or capture.final_hidden_state.shape != ref_final.shape:
        raise ValueError(
            f"shape mismatch: capture aux {tuple(capture.aux_hidden_states.shape)} final "
            f"{tuple(capture.final_hidden_state.shape)} vs reference {tuple(ref_aux.shape)} {tuple(ref_final.shape)}"
        )
    return {
        "min_cosine_aux": per_token_cosine(capture.aux_hidden_states, ref_aux).min().item(),
        "min_cosine_final": per_token_cosine(capture.final_hidden_state, ref_final).min().item(),
        "max_abs_diff": max(
            (capture.aux_hidden_states.float() - ref_aux.float()).abs().max().item(),
            (capture.final_hidden_state.float() - ref_final.float()).abs().max().item(),
        ),
    }
