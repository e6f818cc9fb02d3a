"""How far a capture is from the independent HF forward
(tasks.target.reference), in the figures the capture tests assert on."""
from __future__ import annotations

import torch

from tasks.capture.dump import Capture
from tasks.target.reference import per_token_cosine


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
