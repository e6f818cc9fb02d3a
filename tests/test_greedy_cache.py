"""The target's greedy tokens remembered across epochs (tasks/train/vocab.py
GreedyCache): computed once per sample, looked up after, the same training."""
from __future__ import annotations

import pytest
import torch

from tasks.train.config import TrainConfig
from tests.conftest import random_store


@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory):
    return random_store(tmp_path_factory.mktemp("greedy-store"), tiny_model, 8, max_length=64)


def test_the_targets_greedy_tokens_are_computed_in_the_first_epoch_only_and_train_the_same(tiny_model, store,
                                                                                           tmp_path, monkeypatch):
    """vocab.GreedyCache: from the second epoch on, no batch multiplies out
    the target's whole head again, and what it looks up is what it would
    have computed: the run's figures equal a run without the cache."""
    import tasks.train.eagle3.ttt as ttt
    from tasks.train.loop import train
    from tasks.train.vocab import GreedyCache, target_greedy

    cache = GreedyCache(max_bytes=4 * 4)
    cache.remember(torch.tensor([7, 8]), torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([3, 2]))
    assert cache.lookup([7], 4).tolist() == [[1, 2, 3, 0]] and cache.lookup([7, 8], 3) is None  # 8: past the budget
    calls = []
    monkeypatch.setattr(ttt, "target_greedy", lambda final, head: calls.append(final.shape) or target_greedy(final, head))
    cfg = TrainConfig(out_dir=str(tmp_path / "cached"), draft_vocab_size=512, ttt_steps=2, epochs=2,
                      tokens_per_batch=256, heldout_fraction=0.25)
    epochs = []
    cached = train(cfg, store, on_eval=lambda entry: epochs.append(len(calls)))
    # The untrained evaluation and epoch 1 compute; epoch 2 (and its evaluation) looks up.
    assert epochs[0] > 0 and epochs[1] > epochs[0] and epochs[1] == epochs[2], epochs
    monkeypatch.setattr(GreedyCache, "lookup", lambda self, indices, n: None)  # every batch computes
    plain = train(cfg.model_copy(update={"out_dir": str(tmp_path / "plain")}), store)
    assert cached.history == plain.history
