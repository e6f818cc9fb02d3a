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

from tasks.target.layers import default_aux_layer_ids


class UnsupportedArchitecture(ValueError):
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

    def sizes(self, config: dict) -> dict:
        """The config section that holds the text model's sizes."""
        return config[self.text_config] if self.text_config else config

    def default_aux_layers(self, num_hidden_layers: int) -> tuple[int, ...]:
        """Our default aux layers, as "output of decoder layer i" ids."""
        return default_aux_layer_ids(num_hidden_layers)

    def sglang_layer_ids(self, ids: Sequence[int]) -> list[int]:
        """Our "output of layer i" ids as SGLang's
        --return-aux-hidden-state-layer-ids expects them for this class."""
        return [int(i) for i in ids]

    def as_record(self) -> dict:
        return asdict(self)


LLAMA = Architecture(name="LlamaForCausalLM", decoder_stack="model", embed_weight="model.embed_tokens.weight",
                     head_weight="lm_head.weight")

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA,)}


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
