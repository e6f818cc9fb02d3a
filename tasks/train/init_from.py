"""`train.init_from`: a training that starts from a drafter exported before
(an earlier run's drafter/, or a published one in SGLang's EAGLE-3 layout)
instead of random weights.

What the drafter was trained against must be what this run trains it
against, or the starting weights mean nothing here (and SGLang, serving the
result, would feed it other states than it learned on): the same target
(its sizes and vocabulary; the weights' fingerprint where the export
recorded it, a warning where not), the same split into heads, the same aux
layers, the same layout, variant and draft vocabulary size. Each is checked
before anything is trained and refused naming what differs (another rope
is a warning: a worse start, not wrong weights). The run keeps the drafter's vocabulary map (d2t): its
lm_head rows are those tokens.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from tasks.target.architectures import Architecture
from tasks.target.layers import AuxLayers, default_aux_layer_ids
from tasks.train.config import DrafterRefused, TrainConfig
from tasks.train.eagle3.model import DrafterConfig, Eagle3Drafter
from tasks.train.eagle3.export import attention_of, export_weights, variant_of
from tasks.train.layers.rope import rope_parameters
from tasks.train.record import TARGET_WEIGHTS
from tasks.train.vocab import DraftVocab

logger = logging.getLogger("eagle3.training")


class InitRefused(DrafterRefused):
    """train.init_from names a drafter this run cannot start from."""


def _refuse(path: Path, what: str) -> InitRefused:
    return InitRefused(f"train.init_from {path}: {what}; give a drafter exported for this target and store, or "
                       f"leave init_from unset to start from random weights")


def _check_heads(path: Path, config: dict, cfg: TrainConfig, target_config: dict, num_aux: int) -> None:
    """Refused: tensors of the same shapes split into other heads (8 of 64
    or 16 of 32), which would load and mean nothing. Warned: another rope,
    a worse start but no wrong weights (training turns by the target's, and
    the export writes it)."""
    try:
        ours = DrafterConfig.from_target(target_config, cfg.draft_vocab_size, num_aux, cfg.variant, cfg.attention,
                                         cfg.mla_dims, cfg.head_dim)
    except ValueError:
        return  # build_drafter refuses this run's own settings, naming why
    # SGLang's MLA layer reads neither head_dim nor num_key_value_heads
    # (transformers' DeepseekV3Config writes qk_rope_head_dim as head_dim).
    keys = ("num_attention_heads",) if ours.attention == "mla" else (
        "num_attention_heads", "num_key_value_heads", "head_dim")
    differ = [f"{k} {config[k]} (this run's {getattr(ours, k)})" for k in keys
              if k in config and config[k] != getattr(ours, k)]
    if differ:
        raise _refuse(path, f"its attention splits into other heads: {', '.join(differ)}")
    if any(k in config for k in ("rope_theta", "rope_scaling", "rope_parameters")):
        theirs, mine = rope_parameters(config), rope_parameters(target_config)
        if theirs != mine:
            logger.warning("train.init_from %s: trained with the rope %s, where this run turns by the target's %s: "
                           "a worse start, trained to the target's rope from here", path, theirs, mine)


def read_init(path: str | Path, cfg: TrainConfig, target_config: dict, layers: AuxLayers,
              architecture: Architecture, manifest: dict) -> tuple[DraftVocab, dict[str, torch.Tensor]]:
    """The exported drafter at `path`, checked against this run (its
    settings `cfg`, the target's text config, the aux layers it reads, the
    store's `manifest`): its vocabulary and its tensors by export name."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise _refuse(path, "no config.json and model.safetensors there (an exported drafter's folder holds both)")
    config = json.loads((path / "config.json").read_text())
    try:
        attention = attention_of(config)
    except ValueError as e:
        raise _refuse(path, str(e)) from None
    if (attention, variant_of(config)) != (cfg.attention, cfg.variant):
        raise _refuse(path, f"a {variant_of(config)} drafter with {attention} attention, where this run trains "
                            f"{cfg.variant} with {cfg.attention} (train.variant, train.attention)")
    for key in ("vocab_size", "hidden_size"):
        if config.get(key) != target_config.get(key):
            raise _refuse(path, f"made for a target with {key} {config.get(key)}, where this target has "
                                f"{target_config.get(key)}")
    _check_heads(path, config, cfg, target_config, len(layers.sglang_ids))
    recorded = config.get("eagle3_training", {}).get(TARGET_WEIGHTS)
    store_weights = manifest.get("target", {}).get("weights_sha256")
    if recorded and store_weights and recorded != store_weights:
        raise _refuse(path, f"trained on a target whose weights fingerprint is {recorded[:12]}..., where the store "
                            f"was captured from {store_weights[:12]}... (other weights of the same shapes)")
    if not (recorded and store_weights):
        # A published drafter records none: a base model and its fine-tune have the same sizes.
        logger.warning("train.init_from %s: %s no target weights fingerprint, so only the target's sizes are "
                       "checked: make sure it was trained for %s", path,
                       "the drafter records" if not recorded else "the store records", manifest.get("target", {})
                       .get("name", "this target"))
    eagle = config.get("eagle_config", {})
    # Ours also write the layers in a convention no target class changes
    # (layer_output_ids); a published one has SGLang's list, or none: the
    # target class's default layers.
    if "layer_output_ids" in eagle:
        ids, want = eagle["layer_output_ids"], list(layers.sglang_ids)
    else:
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        want = architecture.sglang_layer_ids(layers.sglang_ids)
        if ids is None:
            try:
                default = list(layers.sglang_ids) == list(default_aux_layer_ids(target_config["num_hidden_layers"]))
            except ValueError as e:  # a target too shallow for SGLang's default layers
                raise _refuse(path, f"names no aux layers, and {e}") from None
            ids, want = "SGLang's default ones", ("SGLang's default ones" if default else want)
    if ids != want:
        raise _refuse(path, f"reads the target's layers {ids}, where this run trains on {want}: the store's aux "
                            f"layers, or train.aux_layer_ids")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if "d2t" not in tensors:
        raise _refuse(path, "no d2t tensor (the draft-to-target vocabulary map)")
    size = len(tensors["d2t"])
    if size != cfg.draft_vocab_size:
        raise _refuse(path, f"a draft vocabulary of {size} tokens, where train.draft_vocab_size is "
                            f"{cfg.draft_vocab_size}: set it to {size}")
    vocab = DraftVocab.from_d2t(tensors["d2t"], target_config["vocab_size"])
    ids = vocab.target_ids
    if ids.min() < 0 or ids.max() >= vocab.vocab_size or (np.diff(ids) <= 0).any():
        raise _refuse(path, f"its d2t maps draft ids to target ids outside 0..{vocab.vocab_size - 1} or not "
                            f"ascending and distinct: not a vocabulary map of this target")
    if "t2d" in tensors and tensors["t2d"].shape != vocab.t2d.shape:
        raise _refuse(path, f"its t2d has {tuple(tensors['t2d'].shape)} entries, where this target's vocabulary has "
                            f"{vocab.vocab_size}")
    if "t2d" in tensors and not torch.equal(tensors["t2d"].bool(), vocab.t2d):
        raise _refuse(path, "its t2d (the target tokens it can propose) disagrees with its d2t")
    return vocab, tensors


def load_init(model: Eagle3Drafter, tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """Copy the exported tensors into `model` (built with their vocabulary,
    whose maps it keeps): every trained tensor must be there with its shape."""
    names = {k: p for k, p in export_weights(model).items() if k not in ("d2t", "t2d")}
    missing = sorted(set(names) - set(tensors))
    shapes = [f"{k} {tuple(tensors[k].shape)} (this run's {tuple(p.shape)})" for k, p in names.items()
              if k in tensors and tensors[k].shape != p.shape]
    if missing or shapes:
        raise _refuse(Path(path), "; ".join(filter(None, [missing and f"lacks {', '.join(missing)}",
                                                          shapes and f"other shapes: {', '.join(shapes)}"])))
    with torch.no_grad():
        for k, p in names.items():
            p.copy_(tensors[k].to(p.dtype))
