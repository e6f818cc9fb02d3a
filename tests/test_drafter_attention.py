"""The drafter's TTT attention (tasks/train/eagle3/model.py ttt_attention): a
loop reference, MLA's shapes, the blockwise implementation against the dense
one it replaced, in values and gradients, and where it recomputes in
backward."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tasks.train.eagle3.model import ttt_attention


def _naive_step_attention(q, keys, values, valid, scale=None):
    """Loops: query t attends to step-0 keys s <= t (valid), then to steps 1..k at t."""
    b, h, n, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(b, h, n, values[0].shape[-1])
    rep = h // keys[0].shape[1]
    for bi in range(b):
        for hi in range(h):
            for t in range(n):
                ks = [keys[0][bi, hi // rep, s] for s in range(t + 1) if valid[bi, s]]
                vs = [values[0][bi, hi // rep, s] for s in range(t + 1) if valid[bi, s]]
                ks += [k[bi, hi // rep, t] for k in keys[1:]]
                vs += [v[bi, hi // rep, t] for v in values[1:]]
                w = torch.softmax(torch.stack([q[bi, hi, t] @ k for k in ks]) * scale, 0)
                out[bi, hi, t] = sum(wi * vi for wi, vi in zip(w, vs))
    return out


@pytest.mark.parametrize("depth", [1, 3])
def test_ttt_attention_equals_a_loop_reference(depth):
    torch.manual_seed(0)
    b, h, kv, n, d = 2, 4, 2, 6, 8
    q = torch.randn(b, h, n, d)
    keys = [torch.randn(b, kv, n, d) for _ in range(depth)]
    values = [torch.randn(b, kv, n, d) for _ in range(depth)]
    valid = torch.tensor([[True] * n, [True] * 4 + [False] * 2])
    got = ttt_attention(q, keys, values, valid)
    want = _naive_step_attention(q, keys, values, valid)
    assert torch.allclose(got, want, atol=1e-5)
    if depth == 1:  # step 0 is plain causal attention
        sdpa = F.scaled_dot_product_attention(q[:1], keys[0][:1].repeat_interleave(2, 1),
                                              values[0][:1].repeat_interleave(2, 1), is_causal=True)
        assert torch.allclose(got[:1], sdpa, atol=1e-5)


@pytest.mark.parametrize("depth", [1, 3])
def test_ttt_attention_with_mlas_shapes_equals_a_loop_reference(depth):
    # MLA's: a key and a value per query head, values narrower than keys
    # (v_head_dim against qk_nope + qk_rope), the softmax scaled by YaRN's
    # mscale^2 rather than d^-0.5; several query blocks.
    torch.manual_seed(1)
    b, h, n, d, dv, scale = 2, 4, 6, 12, 8, 0.37
    q = torch.randn(b, h, n, d)
    keys = [torch.randn(b, h, n, d) for _ in range(depth)]
    values = [torch.randn(b, h, n, dv) for _ in range(depth)]
    valid = torch.tensor([[True] * n, [True] * 4 + [False] * 2])
    got = ttt_attention(q, keys, values, valid, block=4, scale=scale)
    assert got.shape == (b, h, n, dv)
    assert torch.allclose(got, _naive_step_attention(q, keys, values, valid, scale), atol=1e-5)


def _dense_ttt_attention(q, keys, values, valid):
    """The implementation this project had before the memory-linear one: it
    keeps fp32 [B, heads, n, n] scores per TTT step for backward."""
    def rep(x):
        return x.repeat_interleave(q.shape[1] // x.shape[1], dim=1)

    n, d = q.shape[2], q.shape[3]
    scale = d ** -0.5
    k0, v0 = rep(keys[0]), rep(values[0])
    scores = (q @ k0.transpose(-1, -2)) * scale
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    diag = [((q * rep(k)).sum(-1, keepdim=True)) * scale for k in keys[1:]]
    p = torch.softmax(torch.cat([scores, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = p[..., :n] @ v0
    for j, v in enumerate(values[1:]):
        out = out + p[..., n + j:n + j + 1] * rep(v)
    return out


@pytest.mark.parametrize("depth", range(1, 8))
def test_blockwise_ttt_attention_equals_the_dense_one_in_values_and_gradients(depth):
    torch.manual_seed(depth)
    b, h, kv, n, d = 3, 8, 2, 11, 16
    q = torch.randn(b, h, n, d, dtype=torch.float32, requires_grad=True)
    keys = [torch.randn(b, kv, n, d, dtype=torch.float32, requires_grad=True) for _ in range(depth)]
    values = [torch.randn(b, kv, n, d, dtype=torch.float32, requires_grad=True) for _ in range(depth)]
    valid = torch.arange(n)[None, :] < torch.tensor([n, 7, 1])[:, None]
    upstream = torch.randn(b, h, n, d, dtype=torch.float32)
    leaves = [q, *keys, *values]
    want = _dense_ttt_attention(q, keys, values, valid)
    want_grads = torch.autograd.grad((want * upstream).sum(), leaves)
    # Several blocks with a ragged last one, exactly one, one larger than n; each checkpointed (0) or kept.
    for block, checkpoint_above in itertools.product((4, 11, 512), (0, 2**40)):
        got = ttt_attention(q, keys, values, valid, block=block, checkpoint_above=checkpoint_above)
        assert torch.allclose(got, want, atol=1e-5), block
        grads = torch.autograd.grad((got * upstream).sum(), leaves)
        for name, g, w in zip(["q"] + [f"k{i}" for i in range(depth)] + [f"v{i}" for i in range(depth)],
                              grads, want_grads):
            assert torch.allclose(g, w, atol=1e-5), (block, name)
    with torch.no_grad():  # evaluation takes the path without checkpointing
        assert torch.allclose(ttt_attention(q, keys, values, valid, block=4), want, atol=1e-5)


def test_the_prefix_attention_recomputes_its_blocks_in_backward_only_above_the_threshold(monkeypatch):
    import tasks.train.eagle3.model as drafter

    calls = []
    real = drafter._prefix_block
    monkeypatch.setattr(drafter, "_prefix_block", lambda *a: calls.append(1) or real(*a))
    b, h, kv, n, d = 1, 2, 1, 8, 4  # scores: 1 x 2 x 8 x 8 fp32 = 512 bytes
    q = torch.randn(b, h, n, d, requires_grad=True)
    keys, values = [torch.randn(b, kv, n, d)], [torch.randn(b, kv, n, d)]
    valid = torch.ones(b, n, dtype=torch.bool)
    for above, per_block in ((511, 2), (512, 1)):  # checkpointed: run again in backward; kept: once
        calls.clear()
        ttt_attention(q, keys, values, valid, block=4, checkpoint_above=above).sum().backward()
        assert len(calls) == 2 * per_block, (above, len(calls))
