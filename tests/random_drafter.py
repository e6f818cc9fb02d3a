"""An untrained drafter in the served layout, for the export and serving
tests that need a drafter but not a trained one."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from tasks.target.architectures import architecture_of, read_config
from tasks.target.layers import AuxLayers
from tasks.train.eagle3.model import build_drafter
from tasks.train.layers.sizes import target_sizes
from tasks.train.eagle3.export import export_drafter
from tasks.train.vocab import DraftVocab


def export_random_drafter(target_model_path: Path, out_dir: Path, *, draft_vocab_size: int,
                          aux_layer_ids: Sequence[int] | None = None, seed: int = 0, extra: dict | None = None) -> Path:
    """The draft vocabulary is the lowest `draft_vocab_size` target ids;
    `extra`: the training record the export carries (eagle3_training)."""
    target_config = target_sizes(target_model_path)
    vocab = DraftVocab.from_counts(np.zeros(target_config["vocab_size"], dtype=np.int64), draft_vocab_size)
    model = build_drafter(Path(target_model_path), vocab, seed=seed)
    layers = AuxLayers.for_model(target_config["num_hidden_layers"], aux_layer_ids)
    return export_drafter(model, layers, Path(out_dir), architecture=architecture_of(read_config(target_model_path)),
                          extra=extra)
