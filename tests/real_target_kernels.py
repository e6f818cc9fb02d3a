"""SGLang 0.5.23's Triton kernels at the real targets' drafter shapes, run
under Triton's interpreter (tests/triton_interpreter.py runs these in its
child; tests/test_real_targets.py reads the results).

A few tokens and one KV head with its real group of query heads: the
kernels' compile-time rules (block sizes from the head dim, aranges that
must be powers of two, the grouped kernel's head blocks) are those of the
served shapes; the head count beyond one group only widens the grid.
- GQA attention (EAGLE-3's gqa layer; DFlash's layers): the Triton
  backend's decode and extend (kernels/ops/attention/decode_attention.py,
  extend_attention.py) in bf16, against the CPU stand-ins.
- MLA (Eagle3DeepseekV2ForCausalLM): the decode over the latent cache and
  the absorbed extend (kv_lora + rope wide keys, kv_lora wide values).
- DFlash: table_qk_norm_rope_ (kernels/ops/attention/table_qk_norm_rope.py),
  which SGLang runs on every DFlash layer in bf16, against our training
  forward's q/k norm and rope (tasks/train/dflash/model.py) on the same inputs;
  and at the head dims the project derived before (Kimi-K2.5's 112,
  DeepSeek-V3's 56), where it must fail.
"""
from __future__ import annotations

import torch

from tests.real_targets import REAL_TARGETS, text_config
from tests.stand_ins_vs_triton import _decode, _extend

# What the project derived for Kimi-K2.5 and DeepSeek-V3 before
# tasks/train/layers/sizes.py: hidden // heads.
OLD_DERIVED_HEAD_DIMS = (112, 56)


def drafter_shapes() -> dict:
    """Per real target and family: the attention shape of the drafter the
    project derives (or the refusal's message)."""
    from tasks.train.dflash.model import DFlashConfig
    from tasks.train.eagle3.model import DrafterConfig

    out = {}
    for name, config in REAL_TARGETS.items():
        target = text_config(config)
        for family in ("gqa", "mla", "dflash"):
            try:
                cfg = (DFlashConfig.from_target(target, 5, 5) if family == "dflash"
                       else DrafterConfig.from_target(target, 32000, attention=family))
            except ValueError as e:
                out[f"{name}/{family}"] = {"refused": str(e)}
                continue
            out[f"{name}/{family}"] = {"heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                                       "head_dim": cfg.head_dim,
                                       **({"kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim,
                                           "qk_nope_head_dim": cfg.qk_nope_head_dim, "v_head_dim": cfg.v_head_dim}
                                          if family == "mla" else {})}
    return out


def _unique(shapes: dict, family: str, key) -> dict:
    found = {}
    for where, s in shapes.items():
        if where.endswith("/" + family) and "refused" not in s:
            found.setdefault(key(s), []).append(where.split("/")[0])
    return found


def gqa_attention() -> dict:
    """The Triton backend's bf16 decode and extend at every GQA drafter's
    head dim and group (EAGLE-3 gqa and DFlash)."""
    shapes = drafter_shapes()
    groups = {**_unique(shapes, "gqa", lambda s: (s["heads"] // s["kv_heads"], s["head_dim"])),
              **_unique(shapes, "dflash", lambda s: (s["heads"] // s["kv_heads"], s["head_dim"]))}
    out = {}
    for (group, dim), targets in sorted(groups.items()):
        out[f"group{group}-d{dim}"] = {"targets": targets,
                                       "decode": _decode(torch.bfloat16, dim, group, 1),
                                       "extend": _extend(torch.bfloat16, False, head_dim=dim, num_heads=group)}
    return out


def mla_attention() -> dict:
    """The Triton backend's MLA decode over the latent cache (kv_lora + rope
    keys, kv_lora values) at the MLA drafters' dims, and the absorbed extend."""
    shapes = drafter_shapes()
    dims = _unique(shapes, "mla", lambda s: (s["kv_lora_rank"], s["qk_rope_head_dim"]))
    out = {}
    for (kv_lora, rope), targets in sorted(dims.items()):
        out[f"latent{kv_lora}-rope{rope}"] = {
            "targets": targets,
            "decode": _decode(torch.bfloat16, kv_lora + rope, 16, 1, mla_kv_lora=kv_lora),
            "extend": _absorbed_extend(kv_lora, rope),
        }
    return out


def _absorbed_extend(kv_lora: int, rope: int, heads: int = 4) -> dict:
    """extend_attention_fwd as the Triton backend runs MLA's absorbed extend:
    one latent "head" of kv_lora + rope keys shared by every query head,
    values its first kv_lora columns; against a plain softmax attention."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    g = torch.Generator().manual_seed(0)
    prefix, ext, slots = 3, 4, 16
    dk = kv_lora + rope
    cache = torch.randn(slots, 1, dk, generator=g).bfloat16()
    q = torch.randn(ext, heads, dk, generator=g).bfloat16()
    k_ext = cache[prefix:prefix + ext].clone()
    rows = torch.arange(prefix + ext)
    out = torch.empty(ext, heads, kv_lora, dtype=torch.bfloat16)
    scale = 0.1
    extend_attention_fwd(q, k_ext, k_ext[..., :kv_lora], out, cache, cache[..., :kv_lora],
                         torch.tensor([0, ext], dtype=torch.int32), torch.tensor([0, prefix], dtype=torch.int32),
                         rows[:prefix], None, True, None, ext, 1.0, 1.0, sm_scale=scale)
    keys = cache[:prefix + ext, 0].float()
    scores = torch.einsum("qhd,kd->hqk", q.float(), keys) * scale
    visible = torch.arange(prefix + ext)[None, :] <= (prefix + torch.arange(ext))[:, None]
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    want = torch.einsum("hqk,kd->qhd", p, keys[:, :kv_lora])
    return {"max_abs_diff": (out.float() - want).abs().max().item(), "max_abs_out": want.abs().max().item(),
            "max_abs_v": keys[:, :kv_lora].abs().max().item()}


def _qk_norm_rope(dim: int, rope_config: dict, eps: float = 1e-6, nq: int = 2, nk: int = 1) -> dict:
    """table_qk_norm_rope_ in place on a bf16 qkv row per token, against
    tasks/train/dflash/model.py's Attention on the same q and k: q_norm, k_norm,
    then the rope (tasks/train/layers/rope.py) at the same positions. The kernel's
    cos/sin table is built from our rope's frequencies: SGLang's rotary
    classes do not import in this child (no CPU engine), and
    tests/test_rope.py holds ours to theirs exactly."""
    from sglang.kernels.ops.attention.table_qk_norm_rope import table_qk_norm_rope_

    from tasks.train.layers.decoder_layer import RMSNorm
    from tasks.train.layers.rope import gqa_frequencies, gqa_rotary, rope_parameters

    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 3, 1000, 4096, 20000])
    t = len(positions)
    qkv = torch.randn(t, (nq + 2 * nk) * dim, generator=g).bfloat16()
    q_norm, k_norm = RMSNorm(dim, eps), RMSNorm(dim, eps)
    with torch.no_grad():
        q_norm.weight.copy_((1 + 0.1 * torch.randn(dim, generator=g)).bfloat16())
        k_norm.weight.copy_((1 + 0.1 * torch.randn(dim, generator=g)).bfloat16())
    # SGLang's cos/sin table: [position, cos(d/2) | sin(d/2)], times YaRN's mscale, fp32 (base.py:115-118).
    inv_freq, divisor, scale = gqa_frequencies(rope_parameters(rope_config), dim,
                                               rope_config.get("max_position_embeddings", 8192))
    freqs = (torch.arange(int(positions.max()) + 1, dtype=torch.float32) / divisor)[:, None] * inv_freq
    cos_sin = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
    q = qkv[:, :nq * dim].view(1, t, nq, dim).transpose(1, 2)
    k = qkv[:, nq * dim:(nq + nk) * dim].view(1, t, nk, dim).transpose(1, 2)
    with torch.no_grad():
        want_q, want_k = gqa_rotary(rope_config, dim)(q_norm(q).bfloat16(), k_norm(k).bfloat16(), positions[None])
        # A control: the rope one position on, what a block's positions off by one would give.
        late_q, _ = gqa_rotary(rope_config, dim)(q_norm(q).bfloat16(), k_norm(k).bfloat16(), positions[None] + 1)
    kernel = qkv.clone()
    table_qk_norm_rope_(kernel, positions, q_norm.weight.detach().bfloat16(), k_norm.weight.detach().bfloat16(),
                        cos_sin, nq, nk, dim, eps)
    got_q = kernel[:, :nq * dim].view(1, t, nq, dim).transpose(1, 2).float()
    got_k = kernel[:, nq * dim:(nq + nk) * dim].view(1, t, nk, dim).transpose(1, 2).float()
    return {"max_abs_diff": max((got_q - want_q.float()).abs().max().item(), (got_k - want_k.float()).abs().max().item()),
            "max_abs_out": want_q.float().abs().max().item(),
            "control_one_position_on": (got_q - late_q.float()).abs().max().item(),
            "v_untouched": bool(torch.equal(kernel[:, (nq + nk) * dim:], qkv[:, (nq + nk) * dim:]))}


def dflash_qk_norm_rope() -> dict:
    """At every DFlash drafter's head dim, with its target's rope; and at the
    head dims derived before (a power of two or nothing compiles)."""
    shapes = drafter_shapes()
    out = {}
    for where, s in shapes.items():
        if where.endswith("/dflash") and "refused" not in s:
            out[where] = _qk_norm_rope(s["head_dim"], text_config(REAL_TARGETS[where.split("/")[0]]))
    for dim in OLD_DERIVED_HEAD_DIMS:
        try:
            out[f"old-d{dim}"] = _qk_norm_rope(dim, text_config(REAL_TARGETS["kimi-k2.5"]))
        except Exception as e:
            out[f"old-d{dim}"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return out


def dflash_head_dims() -> dict:
    """table_qk_norm_rope_ at head dims around the ones drafters have: which
    compile (tests/test_real_targets.py holds gpu_kernels' rule to this)."""
    out = {}
    for dim in (48, 56, 64, 96, 112, 128, 256):
        try:
            _qk_norm_rope(dim, {"rope_theta": 10000.0})
            out[str(dim)] = "runs"
        except Exception as e:
            out[str(dim)] = f"{type(e).__name__}: {e}"[:300]
    return out
