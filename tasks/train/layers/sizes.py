"""A drafter layer's sizes, derived from its target's config: both drafter
families (EAGLE-3's GQA layer, DFlash's layers) take them.

The hidden size, MLP width, norm epsilon and vocabulary are the target's.
The attention heads are the target's too, unless the target's config gives
no power-of-two head dim to copy: DeepSeek-V3's and Kimi-K2.5's config.json
have no `head_dim` (their MLA heads are 192 wide for q/k and 128 for v),
and hidden / heads is 56 and 112 there, which SGLang's GPU kernels refuse
(tasks/train/layers/gpu_kernels.py). A drafter of such a target keeps the target's
head count (it then divides any tensor-parallel size the target runs at, as
SGLang asserts for the draft's heads, llama.py:183 and dflash.py:213) with
heads of 128 and 8 KV heads, as the published drafters of Kimi-K2.5 do
(TorchSpec's kimi_k25_eagle3.json: 64 heads of 128; SpecForge's Kimi DFlash
drafter: 64 heads of 128, 8 KV heads). train.head_dim chooses another.
An EAGLE-3 drafter's heads also fill the hidden size exactly (transformers'
LlamaConfig refuses others), so GLM-4.5's drafter has 40 heads of 128.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.target.architectures import architecture_of, read_config

# A drafter's head dim where the target's config has none SGLang's kernels take.
DERIVED_HEAD_DIM = 128
# KV heads of a drafter whose heads are not the target's own shape.
DERIVED_KV_HEADS = 8


def target_sizes(target_path: Path) -> dict:
    """The target config section with its text model's sizes (the drafter
    shares them)."""
    config = read_config(target_path)
    return architecture_of(config).sizes(config)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def attention_heads(target_config: dict, head_dim: int | None = None, whole_heads: bool = False
                    ) -> tuple[int, int, int]:
    """(heads, KV heads, head dim) of a drafter's GQA attention for this
    target: the target's own where its head dim is given or hidden / heads is
    a power of two, else heads of DERIVED_HEAD_DIM (or the given `head_dim`)
    with the target's head count and at most DERIVED_KV_HEADS KV heads.
    `whole_heads`: the hidden size must be a multiple of the heads (SGLang
    reads an EAGLE-3 drafter's config through transformers' LlamaConfig,
    which refuses one that is not, configuration_llama.py:97): GLM-4.5's 96
    heads of 128 over a hidden 5120 become 40."""
    hidden = int(target_config["hidden_size"])
    heads = int(target_config["num_attention_heads"])
    kv = int(target_config.get("num_key_value_heads") or heads)
    own = target_config.get("head_dim")
    if own is None and hidden % heads == 0 and is_power_of_two(hidden // heads):
        own = hidden // heads
    head_dim = int(head_dim or own or DERIVED_HEAD_DIM)
    if head_dim == own and not (whole_heads and hidden % heads):
        return heads, kv, head_dim
    if whole_heads and hidden % heads:
        if hidden % head_dim:
            raise ValueError(f"head dim {head_dim} does not divide the hidden size {hidden}, and SGLang's LlamaConfig "
                             f"needs whole heads: set train.head_dim to a divisor of {hidden}")
        heads = hidden // head_dim
    kv = min(kv, DERIVED_KV_HEADS, heads)
    while heads % kv:
        kv -= 1
    return heads, kv, head_dim


@dataclass(frozen=True)
class LayerSizes:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int

    @staticmethod
    def of(target_config: dict, kv_heads: int | None = None, head_dim: int | None = None,
           whole_heads: bool = False) -> dict:
        """The drafter's sizes for this target, as keyword arguments
        (`kv_heads`: MLA's, whose heads all carry keys; `head_dim`: the
        user's train.head_dim; `whole_heads`: attention_heads')."""
        heads, kv, dim = attention_heads(target_config, head_dim, whole_heads)
        return dict(hidden_size=target_config["hidden_size"], num_attention_heads=heads,
                    num_key_value_heads=kv_heads or kv, head_dim=dim,
                    intermediate_size=target_config["intermediate_size"],
                    rms_norm_eps=target_config["rms_norm_eps"], vocab_size=target_config["vocab_size"])
