"""A drafter folder published as it is (tasks/train/publish.py, the record
of tasks/train/record.py): the target named as a user finds it, the dry
run's file list, and each refusal, on a real export. No network: an upload
is only ever refused here, before any call."""
from __future__ import annotations

import json
import shutil

import pytest
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file

from tasks.target.fingerprint import weights_fingerprint
from tasks.train.config import TrainConfig
from tasks.train.model_card import CARD, FILL_IN, write_card
from tasks.train.publish import PublishRefused, plan, publish
from tasks.train.record import export_record, served_target, target_license, target_name
from tests.conftest import random_store
from tests.random_drafter import export_random_drafter

HUB_ID = "SomeOrg/Tiny-Target-Instruct"


def _target_copy(tiny_model, where, readme: str | None = None, config_update: dict | None = None):
    where.mkdir(parents=True)
    for f in tiny_model.iterdir():
        if f.is_file():
            shutil.copy2(f, where / f.name)
    if config_update:
        config = json.loads((where / "config.json").read_text())
        (where / "config.json").write_text(json.dumps({**config, **config_update}))
    if readme is not None:
        (where / "README.md").write_text(readme)
    return where


@pytest.fixture(scope="module")
def published(tiny_model, tmp_path_factory):
    """A drafter whose target's card states its hub id and licence."""
    d = tmp_path_factory.mktemp("publish")
    store = random_store(d, tiny_model, 6, max_length=64)
    target = _target_copy(tiny_model, d / "target", readme=(
        f"---\nbase_model: {HUB_ID}\nbase_model_relation: quantized\nlicense: apache-2.0\n---\n# a copy\n"))
    cfg = TrainConfig(out_dir=str(d / "train"), draft_vocab_size=512)
    # random_store's manifest records no fingerprint; a captured store's does.
    manifest = {"target": {"weights_sha256": weights_fingerprint(tiny_model)}}
    folder = export_random_drafter(tiny_model, d / "train" / "drafter", draft_vocab_size=512, extra=export_record(
        target, store, manifest, 3, {"tau": 0.4, "tau_exact": 0.4}, cfg.identity(store)))
    write_card(folder)
    return folder, d


def test_the_target_is_named_as_a_user_finds_it(tiny_model, tmp_path, monkeypatch):
    snapshot = _target_copy(tiny_model, tmp_path / "hub" / "models--acme--Big-Model" / "snapshots" / "abc123")
    assert target_name(snapshot) == "acme/Big-Model"
    assert target_name(_target_copy(tiny_model, tmp_path / "named", config_update={"_name_or_path": "acme/X"})) \
        == "acme/X"
    # A local path in _name_or_path names nothing; a card that calls the
    # checkpoint a quantisation names its base; a fine-tune's does not.
    assert target_name(_target_copy(tiny_model, tmp_path / "local", config_update={"_name_or_path": "/data/x"})) \
        == "local"
    # Nor does a relative one that is a folder where the run is (a trainer's output/checkpoint-500).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "output" / "checkpoint-500").mkdir(parents=True)
    assert target_name(_target_copy(tiny_model, tmp_path / "ckpt", config_update={
        "_name_or_path": "output/checkpoint-500"})) == "ckpt"
    assert target_name(_target_copy(tiny_model, tmp_path / "q", readme=(
        "---\nbase_model: acme/Y\nbase_model_relation: quantized\n---\n"))) == "acme/Y"
    assert target_name(_target_copy(tiny_model, tmp_path / "ft", readme="---\nbase_model: acme/Y\n---\n")) == "ft"


def test_a_complete_folder_is_listed_file_by_file_and_would_be_sent(published):
    folder, d = published
    card = ModelCard.load(folder / CARD)
    assert (card.data.base_model, card.data.license) == (HUB_ID, "apache-2.0")
    assert f"--model-path {HUB_ID}" in card.text and "--speculative-draft-model-path ." in card.text
    assert "trained on a quantisation of it" in card.text
    (folder / ".README.md.tmp-1").write_text("half a card")  # a writer's temp file
    (folder / "notes").mkdir()
    try:
        made = publish(folder, "me/tiny-eagle3")  # dry run
        assert made.problems == []
        assert made.files == [(n, (folder / n).stat().st_size) for n in ("README.md", "config.json",
                                                                       "model.safetensors")]
        assert made.left_out == [".README.md.tmp-1", "notes/"]
        for name, _ in made.files:
            assert str(d).encode() not in (folder / name).read_bytes()
    finally:
        (folder / ".README.md.tmp-1").unlink()
        (folder / "notes").rmdir()


@pytest.mark.parametrize("fault", ["placeholder", "absolute path", "no metadata", "repo id", "no weights"])
def test_a_folder_not_ready_is_refused_naming_why(published, tmp_path, fault):
    folder, _ = published
    bad = tmp_path / "drafter"
    shutil.copytree(folder, bad)
    card = (bad / CARD).read_text()
    repo = "me/tiny-eagle3"
    if fault == "placeholder":
        (bad / CARD).write_text(card.replace("license: apache-2.0", f"license: {FILL_IN}"))
        why = f"README.md line 3 still says {FILL_IN}: license: {FILL_IN}"
    elif fault == "absolute path":
        config = json.loads((bad / "config.json").read_text())
        config["eagle3_training"]["data"]["store"] = "/scratch/alice/runs/store"
        (bad / "config.json").write_text(json.dumps(config, indent=2))
        why = "names the absolute path /scratch/alice/runs/store"
    elif fault == "no metadata":
        (bad / CARD).write_text(card.split("\n---\n", 1)[1])
        why = "metadata block lacks base_model, license, library_name, tags, pipeline_tag"
    elif fault == "repo id":
        repo = "tiny-eagle3"
        why = "repo id 'tiny-eagle3' is not <user-or-org>/<name>"
    else:
        (bad / "model.safetensors").unlink()
        why = "no .safetensors weights"
    made = plan(bad, repo)
    assert len(made.problems) == 1 and why in made.problems[0], made.problems
    with pytest.raises(PublishRefused, match="is not published"):
        publish(bad, repo, upload=True)  # refused before huggingface_hub is called


def test_evaluate_takes_the_target_by_its_weights(tiny_model, tmp_path, published):
    """A copy of the target elsewhere is the target; a fine-tune of it, with
    the same config.json byte for byte, is not."""
    folder, _ = published
    record = json.loads((folder / "config.json").read_text())["eagle3_training"]
    assert served_target(record, _target_copy(tiny_model, tmp_path / "copy")) is None
    tuned = _target_copy(tiny_model, tmp_path / "tuned")
    weights = load_file(tuned / "model.safetensors")
    save_file({k: v * 1.01 if v.is_floating_point() else v for k, v in weights.items()},
              str(tuned / "model.safetensors"), metadata={"format": "pt"})
    assert (tuned / "config.json").read_bytes() == (tiny_model / "config.json").read_bytes()
    assert "weights fingerprint" in served_target(record, tuned)


def test_what_a_target_or_store_cannot_say_is_recorded_as_unknown_and_the_export_goes_on(tiny_model, tmp_path,
                                                                                          caplog):
    odd = _target_copy(tiny_model, tmp_path / "odd", readme="---\njust a line of text\n---\n# a card\n")
    assert (target_name(odd), target_license(odd)) == ("odd", None)  # its metadata is no mapping
    (odd / "README.md").write_text("---\nlicense: [unclosed\n---\n")
    assert target_license(odd) is None
    record = export_record(odd, tmp_path / "no-store", {}, 1, {}, {"store": str(tmp_path / "no-store")})
    assert record["data"] is None and "the export records no data" in caplog.text
    assert record["config"] == {"store": "no-store"}


def test_an_export_without_a_fingerprint_is_taken_by_its_targets_name(tiny_model, caplog):
    assert served_target({"target": tiny_model.name}, tiny_model) is None
    assert "only its target's name" in caplog.text
    assert "is not" in served_target({"target": "another-model"}, tiny_model)
    assert "is not this one" in served_target({"target": "/elsewhere/tiny-llama"}, tiny_model)
