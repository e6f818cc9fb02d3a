"""Export: the drafter as SGLang loads it (`--speculative-draft-model-path`),
and reading an export back.

    <dir>/config.json         architectures ["LlamaForCausalLMEagle3"], the
                              target's sizes and rope, num_hidden_layers 1,
                              draft_vocab_size, eagle_config (aux layer ids,
                              as the target's SGLang class reads them)
                              and the variant's flags (fc_norm, norm_output)
    <dir>/model.safetensors   fc, fc_norm.* (eagle3.1), midlayer.*, norm,
                              lm_head, d2t, t2d
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tasks.target.architectures import Architecture
from tasks.target.layers import AuxLayers
from tasks.target.embeddings import load_target_embeddings
from tasks.train.drafter import DrafterConfig, Eagle3Drafter, target_sizes, variant_named
from tasks.train.vocab import DraftVocab

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Target config keys the drafter must share so SGLang builds the same shapes,
# rotary embedding and activation.
_SHARED_CONFIG_KEYS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_parameters", "rope_theta",
    "rope_scaling", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id",
)


def export_weights(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """SGLang's names: it maps `midlayer` to `layers.0` and fuses q/k/v and
    gate/up itself; embeddings are not exported (served from the target)."""
    m = model.midlayer
    out = {
        "fc.weight": model.fc.weight,
        "norm.weight": model.norm.weight,
        "lm_head.weight": model.lm_head.weight,
        "d2t": model.d2t,
        "t2d": model.t2d,
    }
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[f"midlayer.self_attn.{name}.weight"] = getattr(m, name).weight
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[f"midlayer.mlp.{name}.weight"] = getattr(m, name).weight
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"midlayer.{name}.weight"] = getattr(m, name).weight
    for i, norm in enumerate(model.fc_norm or ()):
        out[f"fc_norm.{i}.weight"] = norm.weight
    return out


def export_config(model: Eagle3Drafter, layers: AuxLayers, architecture: Architecture, dtype: torch.dtype) -> dict:
    """`architecture`: the target's. SGLang hands the drafter's
    eagle_aux_hidden_state_layer_ids to the target's own class, and the
    DeepSeek-style ones read them in another convention: written as our
    "output of layer i" ids, a drafter trained on non-default layers would be
    fed other layers than it was trained on."""
    config = {k: model.target_config[k] for k in _SHARED_CONFIG_KEYS if k in model.target_config}
    config.update({
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
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
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
               for k, v in export_weights(model).items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = export_config(model, layers, architecture, dtype)
    if extra:
        config["eagle3_training"] = extra
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _fsync_tree(tmp)
    _swap_in(tmp, out_dir)
    return out_dir


def _fsync_tree(directory: Path) -> None:
    for path in [*directory.iterdir(), directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _swap_in(new: Path, out_dir: Path) -> None:
    """Put `new` at `out_dir`; the old export is deleted only once the new
    one is in place, so a crash never leaves neither. Linux exchanges the two
    atomically; elsewhere the old one is first renamed aside (a crash in that
    instant leaves it there, whole, under .<name>.old-<pid>)."""
    if not out_dir.exists():
        os.replace(new, out_dir)
        return
    if _exchange(new, out_dir):
        shutil.rmtree(new)  # now the old export
        return
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    os.replace(out_dir, old)
    os.replace(new, out_dir)
    shutil.rmtree(old)


def _exchange(a: Path, b: Path) -> bool:
    """renameat2(RENAME_EXCHANGE); False where the OS or filesystem lacks it."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def variant_of(config: dict) -> str:
    """The variant an exported config.json describes, as SGLang reads it
    (`use_aux_norm` is its older name for fc_norm)."""
    return variant_named(fc_norm=bool(config.get("fc_norm") or config.get("use_aux_norm")),
                         norm_output=bool(config.get("norm_output")))


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
    cfg = DrafterConfig.from_target(target_config, vocab.size, num_aux, variant)
    model = Eagle3Drafter(cfg, target_config)
    embed, _ = load_target_embeddings(target_path)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        names = export_weights(model)
        for k, p in names.items():
            p.copy_(tensors[k].to(p.dtype))
    return model
