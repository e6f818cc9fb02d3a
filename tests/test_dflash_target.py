"""The DFlash drafter's target side: a store without the target layers the
drafter reads is refused naming them, and the mask token chosen is one
SGLang 0.5.23's own resolution (its source, run here) takes to the same id."""
from __future__ import annotations

import ast
import json

import pytest

from tasks.store.shards import FORMAT
from tasks.target.layers import AuxLayers
from tasks.train.dflash.target import (DEFAULT_MASK_TOKEN, check_target_layer_ids, layer_positions, mask_token_for,
                                       store_layer_positions)
from tests.test_dflash import SGLANG


def test_a_store_without_the_layers_is_refused_naming_them(tmp_path):
    manifest = {"format": FORMAT, "aux_layers": AuxLayers((1, 2, 4, 5, 6)).as_record()}
    assert layer_positions(manifest, [2, 5, 6]) == (1, 3, 4)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert store_layer_positions(tmp_path, [1, 4]) == (0, 2)
    with pytest.raises(ValueError, match=r"target layers \[3, 7\] are not in the store, which holds outputs of "
                                         r"layers \[1, 2, 4, 5, 6\]"):
        store_layer_positions(tmp_path, [1, 3, 7])
    assert check_target_layer_ids([0, 6], 8) == (0, 6)


class Tokenizer:
    """What mask_token_for and SGLang's resolution read of a tokenizer."""

    def __init__(self, vocab: dict, mask_token=None, pad_token_id=None):
        self.vocab, self.mask_token, self.pad_token_id = dict(vocab), mask_token, pad_token_id
        self.mask_token_id = self.vocab.get(mask_token)

    def __len__(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token)

    def convert_ids_to_tokens(self, i):
        return {v: k for k, v in self.vocab.items()}[i]

    def add_special_tokens(self, special):
        token = special["mask_token"]
        added = token not in self.vocab
        self.vocab.setdefault(token, len(self.vocab))
        self.mask_token, self.mask_token_id = token, self.vocab[token]
        return int(added)


def sglang_resolve_mask_token_id():
    """DFlashWorkerV2._resolve_mask_token_id, SGLang's own source (the worker
    module itself needs a GPU runtime to import)."""
    import logging
    from types import SimpleNamespace
    from typing import Optional

    source = (SGLANG / "speculative" / "dflash_worker_v2.py").read_text()
    node = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.FunctionDef) and n.name == "_resolve_mask_token_id")
    scope = {"Optional": Optional, "logger": logging.getLogger("sglang-dflash"),
             "get_parallel": lambda: SimpleNamespace(tp_rank=0)}
    exec(compile(ast.Module([node], []), "dflash_worker_v2.py", "exec"), scope)

    def resolve(tokenizer, vocab_size, mask_token, mask_token_id):
        worker = SimpleNamespace(target_worker=SimpleNamespace(
            tokenizer=tokenizer, model_runner=SimpleNamespace(model_config=SimpleNamespace(vocab_size=vocab_size))))
        return scope["_resolve_mask_token_id"](worker, mask_token=mask_token, mask_token_id=mask_token_id)
    return resolve


def test_the_mask_token_is_one_sglang_resolves_to_the_same_id(tiny_model):
    from transformers import AutoTokenizer

    resolve = sglang_resolve_mask_token_id()
    base = {"a": 0, "b": 1, "<pad>": 2}
    cases = [  # (tokenizer, embedding rows, what is chosen)
        (Tokenizer({**base, "[MASK]": 3}, mask_token="[MASK]"), 4, ("[MASK]", 3)),
        (Tokenizer({**base, DEFAULT_MASK_TOKEN: 3}), 4, (DEFAULT_MASK_TOKEN, 3)),
        (Tokenizer(base, pad_token_id=2), 8, (DEFAULT_MASK_TOKEN, 3)),  # a spare embedding row
        (Tokenizer(base, pad_token_id=2), 3, ("<pad>", 2)),  # none: the pad token
        (Tokenizer(base), 3, ("<pad>", 2)),  # nor a pad token: the last id
        (AutoTokenizer.from_pretrained(tiny_model), 2048, ("<|endoftext|>", 0)),
    ]
    for tokenizer, rows, want in cases:
        token, token_id = mask_token_for(tokenizer, rows)
        assert (token, token_id) == want
        # Written into dflash_config, SGLang resolves it to the same id; and
        # given no id, SGLang's own choice is this one where it can make one.
        assert resolve(tokenizer, rows, token, token_id) == token_id
        if token != "<pad>" and token != "<|endoftext|>":
            assert resolve(tokenizer, rows, token, None) == token_id
    with pytest.raises(ValueError, match=r"'\[MASK\]' has id 5, outside the target's 4 embedding rows"):
        mask_token_for(Tokenizer({**base, "x": 3, "y": 4, "[MASK]": 5}, mask_token="[MASK]"), 4)
