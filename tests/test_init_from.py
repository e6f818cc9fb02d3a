"""train.init_from: a training that starts from an exported drafter takes
its weights and vocabulary map, and refuses one made for another target,
other layers, another layout or another vocabulary, naming what differs."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tasks.target.architectures import architecture_of, read_config
from tasks.target.fingerprint import weights_fingerprint
from tasks.target.layers import AuxLayers
from tasks.train.config import TrainConfig
from tasks.train.layers.sizes import target_sizes
from tasks.train.eagle3.export import export_weights
from tasks.train.init_from import TARGET_WEIGHTS, InitRefused, read_init
from tasks.train.prepare import prepare
from tests.conftest import random_store
from tests.random_drafter import export_random_drafter
from tests.tiny_models import TINY_ENDS, ensure_model


@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory):
    return random_store(tmp_path_factory.mktemp("init-store"), tiny_model, 8, max_length=64)


def settings(tmp_path, init, **kw) -> TrainConfig:
    return TrainConfig(**{"out_dir": str(tmp_path / "train"), "draft_vocab_size": 512, "init_from": str(init), **kw})


def test_a_run_starts_from_the_exported_drafters_weights_and_vocabulary(tiny_model, store, tmp_path):
    # Its vocabulary is the lowest 512 ids, which counting this store would not choose.
    init = export_random_drafter(tiny_model, tmp_path / "init", draft_vocab_size=512, seed=7)
    run = prepare(settings(tmp_path, init), store)
    exported = load_file(str(init / "model.safetensors"))
    assert run.vocab.target_ids.tolist() == list(range(512))
    mine = export_weights(run.model)
    assert set(mine) == set(exported)
    for name, tensor in exported.items():
        assert torch.equal(mine[name].to(tensor.dtype), tensor), name
    fresh = prepare(TrainConfig(out_dir=str(tmp_path / "fresh"), draft_vocab_size=512), store)
    assert fresh.vocab.target_ids.tolist() != list(range(512))  # without it: counted, and other weights


def test_a_drafter_for_another_vocabulary_or_other_layers_is_refused_naming_it(tiny_model, store, tmp_path):
    init = export_random_drafter(tiny_model, tmp_path / "init", draft_vocab_size=512)
    with pytest.raises(InitRefused, match="a draft vocabulary of 512 tokens, where train.draft_vocab_size is 256"):
        prepare(settings(tmp_path, init, draft_vocab_size=256), store)
    with pytest.raises(InitRefused, match="a eagle3 drafter with gqa attention, where this run trains eagle3.1"):
        prepare(settings(tmp_path, init, variant="eagle3.1"), store)
    other_layers = export_random_drafter(tiny_model, tmp_path / "layers", draft_vocab_size=512,
                                         aux_layer_ids=[0, 3, 5])
    with pytest.raises(InitRefused, match=r"reads the target's layers \[0, 3, 5\].*where this run trains on \[1, 3, 4\]"):
        prepare(settings(tmp_path, other_layers), store)
    # A vocabulary map that is not one of this target's: a draft id mapped past its vocabulary.
    tensors = load_file(str(init / "model.safetensors"))
    tensors["d2t"][-1] = 5000
    save_file(tensors, str(init / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InitRefused, match="target ids outside 0..2047"):
        prepare(settings(tmp_path, init), store)
    # A t2d (what it can propose: what training's loss counts) that is not its d2t's.
    init = export_random_drafter(tiny_model, tmp_path / "t2d", draft_vocab_size=512)
    tensors = load_file(str(init / "model.safetensors"))
    tensors["t2d"][600] = True
    save_file(tensors, str(init / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InitRefused, match="its t2d .* disagrees with its d2t"):
        prepare(settings(tmp_path, init), store)


def test_a_drafter_whose_tensors_fit_but_whose_heads_differ_is_refused_and_another_rope_said(tiny_model, store,
                                                                                             tmp_path, caplog):
    init = export_random_drafter(tiny_model, tmp_path / "init", draft_vocab_size=512)
    config = json.loads((init / "config.json").read_text())
    heads, kv, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    # The same q/k/v/o shapes in twice the heads of half the width: the weights would load, and mean nothing.
    (init / "config.json").write_text(json.dumps({**config, "num_attention_heads": 2 * heads,
                                                   "num_key_value_heads": 2 * kv, "head_dim": dim // 2}))
    with pytest.raises(InitRefused, match=f"its attention splits into other heads: num_attention_heads {2 * heads} "
                                          f"\\(this run's {heads}\\)"):
        prepare(settings(tmp_path, init), store)
    # Another rope: a worse start, not wrong weights (training and the export turn by the target's).
    (init / "config.json").write_text(json.dumps({**config, "rope_theta": config["rope_theta"] * 2,
                                                   "rope_parameters": None}))
    assert prepare(settings(tmp_path, init), store).vocab.size == 512
    assert f"trained with the rope {{'rope_theta': {config['rope_theta'] * 2}" in caplog.text
    # This store and this drafter record no target weights fingerprint: said, not silently passed.
    assert "no target weights fingerprint, so only the target's sizes are checked" in caplog.text


def test_a_drafter_for_another_target_is_refused_by_its_sizes_or_its_weights(tiny_model, tmp_path):
    layers = AuxLayers.for_model(target_sizes(tiny_model)["num_hidden_layers"])
    architecture, cfg = architecture_of(read_config(tiny_model)), TrainConfig(draft_vocab_size=512)
    mine, other = weights_fingerprint(tiny_model), weights_fingerprint(ensure_model(TINY_ENDS))
    assert mine != other  # the same shapes, other weights
    manifest = {"target": {"weights_sha256": mine}}
    init = export_random_drafter(tiny_model, tmp_path / "a", draft_vocab_size=512, extra={TARGET_WEIGHTS: other})
    with pytest.raises(InitRefused, match="trained on a target whose weights fingerprint is"):
        read_init(init, cfg, target_sizes(tiny_model), layers, architecture, manifest)
    init = export_random_drafter(tiny_model, tmp_path / "b", draft_vocab_size=512, extra={TARGET_WEIGHTS: mine})
    vocab, _ = read_init(init, cfg, target_sizes(tiny_model), layers, architecture, manifest)
    assert vocab.size == 512
    config = json.loads((init / "config.json").read_text())
    (init / "config.json").write_text(json.dumps({**config, "hidden_size": 256}))
    with pytest.raises(InitRefused, match="made for a target with hidden_size 256, where this target has 128"):
        read_init(init, cfg, target_sizes(tiny_model), layers, architecture, manifest)

