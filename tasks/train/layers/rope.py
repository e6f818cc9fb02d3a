"""A drafter's rotary embedding, computed as SGLang 0.5.23 computes the one
it serves the drafter with (sglang/srt/layers/rotary_embedding/), so that
positions mean the same in training as in serving.

SGLang builds a drafter's rope from its config.json alone, never from the
target's classes, and it is not the target's rope in every detail:
- the GQA layer (llama.py LlamaAttention -> factory.get_rope) rotates the
  whole head (the export writes no partial_rotary_factor), neox style, by
  rope type: default, linear, llama3 (rope_variant.py Llama3RotaryEmbedding)
  or yarn (yarn.py YaRNScalingRotaryEmbedding: `truncate` honoured, cos/sin
  times mscale(factor, mscale)/mscale(factor, mscale_all_dim) when both are
  given, else 0.1 ln(factor) + 1, times attn_factor);
- the MLA layer (deepseek_v2.py:2065) turns ANY rope scaling into
  "deepseek_yarn" (rope_variant.py DeepseekScalingRotaryEmbedding): the
  correction range always truncated whatever `truncate` says, cos/sin times
  mscale(factor, mscale)/mscale(factor, mscale_all_dim) * attn_factor with
  mscale 1 and mscale_all_dim 0 when absent, interleaved pairs unless
  rope_interleave is false, and the softmax scale times
  mscale(factor, mscale_all_dim)^2 (model_config.py:2623).
Written from those formulas; tests/test_rope.py holds each against SGLang's
own classes over a grid of rope settings and every real target's.
"""
from __future__ import annotations

import math

import torch
from torch import nn

# The GQA layer's rope types this project computes as SGLang does; another
# is refused before training, naming it.
GQA_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# SGLang serves an MLA drafter these (any scaling as deepseek_yarn); a rope
# defined otherwise (llama3's wavelength bands, say) would be served as a
# YaRN it was never meant to be.
MLA_ROPE_TYPES = ("default", "yarn", "deepseek_yarn")


class UnsupportedRope(ValueError):
    pass


def rope_parameters(config: dict) -> dict:
    """A config's rope as one dict (transformers 5's rope_parameters, or the
    older rope_theta + rope_scaling), with rope_theta and rope_type always set
    and no partial_rotary_factor: a drafter rotates its whole head."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.pop("type", None)
    rope.pop("partial_rotary_factor", None)
    return rope


def rope_config(config: dict) -> dict:
    """The rope keys a drafter's config.json carries: the target's rope,
    normalised by rope_parameters, in both of the forms transformers' config
    classes read (5's rope_parameters; rope_theta + rope_scaling before)."""
    rope = rope_parameters(config)
    out = {"rope_theta": rope["rope_theta"], "rope_parameters": rope}
    if config.get("max_position_embeddings") is not None:
        out["max_position_embeddings"] = config["max_position_embeddings"]
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["rope_scaling"] = scaling if scaling["rope_type"] != "default" else None
    return out


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(rope: dict, dim: int, base: float, original: int, truncate: bool) -> torch.Tensor:
    factor = float(rope.get("factor", 1.0))
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos, 1.0 / (factor * pos)

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(rope.get("beta_fast", 32)), correction(rope.get("beta_slow", 1))
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp) * rope.get("extrapolation_factor", 1)
    return interpolation * (1 - keep) + extrapolation * keep


def gqa_frequencies(rope: dict, dim: int, max_position: int) -> tuple[torch.Tensor, float, float]:
    """(inverse frequencies [dim/2], position divisor, cos/sin scale) of
    SGLang's get_rope for a rotated width of `dim`."""
    kind, base = rope["rope_type"], float(rope["rope_theta"])
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if kind == "default":
        return plain, 1.0, 1.0
    if kind == "linear":
        return plain, float(rope.get("factor", 1.0)), 1.0
    if kind == "llama3":
        factor = rope.get("factor", 1.0)
        low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        original = rope.get("original_max_position_embeddings", max_position)
        wave = 2 * math.pi / plain
        smooth = (original / wave - low) / (high - low) if low != high else 0
        return torch.where(wave < original / high, plain,
                           torch.where(wave > original / low, plain / factor,
                                       (1 - smooth) * plain / factor + smooth * plain)), 1.0, 1.0
    if kind == "yarn":
        factor = float(rope.get("factor", 1.0))
        original = rope.get("original_max_position_embeddings", max_position)
        if rope.get("mscale") is not None and rope.get("mscale_all_dim") is not None:
            scale = yarn_mscale(factor, rope["mscale"]) / yarn_mscale(factor, rope["mscale_all_dim"])
        else:
            scale = yarn_mscale(factor)
        return (_yarn_inv_freq(rope, dim, base, original, bool(rope.get("truncate", True))), 1.0,
                scale * rope.get("attn_factor", 1))
    raise UnsupportedRope(f"rope_type {kind!r}: a drafter's GQA layer is trained with the rope SGLang serves it "
                          f"with, computed here for {', '.join(GQA_ROPE_TYPES)} only")


def check_gqa_rope(config: dict, head_dim: int) -> None:
    """Refuse (UnsupportedRope) a target rope the GQA layer would not be
    trained with as SGLang serves it."""
    gqa_frequencies(rope_parameters(config), head_dim, config.get("max_position_embeddings", 8192))


def mla_frequencies(rope: dict, dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2], cos/sin scale) of SGLang's MLA rope."""
    kind, base = rope["rope_type"], float(rope["rope_theta"])
    if kind not in MLA_ROPE_TYPES:
        raise UnsupportedRope(f"the target's rope is {kind!r}: SGLang serves an MLA drafter only plain or YaRN rope "
                              f"(it makes any scaling deepseek_yarn); use train.attention gqa")
    if kind == "default":
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    factor = float(rope.get("factor", 1.0))
    scale = yarn_mscale(factor, float(rope.get("mscale", 1))) / yarn_mscale(factor, float(rope.get("mscale_all_dim", 0)))
    # SGLang's DeepseekScalingRotaryEmbedding takes original_max_position_embeddings as its length.
    original = rope.get("original_max_position_embeddings", rope.get("max_position_embeddings", 4096))
    return _yarn_inv_freq(rope, dim, base, original, truncate=True), scale * rope.get("attn_factor", 1)


def mla_softmax_scale(target_config: dict, qk_head_dim: int) -> float:
    """SGLang's MLA softmax scale: qk_head_dim^-0.5, times
    mscale(factor, mscale_all_dim)^2 when the rope is scaled."""
    rope = rope_parameters(target_config)
    scale = qk_head_dim ** -0.5
    if rope["rope_type"] == "default" or not rope.get("apply_yarn_scaling", True) or not rope.get("apply_scale", True):
        return scale
    m = yarn_mscale(float(rope.get("factor", 1.0)), float(rope.get("mscale_all_dim") or 0.0))
    return scale * m * m


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """SGLang's apply_rotary_emb: x [..., d], cos/sin [..., d/2] broadcast."""
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1) if neox else torch.stack((o1, o2), dim=-1).flatten(-2)


class Rotary(nn.Module):
    """Rotates q [B, heads, L, d] and k [B, kv, L, d] at positions [B, L].
    `inv_freq` [d/2]; positions are divided by `divisor` (linear scaling)
    and cos/sin multiplied by `scale` (YaRN's mscale), in fp32, as SGLang's
    cos/sin cache is."""

    def __init__(self, inv_freq: torch.Tensor, *, neox: bool, divisor: float = 1.0, scale: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.neox, self.divisor, self.scale = neox, divisor, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        t = positions.to(torch.float32)
        if self.divisor != 1.0:
            t = t / self.divisor
        freqs = t[..., None] * self.inv_freq.to(t.device)
        cos, sin = (freqs.cos() * self.scale)[:, None], (freqs.sin() * self.scale)[:, None]
        return (rotate(q, cos.to(q.dtype), sin.to(q.dtype), self.neox),
                rotate(k, cos.to(k.dtype), sin.to(k.dtype), self.neox))


def gqa_rotary(config: dict, head_dim: int) -> Rotary:
    """The rope SGLang's LlamaAttention builds from a drafter config carrying
    `config`'s rope keys, over the whole head."""
    inv_freq, divisor, scale = gqa_frequencies(rope_parameters(config), head_dim,
                                               config.get("max_position_embeddings", 8192))
    return Rotary(inv_freq, neox=True, divisor=divisor, scale=scale)


def mla_rotary(config: dict, rope_dim: int, interleave: bool) -> Rotary:
    """The rope SGLang's DeepseekV2AttentionMLA builds on an MLA head's rope dims."""
    rope = {"max_position_embeddings": config.get("max_position_embeddings", 4096), **rope_parameters(config)}
    inv_freq, scale = mla_frequencies(rope, rope_dim)
    return Rotary(inv_freq, neox=not interleave, scale=scale)
