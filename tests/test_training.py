"""Drafter training on a real store of the tiny model: it learns, what it
learns is checked by an independent forward against the target's own greedy
tokens, a killed run resumes to the same result, and unverified data is
refused."""
from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tasks.store.reader import StoreReader
from tasks.store.verification import StoreNotVerified, require_verified
from tasks.train.checkpoint import CHECKPOINT, identity_changes
from tasks.train.config import TrainConfig, TrainingError
from tasks.train.data import split
from tasks.train.launch import result_from_dir, write_launch_config
from tasks.train.loop import train
from tests.conftest import tiny_train_config as config

pytestmark = pytest.mark.server
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trained(tiny_pipeline):
    """The training the pipeline test's run did (conftest's `tiny_pipeline`),
    read back as its rank 0 recorded it."""
    _, cfg = tiny_pipeline
    return cfg, result_from_dir(Path(cfg.out_dir))


def test_training_beats_the_untrained_drafter(trained):
    _, result = trained
    untrained, final = result.history[0], result.history[-1]
    assert len(result.history) == 7  # untrained + 6 epochs
    assert final["loss"] < 0.5 * untrained["loss"]
    assert final["tau"] > untrained["tau"] + 0.4, (untrained, final)
    assert final["acc"][0] > 0.3
    # Deeper steps see their own (imperfect) hidden states: no better than step 0.
    assert final["acc"][0] >= final["acc"][-1]


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotate-half RoPE, written out. x [h, L, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def independent_step0_predictions(drafter_dir: Path, target: Path, input_ids: torch.Tensor,
                                  aux: torch.Tensor) -> torch.Tensor:
    """The exported drafter's first draft token at every position, computed
    from the exported files alone, as SGLang's draft extend does: position t
    takes fc(aux_t) and the embedding of token t+1, full causal attention."""
    cfg = json.loads((drafter_dir / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(drafter_dir / "model.safetensors")).items()}
    target_w = load_file(str(target / "model.safetensors"))
    embed = target_w["model.embed_tokens.weight"].float()
    eps, heads, kv = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    theta = cfg["rope_parameters"]["rope_theta"]
    n = len(input_ids) - 1
    hidden = aux[:n].reshape(n, -1).float() @ w["fc.weight"].T
    e = embed[input_ids[1:].long()]
    x = torch.cat([_norm(e, w["midlayer.input_layernorm.weight"], eps),
                   _norm(hidden, w["midlayer.hidden_norm.weight"], eps)], -1)
    d = w["midlayer.self_attn.q_proj.weight"].shape[0] // heads
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv, d).transpose(0, 1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv, d).transpose(0, 1)
    pos = torch.arange(n)
    q, k = _rope(q, pos, theta), _rope(k, pos, theta)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(n, -1)
    h = attn @ w["midlayer.self_attn.o_proj.weight"].T + hidden
    m = _norm(h, w["midlayer.post_attention_layernorm.weight"], eps)
    h = (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) \
        @ w["midlayer.mlp.down_proj.weight"].T + h
    logits = _norm(h, w["norm.weight"], eps) @ w["lm_head.weight"].T
    draft = logits.argmax(-1)
    return draft + w["d2t"].long()[draft]  # SGLang: hot_token_id = d2t + arange


def test_served_acceptance_during_training_is_sglangs_own_count_and_the_best_served_is_exported(trained):
    from tasks.train.served import choose_served, served_dir

    cfg, result = trained
    served = [m for m in result.history if m.get("served")]
    assert [m["epoch"] for m in served] == [3, 6]  # serve_every 3 of 6 epochs; never the untrained drafter
    for m in served:
        raw = [json.loads(line) for line in
               (served_dir(cfg.out_dir, m["epoch"]) / "requests.jsonl").read_text().splitlines()]
        s = m["served"]
        assert 1 <= len(raw) == s["requests"] <= cfg.serve_prompts
        tokens, steps = sum(r["completion_tokens"] for r in raw), sum(r["spec_verify_ct"] for r in raw)
        assert tokens == len(raw) * cfg.serve_max_new_tokens and steps == s["verify_steps"]
        assert s["pooled"] == tokens / steps  # SGLang's counts, by hand
        histogram = [sum(c) for c in zip(*(r["spec_correct_drafts_histogram"] + [0] * (4 - len(
            r["spec_correct_drafts_histogram"])) for r in raw))]
        assert s["per_position"] == [sum(histogram[k:]) / steps for k in range(1, 4)]
    # The epoch kept is the last unless an earlier one served better by more than its margin of standard
    # errors (served.choose_served, its own tests: tests/test_served.py), not the best by a hair.
    choice = choose_served(result.history, cfg.keep_best_margin)
    assert result.served_choice == choice and choice["last_epoch"] == 6
    assert result.exported_epoch == (None if choice["epoch"] == 6 else choice["epoch"])
    # The drafter is the chosen epoch's export, byte for byte (a fresh export of the same weights when
    # that is the last epoch).
    for name in ("model.safetensors", "config.json"):
        assert (Path(result.drafter_dir) / name).read_bytes() == (
            served_dir(cfg.out_dir, choice["epoch"]) / "drafter" / name).read_bytes()
    table = (Path(cfg.out_dir) / "metrics.csv").read_text().splitlines()
    header = table[0].split(",")
    column = [row.split(",")[header.index("served_accept_length")] for row in table[1:]]
    assert column == ["" if not m.get("served") else str(round(m["served"]["pooled"], 3)) for m in result.history]


def test_an_independent_forward_agrees_with_the_targets_greedy_tokens(trained, tiny_store, tiny_model):
    """Not the training code's alignment: the target model itself (HF, fp32)
    says which token comes next, and the exported files alone say what the
    drafter proposes. Labels shifted by one would make these disagree."""
    from transformers import AutoModelForCausalLM

    cfg, result = trained
    reader = StoreReader(tiny_store)
    _, held = split(reader.sample_ids, cfg.heldout_fraction)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    hits = total = 0
    for i in held[:24]:
        s = reader[int(i)]
        ids = s["input_ids"].long()
        with torch.no_grad():
            greedy = model(input_ids=ids[None]).logits[0].argmax(-1)  # greedy[j] follows ids[:j+1]
        proposed = independent_step0_predictions(Path(result.drafter_dir), tiny_model, ids, s["aux_hidden_states"])
        # Position t proposes the token after t+1: the target's greedy[t+1].
        scored = s["loss_mask"][2:].bool()
        hits += int(((proposed[:-1] == greedy[1:-1]) & scored).sum())
        total += int(scored.sum())
    independent = hits / total
    reported = result.final["acc"][0]
    assert total > 300
    assert independent > 0.3
    assert abs(independent - reported) < 0.08, (independent, reported)


def test_a_killed_run_resumes_to_the_same_result(trained, tiny_store, tmp_path):
    cfg, uninterrupted = trained
    out = tmp_path / "run"
    killed_cfg = config(out, checkpoint_every=3)
    out.mkdir()
    write_launch_config(out / "cfg.json", killed_cfg, tiny_store)
    proc = subprocess.Popen([sys.executable, "-m", "tasks.train.launch", "--config", str(out / "cfg.json")],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    try:
        # Kill mid-epoch 2, just after some checkpoint: the resume replays the rest.
        while time.time() < deadline:
            if (out / CHECKPOINT).exists():
                state = torch.load(out / CHECKPOINT, weights_only=False)
                if state["epoch"] == 1 and state["batches_done"] > 0:
                    break
            assert proc.poll() is None, "training exited before it could be killed"
            time.sleep(0.5)
        else:
            pytest.fail("no mid-epoch checkpoint within 300 s")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed_at = torch.load(out / CHECKPOINT, weights_only=False)
    assert not (out / "drafter").exists()

    resumed = train(killed_cfg, tiny_store)
    assert resumed.resumed_from == {"epoch": killed_at["epoch"], "batches_done": killed_at["batches_done"],
                                    "step": killed_at["step"]}
    assert resumed.steps == uninterrupted.steps
    for a, b in zip(resumed.history, uninterrupted.history):
        assert a["epoch"] == b["epoch"]
        assert math.isclose(a["tau"], b["tau"], abs_tol=0.03), (a, b)
        assert math.isclose(a["loss"], b["loss"], rel_tol=0.02), (a, b)


def test_a_changed_setting_is_not_resumed_silently(trained, tiny_store, tmp_path):
    cfg, _ = trained
    out = tmp_path / "run"
    shutil.copytree(cfg.out_dir, out)
    with pytest.raises(Exception, match="other settings.*lr"):
        train(config(out, lr=1e-4), tiny_store)
    with pytest.raises(Exception, match="other settings.*variant"):
        train(config(out, variant="eagle3.1"), tiny_store)


def test_a_drafter_asking_for_layers_the_store_lacks_is_refused_naming_what_it_holds(tiny_store, tmp_path):
    with pytest.raises(TrainingError, match=r"train.aux_layer_ids \[1, 2, 3\]: aux layers \[2\] are not in the "
                                            r"store, which holds outputs of layers \[1, 3, 4\]"):
        train(config(tmp_path / "out", aux_layer_ids=[1, 2, 3]), tiny_store)
    assert not (tmp_path / "out" / "drafter").exists()


def test_unverified_or_failed_stores_are_refused(tiny_store, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    require_verified(store)
    latest = store / "reports" / "latest.json"
    report = json.loads(latest.read_text())
    latest.write_text(json.dumps({**report, "ok": False, "failed_files": 1}))
    with pytest.raises(StoreNotVerified, match="failed its last verification"):
        train(config(tmp_path / "out"), store)
    latest.unlink()
    with pytest.raises(StoreNotVerified, match="no verification report.*flows.verify"):
        train(config(tmp_path / "out"), store)


def test_two_process_ddp_run_trains_and_exports(tiny_store, tmp_path):
    """torchrun with two CPU processes (gloo): the same code as on GPUs."""
    from tasks.train.launch import launch_distributed

    result = launch_distributed(config(tmp_path / "ddp", epochs=1, devices=2), tiny_store)
    assert (Path(result.drafter_dir) / "model.safetensors").exists()
    assert result.final["tau"] > result.history[0]["tau"]


def test_checkpoints_written_before_the_dflash_settings_resume_as_they_trained():
    """An EAGLE-3 checkpoint of then held loss_gamma 7.0 (unread by it) and
    resumes; a DFlash one of then trained on the data's tokens with gamma 7:
    it resumes as such (labels data, blocks of 16, whose gamma is 7) and is
    refused, naming the setting, as a target-labelled run or at another
    block's gamma."""
    then = TrainConfig().model_dump()
    then.pop("labels"), then.pop("head_dim"), then.pop("keep_best_margin")
    then = {k: v for k, v in then.items() if k not in TrainConfig.resumable()}
    then.update(store="s", loss_gamma=7.0)
    assert identity_changes(then, TrainConfig(), "s")[1] == {}
    dflash_then = {**then, "method": "dflash", "block_size": 16}
    assert identity_changes(dflash_then, TrainConfig(method="dflash", labels="data"), "s")[1] == {}
    assert identity_changes(dflash_then, TrainConfig(method="dflash"), "s")[1] == {"labels": ("data", "target")}
    assert identity_changes({**dflash_then, "block_size": 8}, TrainConfig(method="dflash", labels="data",
                                                                          block_size=8), "s")[1] == \
        {"loss_gamma": (7.0, 4.0)}
