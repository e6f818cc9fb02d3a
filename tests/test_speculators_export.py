"""The speculators export (tasks/train/eagle3/speculators.py) without
speculators: the names, the tensors and the config it writes from an SGLang
export, its card, and what it refuses. That speculators 0.9.0's own class
loads it and computes our first draft step is bench/speculators_format.py
(it builds speculators' environment; docs/benchmarks.md has its figures)."""
from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from tasks.target.embeddings import load_target_embeddings
from tasks.target.fingerprint import weights_fingerprint
from tasks.train.config import TrainConfig
from tasks.train.eagle3.speculators import export_beside, speculators_config, speculators_name
from tasks.train.model_card import CARD, write_card
from tasks.train.record import FILL_IN, export_record
from tests.conftest import random_store
from tests.random_drafter import export_random_drafter


@pytest.fixture(scope="module")
def exported(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("speculators")
    store = random_store(d, tiny_model, 6, max_length=64)
    cfg = TrainConfig(out_dir=str(d / "train"), draft_vocab_size=512, serve_steps=4,
                      export_formats=["sglang", "speculators"])
    record = export_record(tiny_model, store, {"target": {"weights_sha256": weights_fingerprint(tiny_model)}}, 5,
                           {"tau": 0.5, "tau_exact": 0.5}, cfg.identity(store))
    drafter = export_random_drafter(tiny_model, d / "train" / "drafter", draft_vocab_size=512, extra=record)
    folder = export_beside(drafter, tiny_model, cfg.serve_steps)
    write_card(folder)
    return drafter, folder


def test_the_same_weights_under_speculators_names_with_the_targets_embeddings(exported, tiny_model):
    drafter, folder = exported
    ours, theirs = load_file(drafter / "model.safetensors"), load_file(folder / "model.safetensors")
    assert folder.name == "drafter-speculators" and folder.parent == drafter.parent
    assert "layers.0.self_attn.q_proj.weight" in theirs and "layers.0.hidden_norm.weight" in theirs
    assert not [k for k in theirs if k.startswith("midlayer.")]
    assert set(theirs) == {speculators_name(k) for k in ours} | {"embed_tokens.weight"}
    for k, v in ours.items():
        if k != "t2d":
            assert torch.equal(theirs[speculators_name(k)], v), k
    assert theirs["t2d"].dtype == torch.bool and torch.equal(theirs["t2d"], ours["t2d"].bool())
    assert int(theirs["t2d"].sum()) == 512 == len(theirs["d2t"])  # what speculators' load_vocab_mappings checks
    assert torch.equal(theirs["embed_tokens.weight"], load_target_embeddings(tiny_model)[0].to(torch.bfloat16))


def test_the_config_names_the_layer_the_verifier_and_the_proposals(exported, tiny_model):
    drafter, folder = exported
    ours, config = (json.loads((p / "config.json").read_text()) for p in (drafter, folder))
    layer = config["transformer_layer_config"]
    assert (config["architectures"], config["speculators_model_type"]) == (["Eagle3Speculator"], "eagle3")
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "rms_norm_eps", "vocab_size", "rope_parameters"):
        assert layer[key] == ours[key], key
    # vLLM's layer convention: HF hidden_states indices, the input of layer i.
    assert config["eagle_aux_hidden_state_layer_ids"] == ours["eagle_config"]["hf_hidden_state_indices"]
    assert [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]] == ours["eagle_config"]["layer_output_ids"]
    assert config["speculators_config"] == {
        "algorithm": "eagle3", "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
        "default_proposal_method": "greedy",
        # vLLM loads the verifier by this name: a folder's is left for the user (publish refuses it).
        "verifier": {"name_or_path": FILL_IN, "architectures": ["LlamaForCausalLM"]}}
    assert config["draft_vocab_size"] == 512 and not config["fc_norm"] and not config["norm_before_residual"]
    assert config["eagle3_training"] == ours["eagle3_training"]


def test_its_card_serves_it_in_vllm(exported):
    _, folder = exported
    card = ModelCard.load(folder / CARD)
    assert card.data.library_name == "speculators" and "vllm" in card.data.tags
    spec = {"model": ".", "method": "eagle3", "num_speculative_tokens": 4}
    assert f"--speculative-config '{json.dumps(spec)}'" in card.text
    assert "(speculators format)" in card.text.strip().splitlines()[0]


def test_what_speculators_has_no_drafter_for_is_refused(exported):
    drafter, _ = exported
    config = json.loads((drafter / "config.json").read_text())
    with pytest.raises(ValueError, match="the speculators format has no MLA drafter"):
        speculators_config({**config, "architectures": ["Eagle3DeepseekV2ForCausalLM"]}, "x/y", 3)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "mscale": 1.0, "mscale_all_dim": 1.0}  # DeepSeek-V3's and Kimi-K2.5's
    with pytest.raises(ValueError, match="which vLLM's YaRN rope does not read"):
        speculators_config({**config, "rope_parameters": yarn}, "x/y", 3)
    yarn.pop("mscale_all_dim")  # gpt-oss's form, which vLLM reads as SGLang does
    assert speculators_config({**config, "rope_parameters": yarn}, "x/y", 3)["transformer_layer_config"]
    four = {**config["eagle_config"], "eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}
    with pytest.raises(ValueError, match="vLLM's EAGLE-3 layer takes 3"):
        speculators_config({**config, "eagle_config": four}, "x/y", 3)
    for bad, why in [({"attention": "mla"}, "not eagle3 with mla attention"),
                     ({"method": "dflash"}, "not dflash with gqa attention"),
                     ({}, "keep sglang in the list")]:
        formats = ["speculators"] if not bad else ["sglang", "speculators"]
        with pytest.raises(ValueError, match=why):
            TrainConfig(export_formats=formats, **bad)


def test_the_sglang_card_points_at_vllm_only_where_the_drafter_has_a_speculators_export(exported, tmp_path):
    drafter, _ = exported
    assert "drafter-speculators/" in write_card(drafter).read_text()
    config = json.loads((drafter / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                 "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "drafter-speculators/" not in write_card(tmp_path).read_text()
