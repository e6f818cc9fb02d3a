"""The drafter's card (tasks/train/model_card.py) without a server: what the
export and the store record, read back from the card; and a card that
cannot be written leaves the drafter as it was."""
from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard

from tasks.store.ledger.open import open_ledger
from tasks.train.config import TrainConfig
from tasks.train.model_card import CARD, FILL_IN, add_served, card_or_warning, write_card
from tasks.train.record import export_record
from tests.conftest import random_store
from tests.random_drafter import export_random_drafter


@pytest.fixture(scope="module")
def drafter(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("card")
    store = random_store(d, tiny_model, 8, max_length=64)
    cfg = TrainConfig(out_dir=str(d / "train"), draft_vocab_size=512, loss="kl_tv", lr=1e-3)
    heldout = {"tau": 0.5, "tau_exact": 0.52, "acc": [0.3, 0.2, 0.1], "heldout_tokens": 99, "unproposable": 0.125}
    manifest = json.loads((store / "manifest.json").read_text())
    return export_random_drafter(tiny_model, d / "train" / "drafter", draft_vocab_size=512, extra=export_record(
        tiny_model, store, manifest, 7, heldout, cfg.identity(store))), store


def test_the_card_holds_the_target_data_recipe_heldout_and_served_figures(drafter, tiny_model):
    path, store = drafter
    counts = open_ledger(store).summary()
    card = write_card(path).read_text()
    assert f"# EAGLE-3 drafter for {tiny_model.name}" in card
    assert f"{counts['samples']:,} samples, {counts['tokens']:,} tokens" in card and "not regenerated" in card
    assert "| loss | kl_tv |" in card and "| lr | 0.001 |" in card and "| draft_vocab_size | 512 |" in card
    assert "tau 0.500, exact 0.520; accuracy per step 0.300 / 0.200 / 0.100; 12.5% of positions unproposable" in card
    assert "Not measured yet" in card and str(store) not in card
    meta = ModelCard.load(path / CARD).data  # huggingface_hub's own reader
    assert (meta.base_model, meta.license, meta.library_name, meta.pipeline_tag) == (
        FILL_IN, FILL_IN, "sglang", "text-generation")  # the tiny target says neither
    assert meta.tags == ["speculative-decoding", "eagle3", "sglang", "draft-model"]
    report = {"acceptance": [{"drafter": "d", "mode": "greedy", "prompt_set": "/x/heldout_prompts.jsonl",
                              "requests": 3, "pooled": 1.4567, "pooled_se": 0.0321, "mean_of_means": 1.44,
                              "per_position": [0.3, 0.1, 0.05], "outputs_equal": True},
                             {"drafter": "other", "mode": "greedy", "prompt_set": "p", "requests": 1, "pooled": 9.0,
                              "pooled_se": 0, "mean_of_means": 9, "per_position": [1], "outputs_equal": True}],
              "sweep": [{"drafter": "d", "concurrency": 4, "per_user_speedup": 1.5, "spec_per_user_tokens_per_s": 3,
                         "plain_per_user_tokens_per_s": 2},
                        {"drafter": "d", "concurrency": 1, "per_user_speedup": 0.8, "spec_per_user_tokens_per_s": 8,
                         "plain_per_user_tokens_per_s": 10}],
              "prompt_sets": {"/x/heldout_prompts.jsonl": 3}, "settings": {"device": "cpu", "dtype": "float32"}}
    card = add_served(path, report, "d", num_steps=2).read_text()
    assert "| heldout_prompts.jsonl (3) | 3 | 1.457 | 0.032 | 1.440 | 0.300 / 0.100 / 0.050 | True |" in card
    assert "9.000" not in card  # another drafter's row
    assert "Greedy, 2 drafts a verify step, served in float32 on cpu." in card  # not the command's dtype
    assert "Speed-up at 1 stream(s): 0.80x" in card  # the fewest streams
    assert "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3" in card


def test_a_card_that_cannot_be_written_warns_and_leaves_the_drafter(drafter, tmp_path, caplog):
    path, _ = drafter
    copy = tmp_path / "drafter"
    copy.mkdir()
    for f in path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes()) if f.is_file() else None
    (copy / CARD).unlink(missing_ok=True)
    (copy / CARD).mkdir()  # in the card's way: its rename fails
    (copy / CARD / "x").write_text("x")
    before = {f.name: f.read_bytes() for f in copy.iterdir() if f.is_file()}
    assert card_or_warning(copy) is None
    assert "no model card written" in caplog.text
    assert {f.name: f.read_bytes() for f in copy.iterdir() if f.is_file()} == before


def test_a_card_is_written_from_the_folder_alone(drafter, tmp_path):
    """The store moved or gone, the folder copied to another machine: the
    same card, from the record the folder carries."""
    path, store = drafter
    before = write_card(path).read_text()
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    (copy / "config.json").write_bytes((path / "config.json").read_bytes())
    store.rename(tmp_path / "moved")
    try:
        assert (card_or_warning(copy) or copy / CARD).read_text() == before
    finally:
        (tmp_path / "moved").rename(store)


def test_an_older_export_naming_paths_gets_a_card_without_them(drafter, tmp_path):
    path, store = drafter
    config = json.loads((path / "config.json").read_text())
    record = config["eagle3_training"]
    record.pop("data")
    record.update(store=str(store), target=str(tmp_path / "models" / "old-target"))
    copy = tmp_path / "old"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps(config))
    card = (card_or_warning(copy) or copy / CARD).read_text()
    assert "# EAGLE-3 drafter for old-target" in card and "- not recorded" in card and str(tmp_path) not in card
