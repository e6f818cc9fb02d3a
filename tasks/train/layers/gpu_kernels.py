"""What SGLang 0.5.23's GPU kernels take of a drafter, written down once,
each rule with the file and line it comes from (paths under site-packages),
for bf16 on Hopper (sm90) and Blackwell (sm100).

Which backend a draft gets:
- EAGLE-3 (either layout) has no draft backend of its own unless
  --speculative-draft-attention-backend names one: it runs on the target's
  (model_executor/model_runner_components/attention_backend_setup.py:203). That is fa3
  on Hopper for GQA and MLA targets, and on Blackwell flashinfer or
  trtllm_mha for GQA targets and trtllm_mla for DeepSeek-V3 and Kimi-K2.5
  (arg_groups/model_override_base.py:305-340,
  arg_groups/model_overrides/deepseek_v2.py:179-188). trtllm_mla refuses a
  draft that is not MLA (attention_registry.py:94-97) and trtllm_mha one
  that is (:277-280): a drafter whose layout is not its target's needs a
  draft backend named on Blackwell (the launcher names flashinfer, which
  builds either: tasks/server/launch.py draft_attention_backend).
- DFlash resolves its own among flashinfer, fa3, fa4, triton, trtllm_mha
  (arg_groups/speculative_hook.py:886-987, choices.py:103-111): fa3 on
  Hopper, fa4 or flashinfer on Blackwell.

A drafter whose heads are the target's own shape runs wherever the target
runs. Heads the project shapes itself (tasks/train/layers/sizes.py, or
train.head_dim) must suit every backend a draft can get:
- FlashInfer's FA2 prefill and tensor-core decode, which SGLang forces
  (layers/attention/flashinfer_backend.py:335-336): head_dim / 16 >= 4
  (flashinfer/data/include/flashinfer/attention/prefill.cuh:385, refused at
  run time at :2844-2848), loads in 64-column steps (:1056, a bf16 head dim
  not a multiple of 64 computes wrongly without an error);
- fa3: at most 256, a multiple of 8 (sgl_kernel/flash_ops.abi3.so, a
  compiled library: its checks' messages "at most" and "head_size should be
  a multiple of"; SGLang itself checks nothing, flashattention_backend.py:281-289);
- fa4 on sm100: 8-128 in multiples of 8, or 256 with v 256
  (kernels/ops/attention/flash_attn/cute/interface.py:119-154);
- triton: any (decode_attention.py:293-294 and extend_attention.py:501 mask
  a power-of-two block).
  Together: 64, 128 or 256 (GQA_HEAD_DIMS).
- DFlash in bf16 runs `table_qk_norm_rope_` on every layer
  (models/dflash.py:283-289,383), whose `tl.arange(0, D)` needs a power of
  two (kernels/ops/attention/table_qk_norm_rope.py:24-25): whatever the
  target, a DFlash head dim is a power of two.
- MLA: FlashMLA takes only a 576-wide key of 512 latent + 64 rope and a
  512-wide value (flash_mla/_C_legacy.abi3.so, compiled: "Only head_size_k
  == 576 is supported", "Only head_size_v == 512"); trtllm_mla and
  cutedsl_mla (512, 64), (256, 64) or (512, 0) (flashinfer/mla/_core.py:787-806);
  fa4's MLA exactly (512, 64) (interface.py:1019-1020); Triton's MLA decode
  576 or 288 only (decode_attention.py:826-835, another width fails to
  compile, seen under the interpreter). An MLA drafter with dims other
  than its target's must have the DeepSeek shape (MLA_SHAPE), which fits
  all of them: its draft prefill may take the MHA path with q/k of
  nope + rope = 192 and v 128 (models/deepseek_common/
  attention_backend_handler.py:108-140), a pair fa3 compiles and fa4 takes
  (flash_attn/cute/interface.py:123).
- Tensor parallelism: a draft layer splits its heads over its TP group and
  asserts they divide (llama.py:181-189, dflash.py:213-229,
  deepseek_v2.py:2051-2057); with data-parallel attention that group is each
  attention group's share of the TP ranks (the draft models declare
  SINGLE_GROUP, llama_eagle3.py:273, dflash.py:680, and
  speculative/draft_parallel.py:53-66 runs them on the attention-TP group).
tests/test_real_targets.py holds every real target's drafters against these
rules and runs the Triton kernels on their shapes under the interpreter.
"""
from __future__ import annotations

from tasks.train.layers.sizes import is_power_of_two

# Head dims every GQA attention backend a draft can get takes.
GQA_HEAD_DIMS = (64, 128, 256)
# The MLA shape every GPU MLA backend takes (DeepSeek-V3's and Kimi-K2.5's).
MLA_SHAPE = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


class KernelRefusal(ValueError):
    """A drafter that SGLang's GPU kernels would refuse, or compute wrongly."""


def target_head_dim(target_config: dict) -> int | None:
    """The head dim the target's own GQA attention runs at (None for an MLA
    target, whose config.json has none)."""
    if target_config.get("head_dim"):
        return int(target_config["head_dim"])
    if target_config.get("kv_lora_rank"):
        return None
    return target_config["hidden_size"] // target_config["num_attention_heads"]


def check_gqa_heads(heads: int, kv_heads: int, head_dim: int, target_config: dict, what: str) -> None:
    """A GQA attention's heads (EAGLE-3's gqa layer, DFlash's layers): the
    target's own shape runs wherever the target does; another must be one
    every draft backend takes."""
    if heads % kv_heads:
        raise KernelRefusal(f"{what}: {heads} heads over {kv_heads} KV heads: every attention kernel needs the heads "
                            f"to be a multiple of the KV heads")
    own = target_head_dim(target_config)
    if head_dim != own and head_dim not in GQA_HEAD_DIMS:
        mine = f"the target's is {own}" if own else "the target's MLA heads are not GQA heads"
        raise KernelRefusal(f"{what}: head dim {head_dim} ({mine}): SGLang's GPU attention backends "
                            f"take {', '.join(map(str, GQA_HEAD_DIMS))} in every case (FlashInfer needs a multiple of "
                            f"64, fa4 on Blackwell at most 128 or 256); set train.head_dim to one of them")


def check_dflash_head_dim(head_dim: int) -> None:
    if not is_power_of_two(head_dim):
        raise KernelRefusal(f"a DFlash drafter with head dim {head_dim}: in bf16 SGLang runs every layer's q/k norm "
                            f"and rope through the Triton kernel table_qk_norm_rope_, which needs a power of two "
                            f"(tl.arange(0, {head_dim}) does not compile); set train.head_dim to 128 (or 64, 256)")


def check_mla_dims_served(dims: dict, target_config: dict) -> None:
    """An MLA drafter's dims: the target's own (served by the target's MLA
    backend), or MLA_SHAPE."""
    own = all(target_config.get(k) == dims[k] for k in MLA_SHAPE)
    if not own and any(dims[k] != v for k, v in MLA_SHAPE.items()):
        given = ", ".join(f"{k} {dims[k]}" for k in MLA_SHAPE)
        want = ", ".join(f"{k} {v}" for k, v in MLA_SHAPE.items())
        raise KernelRefusal(f"an MLA drafter with {given}: SGLang's GPU MLA kernels (FlashMLA, trtllm_mla, fa4, "
                            f"Triton's MLA decode) take a 512 latent with 64 rope dims; set train.mla_dims to {want} "
                            f"(q_lora_rank is free), or leave them to the target's")


def check_tensor_parallel(heads: int, kv_heads: int | None, tp: int, what: str) -> None:
    """Heads split over `tp` ranks as SGLang's draft layers assert."""
    wrong = heads % tp or (kv_heads is not None and (kv_heads % tp if kv_heads >= tp else tp % kv_heads))
    if wrong:
        raise KernelRefusal(f"{what}: {heads} heads ({kv_heads} KV) cannot be split over tensor parallelism {tp}: "
                            f"SGLang asserts heads % tp == 0 and KV heads a multiple or a divisor of tp; choose "
                            f"train.head_dim (the heads follow it) or the server's parallelism so that they split")
