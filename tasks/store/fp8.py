"""FP8 storage of hidden states: e4m3 values with one float32 scale per token
(and per aux layer), chosen per store in its manifest (`dtype`).

A token's row x is stored as q = e4m3(x / s) with s = max|x| / 448, so each
row uses the format's whole range whatever its magnitude (the residual
stream's scale varies by orders of magnitude between layers and tokens; one
scale per tensor would push small rows into e4m3's subnormals). Reading gives
back bf16: q * s, rounded once.

Error bound per value, from e4m3's 3 mantissa bits: |x - x'| <= 2^-4 |x|
for values in the normal range, and <= 2^-10 s below it (subnormal spacing
2^-9, times the scale), plus bf16's own rounding (2^-8 relative) of the
result. tests/test_fp8.py checks exactly this.
"""
from __future__ import annotations

import torch

STORAGE_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
E4M3_MAX = 448.0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (q e4m3 [..., H], scale float32 [...]); scale over the last axis."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    # An all-zero row has no range to fit: any positive scale stores it exactly.
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # x / s can round to a hair above 448; clamp so no cast can overflow to NaN.
    q = (xf / scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(STORAGE_DTYPE)
    return q, scale.to(SCALE_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)).to(dtype)
