"""Export: the DFlash drafter as SGLang 0.5.23 loads it
(`--speculative-algorithm DFLASH --speculative-draft-model-path <dir>`), and
reading an export back.

    <dir>/config.json         architectures DFlashDraftModel, model_type qwen3
                              (SGLang registers no dflash type; transformers
                              builds a Qwen3Config), the target's sizes and
                              rope, num_hidden_layers N, layer_types all
                              full_attention (non-causal in SGLang), and
                              dflash_config {block_size, target_layer_ids,
                              num_target_layers, mask_token, mask_token_id}
                              (dflash_utils.parse_dflash_draft_config)
    <dir>/model.safetensors   fc, hidden_norm, norm, layers.{i}.*

SGLang's DFlashDraftModel.load_weights skips any tensor it has no
parameter for, without a word (dflash.py:945), and leaves a parameter no
tensor fills as initialised: the export refuses both, naming them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tasks.target.embeddings import load_target_embeddings
from tasks.durable import replace_dir_durably
from tasks.train.dflash.model import DFlashConfig, DFlashDrafter
from tasks.train.dflash.target import DEFAULT_MASK_TOKEN, check_target_layer_ids
from tasks.train.layers.sizes import target_sizes
from tasks.train.export import SIZE_KEYS, refuse_unserved

ARCHITECTURE = "DFlashDraftModel"

# The checkpoint names DFlashDraftModel.load_weights maps to its parameters
# (dflash.py:886-999: q/k/v_proj into qkv_proj, gate/up_proj into
# gate_up_proj, the rest by name), per decoder layer and once.
LAYER_TENSORS = tuple(f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")) \
    + tuple(f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")) \
    + ("input_layernorm.weight", "post_attention_layernorm.weight")
MODEL_TENSORS = ("fc.weight", "hidden_norm.weight", "norm.weight")
# Target config keys copied as they are, for the tokenizer side; the sizes
# are the drafter's own (tasks/train/layers/sizes.py).
_SHARED_CONFIG_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def is_dflash(config: dict) -> bool:
    """Whether an exported drafter's config.json is a DFlash drafter's (else EAGLE-3's)."""
    return config.get("architectures") == [ARCHITECTURE]


def served_tensors(num_layers: int) -> set[str]:
    return set(MODEL_TENSORS) | {f"layers.{i}.{t}" for i in range(num_layers) for t in LAYER_TENSORS}


def check_served(names, num_layers: int) -> None:
    """Refuse an export SGLang's DFlashDraftModel would not load whole."""
    refuse_unserved(names, served_tensors(num_layers), ARCHITECTURE, "tasks/train/dflash/export.py")


def dflash_config(model: DFlashDrafter, target_layer_ids, *, target_config: dict, block_size: int,
                  mask_token_id: int, mask_token: str, dtype: torch.dtype) -> dict:
    cfg = model.cfg
    config = {k: target_config[k] for k in _SHARED_CONFIG_KEYS if target_config.get(k) is not None}
    config.update({k: getattr(cfg, k) for k in SIZE_KEYS}, **dict(cfg.rope))
    config.update({
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu",
        # The drafter has no biases, whatever the target has.
        "attention_bias": False,
        # Written, not left to defaults: full attention layers without
        # is_causal are SGLang's non-causal ENCODER_ONLY (dflash.py:166-191),
        # the rope is neox (the rotate-half one trained here).
        "layer_types": ["full_attention"] * cfg.num_layers,
        "use_sliding_window": False,
        "rope_is_neox_style": True,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dflash_config": {
            "block_size": int(block_size),
            # SGLang's ids: output of target layer i (it captures at i + 1,
            # llama.py:953), concatenated in ascending order.
            "target_layer_ids": [int(i) for i in target_layer_ids],
            # The target's depth: SGLang checks every id is below it.
            "num_target_layers": int(target_config["num_hidden_layers"]),
            "mask_token": mask_token,
            "mask_token_id": int(mask_token_id),
        },
    })
    return config


def export_dflash(model: DFlashDrafter, target_layer_ids, out_dir: Path, *, target_config: dict, block_size: int,
                  mask_token_id: int, mask_token: str = DEFAULT_MASK_TOKEN, dtype: torch.dtype = torch.bfloat16,
                  extra: dict | None = None) -> Path:
    """Write config.json + model.safetensors atomically. `mask_token`,
    `mask_token_id`: as `dflash_target.mask_token_for` chose them (SGLang
    checks the id against the target vocabulary and the tokenizer)."""
    ids = check_target_layer_ids(target_layer_ids, target_config["num_hidden_layers"])
    if len(ids) != model.cfg.num_context:
        raise ValueError(f"target_layer_ids {list(ids)}: {len(ids)} layers, but the drafter's fc reads "
                         f"{model.cfg.num_context} (SGLang would refuse fc.weight's shape)")
    if block_size < 2:
        raise ValueError(f"block_size {block_size}: a block is the bonus token and at least one draft")
    if not 0 <= mask_token_id < model.cfg.vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the target vocabulary "
                         f"(0..{model.cfg.vocab_size - 1}): SGLang embeds it with the target's embedding and "
                         f"refuses it")
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.trained_tensors().items()}
    check_served(tensors, model.cfg.num_layers)
    config = dflash_config(model, ids, target_config=target_config, block_size=block_size,
                           mask_token_id=mask_token_id, mask_token=mask_token, dtype=dtype)
    if extra:
        config["dflash_training"] = extra

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return replace_dir_durably(out_dir, fill)


def load_dflash(out_dir: Path, target_path: Path) -> DFlashDrafter:
    """Read an exported drafter back, with the target's embedding and head;
    refused if it was exported for a target of other sizes."""
    out_dir = Path(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    if not is_dflash(config):
        raise ValueError(f"{out_dir}: architectures {config.get('architectures')}, not [{ARCHITECTURE!r}]")
    target_config = target_sizes(target_path)
    layer_ids = config["dflash_config"]["target_layer_ids"]
    cfg = DFlashConfig.from_target(target_config, config["num_hidden_layers"], len(layer_ids), config.get("head_dim"))
    differ = [f"{k} {config.get(k)} (target {getattr(cfg, k)})" for k in
              ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "vocab_size") if config.get(k) != getattr(cfg, k)]
    if differ:
        raise ValueError(f"{out_dir} was exported for another target than {target_path}: {', '.join(differ)}")
    model = DFlashDrafter(cfg)
    embed, head = load_target_embeddings(target_path)
    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    check_served(tensors, cfg.num_layers)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        for k, p in model.trained_tensors().items():
            p.copy_(tensors[k].to(p.dtype))
    return model
