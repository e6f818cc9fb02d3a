"""An EAGLE-3 drafter's export: the drafter as SGLang loads it (`--speculative-draft-model-path`),
and reading an export back.

    <dir>/config.json         architectures: LlamaForCausalLMEagle3 (attention
                              gqa) or Eagle3DeepseekV2ForCausalLM (mla); the
                              target's sizes and rope, num_hidden_layers 1,
                              draft_vocab_size, eagle_config (aux layer ids,
                              as the target's SGLang class reads them), the
                              variant's flags (fc_norm, norm_output), and for
                              mla its five dims and rope_interleave
    <dir>/model.safetensors   fc, fc_norm.* (eagle3.1), midlayer.*, norm,
                              lm_head, d2t, t2d

What SGLang 0.5.23's two classes load is written down once, in SERVED: a
tensor they would skip (with at most a warning) or a parameter no tensor
fills (left as initialised) serves a drafter other than the trained one,
and the export refuses both, naming them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tasks.target.architectures import Architecture
from tasks.target.layers import AuxLayers
from tasks.target.embeddings import load_target_embeddings
from tasks.durable import replace_dir_durably
from tasks.train.eagle3.model import DrafterConfig, Eagle3Drafter, variant_named
from tasks.train.export import SIZE_KEYS, refuse_unserved
from tasks.train.layers.sizes import target_sizes
from tasks.train.eagle3.mla import MLA_DIMS
from tasks.train.layers.rope import rope_config
from tasks.train.vocab import DraftVocab

ARCHITECTURES = {"gqa": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}
# Target config keys copied as they are (the activation; token ids for the
# tokenizer side). The sizes are the drafter's (tasks/train/layers/sizes.py),
# the rope the one it was trained with (tasks/train/layers/rope.py rope_config).
_SHARED_CONFIG_KEYS = ("hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")
# The tensor names each SGLang class maps to a parameter of its model
# (llama_eagle3.py load_weights; kimi_k25_eagle3.py load_weights, which also
# fuses q_a_proj with kv_a_proj_with_mqa, in that order, and needs both),
# besides fc_norm.{i} (eagle3.1), d2t (its hot token ids) and t2d (skipped by
# both; kept for reading an export back).
_COMMON = ("fc.weight", "norm.weight", "lm_head.weight", "midlayer.input_layernorm.weight",
           "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
           "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
           "midlayer.self_attn.o_proj.weight")
SERVED = {
    "gqa": _COMMON + tuple(f"midlayer.self_attn.{p}_proj.weight" for p in "qkv"),
    "mla": _COMMON + tuple(f"midlayer.self_attn.{p}.weight" for p in (
        "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")),
}
_VOCAB_MAPS = ("d2t", "t2d")
_ATTENTION_PARTS = re.compile(r"^midlayer\.((?:q|k|v|o)_proj|q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|"
                              r"kv_a_layernorm|kv_b_proj)\.")
_MLP_PARTS = re.compile(r"^midlayer\.((?:gate|up|down)_proj)\.")


def export_name(name: str) -> str:
    """A drafter parameter's name in the checkpoint SGLang reads: the layer's
    attention under self_attn., its MLP under mlp. (SGLang maps midlayer to
    its layer and fuses q/k/v, gate/up and MLA's q_a/kv_a itself)."""
    name = _ATTENTION_PARTS.sub(r"midlayer.self_attn.\1.", name)
    return _MLP_PARTS.sub(r"midlayer.mlp.\1.", name)


def export_weights(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """Every trained tensor of the drafter, by its checkpoint name (the
    embeddings are not exported: SGLang shares the target's): the module's
    own tensors (load_exported copies into them)."""
    return {export_name(k): v for k, v in model.trained_tensors().items()}


def check_served(names, attention: str, num_aux: int, fc_norm: bool) -> None:
    """Refuse an export that SGLang's class for `attention` would not load
    whole."""
    want = set(SERVED[attention]) | set(_VOCAB_MAPS)
    if fc_norm:
        want |= {f"fc_norm.{i}.weight" for i in range(num_aux)}
    refuse_unserved(names, want, ARCHITECTURES[attention], "tasks/train/eagle3/export.py SERVED")


def export_config(model: Eagle3Drafter, layers: AuxLayers, architecture: Architecture, dtype: torch.dtype) -> dict:
    """`architecture`: the target's. SGLang hands the drafter's
    eagle_aux_hidden_state_layer_ids to the target's own class, and the
    DeepSeek-style ones read them in another convention: written as our
    "output of layer i" ids, a drafter trained on non-default layers would be
    fed other layers than it was trained on."""
    cfg = model.cfg
    config = {k: model.target_config[k] for k in _SHARED_CONFIG_KEYS if k in model.target_config}
    config.update({k: getattr(cfg, k) for k in SIZE_KEYS}, **rope_config(model.target_config))
    if cfg.attention == "mla":
        # SGLang's MLA layer reads the dims and the interleaving; its heads
        # are all query-and-key heads, whatever the target's KV heads.
        config.update(cfg.mla_dims, rope_interleave=cfg.rope_interleave, num_key_value_heads=cfg.num_attention_heads)
        config.pop("head_dim", None)
    config.update({
        "architectures": [ARCHITECTURES[cfg.attention]],
        # deepseek_v3: the config class transformers gives SGLang's MLA drafter
        # its MLA dims and rope through.
        "model_type": "deepseek_v3" if cfg.attention == "mla" else "llama",
        "num_hidden_layers": 1,
        "draft_vocab_size": model.cfg.draft_vocab_size,
        # SGLang would otherwise make lm_head the (full-vocab) embedding.
        "tie_word_embeddings": False,
        # The drafter has no biases whatever the target has (a Qwen2 target's
        # q/k/v do): SGLang would otherwise build bias parameters no weight fills.
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        # Written whatever the variant: an absent flag is SGLang's default today, not a promise.
        "fc_norm": model.cfg.fc_norm,
        "norm_output": model.cfg.norm_output,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": architecture.sglang_layer_ids(layers.sglang_ids),
            "use_aux_hidden_state": True,
            # The same tensors in the conventions that do not depend on the
            # target's class: outputs of decoder layers, and HF hidden_states
            # indices (vLLM/EAGLE's "input of layer i").
            "layer_output_ids": list(layers.sglang_ids),
            "hf_hidden_state_indices": list(layers.hf_hidden_state_indices),
        },
    })
    return config


def export_drafter(model: Eagle3Drafter, layers: AuxLayers, out_dir: Path, *, architecture: Architecture,
                   dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors`, atomically (a temp dir renamed
    into place), loadable by `--speculative-draft-model-path out_dir` next to
    a target of `architecture`."""
    out_dir = Path(out_dir)
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
               for k, v in export_weights(model).items()}
    check_served(tensors, model.cfg.attention, model.cfg.num_aux, model.cfg.fc_norm)

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = export_config(model, layers, architecture, dtype)
        if extra:
            config["eagle3_training"] = extra
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return replace_dir_durably(out_dir, fill)


def variant_of(config: dict) -> str:
    """The variant an exported config.json describes, as SGLang reads it
    (`use_aux_norm` is its older name for fc_norm)."""
    return variant_named(fc_norm=bool(config.get("fc_norm") or config.get("use_aux_norm")),
                         norm_output=bool(config.get("norm_output")))


def attention_of(config: dict) -> str:
    """The drafter layout an exported config.json names."""
    for attention, architecture in ARCHITECTURES.items():
        if config.get("architectures") == [architecture]:
            return attention
    raise ValueError(f"drafter config with architectures {config.get('architectures')}: not one this project "
                     f"exports ({', '.join(ARCHITECTURES.values())})")


def load_exported(out_dir: Path, target_path: Path) -> Eagle3Drafter:
    """Read an exported drafter back (embeddings from the target)."""
    out_dir = Path(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    target_config = target_sizes(target_path)
    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    vocab = DraftVocab.from_d2t(tensors["d2t"], config["vocab_size"])
    variant = variant_of(config)
    num_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    attention = attention_of(config)
    mla_dims = {k: config[k] for k in MLA_DIMS} if attention == "mla" else None
    cfg = DrafterConfig.from_target(target_config, vocab.size, num_aux, variant, attention, mla_dims,
                                    config.get("head_dim") if attention == "gqa" else None)
    model = Eagle3Drafter(cfg, target_config)
    embed, _ = load_target_embeddings(target_path)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        names = export_weights(model)
        for k, p in names.items():
            p.copy_(tensors[k].to(p.dtype))
    return model
