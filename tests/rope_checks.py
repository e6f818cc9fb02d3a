"""The drafters' rope against SGLang 0.5.23's own rotary classes, run in a
child process with SGLANG_USE_CPU_ENGINE=1 (without it SGLang's rotary
classes reach for vLLM's CUDA ops): tests/test_rope.py.

Each check rotates the same q and k at the same positions (long ones too:
YaRN's changes are in the low frequencies) with our rope and with the class
SGLang builds, and returns the largest difference. The real targets' check
goes the way SGLang goes: the drafter's exported config.json, read by
SGLang's get_config (transformers' config class), the rope arguments taken
from it as each served class takes them."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

POSITIONS = torch.tensor([0, 1, 5, 1023, 1024, 4097, 70000, 250000])

# Rope settings as a config carries them: every type the GQA layer computes,
# YaRN with and without truncation, mscale pairs and attn_factor.
GQA_GRID = {
    "default": {"rope_theta": 10000.0},
    "default-500k": {"rope_theta": 500000.0},
    "linear": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3": {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192}},
    "yarn": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 1024}},
    "yarn-no-truncate": {"rope_theta": 150000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False}},
    "yarn-mscales": {"rope_theta": 10000.0, "rope_scaling": {
        "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
        "mscale_all_dim": 1.0}},
    "yarn-mscale-alone": {"rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048, "mscale": 0.707}},
    "yarn-attn-factor": {"rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "attn_factor": 1.3,
        "beta_fast": 16, "beta_slow": 2}},
}
# MLA: SGLang makes every scaling deepseek_yarn; the interleaving is the config's.
MLA_GRID = {
    "default": ({"rope_theta": 10000.0}, True),
    "deepseek-v3": ({"rope_theta": 10000.0, "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}}, True),
    "gpt-oss-style": ({"rope_theta": 150000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False}}, True),
    "mscale-alone": ({"rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048, "mscale": 0.707}}, True),
    "mscale-all-dim-alone": ({"rope_theta": 50000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "mscale_all_dim": 1.0}}, True),
    "attn-factor": ({"rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attn_factor": 0.8}}, True),
    "factor-1": ({"rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096, "mscale_all_dim": 1.0}}, True),
    "neox": ({"rope_theta": 10000.0, "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
        "mscale_all_dim": 1.0}}, False),
}


def _diff(sglang_rope, rotary, dim: int, heads: int = 2) -> float:
    """The largest difference of q [tokens, heads * dim] and k [tokens, dim]
    rotated by SGLang's class and by our Rotary, at the POSITIONS its
    cos/sin table holds."""
    positions = POSITIONS[POSITIONS < sglang_rope.cos_sin_cache.shape[0]]
    n = len(positions)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(n, heads * dim, generator=g), torch.randn(n, dim, generator=g)
    # [tokens, heads, dim]: the layout both SGLang's base class and its
    # DeepSeek one (which rotates the last dim in place) take.
    sq, sk = sglang_rope.forward_native(positions, q.clone().view(n, heads, dim), k.clone().view(n, 1, dim))
    sq, sk = sq.reshape(n, -1), sk.reshape(n, -1)
    oq, ok = rotary(q.view(1, n, -1, dim).transpose(1, 2), k.view(1, n, -1, dim).transpose(1, 2), positions[None])
    oq, ok = oq.transpose(1, 2).reshape(n, -1), ok.transpose(1, 2).reshape(n, -1)
    return float(max((oq - sq).abs().max(), (ok - sk).abs().max()))


def _config(rope: dict, max_position: int = 131072) -> dict:
    return {"max_position_embeddings": max_position, **rope}


def _as_read(config: dict, model_type: str, dim: int) -> dict:
    """The rope_parameters transformers' config class makes of a config's
    rope keys (what SGLang's classes read), not ours."""
    from transformers import AutoConfig

    sizes = dict(hidden_size=2 * dim, num_attention_heads=2, head_dim=dim)
    return dict(AutoConfig.for_model(model_type, **sizes, **config).rope_parameters)


def _sglang_gqa(rope_parameters: dict, dim: int, max_position: int):
    """llama.py:322-335 (and dflash.py:252-277): rope_parameters whole as
    rope_scaling, its rope_theta, the whole head, neox."""
    from sglang.srt.layers.rotary_embedding import get_rope

    return get_rope(dim, dim, max_position, rope_parameters.get("rope_theta", 10000), True, dict(rope_parameters),
                    dtype=torch.float32)


def gqa_grid() -> dict:
    """Our GQA rope (EAGLE-3's gqa layer, DFlash's) against SGLang's get_rope
    as llama.py and dflash.py call it on what transformers' LlamaConfig makes
    of the same keys."""
    from tasks.train.layers.rope import gqa_rotary

    out = {}
    for name, rope in GQA_GRID.items():
        for dim in (64, 128):
            config = _config(rope)
            theirs = _sglang_gqa(_as_read(config, "llama", dim), dim, config["max_position_embeddings"])
            out[f"{name}/{dim}"] = {"diff": _diff(theirs, gqa_rotary(config, dim), dim),
                                    "class": type(theirs).__name__}
    return out


def _sglang_mla(rope_parameters: dict, max_position: int, rope_dim: int, interleave: bool, qk_head_dim: int):
    """What deepseek_v2.py builds from a config's rope_parameters:
    rope_scaling unless its type is default (:2604-2612), any scaling made
    deepseek_yarn (:2065), interleaved unless rope_interleave is false
    (:2166), the softmax scale through compute_mla_mscale_scaling
    (:2177-2178)."""
    from sglang.srt.configs.model_config import compute_mla_mscale_scaling
    from sglang.srt.layers.rotary_embedding import get_rope

    theta = rope_parameters["rope_theta"]
    scaling = dict(rope_parameters) if rope_parameters.get("rope_type") != "default" else None
    scale = qk_head_dim ** -0.5
    if scaling:
        scaling["rope_type"] = "deepseek_yarn"
        scale = compute_mla_mscale_scaling(scaling, scale)
    rope = get_rope(rope_dim, rope_dim, max_position, theta, not interleave, scaling, dtype=torch.float32)
    return rope, scale


def mla_grid() -> dict:
    """Our MLA rope and softmax scale against SGLang's DeepseekV2AttentionMLA's,
    on what transformers' DeepseekV3Config makes of the same keys; and a
    control: the same YaRN with its `truncate: false` honoured (what HF's rope
    and SGLang's GQA layer do), which the MLA layer does not."""
    from tasks.train.layers.rope import Rotary, gqa_frequencies, mla_rotary, mla_softmax_scale, rope_parameters

    out = {}
    for name, (rope, interleave) in MLA_GRID.items():
        config = _config(rope, 163840)
        theirs, scale = _sglang_mla(_as_read(config, "deepseek_v3", 128), 163840, 64, interleave, 192)
        out[name] = {"diff": _diff(theirs, mla_rotary(config, 64, interleave), 64),
                     "scale": mla_softmax_scale(config, 192), "sglang_scale": scale, "class": type(theirs).__name__}
    config = _config(MLA_GRID["gpt-oss-style"][0], 163840)
    inv_freq, _, mscale = gqa_frequencies(rope_parameters(config), 64, config["max_position_embeddings"])
    theirs, _ = _sglang_mla(_as_read(config, "deepseek_v3", 128), 163840, 64, True, 192)
    out["control: truncate honoured"] = {"diff": _diff(theirs, Rotary(inv_freq, neox=False, scale=mscale), 64)}
    return out


def _exported_config(name: str, family: str) -> dict:
    """A real target's drafter config.json, as the export writes it (the
    drafter built on the meta device: shapes, no memory)."""
    from tasks.target.architectures import architecture_of
    from tasks.target.layers import AuxLayers
    from tasks.train.dflash.model import DFlashConfig, DFlashDrafter
    from tasks.train.dflash.export import dflash_config
    from tasks.train.eagle3.model import DrafterConfig, Eagle3Drafter
    from tasks.train.eagle3.export import export_config
    from tests.real_targets import REAL_TARGETS, text_config

    config = REAL_TARGETS[name]
    target = text_config(config)
    n = target["num_hidden_layers"]
    with torch.device("meta"):
        if family == "dflash":
            model = DFlashDrafter(DFlashConfig.from_target(target, 5, 5))
            return dflash_config(model, [1, n // 4, n // 2, 3 * n // 4, n - 3], target_config=target, block_size=16,
                                 mask_token_id=0, mask_token="<|MASK|>", dtype=torch.bfloat16)
        cfg = DrafterConfig.from_target(target, 32000, attention=family)
        return export_config(Eagle3Drafter(cfg, target), AuxLayers.for_model(n), architecture_of(config),
                             torch.bfloat16)


def real_targets() -> dict:
    """Every real target's drafters (gqa, and mla where the target has MLA
    dims; dflash): their exported config.json read by SGLang's get_config,
    the rope its class takes from it, against ours."""
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.utils.hf_transformers.common import get_rope_config
    from sglang.srt.utils.hf_transformers.config import get_config

    from tasks.train.layers.rope import gqa_rotary, mla_rotary, mla_softmax_scale
    from tests.real_targets import REAL_TARGETS, text_config

    out = {}
    for name in REAL_TARGETS:
        families = ["gqa", "dflash"] + (["mla"] if text_config(REAL_TARGETS[name]).get("kv_lora_rank") else [])
        for family in families:
            exported = _exported_config(name, family)
            with tempfile.TemporaryDirectory() as d:
                (Path(d) / "config.json").write_text(json.dumps(exported))
                loaded = get_config(d, trust_remote_code=False)
            row = {"model_type": loaded.model_type, "config_class": type(loaded).__name__}
            if family == "mla":
                qk = loaded.qk_nope_head_dim + loaded.qk_rope_head_dim
                theirs, scale = _sglang_mla(dict(loaded.rope_parameters), loaded.max_position_embeddings,
                                            loaded.qk_rope_head_dim, getattr(loaded, "rope_interleave", True), qk)
                row.update(diff=_diff(theirs, mla_rotary(exported, exported["qk_rope_head_dim"],
                                                         exported["rope_interleave"]), loaded.qk_rope_head_dim),
                           scale=mla_softmax_scale(exported, qk), sglang_scale=scale)
            else:
                dim = int(getattr(loaded, "head_dim", None) or loaded.hidden_size // loaded.num_attention_heads)
                # llama.py:322-335 and dflash.py:252-277: rope_parameters whole, the whole head, neox.
                theta, scaling = get_rope_config(loaded)
                rotary_dim = int(getattr(loaded, "partial_rotary_factor", 1.0) * dim)
                theirs = get_rope(dim, rotary_dim, loaded.max_position_embeddings, theta, True,
                                  dict(scaling) if scaling else None, dtype=torch.float32)
                row.update(diff=_diff(theirs, gqa_rotary(exported, dim), dim), head_dim=dim,
                           rotary_dim=rotary_dim, rope_class=type(theirs).__name__)
            out[f"{name}/{family}"] = row
    return out
