"""What an EAGLE-3 drafter's one decoder layer is in either attention
layout (gqa.py, mla.py): the two input norms, the SiLU MLP and SGLang's
`hidden + residual` bookkeeping; and the RMSNorm every drafter uses."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DecoderLayer(nn.Module):
    """The attention's projections and `qkv` are each layout's; each makes
    them before calling `add_mlp`, so parameters are made (and initialised
    from the seed) in the order they always were."""

    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def add_mlp(self) -> None:
        h, cfg = self.cfg.hidden_size, self.cfg
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn [B, heads, L, dv] -> the layer's pre-norm output (SGLang's
        `hidden + residual` after the MLP), what the next draft step takes in."""
        b, _, n, _ = attn.shape
        residual = self.o_proj(attn.transpose(1, 2).reshape(b, n, -1)) + residual
        x = self.post_attention_layernorm(residual)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) + residual
