"""The drafter's parts on plain inputs: draft vocabulary, export layout,
batching, the schedule. (Its TTT attention: tests/test_drafter_attention.py.)"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tasks.target.architectures import LLAMA
from tasks.target.layers import AuxLayers
from tasks.train.config import TrainConfig
from tasks.train.data import plan_batches
from tasks.target.embeddings import load_target_embeddings
from tasks.train.eagle3.model import DrafterConfig, build_drafter
from tasks.train.layers.sizes import target_sizes
from tasks.train.eagle3.mla import MLA_DIMS
from tasks.train.export import UnservedTensor
from tasks.train.eagle3.export import export_drafter, export_weights, load_exported
from tasks.train.loop import lr_at
from tasks.train.metrics import write_metrics
from tasks.train.run import autocast_dtype
from tasks.train.eagle3.ttt import chain_hits, divergence, ttt_forward
from tasks.train.metrics import acceptance_length, exact_acceptance_length
from tasks.train.vocab import DraftVocab, count_target_tokens, target_greedy
from tests.random_drafter import export_random_drafter
from tests.tiny_models import TINY, TINY_DEEPSEEK_V3, TINY_KIMI_K25, ensure_model


def test_draft_vocab_keeps_the_most_frequent_ids_and_maps_them_like_sglang():
    counts = np.array([0, 5, 1, 9, 5, 0, 7])
    vocab = DraftVocab.from_counts(counts, 4)
    assert vocab.target_ids.tolist() == [1, 3, 4, 6]  # 9, 7, 5, 5 (tie by id)
    assert (vocab.d2t + torch.arange(4)).tolist() == [1, 3, 4, 6]  # SGLang: hot_token_id = d2t + arange
    assert vocab.t2d.nonzero().flatten().tolist() == [1, 3, 4, 6]
    assert DraftVocab.from_d2t(vocab.d2t, 7).target_ids.tolist() == [1, 3, 4, 6]
    assert DraftVocab.from_counts(counts, 100).size == 7


def test_the_targets_greedy_tokens_are_counted_where_the_next_token_is_masked():
    head = torch.eye(5)  # the greedy token of a one-hot state is its index
    final = torch.eye(5)[[4, 1, 3, 0]]  # greedy tokens 4, 1, 3, 0 predict positions 1..4
    samples = [{"loss_mask": [1, 0, 1, 1], "final_hidden_state": final}]
    # Tokens 2 and 3 are masked: predicted at positions 1 and 2, greedy 1 and 3.
    assert count_target_tokens(samples, head).tolist() == [0, 1, 0, 1, 0]
    assert count_target_tokens(samples * 3, head, max_tokens=2).tolist() == [0, 1, 0, 1, 0]
    # Batched across samples or not, in bf16 or fp32 (one-hot states leave no near-ties), the same counts.
    for per_matmul in (1, 2, 5, 8192):
        for dtype in (torch.float32, torch.bfloat16):
            got = count_target_tokens(samples * 3, head, max_tokens=5, dtype=dtype, positions_per_matmul=per_matmul)
            assert got.tolist() == [0, 3, 0, 2, 0], (per_matmul, dtype)



class Samples(list):
    """What draft_vocab reads of a store: samples and their token counts."""

    @property
    def num_tokens(self):
        return np.array([len(s["loss_mask"]) for s in self])


def _vocab_on_rank(rank, port, results):
    import os

    from tasks.train.eagle3.training import draft_vocab

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        head = torch.eye(40)
        # Each rank sees other data: only rank 0's may decide, or the ranks would train different drafters.
        greedy = list(range(24, 40)) if rank == 0 else list(range(16))
        samples = Samples([{"loss_mask": [1] * (len(greedy) + 1), "final_hidden_state": torch.eye(40)[greedy + [0]]}])
        cfg = TrainConfig(draft_vocab_size=16)
        results[rank] = draft_vocab(cfg, samples, np.arange(1), head, torch.device("cpu"), rank, 2).target_ids.tolist()
    finally:
        torch.distributed.destroy_process_group()


def test_under_ddp_rank_0_counts_the_draft_vocabulary_and_every_rank_gets_it():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_vocab_on_rank, args=(port, results), nprocs=2)
    assert results[0] == results[1] == list(range(24, 40))

def test_export_has_sglangs_layout_and_reads_back(tiny_model, tmp_path):
    vocab = DraftVocab.from_counts(np.arange(2048)[::-1].copy(), 256)
    model = build_drafter(tiny_model, vocab, seed=1)
    layers = AuxLayers.for_model(8)
    out = export_drafter(model, layers, tmp_path / "drafter", architecture=LLAMA, extra={"note": "test"})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 256
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert config["tie_word_embeddings"] is False
    tensors = load_file(str(out / "model.safetensors"))
    h = config["hidden_size"]
    assert tensors["fc.weight"].shape == (h, 3 * h)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert tensors["lm_head.weight"].shape == (256, h)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert "embed_tokens.weight" not in tensors
    # lm_head starts as the target's rows of the draft vocabulary.
    _, head = load_target_embeddings(tiny_model)
    assert torch.allclose(tensors["lm_head.weight"].float(), head[torch.from_numpy(vocab.target_ids)], atol=1e-2)
    back = export_weights(load_exported(out, tiny_model))
    for name, t in export_weights(model).items():
        assert torch.allclose(back[name].float(), t.float(), rtol=1e-2, atol=1e-3), name


def test_an_eagle31_export_carries_sglangs_flags_and_its_own_fc_norms(tiny_model, tmp_path):
    vocab = DraftVocab.from_counts(np.arange(2048)[::-1].copy(), 256)
    model = build_drafter(tiny_model, vocab, seed=1, variant="eagle3.1")
    with torch.no_grad():
        for i, norm in enumerate(model.fc_norm):
            norm.weight.copy_(torch.linspace(0.5, 2.0, norm.weight.numel()) + i)  # each its own, none all ones
    out = export_drafter(model, AuxLayers.for_model(8), tmp_path / "drafter", architecture=LLAMA)
    config = json.loads((out / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (True, True)
    tensors = load_file(str(out / "model.safetensors"))
    # SGLang's parameter names are model.fc_norm.<i>; its loader prefixes "model." itself.
    assert sorted(k for k in tensors if k.startswith("fc_norm")) == [f"fc_norm.{i}.weight" for i in range(3)]
    back = load_exported(out, tiny_model)
    assert back.cfg.variant == "eagle3.1"
    for i in range(3):
        assert torch.equal(back.fc_norm[i].weight, tensors[f"fc_norm.{i}.weight"].float())
    plain = export_drafter(build_drafter(tiny_model, vocab), AuxLayers.for_model(8), tmp_path / "plain",
                           architecture=LLAMA)
    config = json.loads((plain / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (False, False)
    assert not any(k.startswith("fc_norm") for k in load_file(str(plain / "model.safetensors")))
    assert load_exported(plain, tiny_model).fc_norm is None
    with pytest.raises(ValueError, match="not a variant this project trains"):
        (plain / "config.json").write_text(json.dumps({**config, "norm_output": True}))
        load_exported(plain, tiny_model)


def test_eagle31_normalises_each_aux_state_and_feeds_the_normed_output_back(tiny_model):
    vocab = DraftVocab.from_counts(np.arange(2048)[::-1].copy(), 256)
    model = build_drafter(tiny_model, vocab, seed=1, variant="eagle3.1")
    h = model.cfg.hidden_size
    aux = torch.randn(1, 5, 3, h)
    # An RMSNorm per state undoes a scale per state (up to eps / (2 mean square) <= 1e-5 relative here).
    scaled = aux * torch.tensor([4.0, 1.0, 16.0])[None, None, :, None]
    with torch.no_grad():
        torch.testing.assert_close(model.project(scaled.flatten(2)), model.project(aux.flatten(2)), rtol=1e-4, atol=1e-5)
        plain = build_drafter(tiny_model, vocab, seed=1)
        assert not torch.allclose(plain.project(scaled.flatten(2)), plain.project(aux.flatten(2)), rtol=1e-2)
        out = torch.randn(1, 5, h)
        logits, fed = model.readout(out)
        torch.testing.assert_close(fed, model.norm(out))
        torch.testing.assert_close(logits, model.logits(out))
        assert plain.readout(out)[1] is out  # eagle3: the pre-norm output


def test_a_tied_target_gives_its_embedding_as_head_and_an_untied_drafter(tiny_model, tmp_path):
    tied = tmp_path / "tied"
    shutil.copytree(tiny_model, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(str(tied / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(tied / "model.safetensors"))
    embed, head = load_target_embeddings(tied)
    assert torch.equal(embed, head)
    out = export_drafter(build_drafter(tied, DraftVocab.from_counts(np.ones(2048), 64)), AuxLayers.for_model(8),
                         tmp_path / "drafter", architecture=LLAMA)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False



def test_the_export_says_the_drafter_has_no_biases_even_if_the_target_has(tiny_model, tmp_path):
    biased = tmp_path / "biased"
    shutil.copytree(tiny_model, biased)
    config = json.loads((biased / "config.json").read_text())
    (biased / "config.json").write_text(json.dumps({**config, "attention_bias": True, "mlp_bias": True}))
    model = build_drafter(biased, DraftVocab.from_counts(np.ones(2048), 64))
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    out = export_drafter(model, AuxLayers.for_model(8), tmp_path / "drafter", architecture=LLAMA)
    config = json.loads((out / "config.json").read_text())
    assert config["attention_bias"] is False and config["mlp_bias"] is False


@pytest.mark.parametrize("target, passed", [(TINY, [2, 5, 6]), (TINY_KIMI_K25, [3, 6, 7])])
def test_the_export_gives_the_aux_layers_as_the_targets_sglang_class_reads_them(target, passed, tmp_path):
    # Outputs of layers 2, 5, 6 (not the default 1, 3, 4): Llama's class
    # captures id + 1, DeepSeek-style ones (Kimi-K2.5) take ids not starting
    # at 1 as they are (tests/test_drafter_in_sglang.py serves both).
    out = export_random_drafter(ensure_model(target), tmp_path / "drafter", draft_vocab_size=64,
                                aux_layer_ids=(2, 5, 6))
    eagle = json.loads((out / "config.json").read_text())["eagle_config"]
    assert eagle["eagle_aux_hidden_state_layer_ids"] == passed
    assert eagle["layer_output_ids"] == [2, 5, 6] and eagle["hf_hidden_state_indices"] == [3, 6, 7]


def test_a_drafter_on_layer_0_is_refused_for_a_target_sglang_cannot_capture_it_from(tmp_path):
    with pytest.raises(ValueError, match="output of layer 0"):
        export_random_drafter(ensure_model(TINY_KIMI_K25), tmp_path / "drafter", draft_vocab_size=64,
                              aux_layer_ids=(0, 5, 6))


def test_acceptance_length_is_the_sum_of_running_products():
    assert acceptance_length([1.0, 1.0, 1.0]) == 3.0
    assert acceptance_length([0.5, 0.5]) == 0.75
    assert acceptance_length([0.0, 1.0]) == 0.0



def test_the_exact_tau_follows_each_chain_where_the_product_assumes_independence():
    # Four starting positions, two steps, half of each step hits: tau = 0.5 + 0.5^2.
    step0 = torch.tensor([True, True, False, False])
    everywhere = [torch.ones(4, dtype=torch.bool)] * 2
    same = chain_hits([step0, step0.clone()], everywhere)  # the same positions hit at both steps
    opposite = chain_hits([step0, ~step0], everywhere)  # the positions step 0 missed hit at step 1
    assert acceptance_length([0.5, 0.5]) == 0.75
    assert same[0].tolist() == [2, 2] and exact_acceptance_length(*same) == 1.0
    assert opposite[0].tolist() == [2, 0] and exact_acceptance_length(*opposite) == 0.5
    # A chain whose step 1 is not scored (the answer ends) counts only where it is.
    partly = chain_hits([step0, step0.clone()], [everywhere[0], torch.tensor([True, False, True, True])])
    assert partly[0].tolist() == [2, 1] and partly[1].tolist() == [4, 3]
    assert exact_acceptance_length(*partly) == pytest.approx(0.5 + 1 / 3)


def test_metrics_files_hold_both_taus_and_rows_from_before_the_exact_one(tmp_path):
    old = {"epoch": 0, "step": 0, "loss": 9.0, "acc": [0.1, 0.0], "tau": 0.1, "tau@1": 0.1}
    new = {"epoch": 1, "step": 5, "loss": 4.0, "acc": [0.5, 0.5], "tau": 0.75, "tau@1": 0.5, "tau_exact": 1.0,
           "tau_exact@1": 0.5}
    files = write_metrics(tmp_path, [old, new])
    import csv

    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert {k: rows[1][k] for k in ("tau", "tau@1", "tau_exact", "tau_exact@1")} == \
        {"tau": "0.75", "tau@1": "0.5", "tau_exact": "1.0", "tau_exact@1": "0.5"}
    assert rows[0]["tau_exact"] == ""
    assert (tmp_path / "metrics.png").stat().st_size > 0 and files["plot"].endswith("metrics.png")


def _synthetic_batch(cfg, b=2, n=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (b, n), generator=g),
        "loss_mask": torch.rand(b, n, generator=g) < 0.8,
        "lengths": torch.tensor([n, n - 4]),
        "aux": torch.randn(b, n, cfg.num_aux * cfg.hidden_size, generator=g),
        "final": torch.randn(b, n, cfg.hidden_size, generator=g),
    }


def test_positions_whose_target_token_the_draft_vocabulary_lacks_are_left_out_of_the_loss_only(tiny_model):
    vocab = DraftVocab.from_counts(np.arange(2048)[::-1].copy(), 512)  # target ids 0..511
    model = build_drafter(tiny_model, vocab, seed=1)
    _, head = load_target_embeddings(tiny_model)
    head_rows = head[torch.from_numpy(vocab.target_ids)]
    batch = _synthetic_batch(model.cfg)
    greedy = target_greedy(batch["final"], head)
    assert torch.equal(greedy, (batch["final"] @ head.T).argmax(-1))
    proposable = model.t2d[greedy]
    assert proposable.any() and not proposable.all()
    # The same as dropping, by hand, the loss mask of the token each such greedy token predicts.
    by_hand = dict(batch, loss_mask=batch["loss_mask"] & torch.cat([torch.ones(2, 1, dtype=torch.bool),
                                                                    proposable[:, :-1]], dim=1))
    kw = dict(steps=3, decay=0.8)
    with torch.no_grad():
        parity = ttt_forward(model, batch, head_rows, full_head=head, **kw)
        want = ttt_forward(model, by_hand, head_rows, **kw)
        everything = ttt_forward(model, batch, head_rows, **kw)
    assert torch.allclose(parity.loss, want.loss) and not torch.allclose(parity.loss, everything.loss)
    assert torch.equal(parity.in_loss, want.counted)
    # Accuracy still counts every scored position.
    assert torch.equal(parity.counted, everything.counted) and (parity.in_loss < parity.counted).all()
    assert parity.chained[0] == parity.correct[0] and (parity.chained <= parity.correct).all()


def test_the_losses_are_cross_entropy_total_variation_and_their_sum(tiny_model):
    """tv is what speculative sampling rejects, 1 - sum min(p, q), computed
    here independently; kl_tv their sum; and the unrolled loss of each is
    its per-position value under the same weights."""
    p = torch.softmax(torch.randn(5, 7, generator=torch.Generator().manual_seed(0)), -1)
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    q = torch.softmax(logits, -1)
    assert torch.allclose(divergence("tv", p, logits), 1 - torch.minimum(p, q).sum(-1), atol=1e-6)
    assert torch.allclose(divergence("forward_kl", p, logits), -(p * q.log()).sum(-1), atol=1e-6)
    assert torch.allclose(divergence("kl_tv", p, logits),
                          divergence("forward_kl", p, logits) + divergence("tv", p, logits))
    assert torch.allclose(divergence("tv", q, logits), torch.zeros(5), atol=1e-6)
    with pytest.raises(ValueError, match="use one of forward_kl, tv, kl_tv"):
        divergence("reverse_kl", p, logits)
    vocab = DraftVocab.from_counts(np.arange(2048)[::-1].copy(), 512)
    model = build_drafter(tiny_model, vocab, seed=1)
    _, head = load_target_embeddings(tiny_model)
    batch, head_rows = _synthetic_batch(model.cfg), head[torch.from_numpy(vocab.target_ids)]
    with torch.no_grad():
        runs = {kind: ttt_forward(model, batch, head_rows, steps=3, decay=0.8, full_head=head, loss=kind)
                for kind in ("forward_kl", "tv", "kl_tv")}
    assert all(0 <= loss <= 1 for loss in runs["tv"].step_losses)
    assert torch.allclose(runs["kl_tv"].step_losses, runs["forward_kl"].step_losses + runs["tv"].step_losses)
    assert torch.equal(runs["tv"].correct, runs["forward_kl"].correct)  # the same drafter, the same hits
    with pytest.raises(ValueError, match="train.method dflash: loss 'tv'"):
        TrainConfig(method="dflash", loss="tv")


def test_the_targets_greedy_token_is_found_in_chunks_of_positions(monkeypatch):
    head = torch.randn(1000, 8)
    final = torch.randn(3, 50, 8)
    monkeypatch.setattr("tasks.train.vocab._GREEDY_CHUNK", 7 * 1000)  # 7 positions a chunk, a ragged last one
    assert torch.equal(target_greedy(final, head), (final @ head.T).argmax(-1))


def test_precision_auto_is_bf16_autocast_on_accelerators_and_fp32_on_a_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert autocast_dtype("auto", cpu) is None and autocast_dtype("auto", cuda) == torch.bfloat16
    assert autocast_dtype("fp32", cuda) is None and autocast_dtype("bf16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="precision 'fp16'"):
        TrainConfig(precision="fp16")


def test_a_bf16_autocast_step_keeps_fp32_weights_and_gradients_and_agrees_with_fp32(tiny_model):
    vocab = DraftVocab.from_counts(np.arange(2048)[::-1].copy(), 512)
    model = build_drafter(tiny_model, vocab, seed=1)
    _, head = load_target_embeddings(tiny_model)
    head_rows = head[torch.from_numpy(vocab.target_ids)]
    batch = _synthetic_batch(model.cfg, n=40)
    kw = dict(steps=3, decay=0.8, full_head=head)
    fp32 = ttt_forward(model, batch, head_rows, **kw)
    fp32.loss.backward()
    want = model.midlayer.q_proj.weight.grad.clone()
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = ttt_forward(model, batch, head_rows, **kw)
    bf16.loss.backward()
    got = model.midlayer.q_proj.weight.grad
    assert bf16.loss.dtype == torch.float32 and got.dtype == torch.float32
    assert 0 < abs(bf16.loss.item() - fp32.loss.item()) < 0.02 * fp32.loss.item()  # bf16 ran, and agrees
    assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.95

def test_batches_cover_every_sample_once_within_budget_and_replay_by_epoch():
    lengths = np.random.default_rng(0).integers(5, 300, size=200)
    idx = np.arange(0, 200, 2)
    a = plan_batches(lengths, idx, 1024, seed=3, epoch=1)
    assert sorted(i for b in a for i in b) == idx.tolist()
    assert all(max(lengths[b]) * len(b) <= 1024 or len(b) == 1 for b in a)
    assert a == plan_batches(lengths, idx, 1024, seed=3, epoch=1)
    assert a != plan_batches(lengths, idx, 1024, seed=3, epoch=2)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    cfg = TrainConfig(lr=1.0, warmup_fraction=0.1)
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[0] < lrs[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1, abs=0.01)


def test_an_mla_drafter_takes_the_mla_targets_dims_and_needs_them_given_for_another_target():
    kimi = target_sizes(ensure_model(TINY_KIMI_K25))
    cfg = DrafterConfig.from_target(kimi, 64, attention="mla")
    assert cfg.mla_dims == {k: kimi[k] for k in MLA_DIMS} and cfg.rope_interleave is True
    assert cfg.num_key_value_heads == cfg.num_attention_heads
    # Dims of the drafter's own must be ones SGLang's GPU MLA kernels take:
    # a 512 latent with 64 rope dims (FlashMLA, trtllm_mla, fa4, Triton's MLA decode).
    with pytest.raises(ValueError, match="kv_lora_rank 16, qk_rope_head_dim 32, .*take a 512 latent with 64 rope "
                                         "dims; set train.mla_dims to kv_lora_rank 512, qk_rope_head_dim 64"):
        DrafterConfig.from_target(kimi, 64, attention="mla", mla_dims={"kv_lora_rank": 16})
    llama = target_sizes(ensure_model(TINY))  # a plain rope, no MLA dims
    with pytest.raises(ValueError, match="needs q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
                                         "v_head_dim: the target has none"):
        DrafterConfig.from_target(llama, 64, attention="mla")
    with pytest.raises(ValueError, match="kv_lora_rank 32, qk_rope_head_dim 8, qk_nope_head_dim 16, v_head_dim 24"):
        DrafterConfig.from_target(llama, 64, attention="mla", mla_dims=dict(
            q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24))
    dims = dict(q_lora_rank=48, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    assert DrafterConfig.from_target(llama, 64, attention="mla", mla_dims=dims).mla_dims == dims
    with pytest.raises(ValueError, match="'longrope': SGLang serves an MLA drafter only plain or YaRN rope"):
        DrafterConfig.from_target({**llama, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, 64,
                                  attention="mla", mla_dims=dims)
    with pytest.raises(ValueError, match="mla_dims .* sizes an MLA drafter: set train.attention mla"):
        TrainConfig(mla_dims={"kv_lora_rank": 16})
    with pytest.raises(ValueError, match="kv_rank: not an MLA dim"):
        TrainConfig(attention="mla", mla_dims={"kv_rank": 16})


@pytest.mark.parametrize("target", [TINY_KIMI_K25, TINY_DEEPSEEK_V3])
def test_an_mla_export_has_sglangs_mla_layout_and_reads_back(target, tmp_path):
    path = ensure_model(target)
    model = build_drafter(path, DraftVocab.from_counts(np.arange(2048)[::-1].copy(), 256), seed=1,
                          variant="eagle3.1", attention="mla")
    # The tiny targets' YaRN: factor 4, mscale_all_dim 1, qk head 32 + 32.
    assert model.midlayer.scale == pytest.approx(64 ** -0.5 * (0.1 * np.log(4.0) + 1) ** 2, rel=1e-12)
    out = export_drafter(model, AuxLayers.for_model(8), tmp_path / "drafter", architecture=LLAMA)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v3"
    sizes = target_sizes(path)
    assert {k: config[k] for k in (*MLA_DIMS, "rope_parameters", "rope_interleave")} == \
        {k: sizes[k] for k in (*MLA_DIMS, "rope_parameters", "rope_interleave")}
    assert (config["fc_norm"], config["norm_output"], config["draft_vocab_size"]) == (True, True, 256)
    tensors = load_file(str(out / "model.safetensors"))
    h, attn = config["hidden_size"], "midlayer.self_attn."
    # The two down-projections SGLang fuses (q_a first) both take the 2H input.
    assert tensors[attn + "q_a_proj.weight"].shape == (64, 2 * h)
    assert tensors[attn + "kv_a_proj_with_mqa.weight"].shape == (64 + 32, 2 * h)
    assert tensors[attn + "kv_b_proj.weight"].shape == (4 * (32 + 32), 64)
    assert tensors[attn + "o_proj.weight"].shape == (h, 4 * 32)
    back = load_exported(out, path)
    assert back.cfg == model.cfg
    for name, t in export_weights(model).items():
        assert torch.allclose(export_weights(back)[name].float(), t.float(), rtol=1e-2, atol=1e-3), name


@pytest.mark.parametrize("attention, part", [("gqa", "q_proj"), ("mla", "q_a_proj")])
def test_the_export_refuses_a_tensor_sglang_would_drop_naming_it_and_writes_nothing(attention, part, tmp_path):
    path = ensure_model(TINY_KIMI_K25)
    model = build_drafter(path, DraftVocab.from_counts(np.ones(2048), 64), attention=attention)
    # A bias SGLang's class has no parameter for: its loader skips it.
    proj = getattr(model.midlayer, part)
    proj.bias = torch.nn.Parameter(torch.ones(proj.out_features))
    with pytest.raises(UnservedTensor, match=rf"skips midlayer\.self_attn\.{part}\.bias \(no parameter"):
        export_drafter(model, AuxLayers.for_model(8), tmp_path / "drafter", architecture=LLAMA)
    assert list(tmp_path.iterdir()) == []
    # eagle3.1's config builds fc norms in SGLang: without their tensors they stay ones.
    model = build_drafter(path, DraftVocab.from_counts(np.ones(2048), 64), variant="eagle3.1", attention=attention)
    model.fc_norm = None
    with pytest.raises(UnservedTensor, match=r"nothing fills fc_norm\.0\.weight, fc_norm\.1\.weight"):
        export_drafter(model, AuxLayers.for_model(8), tmp_path / "drafter", architecture=LLAMA)
    assert list(tmp_path.iterdir()) == []


def test_served_epochs_and_the_copy_of_an_earlier_one(tmp_path):
    from tasks.train.config import TrainConfig
    from tasks.train.export import copy_drafter
    from tasks.train.served import same_files, serve_now

    cfg = TrainConfig(epochs=7, serve_every=3)
    assert [e for e in range(8) if serve_now(cfg, e)] == [3, 6, 7]  # every 3rd and the last, never untrained
    assert not any(serve_now(TrainConfig(epochs=7), e) for e in range(8))
    with pytest.raises(ValueError, match="keep_best_served picks among the epochs served.*serve_every"):
        TrainConfig(keep_best_served=True)
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"weights")
    same_files(a, b)
    copied = copy_drafter(a, tmp_path / "c")  # an earlier epoch's export put in place, as keep_best_served does
    same_files(a, copied)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]  # no temporary folder left beside it
    (b / "model.safetensors").write_bytes(b"weightz")
    with pytest.raises(RuntimeError, match="model.safetensors differs"):
        same_files(a, b)
