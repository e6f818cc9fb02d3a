"""Every drafter family for every real target users train drafters for
(tests/real_targets.py, their published configs at their real sizes): the
drafter the project derives, or its refusal in one line naming the setting;
its export's tensors, shaped on the meta device (no memory), against the
shapes SGLang's class builds from the exported config.json (read from the
config as its classes read it: building them needs SGLang's process groups);
and SGLang's GPU
kernels on those shapes, the Triton ones run here under the interpreter
(tests/real_target_kernels.py), the CUDA-only ones held to their rules
(tasks/train/layers/gpu_kernels.py). The rope of each: tests/test_rope.py."""
from __future__ import annotations

import json

import pytest
import torch

from tasks.target.architectures import architecture_of
from tasks.target.layers import AuxLayers
from tasks.train.config import DrafterRefused, TrainConfig
from tasks.train.dflash.model import DFlashDrafter
from tasks.train.dflash.export import check_served as check_dflash_served, dflash_config
from tasks.train.eagle3.model import Eagle3Drafter
from tasks.train.eagle3.export import ARCHITECTURES, check_served, export_config, export_weights
from tasks.server.config import ServerConfig
from tasks.server.launch import MLA_DRAFTER, draft_attention_backend
from tasks.train.layers.gpu_kernels import GQA_HEAD_DIMS, KernelRefusal, check_dflash_head_dim, check_tensor_parallel
from tasks.train.prepare import drafter_config
from tests.real_targets import REAL_TARGETS, text_config
from tests.triton_interpreter import run

# (train.method, train.variant, train.attention)
FAMILIES = {"eagle3-gqa": ("eagle3", "eagle3", "gqa"), "eagle3.1-gqa": ("eagle3", "eagle3.1", "gqa"),
            "eagle3-mla": ("eagle3", "eagle3", "mla"), "eagle3.1-mla": ("eagle3", "eagle3.1", "mla"),
            "dflash": ("dflash", "eagle3", "gqa")}
DFLASH_LAYERS, DFLASH_CONTEXT = 5, 5


def settings(family: str, **more) -> TrainConfig:
    method, variant, attention = FAMILIES[family]
    return TrainConfig(method=method, variant=variant, attention=attention, draft_vocab_size=32000,
                       draft_layers=DFLASH_LAYERS, **more)


def served_shapes(config: dict, family: str) -> dict[str, tuple[int, ...]]:
    """The tensors SGLang's class builds from an exported config.json, read
    from the config alone as its classes read it: llama.py LlamaAttention
    (head_dim = config's or hidden // heads, :195-198) under llama_eagle3.py
    (q/k/v over 2H); deepseek_v2.py DeepseekV2AttentionMLA under
    kimi_k25_eagle3.py; dflash.py DFlashAttention (:205-210) and its fc over
    the target layers' states."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    if family == "dflash":
        hd = config.get("head_dim", h // heads)
        kv = config.get("num_key_value_heads", heads)
        k = len(config["dflash_config"]["target_layer_ids"])
        shapes = {"fc.weight": (h, k * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
        for i in range(config["num_hidden_layers"]):
            p = f"layers.{i}."
            shapes.update({p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                           p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
                           p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                           p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                           p + "post_attention_layernorm.weight": (h,)})
        return shapes
    draft = config["draft_vocab_size"]
    n_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    a, m = "midlayer.self_attn.", "midlayer."
    shapes = {"fc.weight": (h, n_aux * h), "norm.weight": (h,), "lm_head.weight": (draft, h), "d2t": (draft,),
              "t2d": (vocab,), m + "input_layernorm.weight": (h,), m + "hidden_norm.weight": (h,),
              m + "post_attention_layernorm.weight": (h,), m + "mlp.gate_proj.weight": (inter, h),
              m + "mlp.up_proj.weight": (inter, h), m + "mlp.down_proj.weight": (h, inter)}
    if config.get("fc_norm"):
        shapes.update({f"fc_norm.{i}.weight": (h,) for i in range(n_aux)})
    if family.endswith("mla"):
        qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
        shapes.update({a + "q_a_proj.weight": (lora, 2 * h), a + "q_a_layernorm.weight": (lora,),
                       a + "q_b_proj.weight": (heads * qk, lora),
                       a + "kv_a_proj_with_mqa.weight": (kv_lora + config["qk_rope_head_dim"], 2 * h),
                       a + "kv_a_layernorm.weight": (kv_lora,),
                       a + "kv_b_proj.weight": (heads * (config["qk_nope_head_dim"] + config["v_head_dim"]), kv_lora),
                       a + "o_proj.weight": (h, heads * config["v_head_dim"])})
    else:
        hd = config.get("head_dim", h // heads)
        kv = config.get("num_key_value_heads", heads)
        shapes.update({a + "q_proj.weight": (heads * hd, 2 * h), a + "k_proj.weight": (kv * hd, 2 * h),
                       a + "v_proj.weight": (kv * hd, 2 * h), a + "o_proj.weight": (h, heads * hd)})
    return shapes


def exported(name: str, family: str) -> tuple[dict, dict]:
    """(config.json, {tensor: shape}) of the drafter's export, built on the meta device."""
    config = REAL_TARGETS[name]
    target = text_config(config)
    cfg = drafter_config(settings(family), target, name, DFLASH_CONTEXT if family == "dflash" else 3)
    n = target["num_hidden_layers"]
    with torch.device("meta"):
        if family == "dflash":
            model = DFlashDrafter(cfg)
            tensors = model.trained_tensors()
            check_dflash_served(tensors, cfg.num_layers)
            return (dflash_config(model, [1, n // 4, n // 2, 3 * n // 4, n - 3], target_config=target, block_size=16,
                                  mask_token_id=0, mask_token="<|MASK|>", dtype=torch.bfloat16),
                    {k: tuple(v.shape) for k, v in tensors.items()})
        model = Eagle3Drafter(cfg, target)
        tensors = export_weights(model)
        check_served(tensors, cfg.attention, cfg.num_aux, cfg.fc_norm)
        return (export_config(model, AuxLayers.for_model(n), architecture_of(config), torch.bfloat16),
                {k: tuple(v.shape) for k, v in tensors.items()})


def has_mla(name: str) -> bool:
    return bool(text_config(REAL_TARGETS[name]).get("kv_lora_rank"))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", REAL_TARGETS)
def test_each_real_target_gets_each_drafter_or_a_one_line_refusal_naming_the_setting(name, family):
    if family.endswith("mla") and not has_mla(name):
        with pytest.raises(DrafterRefused) as refused:
            drafter_config(settings(family), text_config(REAL_TARGETS[name]), name)
        message = str(refused.value)
        assert "\n" not in message and "set them in train.mla_dims" in message, message
        return
    config, shapes = exported(name, family)
    assert shapes == served_shapes(config, family)
    if not family.endswith("mla"):
        assert config["head_dim"] in GQA_HEAD_DIMS, config
        assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    if family.startswith("eagle3") and family.endswith("gqa"):
        # transformers' LlamaConfig, through which SGLang reads it, refuses anything else.
        assert config["hidden_size"] % config["num_attention_heads"] == 0, config


def test_heads_derived_where_the_target_has_none_sglang_takes():
    """DeepSeek-V3 and Kimi-K2.5 have no head_dim, and hidden / heads is 56
    and 112: their GQA and DFlash drafters keep the target's heads, of 128,
    with 8 KV heads; GLM-4.5's EAGLE-3 heads fill its hidden size."""
    for name, heads in (("deepseek-v3", 128), ("kimi-k2.5", 64)):
        for family in ("eagle3-gqa", "dflash"):
            config, _ = exported(name, family)
            assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == \
                (heads, 8, 128), (name, family)
    glm, _ = exported("glm-4.5", "eagle3-gqa")
    assert (glm["num_attention_heads"], glm["num_key_value_heads"], glm["head_dim"]) == (40, 8, 128)
    assert exported("glm-4.5", "dflash")[0]["num_attention_heads"] == 96  # Qwen3Config takes 96 x 128 over 5120
    assert exported("llama-3.1-8b", "eagle3-gqa")[0]["num_attention_heads"] == 32  # the target's own


def test_a_head_dim_the_kernels_refuse_is_refused_before_any_work_naming_train_head_dim():
    kimi = text_config(REAL_TARGETS["kimi-k2.5"])
    with pytest.raises(DrafterRefused, match="head dim 112: .* table_qk_norm_rope_, which needs a power of two .*"
                                             "set train.head_dim to 128"):
        drafter_config(settings("dflash", head_dim=112), kimi, "kimi-k2.5")
    with pytest.raises(DrafterRefused, match=r"head dim 96 \(the target's MLA heads are not GQA heads\): .* set "
                                             r"train.head_dim to one of them"):
        drafter_config(settings("eagle3-gqa", head_dim=96), kimi, "kimi-k2.5")
    assert drafter_config(settings("eagle3-gqa", head_dim=64), kimi, "kimi-k2.5").head_dim == 64


def test_a_rope_the_project_does_not_compute_as_sglang_does_is_refused_before_any_work():
    longrope = {**text_config(REAL_TARGETS["qwen3-8b"]), "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}
    for family in ("eagle3-gqa", "dflash"):
        with pytest.raises(DrafterRefused, match="rope_type 'longrope': .* computed here for default, linear, "
                                                 "llama3, yarn only"):
            drafter_config(settings(family), longrope, "a longrope target")


def test_tensor_parallel_sizes_the_draft_layers_cannot_split_are_refused():
    check_tensor_parallel(64, 8, 8, "Kimi-K2.5's drafter")
    check_tensor_parallel(64, 8, 16, "Kimi-K2.5's drafter")  # 8 KV heads, each on two ranks
    with pytest.raises(KernelRefusal, match="40 heads .* cannot be split over tensor parallelism 16"):
        check_tensor_parallel(40, 8, 16, "GLM-4.5's drafter")
    with pytest.raises(KernelRefusal, match="KV heads a multiple or a divisor of tp"):
        check_tensor_parallel(48, 6, 4, "a drafter")


def test_the_runs_tensor_parallelism_is_checked_before_any_work_on_each_attention_group():
    """A draft layer splits its heads over its attention-TP group: the whole
    TP group, or with data-parallel attention tp / dp ranks (SGLang runs the
    drafts there). GLM-4.5's 40 heads do not split over 16 ranks, but do over
    8 ranks of each of 2 attention groups; Kimi-K2.5's layout (TP 8, 8
    groups: one rank each) splits anything."""
    glm, kimi = text_config(REAL_TARGETS["glm-4.5"]), text_config(REAL_TARGETS["kimi-k2.5"])
    with pytest.raises(DrafterRefused, match=r"40 heads \(8 KV\) cannot be split over tensor parallelism 16: .*"
                                             r"choose train.head_dim"):
        drafter_config(settings("eagle3-gqa"), glm, "glm-4.5", server=ServerConfig(tp_size=16))
    drafter_config(settings("eagle3-gqa"), glm, "glm-4.5",
                   server=ServerConfig(tp_size=16, dp_size=2, dp_attention=True))
    for family in FAMILIES:
        drafter_config(settings(family), kimi, "kimi-k2.5", server=ServerConfig(tp_size=8, dp_size=8,
                                                                                dp_attention=True))
    with pytest.raises(DrafterRefused, match="over 2 attention groups"):
        drafter_config(settings("eagle3-gqa"), glm, "glm-4.5", server=ServerConfig(tp_size=32, dp_size=2,
                                                                                   dp_attention=True))


def test_a_drafter_of_another_layout_than_its_target_gets_a_draft_backend_on_blackwell_only():
    """There the target's backend is trtllm_mla (MLA targets) or trtllm_mha
    (GQA ones), each refusing the other layout's draft."""
    assert draft_attention_backend(True, False, (10, 0)) == "flashinfer"
    assert draft_attention_backend(False, True, (10, 0)) == "flashinfer"  # an MLA drafter of a Llama or Qwen3
    assert draft_attention_backend(True, False, (9, 0)) is None  # fa3 on Hopper takes both
    assert draft_attention_backend(True, True, (10, 0)) is None
    assert draft_attention_backend(False, False, (10, 0)) is None
    assert draft_attention_backend(True, False, None) is None
    assert MLA_DRAFTER == ARCHITECTURES["mla"]  # the launcher tells the layouts apart by it


@pytest.fixture(scope="module")
def kernels() -> dict:
    return run("tests.real_target_kernels", ["gqa_attention", "mla_attention", "dflash_qk_norm_rope",
                                             "dflash_head_dims"])


def one_ulp(out: dict) -> float:
    """A bf16 ulp of the output's magnitude (8 bits of mantissa)."""
    return 2 ** -7 * out["max_abs_out"]


def test_the_triton_attention_kernels_run_every_gqa_drafters_shape_in_bf16(kernels):
    """Decode and extend at each (query heads per KV head, head dim) the real
    targets' GQA and DFlash drafters have; against the CPU stand-ins: a bf16
    ulp each way, plus the kernel's bf16 softmax weights (p rounded before
    p @ v: 2^-8 of |v|), while a request one token short is far off."""
    seen = set()
    for shape, row in kernels["gqa_attention"].items():
        seen.update(row["targets"])
        for part in ("decode", "extend"):
            r = row[part]
            bound = 2 * one_ulp(r) + 2 ** -8 * r["max_abs_v"]
            assert r["finite"] and r["max_abs_diff"] <= bound, (shape, part, r)
            assert r["controls"]["seq_lens_minus_one"] > 10 * bound, (shape, part, r)
    assert seen == set(REAL_TARGETS)


def test_the_triton_mla_kernels_run_the_mla_drafters_latent(kernels):
    rows = kernels["mla_attention"]
    assert set(rows) == {"latent512-rope64"} and set(rows["latent512-rope64"]["targets"]) == {"deepseek-v3",
                                                                                               "kimi-k2.5"}
    decode, extend = rows["latent512-rope64"]["decode"], rows["latent512-rope64"]["extend"]
    assert decode["max_abs_diff"] <= 2 * one_ulp(decode) + 2 ** -8 * decode["max_abs_v"], decode
    assert extend["max_abs_diff"] <= 2 * one_ulp(extend) + 2 ** -8 * extend["max_abs_v"], extend


def test_dflashs_qk_norm_rope_kernel_computes_the_training_forwards_norm_and_rope_at_every_head_dim(kernels):
    """At each real target's DFlash head dim and rope: SGLang's fused kernel
    against tasks/train/dflash/model.py's q_norm, k_norm and rope on the same
    bf16 rows; ours rounds the norm and the rotation separately, the kernel
    once: two ulps. The rope one position on is far off."""
    rows = kernels["dflash_qk_norm_rope"]
    for name in REAL_TARGETS:
        r = rows[f"{name}/dflash"]
        assert r["max_abs_diff"] <= 2 * one_ulp(r) and r["v_untouched"], (name, r)
        assert r["control_one_position_on"] > 10 * one_ulp(r), (name, r)


def test_the_head_dims_derived_before_fail_to_compile_in_the_dflash_kernel(kernels):
    """Kimi-K2.5's 112 and DeepSeek-V3's 56, hidden // heads, what the
    project derived before tasks/train/layers/sizes.py."""
    for dim in (112, 56):
        assert "arange's range must be a power of 2" in kernels["dflash_qk_norm_rope"][f"old-d{dim}"]["error"]


def test_the_dflash_head_dim_rule_is_the_kernels(kernels):
    """Every head dim tried either runs or fails on the kernel's own rule
    (nothing else), and the project allows exactly the ones that run."""
    for dim, outcome in kernels["dflash_head_dims"].items():
        assert outcome == "runs" or "arange's range must be a power of 2" in outcome, (dim, outcome)
        try:
            check_dflash_head_dim(int(dim))
            allowed = True
        except KernelRefusal:
            allowed = False
        assert allowed == (outcome == "runs"), (dim, outcome)


def test_the_real_configs_are_the_published_ones_where_the_project_reads_them():
    """Guards on the test data itself: the keys whose absence matters."""
    assert "head_dim" not in text_config(REAL_TARGETS["deepseek-v3"])
    assert "head_dim" not in text_config(REAL_TARGETS["kimi-k2.5"])
    assert "head_dim" not in REAL_TARGETS["llama-3.1-8b"]
    assert json.loads(json.dumps(REAL_TARGETS)) == REAL_TARGETS  # as config.json holds them
