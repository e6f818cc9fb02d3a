"""What a DFlash drafter is fixed to on the target's side: the target layers
whose states it reads (and where a store holds them), and its mask token.

Layer ids are SGLang's "output of layer i" (tasks/target/layers.py), the
convention of dflash_config.target_layer_ids too: SGLang's
set_dflash_layers_to_capture captures at i + 1 (llama.py:953), as for
EAGLE-3, and concatenates the layers in ascending order.
"""
from __future__ import annotations

from pathlib import Path

from tasks.store.manifest import read_manifest
from tasks.target.layers import AuxLayers, positions_in_store

# SGLang's default mask token (dflash_utils.DEFAULT_DFLASH_MASK_TOKEN) and
# the reference DFlash's.
DEFAULT_MASK_TOKEN = "<|MASK|>"


def check_target_layer_ids(ids, num_target_layers: int) -> tuple[int, ...]:
    """The ids as a tuple; refused unless distinct, ascending and among the
    layers SGLang captures (outputs of layers 0..L-2: the last layer's
    output is the final state, never captured)."""
    ids = tuple(int(i) for i in ids)
    last = num_target_layers - 2
    wrong = ("none given" if not ids else
             "not distinct and ascending" if list(ids) != sorted(set(ids)) else
             f"out of range for a {num_target_layers}-layer target (SGLang captures outputs of layers 0..{last})"
             if ids[0] < 0 or ids[-1] > last else None)
    if wrong:
        raise ValueError(f"target_layer_ids {list(ids)}: {wrong}; give distinct ascending SGLang layer ids "
                         f"(output of layer i) between 0 and {last}")
    return ids


def layer_positions(manifest: dict, target_layer_ids) -> tuple[int, ...]:
    """Where `target_layer_ids` sit in the layer axis of a store with this
    manifest (the order `collate` then concatenates them in); refused,
    naming the missing ones and what the store holds."""
    held = AuxLayers(tuple(manifest["aux_layers"]["sglang_layer_output_ids"]))
    return positions_in_store(target_layer_ids, held, what="target layers")


def store_layer_positions(store: Path, target_layer_ids) -> tuple[int, ...]:
    """`layer_positions` against a store's manifest."""
    return layer_positions(read_manifest(Path(store)), target_layer_ids)


def mask_token_for(tokenizer, vocab_size: int) -> tuple[str, int]:
    """(mask_token, mask_token_id) to train with and write into
    dflash_config. SGLang (dflash_worker_v2.py:1392-1463) needs the id below
    the target's vocabulary size (the embedding's rows; it cannot add a
    row), and equal to the tokenizer's id for mask_token where the tokenizer
    knows that string; given no id, it takes the tokenizer's mask token or
    adds one, whose id is len(tokenizer). In that order here:

    - the tokenizer's own mask token;
    - `<|MASK|>`, where the vocabulary has it;
    - a new `<|MASK|>` at id len(tokenizer) where the embedding has rows
      past the tokenizer (Qwen3: 151,936 rows, 151,669 tokens), the id
      SGLang's own add_special_tokens would give;
    - else an existing token, named as itself so SGLang's check holds:
      the pad token (it never starts a block of real text), or the last id.

    The mask's input is the target's frozen embedding row of that id."""
    mask = getattr(tokenizer, "mask_token", None)
    if mask:
        return _checked(mask, tokenizer.convert_tokens_to_ids(mask), vocab_size, "the tokenizer's mask token")
    vocab = tokenizer.get_vocab()
    if DEFAULT_MASK_TOKEN in vocab:
        return _checked(DEFAULT_MASK_TOKEN, vocab[DEFAULT_MASK_TOKEN], vocab_size, "the vocabulary's")
    if len(tokenizer) < vocab_size:
        return DEFAULT_MASK_TOKEN, len(tokenizer)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None and 0 <= pad < vocab_size:
        return tokenizer.convert_ids_to_tokens(pad), int(pad)
    last = vocab_size - 1
    return tokenizer.convert_ids_to_tokens(last), last


def _checked(token: str, token_id: int, vocab_size: int, what: str) -> tuple[str, int]:
    if token_id is None or not 0 <= int(token_id) < vocab_size:
        raise ValueError(f"{what} {token!r} has id {token_id}, outside the target's {vocab_size} embedding rows: "
                         f"SGLang cannot serve a DFlash drafter with it (it does not resize the target's embedding)")
    return token, int(token_id)
