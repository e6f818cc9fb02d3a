"""EAGLE-3 auxiliary layer ids, in both conventions people use.

SGLang and SpecForge name a capture by "output of decoder layer i"; HF
transformers' `hidden_states` tuple has the embeddings at index 0, so the same
tensor is `hidden_states[i + 1]` (vLLM/EAGLE also say "input of layer i+1").
Mixing the two silently trains a drafter on the wrong layers, so every place
that records layer ids records both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# An EAGLE-3 drafter reads three; a store may hold more (one capture for
# several drafters: other triples, or five-layer DFlash-style drafters).
NUM_AUX_LAYERS = 3
# SGLang's LlamaModel returns its last hidden state after the final RMSNorm.
FINAL_STATE_NORM = "post-norm"


def default_aux_layer_ids(num_hidden_layers: int) -> tuple[int, ...]:
    """SGLang's default EAGLE-3 layers: outputs of [1, n//2 - 1, n - 4]."""
    n = num_hidden_layers
    ids = (1, n // 2 - 1, n - 4)
    if n < 7 or len(set(ids)) != NUM_AUX_LAYERS:
        raise ValueError(
            f"A {n}-layer model has no three distinct default EAGLE-3 aux layers "
            f"({ids}); pass explicit aux layer ids."
        )
    return ids


@dataclass(frozen=True)
class AuxLayers:
    """The auxiliary layers of a capture or a drafter (at least three).
    `sglang_ids` are SGLang's "output of layer i" ids, ascending (the order
    SGLang concatenates them)."""

    sglang_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        ids = tuple(int(i) for i in self.sglang_ids)
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        wrong = (f"fewer than {NUM_AUX_LAYERS}" if len(ids) < NUM_AUX_LAYERS else
                 f"{repeated} repeated" if repeated else
                 "not ascending" if list(ids) != sorted(ids) else
                 "a negative id" if ids[0] < 0 else None)
        if wrong:
            raise ValueError(f"aux layer ids {list(self.sglang_ids)}: {wrong}; give at least {NUM_AUX_LAYERS} "
                             f"distinct layer ids in ascending order, e.g. {list(range(1, NUM_AUX_LAYERS + 1))}")
        object.__setattr__(self, "sglang_ids", ids)

    @classmethod
    def for_model(cls, num_hidden_layers: int, ids=None) -> "AuxLayers":
        layers = cls(tuple(ids) if ids is not None else default_aux_layer_ids(num_hidden_layers))
        # SGLang captures the output of layer i as the input of layer i + 1,
        # so the last layer's output is never captured: a server given it
        # dies at its first forward ("The model captured 2 aux hidden states,
        # but ... names 3 layers", seen on 0.5.23).
        last = num_hidden_layers - 2
        if layers.sglang_ids[-1] > last:
            raise ValueError(
                f"aux layer ids {layers.sglang_ids} out of range for a {num_hidden_layers}-layer model: SGLang "
                f"captures outputs of layers 0..{last} (the last layer's output is the final state, before its norm)"
            )
        return layers

    @property
    def hf_hidden_state_indices(self) -> tuple[int, ...]:
        return tuple(i + 1 for i in self.sglang_ids)

    def positions_in(self, held: "AuxLayers") -> tuple[int, ...]:
        """Where these layers sit in `held`'s (a store's) layer axis; refused,
        naming what the store holds, when one is not there."""
        return positions_in_store(self.sglang_ids, held)

    def as_record(self) -> dict:
        """How layer ids are written down: both conventions, explicitly named."""
        return {
            "sglang_layer_output_ids": list(self.sglang_ids),
            "hf_hidden_states_indices": list(self.hf_hidden_state_indices),
            "final_state": FINAL_STATE_NORM,
        }

    def describe(self) -> str:
        return (
            f"outputs of layers {list(self.sglang_ids)} (SGLang) = "
            f"HF hidden_states{list(self.hf_hidden_state_indices)}; final state {FINAL_STATE_NORM}"
        )


def positions_in_store(ids: Sequence[int], held: AuxLayers, what: str = "aux layers") -> tuple[int, ...]:
    """Where SGLang layer ids `ids` (any number of them: a DFlash drafter's
    too) sit in `held`'s (a store's) layer axis; refused, naming the missing
    ones (`what` they are) and what the store holds."""
    ids = [int(i) for i in ids]
    missing = [i for i in ids if i not in held.sglang_ids]
    if missing:
        raise ValueError(f"{what} {missing} are not in the store, which holds outputs of layers "
                         f"{list(held.sglang_ids)} (SGLang ids): pick ids among those, or capture a store "
                         f"with them")
    return tuple(held.sglang_ids.index(i) for i in ids)
