"""The MLA layout of the EAGLE-3 drafter's decoder layer: SGLang's
`Eagle3DeepseekV2ForCausalLM` (kimi_k25_eagle3.py over deepseek_v2.py's
DeepseekV2AttentionMLA), the layout of the Kimi-K2.x MLA drafters; and its
dims, the target's unless train.mla_dims gives them."""
from __future__ import annotations

import torch
from torch import nn

from tasks.train.layers.decoder_layer import DecoderLayer, RMSNorm
from tasks.train.layers.gpu_kernels import check_mla_dims_served
from tasks.train.layers.rope import UnsupportedRope, mla_frequencies, rope_parameters

# The dimensions of an MLA drafter's attention (SGLang's
# DeepseekV2AttentionMLA): by default the target's own, for a DeepSeek-V3 or
# Kimi-K2.x target.
MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check_mla_dims(given: dict) -> dict:
    """Given MLA dims (train.mla_dims), refused unless each is one of
    MLA_DIMS and at least 1."""
    unknown = sorted(set(given) - set(MLA_DIMS))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not an MLA dim; use {', '.join(MLA_DIMS)}")
    small = [f"{k} {v}" for k, v in given.items() if v < 1]
    if small:
        raise ValueError(f"{', '.join(small)}: each MLA dim is at least 1")
    return given


def mla_config(target_config: dict, given: dict) -> dict:
    """An MLA drafter's dims: each the given one, else the target's; and the
    rope interleaving, the target's (DeepSeek's default: interleaved). Refuses
    what SGLang cannot serve, naming the setting to give."""
    check_mla_dims(given)
    dims = {k: given.get(k, target_config.get(k)) for k in MLA_DIMS}
    missing = [k for k, v in dims.items() if not v]
    if missing:
        raise ValueError(f"an MLA drafter needs {', '.join(missing)}: the target has none (SGLang's "
                         f"Eagle3DeepseekV2ForCausalLM needs every one, q_lora_rank included); set them in "
                         f"train.mla_dims")
    check_mla_dims_served(dims, target_config)
    try:
        mla_frequencies(rope_parameters(target_config), int(dims["qk_rope_head_dim"]))
    except UnsupportedRope as e:
        raise ValueError(str(e)) from None
    return {**{k: int(v) for k, v in dims.items()}, "rope_interleave": bool(target_config.get("rope_interleave", True))}


class MLAMidLayer(DecoderLayer):
    """DeepSeek-V2 multi-latent attention on the 2H-wide input. Trained in
    the expanded form (per-head keys and values from the latent, as
    TorchSpec's deepseek_eagle); SGLang serves the absorbed form, the same
    product reassociated, and caches one latent + rope key per token."""

    def __init__(self, cfg, scale: float):
        super().__init__(cfg)
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.q_a_proj = nn.Linear(2 * h, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, h, bias=False)
        self.add_mlp()
        self.scale = scale  # the target's rope's: rope.mla_softmax_scale

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, rotary: nn.Module):
        """[B, L, H] each -> q, k [B, heads, L, nope + rope], v [B, heads, L, dv]."""
        c = self.cfg
        x = self.attention_input(embeds, hidden)
        b, n, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, n, -1, c.qk_nope_head_dim + c.qk_rope_head_dim)
        q_nope, q_rot = q.transpose(1, 2).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, n, -1, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        q_rot, k_rot = rotary(q_rot, k_rot[:, None], positions)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return q, k, v
