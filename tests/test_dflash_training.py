"""A DFlash drafter through the training loop (train.method dflash) on a
store of five layers: it reads three of them, learns, exports what SGLang's
DFlashDraftModel loads (read back against the checkpoint), and a run
stopped after a checkpoint resumes to the same weights, byte for byte (the
anchors of a batch are a function of the seed, the epoch and the batch).
No server: the store's states are random (tests/conftest.py random_store)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.train.config import TrainConfig, TrainingError
from tasks.train.dflash.export import ARCHITECTURE, load_dflash
from tasks.train.export_check import compare_export
from tasks.train.loop import train
from tests.conftest import FIVE_LAYER_IDS, random_store

READS = [1, 4, 5]  # of the store's five, not all of them: the layer axis is picked from


def config(out_dir: Path, **kw) -> TrainConfig:
    base = dict(out_dir=str(out_dir), method="dflash", aux_layer_ids=READS, block_size=4, draft_layers=1,
                max_anchors=16, epochs=3, lr=5e-3, tokens_per_batch=1024, heldout_fraction=0.25, eval_max_samples=8,
                checkpoint_every=2, log_every=1000)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory) -> Path:
    return random_store(tmp_path_factory.mktemp("dflash-store"), tiny_model, 32, max_length=128,
                        aux_layer_ids=FIVE_LAYER_IDS)


class Stop(Exception):
    pass


def test_a_dflash_drafter_trains_exports_and_resumes_to_the_same_weights(store, tiny_model, tmp_path):
    whole = train(config(tmp_path / "whole"), store)
    first, last = whole.history[0], whole.history[-1]
    assert [m["epoch"] for m in whole.history] == [0, 1, 2, 3] and len(last["acc"]) == 3  # block_size - 1 slots
    # The loss falls: every trained tensor gets its gradient and the steps are taken. (Not a
    # drafter that learned: the states are noise and the tiny target's head random, so 9 steps
    # only scale the logits down. Seen with seeds 0-5: 12.5-12.9 -> 9.6-10.4, drops 2.1-3.3.)
    assert last["loss"] < first["loss"] - 1.0, (first, last)

    drafter = Path(whole.drafter_dir)
    exported = json.loads((drafter / "config.json").read_text())
    assert exported["architectures"] == [ARCHITECTURE]
    assert exported["dflash_config"]["target_layer_ids"] == READS and exported["dflash_config"]["block_size"] == 4
    assert exported["dflash_training"]["heldout"]["loss"] == last["loss"]
    assert load_dflash(drafter, tiny_model).cfg.num_context == len(READS)
    assert compare_export(drafter, tmp_path / "whole", tiny_model)["worst_relative_diff"] <= 1e-2
    check_read_for_serving(drafter, tiny_model, tmp_path / "evaluation")

    # Stopped at step 4, just after its checkpoint; the rerun resumes there.
    def stop_at_4(s: dict) -> None:
        if s["step"] == 4:
            raise Stop

    with pytest.raises(Stop):
        train(config(tmp_path / "resumed"), store, on_step=stop_at_4)
    resumed = train(config(tmp_path / "resumed"), store)
    assert resumed.resumed_from["step"] == 4 < resumed.steps == whole.steps
    assert resumed.history == whole.history
    assert (Path(resumed.drafter_dir) / "model.safetensors").read_bytes() == \
        (drafter / "model.safetensors").read_bytes()


def check_read_for_serving(drafter: Path, tiny_model, log_dir: Path) -> None:
    """The evaluation reads the export as a DFlash drafter: served with its
    block (3 drafts a verify step), its run's held-out tau beside it; and
    on a CPU it refuses bf16 before starting any server (SGLang's bf16
    DFlash attention is a Triton kernel)."""
    from tasks.evaluation.config import EvaluateConfig
    from tasks.evaluation.prompts import PromptSet
    from tasks.evaluation.side_by_side import drafter_at, evaluate_drafters
    from tasks.server.config import ServerConfig
    from tasks.server.cpu.shim import gpu_present

    d = drafter_at(drafter, num_steps=5)  # evaluate.num_steps is an EAGLE-3 chain's: a block is the drafter's
    assert (d.method, d.num_steps) == ("dflash", 3) and d.heldout_tau == d.heldout["tau"]
    assert d.served_as(ServerConfig(model=str(tiny_model))).algorithm == "DFLASH"
    if not gpu_present():
        with pytest.raises(ValueError, match="served on a CPU in float32 only, not bfloat16"):
            evaluate_drafters(ServerConfig(model=str(tiny_model)), [d], [PromptSet("p", [[1, 2]])],
                              EvaluateConfig(dtype="bfloat16"), log_dir=log_dir)
        assert not (log_dir / "plain-server.log").exists()


def test_a_dflash_run_refuses_missing_layers_and_eagle3_settings(store, tmp_path):
    with pytest.raises(TrainingError, match=r"target layers \[3\] are not in the store, which holds outputs of "
                                            r"layers \[1, 2, 4, 5, 6\]"):
        train(config(tmp_path / "out", aux_layer_ids=[1, 3, 4]), store)
    assert not (tmp_path / "out" / "drafter").exists()
    with pytest.raises(ValidationError, match="variant 'eagle3.1'.* leave them at their defaults"):
        config(tmp_path / "x", variant="eagle3.1")
