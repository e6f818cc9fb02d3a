"""The drafters' rope is the one SGLang 0.5.23 serves them with
(tasks/train/layers/rope.py): over a grid of rope settings, against SGLang's own
rotary classes, and for every real target's exported drafter as SGLang reads
its config.json (tests/rope_checks.py, in a child process: SGLang's rotary
classes import only with its CPU engine on).

Both sides compute cos/sin in fp32 from the same formulas, so the rotated
q and k agree exactly (0.0 seen everywhere); 1e-6 leaves room for a
summation order and nothing more: a YaRN correction range one dimension
off, or an mscale of another formula, moves values of order 1 by more than
1e-3 at the long positions checked (the control below)."""
from __future__ import annotations

import pytest

from tests.rope_checks import GQA_GRID, MLA_GRID
from tests.real_targets import REAL_TARGETS, text_config
from tests.triton_interpreter import run

EXACT = 1e-6


@pytest.fixture(scope="module")
def checked() -> dict:
    return run("tests.rope_checks", ["gqa_grid", "mla_grid", "real_targets"], interpret=False)


@pytest.mark.parametrize("name", GQA_GRID)
@pytest.mark.parametrize("dim", [64, 128])
def test_the_gqa_rope_equals_sglangs_get_rope(checked, name, dim):
    row = checked["gqa_grid"][f"{name}/{dim}"]
    assert row["diff"] <= EXACT, row


@pytest.mark.parametrize("name", MLA_GRID)
def test_the_mla_rope_and_softmax_scale_equal_sglangs_deepseek_yarn(checked, name):
    """SGLang's MLA layer makes any YaRN its DeepSeek variant: `truncate`
    ignored, mscale(factor, mscale) / mscale(factor, mscale_all_dim) on
    cos/sin with defaults 1 and 0."""
    row = checked["mla_grid"][name]
    assert row["diff"] <= EXACT, row
    assert row["scale"] == pytest.approx(row["sglang_scale"], rel=1e-12), row


def test_a_yarn_that_honours_truncate_is_not_what_the_mla_layer_serves(checked):
    assert checked["mla_grid"]["control: truncate honoured"]["diff"] > 1e-3


@pytest.mark.parametrize("family", ["gqa", "mla", "dflash"])
@pytest.mark.parametrize("name", REAL_TARGETS)
def test_every_real_targets_drafter_is_rotated_as_sglang_reads_its_export(checked, name, family):
    if family == "mla" and not text_config(REAL_TARGETS[name]).get("kv_lora_rank"):
        assert f"{name}/mla" not in checked["real_targets"]  # refused: tests/test_real_targets.py
        return
    row = checked["real_targets"][f"{name}/{family}"]
    assert row["diff"] <= EXACT, row
    assert row["config_class"] == {"gqa": "LlamaConfig", "mla": "DeepseekV3Config", "dflash": "Qwen3Config"}[family]
    if family == "mla":
        assert row["scale"] == pytest.approx(row["sglang_scale"], rel=1e-12), row
    else:  # the whole head rotated, GLM-4.5's partial rotary not carried over
        assert row["rotary_dim"] == row["head_dim"], row
