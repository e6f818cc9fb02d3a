"""The DFlash drafter against SGLang 0.5.23's own code: its draft forward
re-done here in plain torch from SGLang's source, the training blocks'
labels and weights by hand, the export under SGLang's config parser and its
load_weights' names. (The store and mask-token checks:
tests/test_dflash_target.py.)"""
from __future__ import annotations

import ast
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tasks.target.embeddings import load_target_embeddings
from tasks.train.dflash.model import (LOSS_GAMMA, DFlashConfig, DFlashDrafter, block_labels, build_dflash, dflash_forward,
                                greedy_targets, loss_gamma_for, sample_anchors, score)
from tasks.train.dflash.export import check_served, export_dflash, load_dflash
from tasks.train.layers.sizes import target_sizes
from tasks.train.export import UnservedTensor

TARGET = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
              rms_norm_eps=1e-6, vocab_size=40, num_hidden_layers=8, max_position_embeddings=256,
              rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
SGLANG = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt"


def _drafter(num_layers=2, num_context=3, seed=0) -> DFlashDrafter:
    g = torch.Generator().manual_seed(seed + 100)
    embed, head = torch.randn(40, 32, generator=g), torch.randn(40, 32, generator=g)
    model = build_dflash(TARGET, (embed, head), num_layers=num_layers, num_context=num_context, seed=seed)
    with torch.no_grad():  # norms away from 1, so a norm skipped or misplaced shows
        for name, p in model.trained_tensors().items():
            if p.dim() == 1:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return model


# --- SGLang's DFlash draft forward, re-done in plain torch (float64) from
# models/dflash.py and speculative/dflash_worker_v2.py --------------------

def _rms(x, w, eps):  # sglang RMSNorm.forward_native
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _neox_rope(x, positions, theta):
    """get_rope(is_neox_style=True): the head's halves are the pairs."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # [n, 1, d/2]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def sglang_draft_logits(w: dict, embed: torch.Tensor, head: torch.Tensor, features: torch.Tensor,
                        block_ids: torch.Tensor, p: int) -> torch.Tensor:
    """One request: committed tokens 0..p-1 (their concatenated target
    states `features` [p, K*H]), a block `block_ids` [B] at positions
    p..p+B-1. Returns the target-head logits of slots 1..B-1."""
    c, eps, theta = TARGET, TARGET["rms_norm_eps"], TARGET["rope_parameters"]["rope_theta"]
    heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    w = {k: v.double() for k, v in w.items()}
    # project_target_hidden: hidden_norm(fc(target_hidden)), then per layer
    # kv_proj_only + apply_k_norm + apply_k_rope into the draft KV cache.
    ctx = _rms(features.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ctx_pos = torch.arange(p)
    pos = torch.arange(p, p + len(block_ids))
    h = embed.double()[block_ids]  # the target's embedding of [bonus, MASK...]
    residual = None
    n_layers = len({k.split(".")[1] for k in w if k.startswith("layers.")})
    for i in range(n_layers):
        lw = {k.removeprefix(f"layers.{i}."): v for k, v in w.items() if k.startswith(f"layers.{i}.")}
        ck = _rms((ctx @ lw["self_attn.k_proj.weight"].T).view(p, kv, d), lw["self_attn.k_norm.weight"], eps)
        ck = _neox_rope(ck, ctx_pos, theta)
        cv = (ctx @ lw["self_attn.v_proj.weight"].T).view(p, kv, d)
        # DFlashDecoderLayer: fused residual add + input_layernorm.
        residual = h if residual is None else h + residual
        x = _rms(residual, lw["input_layernorm.weight"], eps)
        q = _rms((x @ lw["self_attn.q_proj.weight"].T).view(-1, heads, d), lw["self_attn.q_norm.weight"], eps)
        k = _rms((x @ lw["self_attn.k_proj.weight"].T).view(-1, kv, d), lw["self_attn.k_norm.weight"], eps)
        v = (x @ lw["self_attn.v_proj.weight"].T).view(-1, kv, d)
        q, k = _neox_rope(q, pos, theta), _neox_rope(k, pos, theta)
        keys, values = torch.cat([ck, k]), torch.cat([cv, v])  # every query sees all of them (ENCODER_ONLY)
        out = torch.empty_like(q)
        for hh in range(heads):
            g = hh // (heads // kv)
            s = (q[:, hh] @ keys[:, g].T) * d ** -0.5
            out[:, hh] = torch.softmax(s, dim=-1) @ values[:, g]
        attn = out.reshape(len(block_ids), -1) @ lw["self_attn.o_proj.weight"].T
        residual = attn + residual
        x = _rms(residual, lw["post_attention_layernorm.weight"], eps)
        h = (torch.nn.functional.silu(x @ lw["mlp.gate_proj.weight"].T) * (x @ lw["mlp.up_proj.weight"].T)) \
            @ lw["mlp.down_proj.weight"].T
    final = _rms(h + residual, w["norm.weight"], eps)
    return final[1:] @ head.double().T  # hidden[1:] -> target lm_head


def test_the_training_forward_computes_sglangs_draft_for_every_block_at_once():
    torch.manual_seed(0)
    model = _drafter()
    weights = {k: v.detach() for k, v in model.trained_tensors().items()}
    embed, head = model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    bk, mask_id = 4, 39
    ids = torch.randint(0, 39, (2, 12))
    features = torch.randn(2, 12, 3 * 32)
    anchors = torch.tensor([[1, 5, 9], [0, 4, 7]])  # anchor 0: a block with no context at all
    block_ids = torch.full((2, 3, bk), mask_id)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    with torch.no_grad():
        got = model.blocks(features, block_ids, anchors) @ head.T  # [2, 3, bk, V]
    worst = 0.0
    for r in range(2):
        for j in range(3):
            a = int(anchors[r, j])
            want = sglang_draft_logits(weights, embed, head, features[r, :a], block_ids[r, j], a)
            err = (got[r, j, 1:].double() - want).abs().max() / want.abs().max()
            worst = max(worst, float(err))
    # float32 against float64: ~1e-7 per op, a few hundred ops deep.
    assert worst < 1e-5, worst


def test_context_is_only_the_tokens_before_the_anchor():
    """Changing the features at or after an anchor leaves its block alone;
    changing one before it does not."""
    torch.manual_seed(1)
    model = _drafter()
    features = torch.randn(1, 10, 96)
    anchors = torch.tensor([[6]])
    block_ids = torch.tensor([[[3, 39, 39, 39]]])
    with torch.no_grad():
        base = model.blocks(features, block_ids, anchors)
        later = features.clone()
        later[0, 6:] += 1.0
        assert torch.equal(model.blocks(later, block_ids, anchors), base)
        earlier = features.clone()
        earlier[0, 5] += 1.0
        assert not torch.allclose(model.blocks(earlier, block_ids, anchors), base)


# --- the training blocks --------------------------------------------------

def test_anchors_are_seeded_bounded_and_where_a_block_has_a_first_label():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 1, 1],
                         [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    anchors, keep = sample_anchors(mask, 100)
    # Row 0: a and a+1 both masked at 2, 3, 4, 5, 8; row 1 at 0, 1.
    assert [anchors[0][keep[0]].tolist(), anchors[1][keep[1]].tolist()] == [[2, 3, 4, 5, 8], [0, 1]]
    draws = [sample_anchors(mask, 3, torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])
    picked = {tuple(a[0].tolist()) for a, _ in draws}
    for a, k in draws:
        assert a.shape == (2, 3) and k[0].all() and k[1].tolist() == [True, True, False]
        assert set(a[0].tolist()) <= {2, 3, 4, 5, 8} and a[0].tolist() == sorted(a[0].tolist())
    assert len({tuple(sample_anchors(mask, 3, torch.Generator().manual_seed(s))[0][0].tolist())
                 for s in range(20)}) > 1 and picked


def test_labels_weights_and_what_is_scored_by_hand():
    ids = torch.arange(100, 110)[None]
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    anchors, keep = torch.tensor([[5, 8, 0]]), torch.tensor([[True, True, False]])
    block_ids, labels, scored, weights = block_labels(ids, mask, anchors, keep, 4, mask_token_id=7, gamma=7.0)
    assert block_ids.tolist() == [[[105, 7, 7, 7], [108, 7, 7, 7], [100, 7, 7, 7]]]
    assert labels[0, 0].tolist() == [105, 106, 107, 108]  # slot k: token anchor+k
    assert labels[0, 1, :2].tolist() == [108, 109]
    # Anchor 5: slot 2 is token 7, not loss-masked. Anchor 8: slots 2, 3
    # are past the sequence. The dropped block scores nothing. Slot 0 never.
    assert scored.tolist() == [[[False, True, False, True], [False, True, False, False], [False] * 4]]
    e = math.exp
    want = [[[0, 1, 0, e(-2 / 7)], [0, 1, 0, 0], [0, 0, 0, 0]]]
    assert torch.allclose(weights, torch.tensor(want, dtype=torch.float32))
    _, _, _, w3 = block_labels(ids, torch.ones_like(mask), anchors[:, :1], keep[:, :1], 4, 7, gamma=3.0)
    assert torch.allclose(w3[0, 0], torch.tensor([0, 1, e(-1 / 3), e(-2 / 3)], dtype=torch.float32))


def test_loss_and_metrics_are_the_weighted_full_vocabulary_ones():
    torch.manual_seed(2)
    model = _drafter()
    ids = torch.randint(0, 39, (2, 14))
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[0, :3] = False
    mask[0, 8] = False
    mask[1, 10:] = False  # padding
    batch = {"input_ids": ids, "loss_mask": mask, "aux": torch.randn(2, 14, 96)}
    out = dflash_forward(model, batch, block_size=4, mask_token_id=39, max_anchors=4, gamma=LOSS_GAMMA, labels="data",
                         generator=torch.Generator().manual_seed(0), rows=3)
    anchors, keep = sample_anchors(mask, 4, torch.Generator().manual_seed(0))
    block_ids, labels, scored, weights = block_labels(ids, mask, anchors, keep, 4, 39)
    logits = model.blocks(batch["aux"], block_ids, anchors) @ model.lm_head.weight.T
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
    want = (ce * weights.flatten()).sum() / weights.sum()
    assert torch.allclose(out.loss, want, rtol=1e-5)
    hit = (logits.argmax(-1) == labels) & scored
    assert out.correct.tolist() == hit[:, :, 1:].sum((0, 1)).tolist()
    assert out.counted.tolist() == scored[:, :, 1:].sum((0, 1)).tolist()
    chain = [int((hit[:, :, 1:k + 1].all(-1) & keep).sum()) for k in range(1, 4)]
    through = [int((scored[:, :, 1:k + 1].all(-1) & keep).sum()) for k in range(1, 4)]
    assert out.chained.tolist() == chain and out.chain_counted.tolist() == through
    assert int(out.blocks) == int(keep.sum())
    assert out.accept_length == pytest.approx(1 + sum(c / n for c, n in zip(chain, through) if n))
    # Chunked rows give the unchunked gradient.
    grads = []
    for rows in (2, 1000):
        model.zero_grad()
        dflash_forward(model, batch, block_size=4, mask_token_id=39, max_anchors=4, labels="data",
                       generator=torch.Generator().manual_seed(0), rows=rows).loss.backward()
        grads.append(model.fc.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)
    assert model.embed_tokens.weight.grad is None and model.lm_head.weight.grad is None


def test_target_labels_are_the_targets_greedy_token_where_sglangs_verify_compares():
    """SGLang accepts a draft where it equals the target's argmax: each
    scored token t+1 is labelled with argmax(head @ final[t]) (computed at
    the scored positions only), the rest keep the data's; the blocks' inputs
    (the anchor's token) stay the data's."""
    torch.manual_seed(3)
    model = _drafter()
    ids = torch.randint(0, 39, (2, 14))
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[0, :4] = False
    mask[1, 11:] = False
    final = torch.randn(2, 14, 32)
    head = model.lm_head.weight
    want = ids.clone()
    for b in range(2):
        for t in range(13):
            if mask[b, t + 1]:
                want[b, t + 1] = int((final[b, t] @ head.T).argmax())
    assert torch.equal(greedy_targets(ids, mask, final, head), want)
    assert not torch.equal(want, ids)  # a random target disagrees with the data somewhere
    some = torch.zeros_like(mask)
    some[0, 5], some[1, 0] = True, True  # position 0 has no state before it: the data's
    assert torch.equal(greedy_targets(ids, some, final, head)[0, 5], want[0, 5])
    assert torch.equal(greedy_targets(ids, some, final, head)[1], ids[1])
    batch = {"input_ids": ids, "loss_mask": mask, "aux": torch.randn(2, 14, 96), "final": final}
    drawn = dict(block_size=4, mask_token_id=39, max_anchors=4)
    target = dflash_forward(model, batch, **drawn, generator=torch.Generator().manual_seed(0))
    data = dflash_forward(model, batch, **drawn, labels="data", generator=torch.Generator().manual_seed(0))
    anchors, keep = sample_anchors(mask, 4, torch.Generator().manual_seed(0))
    block_ids, labels, scored, weights = block_labels(ids, mask, anchors, keep, 4, 39, loss_gamma_for(4), want)
    assert torch.equal(block_ids, block_labels(ids, mask, anchors, keep, 4, 39)[0])
    logits = model.blocks(batch["aux"], block_ids, anchors) @ head.T
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
    assert torch.allclose(target.loss, (ce * weights.flatten()).sum() / weights.sum(), rtol=1e-5)
    assert not torch.allclose(target.loss, data.loss)


def test_the_loss_decay_follows_the_block():
    """The DFlash paper's gamma: 4 for blocks of 8, 5 for 10, 7 for 16
    (SpecForge's train_dflash.py), linear between them and beyond; a
    forward without one takes its block's."""
    assert [loss_gamma_for(b) for b in (8, 10, 16)] == [4.0, 5.0, 7.0]
    assert loss_gamma_for(12) == pytest.approx(5 + 2 / 3) and loss_gamma_for(4) == 2.0
    assert loss_gamma_for(32) > loss_gamma_for(16) > loss_gamma_for(8) > loss_gamma_for(2) > 0
    model = _drafter()
    batch = {"input_ids": torch.randint(0, 39, (1, 12)), "loss_mask": torch.ones(1, 12, dtype=torch.bool),
             "aux": torch.randn(1, 12, 96)}
    run = lambda gamma: dflash_forward(model, batch, block_size=8, mask_token_id=39, gamma=gamma,  # noqa: E731
                                       labels="data", generator=torch.Generator().manual_seed(0)).loss
    assert torch.equal(run(None), run(4.0)) and not torch.allclose(run(None), run(LOSS_GAMMA))


def test_scoring_in_chunks_equals_one_matmul():
    h, head, labels = torch.randn(11, 8), torch.randn(30, 8), torch.randint(0, 30, (11,))
    ce, top = score(h, head, labels, rows=4)
    assert torch.allclose(ce, torch.nn.functional.cross_entropy(h @ head.T, labels, reduction="none"))
    assert torch.equal(top, (h @ head.T).argmax(-1))


def test_a_batch_without_a_block_gives_a_zero_loss_with_a_graph():
    model = _drafter()
    batch = {"input_ids": torch.zeros(1, 5, dtype=torch.long), "loss_mask": torch.tensor([[1, 0, 1, 0, 1]]),
             "aux": torch.randn(1, 5, 96)}
    out = dflash_forward(model, batch, block_size=4, mask_token_id=39, labels="data")
    out.loss.backward()
    assert float(out.loss) == 0 and int(out.blocks) == 0 and out.accept_length == 1.0


# --- export ---------------------------------------------------------------

def _sglang_tree():
    return ast.parse((SGLANG / "models" / "dflash.py").read_text())


def _init_attrs(tree, cls: str) -> set[str]:
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr for a in ast.walk(init) if isinstance(a, (ast.Assign, ast.AnnAssign))
            for t in (a.targets if isinstance(a, ast.Assign) else [a.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def sglang_parameters(num_layers: int) -> set[str]:
    """DFlashDraftModel's parameters (a plain DFlash draft: no conv, selector,
    Domino or Nemotron parts, no biases), each attribute checked to be one
    its __init__ makes, so a rename in SGLang fails here."""
    tree = _sglang_tree()
    parts = {"DFlashDraftModel": {"fc", "hidden_norm", "norm", "layers"},
             "DFlashDecoderLayer": {"input_layernorm", "post_attention_layernorm", "self_attn", "mlp"},
             "DFlashAttention": {"qkv_proj", "o_proj", "q_norm", "k_norm"},
             "DFlashMLP": {"gate_up_proj", "down_proj"}}
    for cls, attrs in parts.items():
        assert attrs <= _init_attrs(tree, cls), (cls, attrs - _init_attrs(tree, cls))
    layer = [f"self_attn.{a}.weight" for a in parts["DFlashAttention"]] + \
            [f"mlp.{a}.weight" for a in parts["DFlashMLP"]] + ["input_layernorm.weight", "post_attention_layernorm.weight"]
    return {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{t}" for i in range(num_layers)
                                                                  for t in layer}


def sglang_stacked_mapping() -> list[tuple]:
    tree = _sglang_tree()
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DFlashDraftModel")
    load = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights")
    node = next(a for a in ast.walk(load) if isinstance(a, ast.Assign)
                and getattr(a.targets[0], "id", None) == "stacked_params_mapping")
    return ast.literal_eval(node.value)


def sglang_loads(names, num_layers: int) -> tuple[dict, list]:
    """load_weights' name resolution (dflash.py:886-945): {parameter: shards
    filled}, and the names it ignores."""
    params, mapping = sglang_parameters(num_layers), sglang_stacked_mapping()
    filled, ignored = {}, []
    for name in names:
        for param, weight, shard in mapping:
            if f".{weight}." not in name:
                continue
            mapped = name.replace(weight, param)
            if mapped in params:
                filled.setdefault(mapped, set()).add(shard)
                break
        else:
            if name in params:
                filled.setdefault(name, set()).add(None)
            else:
                ignored.append(name)
    return filled, ignored


def test_the_export_is_what_sglangs_dflash_loads(tiny_model, tmp_path):
    from transformers import AutoConfig

    from sglang.srt.speculative.dflash_utils import get_dflash_layer_types, parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers.common import get_rope_config

    target = target_sizes(tiny_model)
    model = build_dflash(target, load_target_embeddings(tiny_model), num_layers=2, num_context=3, seed=3)
    out = export_dflash(model, [1, 3, 5], tmp_path / "dflash", target_config=target, block_size=8,
                        mask_token_id=0, mask_token="<|endoftext|>", dtype=torch.float32)
    raw = json.loads((out / "config.json").read_text())
    hf = AutoConfig.from_pretrained(out)  # what SGLang hands DFlashDraftModel
    assert type(hf).__name__ == "Qwen3Config" and hf.architectures == ["DFlashDraftModel"]
    for config in (raw, hf):
        parsed = parse_dflash_draft_config(draft_hf_config=config)
        assert parsed.require_num_layers() == 2 and parsed.block_size == 8
        assert parsed.target_layer_ids == [1, 3, 5] and parsed.num_target_layers == 8
        assert parsed.resolve_target_layer_ids(target_num_layers=8) == [1, 3, 5]
        assert (parsed.mask_token, parsed.mask_token_id) == ("<|endoftext|>", 0)
        assert not parsed.conv_kernel_size and not parsed.selector_rank and parsed.projector_type is None
        assert set(get_dflash_layer_types(config)) == {"full_attention"}  # non-causal in SGLang
    assert getattr(hf, "is_causal", None) is None and hf.hidden_size == 128 and hf.head_dim == 32
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.hidden_act) == (4, 2, "silu")
    theta, rope = get_rope_config(hf)
    assert theta == 10000.0 and rope["rope_type"] == "default"
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].shape == (128, 3 * 128)  # SGLang's shape check
    filled, ignored = sglang_loads(tensors, 2)
    assert ignored == []
    assert filled.keys() == sglang_parameters(2)
    for name, shards in filled.items():
        want = {"q", "k", "v"} if "qkv_proj" in name else {0, 1} if "gate_up_proj" in name else {None}
        assert shards == want, name
    back = load_dflash(out, tiny_model)
    for name, t in model.trained_tensors().items():
        assert torch.equal(back.trained_tensors()[name], t), name
    assert torch.equal(back.lm_head.weight, model.lm_head.weight)
    assert "embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors
    # Exported again over it (the atomic swap), in bf16: the new one is there.
    export_dflash(model, [1, 3, 5], out, target_config=target, block_size=8, mask_token_id=0,
                  mask_token="<|endoftext|>")
    again = load_dflash(out, tiny_model)
    assert torch.equal(again.fc.weight, model.fc.weight.detach().to(torch.bfloat16).float())
    assert [p.name for p in tmp_path.iterdir()] == ["dflash"]


def test_the_export_refuses_what_sglang_would_not_load(tiny_model, tmp_path):
    target = target_sizes(tiny_model)
    model = build_dflash(target, load_target_embeddings(tiny_model), num_layers=1, num_context=3)
    model.register_parameter("d2t", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(UnservedTensor, match=r"skips d2t \(no parameter"):
        export_dflash(model, [1, 3, 5], tmp_path / "x", target_config=target, block_size=4, mask_token_id=0)
    names = set(_drafter(num_layers=1).trained_tensors()) - {"layers.0.self_attn.k_norm.weight"}
    with pytest.raises(UnservedTensor, match="nothing fills layers.0.self_attn.k_norm.weight"):
        check_served(names, 1)
    assert not (tmp_path / "x").exists()
    del model.d2t
    for ids, match in (([1, 3], "2 layers, but the drafter's fc reads 3"), ([3, 1, 5], "not distinct and ascending"),
                       ([1, 3, 7], r"out of range .*0\.\.6")):
        with pytest.raises(ValueError, match=match):
            export_dflash(model, ids, tmp_path / "x", target_config=target, block_size=4, mask_token_id=0)
    with pytest.raises(ValueError, match="mask_token_id 2048 is outside the target vocabulary"):
        export_dflash(model, [1, 3, 5], tmp_path / "x", target_config=target, block_size=4, mask_token_id=2048)


def test_reading_back_refuses_an_extra_tensor_and_another_target(tiny_model, tmp_path):
    target = target_sizes(tiny_model)
    model = build_dflash(target, load_target_embeddings(tiny_model), num_layers=1, num_context=3)
    out = export_dflash(model, [1, 3, 5], tmp_path / "d", target_config=target, block_size=4, mask_token_id=0)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({**tensors, "lm_head.weight": torch.zeros(2, 2)}, str(out / "model.safetensors"))
    with pytest.raises(UnservedTensor, match="skips lm_head.weight"):
        load_dflash(out, tiny_model)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    with pytest.raises(ValueError, match="exported for another target .*hidden_size 64 \\(target 128\\)"):
        load_dflash(out, tiny_model)


def test_a_config_dict_builds_the_same_drafter_as_the_target_would():
    cfg = DFlashConfig.from_target(TARGET, 2, 3)
    assert dict(cfg.rope)["rope_parameters"]["rope_theta"] == 10000.0 and cfg.head_dim == 8
    with pytest.raises(ValueError, match="at least one layer"):
        DFlashConfig.from_target(TARGET, 0, 3)
