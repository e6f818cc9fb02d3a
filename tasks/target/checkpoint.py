"""A target as a run uses it: its checkpoint folder, config, the SGLang
class that serves it (tasks/target/architectures.py), and the aux layers
the run captures (tasks/target/layers.py), resolved once."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tasks.target.architectures import Architecture, architecture_of, load_tokenizer, read_config
from tasks.target.layers import AuxLayers
from tasks.target.models import resolve_model


@dataclass(frozen=True)
class Target:
    path: Path
    config: dict
    arch: Architecture
    layers: AuxLayers

    @classmethod
    def load(cls, model: str, aux_layer_ids: Sequence[int] | None = None) -> "Target":
        """`model`: a checkpoint folder or the demo model's name; the aux
        layers are SGLang's defaults for it unless given (refused when out
        of range for it)."""
        path = resolve_model(model)
        config = read_config(path)
        arch = architecture_of(config)
        return cls(path, config, arch, AuxLayers.for_model(arch.sizes(config)["num_hidden_layers"], aux_layer_ids))

    @property
    def hidden_size(self) -> int:
        return self.arch.sizes(self.config)["hidden_size"]

    @property
    def served_layer_ids(self) -> list[int]:
        """The aux layer ids as this target's SGLang class reads them
        (`--return-aux-hidden-state-layer-ids`)."""
        return self.arch.sglang_layer_ids(self.layers.sglang_ids)

    def tokenizer(self):
        return load_tokenizer(self.path)
