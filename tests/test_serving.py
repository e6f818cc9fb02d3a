"""EAGLE-3 speculative decoding served by real SGLang on the tiny model: it must
give exactly the plain server's greedy outputs, with SGLang's acceptance
figures in meta_info."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from tasks.serve.config import ServeConfig
from flows.serve import baseline_server
from tasks.serve.check import GenerationRun, compare, serve_check, serving_dtype
from tasks.server.config import ServerConfig
from tasks.server.launch import LaunchSpec, build_command
from tests.conftest import ARTIFACTS
from tests.random_drafter import export_random_drafter

PROMPTS = [[1, 5, 9, 33, 100, 7, 8], [1, 42], [1, 200, 300, 400]]
MAX_NEW_TOKENS = 24


def target_greedy(model_path, prompts, max_new_tokens):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    outputs = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(ids):].tolist())
    return outputs


def pin_drafter_to(draft_dir, token: int) -> None:
    """Make the drafter propose `token` at every step, whatever it sees.

    A random drafter is almost never right, so it would leave SGLang's accept
    path (verify accepting drafts, moving their KV slots) unexercised. Here the
    final norm keeps one hidden dimension d, draft ids 0 and 1 score +d and
    -d (one of them wins, with no tie), and both map to `token`."""
    path = draft_dir / "model.safetensors"
    weights = load_file(path)
    hidden = weights["norm.weight"].shape[0]
    norm = torch.zeros_like(weights["norm.weight"])
    norm[0] = 1.0
    head = torch.zeros_like(weights["lm_head.weight"])
    head[0, 0], head[1, 0] = 10.0, -10.0
    d2t = weights["d2t"].clone()
    d2t[0], d2t[1] = token, token - 1
    weights.update({"norm.weight": norm, "lm_head.weight": head, "d2t": d2t})
    assert head.shape[1] == hidden
    save_file(weights, path)


@pytest.fixture(scope="module")
def pinned_drafter(tiny_model, tmp_path_factory):
    # The tiny target repeats a few tokens greedily; drafting its favourite
    # gets whole runs of drafts accepted, and some rejected.
    favourite = Counter(t for out in target_greedy(tiny_model, PROMPTS, MAX_NEW_TOKENS)
                        for t in out).most_common(1)[0][0]
    draft_dir = export_random_drafter(tiny_model, tmp_path_factory.mktemp("drafter") / "eagle3",
                                      draft_vocab_size=512)
    pin_drafter_to(draft_dir, favourite)
    return draft_dir


@pytest.mark.server
def test_speculative_decoding_gives_the_plain_greedy_outputs(tiny_model, float32_server, pinned_drafter):
    # The plain outputs from a running float32 server of the target (the
    # launched baseline: tests/test_pipeline.py); the speculative server
    # takes its dtype.
    report = serve_check(ServerConfig(model=str(tiny_model), max_total_tokens=16384), pinned_drafter, PROMPTS,
                         ServeConfig(max_new_tokens=MAX_NEW_TOKENS, num_steps=3, baseline="attached"),
                         log_dir=ARTIFACTS / "serving", baseline_url=float32_server.url,
                         baseline_api_key=float32_server.api_key)
    assert report.baseline == float32_server.url
    launched = [line for line in (ARTIFACTS / "serving" / "speculative-server.log").read_text().splitlines()
                if line.startswith("$ ")][-1]
    assert "--dtype float32" in launched, launched
    assert report.outputs_equal, f"speculative outputs differ from plain greedy for prompts {report.differing_prompts}"
    assert report.plain_completion_tokens == report.spec_completion_tokens == len(PROMPTS) * MAX_NEW_TOKENS
    # Every request went through verify steps, and drafts were accepted and rejected.
    assert report.spec_verify_ct >= len(PROMPTS)
    assert report.spec_num_proposed_drafts == report.spec_verify_ct * (report.speculative["num_draft_tokens"] - 1)
    assert 0 < report.spec_num_correct_drafts < report.spec_num_proposed_drafts
    assert 1.0 < report.spec_accept_length <= report.speculative["num_draft_tokens"]
    assert 0.0 < report.spec_accept_rate < 1.0
    assert report.plain_tokens_per_s > 0 and report.spec_tokens_per_s > 0


@pytest.mark.server
def test_a_running_baseline_sets_the_dtype_and_a_different_one_is_refused(capture_server, tmp_path):
    from tasks.server.launch import server_dtype

    url, key, model = capture_server.url, capture_server.api_key, capture_server.spec.server.model
    theirs = serving_dtype(model, None, url, key)
    assert theirs == server_dtype(capture_server.spec, cpu=True)  # what the server was started with
    other = next(d for d in ("float32", "bfloat16") if d != theirs)
    with pytest.raises(ValueError, match=f"serve.dtype is {other}, but the baseline server at {url} computes in"):
        serving_dtype(model, other, url, key)
    with pytest.raises(ValueError, match="server.url is not set"):
        baseline_server(ServerConfig(model=model), ServeConfig(baseline="attached"))
    attached = ServerConfig(model=model, url=url)
    assert baseline_server(attached, ServeConfig()) is None
    assert baseline_server(attached, ServeConfig(baseline="attached")) is attached


def test_compare_weights_acceptance_by_verify_steps_and_names_differences():
    plain = GenerationRun([[1, 2, 3], [4, 5]], [{}, {}], wall_s=1.0)
    spec = GenerationRun([[1, 2, 3], [4, 6]], [
        {"spec_verify_ct": 1, "spec_accept_length": 3.0, "spec_num_correct_drafts": 2, "spec_num_proposed_drafts": 3},
        {"spec_verify_ct": 2, "spec_accept_length": 1.0, "spec_num_correct_drafts": 0, "spec_num_proposed_drafts": 6},
    ], wall_s=0.5)
    report = compare(plain, spec, {"num_draft_tokens": 4})
    assert not report.outputs_equal and report.differing_prompts == [1]
    assert report.spec_verify_ct == 3
    assert report.spec_accept_length == pytest.approx((3.0 * 1 + 1.0 * 2) / 3)
    assert report.spec_accept_rate == pytest.approx(2 / 9)
    assert report.speedup == pytest.approx(2.0)


def test_speculative_server_command(tmp_path):
    cfg = LaunchSpec(ServerConfig(model="m"), dump_dir=tmp_path, capture=False, draft_model_path="d",
                     speculative_num_steps=5, speculative_eagle_topk=2, speculative_num_draft_tokens=8)
    cmd = build_command(cfg, 1234, cpu=True)
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--speculative-algorithm"] == "EAGLE3" and flags["--speculative-draft-model-path"] == "d"
    assert (flags["--speculative-num-steps"], flags["--speculative-eagle-topk"],
            flags["--speculative-num-draft-tokens"]) == ("5", "2", "8")
    assert flags["--attention-backend"] == "intel_amx"
    assert "--enable-return-aux-hidden-states" not in cmd
    assert "--attention-backend" not in build_command(cfg, 1234, cpu=False)
    assert "--speculative-algorithm" not in build_command(LaunchSpec(ServerConfig(model="m"), dump_dir=tmp_path,
                                                                     capture=False), 1234, cpu=True)
    with pytest.raises(ValueError, match="capture server cannot also serve a drafter"):
        build_command(LaunchSpec(ServerConfig(model="m"), dump_dir=tmp_path, draft_model_path="d"), 1234, cpu=True)
