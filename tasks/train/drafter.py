"""The EAGLE-3 drafter, in the layouts SGLang serves (`LlamaForCausalLMEagle3`;
`Eagle3DeepseekV2ForCausalLM` with attention "mla"), and its forward: the
computation SGLang serves, step by step.

    fc          [H, N*H]   the target's N aux states (three for EAGLE-3), concatenated
    midlayer    one decoder layer whose attention takes 2H inputs: the
                normed token embedding concatenated with the normed hidden
                state (input_layernorm, hidden_norm); residual = the hidden
                state entering the layer. Its attention is a Llama layer's
                (q/k/v, grouped KV heads) or DeepSeek-V2's multi-latent one
                (`MLAMidLayer`); the MLP is a SiLU one either way
    norm        final RMSNorm
    lm_head     [N, H]     over the draft vocabulary
    d2t, t2d    draft id j is target id j + d2t[j]; t2d[t] marks target ids
                in the draft vocabulary

Variants (`VARIANTS`, the two flags SGLang's class reads from config.json):
eagle3 as above; eagle3.1 adds `fc_norm` (one RMSNorm per aux state before
fc) and `norm_output` (a draft decode step is fed the previous step's normed
output, the one lm_head scores, instead of its pre-norm one). The capture is
the same for both.

The token embeddings are the target's (frozen here; SGLang shares the
target's at serving time). `Eagle3Drafter.step` mirrors SGLang's
`llama_eagle3.LlamaDecoderLayer.forward` (and `kimi_k25_eagle3`'s
`Eagle3MLADecoderLayer`), so what is trained is what is served;
tests/test_drafter_in_sglang.py checks the exported weights load into
SGLang's own classes and compute the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tasks.target.architectures import architecture_of, read_config
from tasks.target.embeddings import load_target_embeddings
from tasks.train.vocab import DraftVocab


def target_sizes(target_path: Path) -> dict:
    """The target config section with its text model's sizes (the drafter
    shares them)."""
    config = read_config(target_path)
    return architecture_of(config).sizes(config)


def _prefix_block(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, valid: torch.Tensor,
                  start: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the queries at positions start.. to the step-0 keys,
    grouped by KV head so the keys are never repeated: q [B, kv, rep, m, d],
    k0 [B, kv, n, d], v0 [B, kv, n, dv]. Returns the normalised output
    [B, kv, rep, m, dv] and the fp32 log-sum-exp [B, kv, rep, m] (-inf where
    no key is allowed)."""
    b, kv, rep, m, d = q.shape
    end = start + m  # keys past the block's last query are masked anyway
    k0, v0 = k0[:, :, :end], v0[:, :, :end]
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax in fp32 at least
    scores = (q.reshape(b, kv, rep * m, d) @ k0.transpose(-1, -2)).to(acc).view(b, kv, rep, m, end) * scale
    rows = torch.arange(start, end, device=q.device)
    allowed = (torch.arange(end, device=q.device)[None, :] <= rows[:, None])[None] & valid[:, None, :end]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0)[..., None]).to(v0.dtype)
    out = (p.view(b, kv, rep * m, end) @ v0).view(b, kv, rep, m, v0.shape[-1])
    return out, lse


# Above this many bytes of fp32 scores per TTT step ([B, h, L, L]), the
# prefix attention's blocks are checkpointed; below it keeping them costs
# little memory and recomputing them costs time (a fifth of a small
# drafter's training step on a CPU).
CHECKPOINT_ABOVE_BYTES = 256 * 2**20


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  valid: torch.Tensor, block: int = 512, scale: float | None = None,
                  checkpoint_above: int | None = None) -> torch.Tensor:
    """Step-k attention: the causal prefix of step-0 keys, plus the diagonal
    (same position) keys of steps 1..k. q [B, h, L, d]; keys [B, kv_heads, L,
    d]; values [B, kv_heads, L, dv] (MLA's dv differs from d); valid [B, L];
    scale: the softmax's, d^-0.5 unless given (MLA's carries YaRN's mscale).

    Memory-linear: the prefix part runs over blocks of `block` queries, each
    under activation checkpointing once the scores pass `checkpoint_above`
    bytes (CHECKPOINT_ABOVE_BYTES unless given), so backward keeps only its
    output and log-sum-exp ([B, h, L] per step) and recomputes one block's
    scores at a time, instead of keeping fp32 [B, h, L, L] per TTT step (8k
    tokens x 64 heads x 7 steps do not fit any GPU). The diagonal terms are merged with the prefix by log-sum-exp,
    which is exactly one softmax over both."""
    b, heads, n, d = q.shape
    kv = keys[0].shape[1]
    scale = d ** -0.5 if scale is None else scale
    qg = q.reshape(b, kv, heads // kv, n, d)
    above = CHECKPOINT_ABOVE_BYTES if checkpoint_above is None else checkpoint_above
    recompute = torch.is_grad_enabled() and b * heads * n * n * 4 > above
    outs, lses = [], []
    for start in range(0, n, block):
        args = (qg[:, :, :, start:start + block], keys[0], values[0], valid, start, scale)
        if recompute:
            o, s = checkpoint(_prefix_block, *args, use_reentrant=False)
        else:
            o, s = _prefix_block(*args)
        outs.append(o)
        lses.append(s)
    prefix, prefix_lse = torch.cat(outs, dim=3), torch.cat(lses, dim=3)
    acc = torch.promote_types(q.dtype, torch.float32)
    diag = [(qg * k[:, :, None]).sum(-1).to(acc) * scale for k in keys[1:]]  # [B, kv, rep, L] each
    total = torch.logsumexp(torch.stack([prefix_lse, *diag]), dim=0)
    out = torch.exp(prefix_lse - total)[..., None] * prefix.to(acc)
    for s, v in zip(diag, values[1:]):
        out = out + torch.exp(s - total)[..., None] * v[:, :, None].to(acc)
    return out.to(q.dtype).view(b, heads, n, values[0].shape[-1])


# What each drafter variant sets in SGLang 0.5.23's LlamaForCausalLMEagle3
# (llama_eagle3.py reads both from the drafter's config.json).
VARIANTS = {
    "eagle3": {"fc_norm": False, "norm_output": False},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
}


def variant_flags(variant: str) -> dict:
    if variant not in VARIANTS:
        raise ValueError(f"drafter variant {variant!r}: SGLang serves {', '.join(VARIANTS)}")
    return dict(VARIANTS[variant])


def variant_named(**flags: bool) -> str:
    """The variant these flags make, or ValueError naming the flags."""
    for name, want in VARIANTS.items():
        if flags == want:
            return name
    raise ValueError(f"drafter config with {flags}: not a variant this project trains ({', '.join(VARIANTS)})")


# The dimensions of an MLA drafter's attention (SGLang's
# DeepseekV2AttentionMLA): by default the target's own, for a DeepSeek-V3 or
# Kimi-K2.x target.
MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# SGLang's MLA layer makes any rope scaling "deepseek_yarn" (deepseek_v2.py):
# a target with another scaling would be served a rope it was not trained with.
MLA_ROPE_TYPES = ("default", "yarn", "deepseek_yarn")


def _rope_parameters(target_config: dict) -> dict:
    """The target's rope as one dict (transformers 5's rope_parameters, or the
    older rope_theta + rope_scaling)."""
    rope = target_config.get("rope_parameters") or target_config.get("rope_scaling") or {}
    rope = dict(rope)
    rope.setdefault("rope_theta", target_config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def mla_softmax_scale(target_config: dict, qk_head_dim: int) -> float:
    """The MLA softmax scale SGLang serves: qk_head_dim^-0.5, times YaRN's
    mscale(factor, mscale_all_dim)^2 when the rope is scaled
    (compute_mla_mscale_scaling in SGLang, yarn_apply_mscale in HF)."""
    rope = _rope_parameters(target_config)
    scale = qk_head_dim ** -0.5
    if rope["rope_type"] == "default":
        return scale
    factor, all_dim = float(rope.get("factor", 1.0)), float(rope.get("mscale_all_dim") or 0.0)
    mscale = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
    return scale * mscale * mscale


@dataclass(frozen=True)
class LayerSizes:
    """A drafter layer's sizes, the target's: both drafter families
    (EAGLE-3 here, DFlash in dflash.py) take them."""
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int

    @staticmethod
    def of(target_config: dict, kv_heads: int | None = None) -> dict:
        """The target's sizes, as keyword arguments (`kv_heads`: MLA's, not the target's)."""
        heads = target_config["num_attention_heads"]
        return dict(hidden_size=target_config["hidden_size"], num_attention_heads=heads,
                    num_key_value_heads=kv_heads or target_config.get("num_key_value_heads") or heads,
                    head_dim=target_config.get("head_dim") or target_config["hidden_size"] // heads,
                    intermediate_size=target_config["intermediate_size"],
                    rms_norm_eps=target_config["rms_norm_eps"], vocab_size=target_config["vocab_size"])


@dataclass(frozen=True)
class DrafterConfig(LayerSizes):
    draft_vocab_size: int
    num_aux: int = 3
    fc_norm: bool = False
    norm_output: bool = False
    # "gqa": a Llama layer (LlamaForCausalLMEagle3); "mla": DeepSeek-V2's
    # multi-latent attention (Eagle3DeepseekV2ForCausalLM), with these dims.
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True

    @classmethod
    def from_target(cls, target_config: dict, draft_vocab_size: int, num_aux: int = 3,
                    variant: str = "eagle3", attention: str = "gqa",
                    mla_dims: dict | None = None) -> "DrafterConfig":
        if target_config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"the drafter's MLP uses SiLU; the target uses {target_config['hidden_act']}")
        if attention not in ("gqa", "mla"):
            raise ValueError(f"drafter attention {attention!r}: gqa or mla")
        mla = mla_config(target_config, mla_dims or {}) if attention == "mla" else {}
        # MLA's heads all carry their own keys and values.
        kv_heads = target_config["num_attention_heads"] if attention == "mla" else None
        return cls(**LayerSizes.of(target_config, kv_heads), draft_vocab_size=draft_vocab_size, num_aux=num_aux,
                   attention=attention, **mla, **variant_flags(variant))

    @property
    def variant(self) -> str:
        return variant_named(fc_norm=self.fc_norm, norm_output=self.norm_output)

    @property
    def mla_dims(self) -> dict:
        return {k: getattr(self, k) for k in MLA_DIMS} if self.attention == "mla" else {}


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
    rope = _rope_parameters(target_config)
    if rope["rope_type"] not in MLA_ROPE_TYPES:
        raise ValueError(f"the target's rope is {rope['rope_type']!r}: SGLang serves an MLA drafter only plain or "
                         f"YaRN rope (it makes any scaling deepseek_yarn); use train.attention gqa")
    return {**{k: int(v) for k, v in dims.items()}, "rope_interleave": bool(target_config.get("rope_interleave", True))}


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


class Rotary(nn.Module):
    """The target's rotary embedding (any rope type transformers knows), so
    positions mean the same to the drafter as to SGLang's draft layer."""

    def __init__(self, target_config: dict):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rope = LlamaRotaryEmbedding(LlamaConfig(**target_config))

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        # q, k: [B, heads, L, d]; positions: [B, L]
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cos, sin = self.rope(q, positions)
        return apply_rotary_pos_emb(q, k, cos, sin)


class MLARotary(nn.Module):
    """DeepSeek's rope on the rope dims of an MLA head: the target's YaRN
    (with its cos/sin mscale) through HF's DeepseekV3 rope, interleaved
    pairs unless `rope_interleave` is false, as SGLang's MLA layer rotates.
    (HF's interleaved form returns the pairs de-interleaved, the same
    permutation for q and k: their dot products are SGLang's.)"""

    def __init__(self, cfg: DrafterConfig, target_config: dict):
        super().__init__()
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3RotaryEmbedding,
                                                                          apply_rotary_pos_emb,
                                                                          apply_rotary_pos_emb_interleave)

        rope = _rope_parameters(target_config)
        if rope["rope_type"] == "deepseek_yarn":
            rope["rope_type"] = "yarn"
        self.rotate = apply_rotary_pos_emb_interleave if cfg.rope_interleave else apply_rotary_pos_emb
        self.rope = DeepseekV3RotaryEmbedding(DeepseekV3Config(
            hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
            qk_rope_head_dim=cfg.qk_rope_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim,
            max_position_embeddings=target_config.get("max_position_embeddings", 4096), rope_parameters=rope))

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        # q [B, heads, L, rope]; k [B, 1, L, rope] (one rope key shared by all heads)
        cos, sin = self.rope(q, positions)
        return self.rotate(q, k, cos, sin)


class DecoderLayer(nn.Module):
    """What both layouts' one decoder layer shares: the two input norms, the
    SiLU MLP, and SGLang's `hidden + residual` bookkeeping. The attention's
    projections and `qkv` are each layout's; each makes them before calling
    `add_mlp`, so parameters are made (and initialised from the seed) in the
    order they always were."""

    def __init__(self, cfg: DrafterConfig):
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


class MidLayer(DecoderLayer):
    """A Llama decoder layer whose q/k/v take the 2H-wide input."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        h, d = cfg.hidden_size, cfg.head_dim
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.add_mlp()

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, rotary: nn.Module):
        """[B, L, H] each -> q [B, heads, L, d], k, v [B, kv_heads, L, d],
        q and k rotated."""
        x = self.attention_input(embeds, hidden)
        b, n, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, n, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, -1, d).transpose(1, 2)
        q, k = rotary(q, k, positions)
        return q, k, v


class MLAMidLayer(DecoderLayer):
    """The decoder layer of SGLang's Eagle3DeepseekV2ForCausalLM: DeepSeek-V2
    multi-latent attention on the 2H-wide input. Trained in the expanded
    form (per-head keys and values from the latent, as TorchSpec's
    deepseek_eagle); SGLang serves the absorbed form, the same product
    reassociated, and caches one latent + rope key per token."""

    def __init__(self, cfg: DrafterConfig, scale: float):
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
        self.scale = scale  # the target's rope's: mla_softmax_scale

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


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, target_config: dict):
        super().__init__()
        self.cfg = cfg
        self.target_config = dict(target_config)
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc_norm = nn.ModuleList([RMSNorm(h, cfg.rms_norm_eps) for _ in range(cfg.num_aux)]) if cfg.fc_norm else None
        self.fc = nn.Linear(cfg.num_aux * h, h, bias=False)
        if cfg.attention == "mla":
            self.midlayer = MLAMidLayer(cfg, mla_softmax_scale(target_config,
                                                               cfg.qk_nope_head_dim + cfg.qk_rope_head_dim))
            self.rotary = MLARotary(cfg, target_config)
        else:
            self.midlayer = MidLayer(cfg)
            self.rotary = Rotary(target_config)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def set_vocab(self, vocab: DraftVocab) -> None:
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [B, L, num_aux * H], concatenated in layer
        order, to the hidden state the first draft step takes in."""
        if self.fc_norm is not None:
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, aux.chunk(self.cfg.num_aux, dim=-1))],
                            dim=-1)
        return self.fc(aux)

    def step(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             keys: list[torch.Tensor], values: list[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
        """One draft step, as SGLang serves it: the embedding of the token
        each position has just seen (`next_ids` [B, L]) with the hidden state
        it carries (`hidden` [B, L, H]: `project` of the target's aux states
        at step 0, `readout`'s feedback of the step before after), through
        the decoder layer. Step k
        attends to the step-0 keys of the causal prefix and to its own chain
        (steps 1..k at the same position); this step's keys and values are
        appended to `keys`/`values`. Returns the layer's pre-norm output
        (`readout` scores it and says what the next step takes in)."""
        q, k, v = self.midlayer.qkv(self.embed_tokens(next_ids), hidden, positions, self.rotary)
        keys.append(k)
        values.append(v)
        return self.midlayer.finish(ttt_attention(q, keys, values, valid, scale=self.midlayer.scale), hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores over the draft vocabulary of a step's output."""
        return self.lm_head(self.norm(hidden))

    def readout(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's pre-norm output -> (its scores over the draft vocabulary,
        the hidden state the next step is fed: the pre-norm output, or with
        norm_output the normed one lm_head reads)."""
        normed = self.norm(out)
        return self.lm_head(normed), normed if self.cfg.norm_output else out

    # Not trained, not checkpointed, not exported: the target's embedding
    # (SGLang shares the target's) and the rope's tables.
    FROZEN = ("embed_tokens.", "rotary.")

    def trainable_state(self) -> dict:
        """Everything but the frozen target embeddings."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(self.FROZEN)}

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        """The trained parameters and the vocabulary maps, as the module holds
        them now: under FSDP2 between `unshard` and `reshard` these are the
        whole tensors, where `state_dict()` would give the shards."""
        named = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        return {k: v for k, v in named.items() if not k.startswith(self.FROZEN)}


def build_drafter(target_path: Path, vocab: DraftVocab, *, seed: int = 0, num_aux: int = 3,
                  variant: str = "eagle3", attention: str = "gqa", mla_dims: dict | None = None,
                  embeddings: tuple[torch.Tensor, torch.Tensor] | None = None) -> Eagle3Drafter:
    """A fresh drafter: random layers, the target's embeddings (frozen), and
    lm_head rows copied from the target's for the draft vocabulary (a far
    better start than random: step 0 then starts near the target's own head).
    `embeddings`: the target's (embed, head) if the caller has read them
    already (for a large target they are gigabytes)."""
    target_config = target_sizes(target_path)
    cfg = DrafterConfig.from_target(target_config, vocab.size, num_aux, variant, attention, mla_dims)
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg, target_config)
    std = target_config.get("initializer_range", 0.02)
    for name, p in model.named_parameters():
        if p.dim() == 2 and not name.startswith("embed_tokens"):
            nn.init.normal_(p, std=std)
    embed, head = embeddings if embeddings is not None else load_target_embeddings(target_path)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head[torch.from_numpy(vocab.target_ids)])
    model.set_vocab(vocab)
    return model
