"""train.serve_every's rules, as plain functions: the server it launches is
the run's own (tests/test_drafter_in_sglang.py and tests/test_training.py
launch it), refused where it cannot start beside training; keep_best_served
keeps an earlier epoch only past a margin of standard errors; the pooled
accept length's standard error, requests as clusters."""
from __future__ import annotations

import json
import math

import pytest

from tasks.evaluation.acceptance import acceptance, paired_difference, pooled_standard_error
from tasks.server.config import ServerConfig
from tasks.server.launch import build_command
from tasks.train.config import TrainConfig
from tasks.train.served import ServingRefused, check_serving_fits, choose_served, describe_choice, served_spec
from tests.tiny_models import TINY, ensure_model


def flags(cmd: list[str]) -> dict[str, str]:
    return {a: (cmd[i + 1] if i + 1 < len(cmd) and not cmd[i + 1].startswith("--") else "")
            for i, a in enumerate(cmd) if a.startswith("--")}


def drafter_dir(tmp_path, architecture="LlamaForCausalLMEagle3"):
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return d


def test_the_served_measurement_launches_the_runs_own_server_settings_on_the_gpus_after_trainings(tmp_path):
    """Kimi-K2.5's layout: TP 8 with 8 attention groups, its memory share and
    quantization, bf16 (the server section), the training target; beside 8
    training GPUs, from GPU 8 on. A one-device float32 server of the target
    (the measurement before) would not start there."""
    target = ensure_model(TINY)
    server = ServerConfig(model="not-the-target", tp_size=8, dp_size=8, dp_attention=True, dtype="bfloat16",
                          mem_fraction_static=0.85, extra_args=["--quantization", "fp8"])
    spec = served_spec(drafter_dir(tmp_path), target, TrainConfig(devices=8, serve_every=1, serve_steps=3), server,
                       gpus=16)
    got = flags(build_command(spec, 30000, cpu=False))
    assert got["--model-path"] == str(target)
    assert (got["--tp-size"], got["--attn-dp-size"], got["--dtype"]) == ("8", "8", "bfloat16")
    assert (got["--mem-fraction-static"], got["--quantization"], got["--base-gpu-id"]) == ("0.85", "fp8", "8")
    assert (got["--speculative-num-steps"], got["--speculative-num-draft-tokens"]) == ("3", "4")


def test_auto_is_the_checkpoints_dtype_on_a_gpu_and_float32_on_a_cpu(tmp_path):
    target, d = ensure_model(TINY), drafter_dir(tmp_path)
    cfg = TrainConfig(serve_every=1)
    assert served_spec(d, target, cfg, ServerConfig(), gpus=2).server.dtype == "auto"
    on_cpu = served_spec(d, target, cfg, ServerConfig(), gpus=0)
    assert on_cpu.server.dtype == "float32" and on_cpu.base_gpu_id is None
    assert served_spec(d, target, cfg, ServerConfig(dtype="bfloat16"), gpus=0).server.dtype == "bfloat16"


def test_an_attached_servers_url_and_key_are_not_launched_with(tmp_path):
    server = ServerConfig(url="http://10.0.0.1:30000", api_key="secret")
    spec = served_spec(drafter_dir(tmp_path), ensure_model(TINY), TrainConfig(serve_every=1), server, gpus=0)
    assert spec.server.url is None and spec.server.api_key is None


def test_serving_that_cannot_start_beside_training_is_refused_naming_why():
    kimi = ServerConfig(tp_size=8, dp_size=8, dp_attention=True)
    with pytest.raises(ServingRefused, match=r"server.tp_size 8, server.dp_size 8, dp_attention: 8 GPU\(s\)\) beside "
                                             r"the 8 GPU\(s\) training holds .* this node has 8: set "
                                             r"train.serve_every 0"):
        check_serving_fits(TrainConfig(devices=8, serve_every=1), kimi, gpus=8)
    check_serving_fits(TrainConfig(devices=8, serve_every=1), kimi, gpus=16)
    check_serving_fits(TrainConfig(devices=8), kimi, gpus=8)  # nothing served
    check_serving_fits(TrainConfig(devices=1, serve_every=1), kimi, gpus=0)  # a CPU: it shares the cores
    with pytest.raises(ServingRefused, match="2 GPU"):  # replicas multiply
        check_serving_fits(TrainConfig(devices=1, serve_every=1), ServerConfig(dp_size=2), gpus=2)


def test_the_pooled_standard_error_is_the_spread_between_requests():
    """With equal verify steps everywhere the pooled ratio is a mean of
    per-request counts over a constant, and its standard error the sample
    standard deviation of those over sqrt(m) (derived in the function's
    terms); one request has none."""
    tokens, v = [48, 40, 44, 36, 52, 47, 41, 45], 30
    mean = sum(tokens) / len(tokens)
    sd = math.sqrt(sum((n - mean) ** 2 for n in tokens) / (len(tokens) - 1))
    assert pooled_standard_error([(n, v) for n in tokens]) == pytest.approx(sd / (v * math.sqrt(len(tokens))),
                                                                            rel=1e-12)
    assert pooled_standard_error([(48, 30)]) == 0.0
    metas = [{"completion_tokens": n, "spec_verify_ct": v, "spec_correct_drafts_histogram": [v]} for n in tokens]
    a = acceptance(metas, 3)
    assert a.pooled_se == pytest.approx(sd / (v * math.sqrt(len(tokens))), rel=1e-12)
    assert a.per_request == [(n, v) for n in tokens]


def served(epoch: int, steps: list[int], tokens: int = 48) -> dict:
    per_request = [[tokens, v] for v in steps]
    return {"epoch": epoch, "served": {"pooled": tokens * len(steps) / sum(steps), "per_request": per_request}}


def test_keep_best_served_keeps_an_earlier_epoch_only_past_the_margin_of_standard_errors():
    """8 prompts of 48 tokens: an earlier epoch a little ahead on average
    but not on every prompt stays within 2 standard errors, and the last
    epoch's weights are exported; one clearly ahead on every prompt is kept.
    (Before: the highest pooled figure was kept whatever the noise.)"""
    last = served(7, [33, 35, 34, 36, 33, 35, 34, 36])
    noisy = served(5, [30, 37, 33, 38, 31, 36, 32, 37])  # 1.4 % fewer steps, prompt against prompt up and down
    clear = served(5, [30, 32, 31, 33, 30, 32, 31, 33])  # 9 % fewer steps on every prompt
    choice = choose_served([{"epoch": 0}, noisy, {"epoch": 6}, last], margin=2.0)
    assert choice["best_epoch"] == 5 and choice["best_pooled"] > choice["last_pooled"]
    assert choice["epoch"] == 7 and 0 < choice["difference"] < 2 * choice["se"], choice
    assert "within 2.00 standard errors" in describe_choice(choice)
    kept = choose_served([clear, last], margin=2.0)
    assert kept["epoch"] == 5 and kept["difference"] > 2 * kept["se"] > 0, kept
    assert "exported epoch 5" in describe_choice(kept)
    assert choose_served([clear, last], margin=1000.0)["epoch"] == 7
    assert choose_served([last], margin=2.0)["epoch"] == 7
    assert choose_served([{"epoch": 0}], margin=2.0) is None
    # One prompt: no standard error, no evidence; the last epoch stays.
    assert choose_served([served(5, [30]), served(7, [34])], margin=2.0)["epoch"] == 7


def test_the_best_of_several_earlier_epochs_must_clear_a_wider_margin():
    """Bonferroni: the best of K earlier epochs faces the one-sided 2-SE tail
    split K ways (K = 4: 2.53 standard errors). A difference of 2.34 SE keeps
    the best of one earlier epoch, not the best of four."""
    last = served(9, [33, 35, 34, 36, 33, 35, 34, 36])
    best = served(5, [31, 34, 33, 35, 31, 36, 33, 36])  # 2.34 standard errors ahead
    others = [served(e, [40] * 8) for e in (3, 6, 7)]  # far behind
    one = choose_served([best, last], margin=2.0)
    ratio = one["difference"] / one["se"]
    assert 2.0 < ratio < 2.53 and one["epoch"] == 5, one
    four = choose_served([others[0], best, *others[1:], last], margin=2.0)
    assert four["threshold_se"] == pytest.approx(2.531, abs=1e-3) and four["epoch"] == 9, four
    assert "widened for the best of several epochs" in describe_choice(four)


def test_the_paired_difference_cancels_what_the_prompts_share():
    """Two epochs with the same per-prompt spread, one a constant factor
    better: pairing leaves a small error where the unpaired one is large."""
    a = [[48, v] for v in (20, 40, 25, 45, 22, 42, 27, 44)]
    b = [[48, v + 1] for v in (20, 40, 25, 45, 22, 42, 27, 44)]
    difference, se = paired_difference(a, b)
    unpaired = math.hypot(pooled_standard_error(a), pooled_standard_error(b))
    assert difference > 0 and se < unpaired / 5, (difference, se, unpaired)
    with pytest.raises(ValueError, match="same requests"):
        paired_difference(a, b[:-1])



def test_a_served_figure_is_logged_beside_the_simulation_of_the_same_drafts():
    """A DFlash drafter's block against tau_exact over the whole block, an
    EAGLE-3 chain against tau_exact@serve_steps (before, DFlash's sat beside
    the EAGLE-3 setting's)."""
    from tasks.train.served import describe_served

    entry = {"epoch": 3, "tau_exact": 2.5, "tau_exact@3": 0.9,
             "served": {"pooled": 3.4, "pooled_se": 0.05, "mean_of_means": 3.3, "per_position": [0.9, 0.8],
                        "verify_steps": 120, "requests": 8}}
    assert "accept length 3.40 +- 0.05 pooled" in describe_served(entry, "tau_exact")
    assert "held-out tau_exact 2.50 simulated" in describe_served(entry, "tau_exact")
    assert "held-out tau_exact@3 0.90 simulated" in describe_served(entry, "tau_exact@3")
