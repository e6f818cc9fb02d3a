"""Per-architecture knowledge, in one table.

SGLang's model classes differ in where the decoder stack sits (the module
the capture hook attaches to), in which checkpoint tensors hold the token
embedding and the head, in where the config keeps the sizes, and in how
they number aux layers. Everything that depends on the architecture reads it
from the entry for `config.json`'s `architectures[0]`, resolved once per run
and recorded in the store's manifest.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from tasks.failures import Permanent
from tasks.target.layers import default_aux_layer_ids


class UnsupportedArchitecture(Permanent, ValueError):
    pass


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json architectures[0]
    # Exact module name (over SGLang's named_modules()) of the decoder stack,
    # whose output in capture mode is (final, aux).
    decoder_stack: str
    embed_weight: str  # checkpoint tensor of the token embedding
    head_weight: str  # checkpoint tensor of the lm_head (absent when tied)
    # What the decoder stack returns as its last hidden state.
    final_state: str = "post-norm"
    # Config section holding num_hidden_layers, hidden_size, vocab_size, ...
    # (None: the top level).
    text_config: str | None = None

    # How this class's set_eagle3_layers_to_capture reads explicit ids:
    # "plus_one" (Llama, Qwen, GLM, gpt-oss: layers_to_capture = id + 1,
    # i.e. "output of layer id") or "deepseek" (+1 only when the first id is
    # 1, otherwise the ids are layers_to_capture themselves).
    layer_id_rule: str = "plus_one"
    # On a CPU, the attention backend this class needs from SGLang, with the
    # plain-PyTorch kernels of tasks/server/cpu/spec_ops.py behind it (None:
    # SGLang's default torch_native). MLA needs "intel_amx": torch_native
    # has no MLA path and fails on the latent KV cache.
    cpu_attention_backend: str | None = None
    # The checkpoints ship their own tokenizer/processor code (Kimi-K2.5's
    # tiktoken tokenizer and media processor): SGLang and transformers load
    # them only with trust_remote_code.
    remote_code: bool = False
    # The one compute dtype SGLang runs this class in (None: any). Its
    # gpt-oss keeps attention weights in bf16 whatever --dtype says, so
    # float32 fails at the first forward ("mat1 and mat2 must have the same
    # dtype").
    only_dtype: str | None = None

    def sizes(self, config: dict) -> dict:
        """The config section that holds the text model's sizes."""
        return config[self.text_config] if self.text_config else config

    def default_aux_layers(self, num_hidden_layers: int) -> tuple[int, ...]:
        """Our default aux layers, as "output of decoder layer i" ids."""
        return default_aux_layer_ids(num_hidden_layers)

    def sglang_layer_ids(self, ids: Sequence[int]) -> list[int]:
        """Our "output of layer i" ids as this class's
        --return-aux-hidden-state-layer-ids must be given them, so that its
        layers_to_capture (capture entering layer j = output of layer j-1)
        is [i + 1 for i in ids] on every architecture."""
        ids = [int(i) for i in ids]
        if self.layer_id_rule == "plus_one":
            return ids
        if self.layer_id_rule == "deepseek":
            if ids[0] == 1:
                return ids  # shifted by SGLang itself
            if ids[0] == 0:
                raise ValueError(f"{self.name}: SGLang cannot capture the output of layer 0 with explicit ids "
                                 "(it reads a first id of 1 as 'output of layer 1'); choose aux layers >= 1")
            return [i + 1 for i in ids]
        raise ValueError(f"unknown layer id rule {self.layer_id_rule!r}")

    @property
    def weights_prefix(self) -> str:
        """What the text model's checkpoint tensors are prefixed with in this
        class's checkpoints ("" for plain causal LMs)."""
        return self.embed_weight[: -len("model.embed_tokens.weight")]

    def as_record(self) -> dict:
        """What the store's manifest records: what the stored states mean.
        How a server is run on a CPU is not part of it, so a store's identity
        does not change when that does."""
        record = asdict(self)
        record.pop("cpu_attention_backend")
        record.pop("remote_code")
        record.pop("only_dtype")
        return record


def _causal_lm(name: str, **kw) -> Architecture:
    """The common layout: decoder stack `model`, embedding
    `model.embed_tokens`, head `lm_head`."""
    return Architecture(name=name, decoder_stack="model", embed_weight="model.embed_tokens.weight",
                        head_weight="lm_head.weight", **kw)


LLAMA = _causal_lm("LlamaForCausalLM")
QWEN3 = _causal_lm("Qwen3ForCausalLM")
QWEN3_MOE = _causal_lm("Qwen3MoeForCausalLM")
GLM4_MOE = _causal_lm("Glm4MoeForCausalLM")
GPT_OSS = _causal_lm("GptOssForCausalLM", cpu_attention_backend="intel_amx",  # sinks + sliding window
                     only_dtype="bfloat16")
DEEPSEEK_V3 = _causal_lm("DeepseekV3ForCausalLM", layer_id_rule="deepseek", cpu_attention_backend="intel_amx")
# Kimi-K2.5 wraps the DeepSeek-V3 text model with a vision tower: the decoder
# stack is language_model.model (its `model` attribute is a property that
# never appears in named_modules(), so a hook on "model" matches nothing),
# the text model's weights sit under language_model., and its sizes under
# text_config.
KIMI_K25 = Architecture(name="KimiK25ForConditionalGeneration", decoder_stack="language_model.model",
                        embed_weight="language_model.model.embed_tokens.weight",
                        head_weight="language_model.lm_head.weight", text_config="text_config",
                        layer_id_rule="deepseek", cpu_attention_backend="intel_amx", remote_code=True)

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a for a in (LLAMA, QWEN3, QWEN3_MOE, GLM4_MOE, GPT_OSS, DEEPSEEK_V3, KIMI_K25)}


def read_config(model_path: Path) -> dict:
    return json.loads((Path(model_path) / "config.json").read_text())


def architecture_of(config: dict) -> Architecture:
    """The entry for a checkpoint's config (its `architectures[0]`)."""
    names = config.get("architectures") or []
    if not names:
        raise UnsupportedArchitecture("config.json names no architecture (`architectures` is missing or empty)")
    arch = ARCHITECTURES.get(names[0])
    if arch is None:
        raise UnsupportedArchitecture(
            f"architecture {names[0]!r} is not supported for capture; supported: {sorted(ARCHITECTURES)}")
    return arch


def architecture_at(model_path: Path) -> Architecture:
    return architecture_of(read_config(model_path))


def load_tokenizer(model_path):
    """The target's tokenizer, with its own code where its architecture ships
    some (the one place that decides it)."""
    from transformers import AutoTokenizer

    try:
        remote = architecture_at(Path(model_path)).remote_code
    except (OSError, ValueError):
        remote = False
    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=remote)
