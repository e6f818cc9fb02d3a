"""The CPU speculative-decoding operators (tasks.server.cpu.spec_ops) against
straightforward references: Python loops over the semantics of SGLang's CPU
kernels, and naive per-head softmax attention. Every op is called through
torch.ops.sgl_kernel, with positional arguments in the order SGLang's callers
use, so a schema that does not fit them fails here too."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tasks.paths import REPO_ROOT
from tasks.server.cpu.shim import CPU_OPS_SWITCH, SGLANG_SITE_DIR, server_environment
from tasks.server.cpu.spec_ops import SCHEMAS, TREE_MASK_FULL, TREE_MASK_QLEN_ONLY, register_ops

ops = torch.ops.sgl_kernel


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_ops()
    missing = [name for name in SCHEMAS if not hasattr(ops, name)]
    assert not missing, f"not registered: {missing}"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------ KV cache moves

def test_copy_all_layer_kv_cache_reads_every_source_before_writing():
    g = gen(0)
    buffers = [torch.randn(12, 2, 4, generator=g), torch.randn(12, 3, dtype=torch.float64, generator=g),
               torch.randint(0, 100, (12, 5), generator=g, dtype=torch.int32)]
    expected = [b.clone() for b in buffers]
    # Chained overlap: slot 3 is both a source and a target.
    tgt, src = torch.tensor([2, 3, 7]), torch.tensor([3, 5, 11])
    for b in expected:
        staged = [b[s].clone() for s in src.tolist()]
        for t, row in zip(tgt.tolist(), staged):
            b[t] = row
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers], dtype=torch.int64)
    ops.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, e in zip(buffers, expected):
        assert torch.equal(b, e)


def random_pool(g, num_reqs=5, pool_len=32):
    return torch.randint(0, 1000, (num_reqs, pool_len), generator=g, dtype=torch.int32)


@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
def test_assign_req_to_token_pool(offset_dtype):
    g = gen(1)
    req_to_token = random_pool(g)
    expected = req_to_token.clone()
    rpi = torch.tensor([3, 0, 4], dtype=torch.int64)
    start = torch.tensor([2, 0, 7], dtype=offset_dtype)
    end = torch.tensor([5, 4, 7], dtype=offset_dtype)  # the last request adds nothing
    out_cache_loc = torch.randint(0, 5000, (7,), generator=g, dtype=torch.int64)
    k = 0
    for r, s, e in zip(rpi.tolist(), start.tolist(), end.tolist()):
        for j in range(s, e):
            expected[r, j] = int(out_cache_loc[k])
            k += 1
    ops.assign_req_to_token_pool_cpu(rpi, req_to_token, start, end, out_cache_loc, req_to_token.shape[1])
    assert torch.equal(req_to_token, expected)


def test_assign_extend_cache_locs():
    g = gen(2)
    req_to_token = random_pool(g)
    rpi = torch.tensor([1, 4, 2], dtype=torch.int64)
    start = torch.tensor([3, 10, 0], dtype=torch.int32)
    end = torch.tensor([7, 11, 2], dtype=torch.int32)
    expected = [int(req_to_token[r, j]) for r, s, e in zip(rpi.tolist(), start.tolist(), end.tolist())
                for j in range(s, e)]
    out = torch.full((len(expected),), -1, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(rpi, req_to_token, start, end, out, req_to_token.shape[1])
    assert out.tolist() == expected


def test_assign_draft_cache_locs_contiguous():
    g = gen(3)
    req_to_token = random_pool(g)
    rpi = torch.tensor([2, 0], dtype=torch.int64)
    seq_lens = torch.tensor([5, 9], dtype=torch.int64)
    topk, num_steps = 2, 3
    expected = [int(req_to_token[r, sl + j]) for r, sl in zip(rpi.tolist(), seq_lens.tolist())
                for j in range(topk * num_steps)]
    out = torch.zeros(len(expected), dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous_cpu(rpi, req_to_token, seq_lens, out, req_to_token.shape[1],
                                               topk, num_steps)
    assert out.tolist() == expected


def test_build_draft_decode_metadata():
    g = gen(4)
    req_to_token = random_pool(g)
    rpi = torch.tensor([4, 1, 3], dtype=torch.int64)
    seq_lens = torch.tensor([6, 2, 11], dtype=torch.int64)
    topk, num_steps = 2, 3
    out = ops.build_draft_decode_metadata_cpu(req_to_token, rpi, seq_lens, topk, num_steps, req_to_token.shape[1])
    assert out.shape == (3 * topk, req_to_token.shape[1]) and out.dtype == req_to_token.dtype
    for b, (r, sl) in enumerate(zip(rpi.tolist(), seq_lens.tolist())):
        for k in range(topk):
            row = out[b * topk + k].tolist()
            src = req_to_token[r].tolist()
            # Only the prefix and this candidate's draft slots are defined.
            assert row[:sl] == src[:sl]
            assert row[sl: sl + num_steps] == src[sl + k * num_steps: sl + (k + 1) * num_steps]


def test_fill_bonus_tokens():
    accept_tokens = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]], dtype=torch.int32)
    accept_lens = torch.tensor([1, 4, 2], dtype=torch.int32)
    bonus = torch.zeros(3, dtype=torch.int32)
    ops.fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus, accept_tokens.shape[1])
    assert bonus.tolist() == [11, 24, 32]


def test_fill_accept_out_cache_loc():
    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1], [6, 7, 8]], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 109, dtype=torch.int64)
    expected = [int(out_cache_loc[i]) for i in accept_index.flatten().tolist() if i != -1]
    out = torch.full((len(expected),), -7, dtype=torch.int64)
    ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, out)
    assert out.tolist() == expected


# ----------------------------------------------------------------- draft tree

def eagle_tree(g, topk, depth, n):
    """A random draft tree the way EAGLE's top-k expansion lays it out:
    flat draft index x < topk is a first-step token (parent: the root); a
    later one's parent is the flat index parent_list[x // topk]. Returns
    parent_list, the sorted selected indices (closed under parents), and the
    parent of each flat index."""
    parent_of = {x: None for x in range(topk)}
    parent_list = [-1] + list(range(topk))  # step 1 expands every first-step token
    for step in range(1, depth):
        expanded = parent_list[1 + (step - 1) * topk: 1 + step * topk]
        new = []
        for k, parent in enumerate(expanded):
            for c in range(topk):
                x = topk + (step - 1) * topk * topk + k * topk + c
                parent_of[x] = parent
                new.append(x)
        if step < depth - 1:
            chosen = sorted(new[i] for i in torch.randperm(len(new), generator=g)[:topk].tolist())
            parent_list += chosen
    assert len(parent_list) == topk * (depth - 1) + 1
    # A random subset of n - 1 nodes that holds every selected node's parent.
    selected: set[int] = set()
    order = torch.randperm(len(parent_of), generator=g).tolist()
    candidates = sorted(parent_of)
    while len(selected) < n - 1:
        for i in order:
            x = candidates[i]
            chain = []
            while x is not None and x not in selected:
                chain.append(x)
                x = parent_of[x]
            if len(selected) + len(chain) <= n - 1:
                selected.update(chain)
            if len(selected) == n - 1:
                break
    return parent_list, sorted(selected), parent_of


def tree_reference(selected, parent_of, n):
    """Node 0 is the root (the bonus token), node i >= 1 is selected[i - 1]."""
    node_of = {x: i + 1 for i, x in enumerate(selected)}
    parent = [None] + [0 if parent_of[x] is None else node_of[parent_of[x]] for x in selected]
    ancestors = [{0}]
    for i in range(1, n):
        ancestors.append(ancestors[parent[i]] | {i})
    children = {i: [c for c in range(1, n) if parent[c] == i] for i in range(n)}
    first_child = [children[i][0] if children[i] else -1 for i in range(n)]
    next_sibling = [-1] * n
    for kids in children.values():
        for a, b in zip(kids, kids[1:]):
            next_sibling[a] = b
    return parent, ancestors, first_child, next_sibling


@pytest.mark.parametrize("mode", [TREE_MASK_QLEN_ONLY, TREE_MASK_FULL])
@pytest.mark.parametrize("topk,depth,n", [(1, 3, 4), (2, 3, 5), (3, 4, 8)])
def test_build_tree_kernel_efficient(mode, topk, depth, n):
    g = gen(10 * topk + depth)
    seq_lens = [7, 3]
    trees = [eagle_tree(g, topk, depth, n) for _ in seq_lens]
    parent_list = torch.tensor([t[0] for t in trees], dtype=torch.int64)
    selected_index = torch.tensor([t[1] for t in trees], dtype=torch.int64)
    verified = torch.tensor(seq_lens, dtype=torch.int64)
    bs = len(seq_lens)
    mask_len = bs * n * n if mode == TREE_MASK_QLEN_ONLY else sum(s * n for s in seq_lens) + bs * n * n
    tree_mask = torch.ones(mask_len, dtype=torch.bool)  # the caller pre-fills True
    positions = torch.empty(bs * n, dtype=torch.int64)
    links = torch.full((3, bs, n), -1, dtype=torch.int64)
    ops.build_tree_kernel_efficient_cpu(parent_list, selected_index, verified, tree_mask, positions,
                                        links[0], links[1], links[2], topk, depth, n, mode)
    mask_offset = 0
    for b, ((_, selected, parent_of), seq_len) in enumerate(zip(trees, seq_lens)):
        parent, ancestors, first_child, next_sibling = tree_reference(selected, parent_of, n)
        assert positions[b * n:(b + 1) * n].tolist() == [seq_len + len(a) - 1 for a in ancestors]
        assert links[0, b].tolist() == [b * n + i for i in range(n)]
        assert links[1, b].tolist() == first_child
        assert links[2, b].tolist() == next_sibling
        want = torch.tensor([[j in ancestors[i] for j in range(n)] for i in range(n)])
        if mode == TREE_MASK_QLEN_ONLY:
            got = tree_mask[b * n * n:(b + 1) * n * n].view(n, n)
        else:
            rows = tree_mask[mask_offset: mask_offset + n * (seq_len + n)].view(n, seq_len + n)
            assert rows[:, :seq_len].all()  # the committed prefix stays visible
            got = rows[:, seq_len:]
            mask_offset += n * (seq_len + n)
        assert torch.equal(got, want)


def test_verify_tree_greedy_accepts_the_longest_matching_path():
    g = gen(20)
    topk, depth, n, num_spec_step = 2, 4, 7, 4
    bs = 3
    candidates, links, targets, expected = [], [], [], []
    for b in range(bs):
        _, selected, parent_of = eagle_tree(g, topk, depth, n)
        parent, _, first_child, next_sibling = tree_reference(selected, parent_of, n)
        # Distinct tokens, so the accepted path does not depend on sibling order.
        cand = (torch.randperm(50, generator=g)[:n] + 100).tolist()
        children = {i: [c for c in range(1, n) if parent[c] == i] for i in range(n)}
        # The target follows the tree for a random number of steps, then says something else.
        follow = b  # request 0 accepts nothing, later ones go deeper where the tree allows
        target = [int(t) for t in torch.randint(0, 50, (n,), generator=g)]
        cur = 0
        for _ in range(follow):
            if not children[cur]:
                break
            nxt = children[cur][int(torch.randint(0, len(children[cur]), (1,), generator=g))]
            target[cur] = cand[nxt]
            cur = nxt
        # Reference walk over the tree's parent structure.
        path, cur = [0], 0
        while len(path) < num_spec_step:
            match = [c for c in children[cur] if cand[c] == target[cur]]
            if not match:
                break
            cur = match[0]
            path.append(cur)
        predicts = [0] * (bs * n)
        for a, b2 in zip(path, path[1:]):
            predicts[b * n + a] = cand[b2]
        predicts[b * n + path[-1]] = target[path[-1]]
        expected.append((path, predicts))
        candidates.append(cand)
        links.append(([b * n + i for i in range(n)], first_child, next_sibling))
        targets.append(target)
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, num_spec_step), -1, dtype=torch.int32)
    accept_num = torch.empty(bs, dtype=torch.int32)
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.int64)  # noqa: E731
    ops.verify_tree_greedy_cpu(predicts, accept_index, accept_num, as_tensor(candidates),
                               as_tensor([l[0] for l in links]), as_tensor([l[1] for l in links]),
                               as_tensor([l[2] for l in links]), as_tensor(targets))
    want_predicts = [0] * (bs * n)
    for b, (path, pred) in enumerate(expected):
        assert accept_num[b] == len(path) - 1
        assert accept_index[b].tolist() == [b * n + i for i in path] + [-1] * (num_spec_step - len(path))
        for i in range(n):
            want_predicts[b * n + i] = pred[b * n + i]
    assert predicts.tolist() == want_predicts
    assert accept_num.tolist() != [0] * bs, "the case should accept some drafts"


# ------------------------------------------------------------------ attention

def naive_attention(q, keys, values, visible, sm_scale, logit_cap, sinks=None):
    """q [M, H, D], keys [N, Hkv, D], values [N, Hkv, Dv], visible [M][N] bools;
    sinks [H]: one more logit per head in the denominator, attending nothing."""
    M, H, _ = q.shape
    group = H // keys.shape[1]
    out = torch.zeros(M, H, values.shape[2], dtype=torch.float64)
    for m in range(M):
        for h in range(H):
            kv = h // group
            scores = []
            for j in range(keys.shape[0]):
                s = float((q[m, h].double() * keys[j, kv].double()).sum()) * sm_scale
                if logit_cap > 0:
                    s = logit_cap * math.tanh(s / logit_cap)
                scores.append(s if visible[m][j] else -math.inf)
            sink = [] if sinks is None else [float(sinks[h])]
            top = max(scores + sink)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights) + sum(math.exp(s - top) for s in sink)
            for j, w in enumerate(weights):
                out[m, h] += (w / total) * values[j, kv].double()
    return out


@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
def test_decode_attention_writes_the_new_token_then_attends(logit_cap):
    g = gen(30)
    H, Hkv, D, Dv, slots = 4, 2, 8, 8, 64
    k_cache, v_cache = torch.randn(slots, Hkv, D, generator=g), torch.randn(slots, Hkv, Dv, generator=g)
    req_to_token = torch.randperm(slots, generator=g).to(torch.int32).view(4, 16)
    rpi = torch.tensor([2, 0, 3], dtype=torch.int64)
    seq_lens = torch.tensor([5, 1, 16], dtype=torch.int64)
    loc = torch.tensor([int(req_to_token[r, s - 1]) for r, s in zip(rpi.tolist(), seq_lens.tolist())])
    query = torch.randn(3, H, D, generator=g)
    key, value = torch.randn(3, Hkv, D, generator=g), torch.randn(3, Hkv, Dv, generator=g)
    output = torch.zeros(3, H, Dv)
    attn_logits = torch.zeros(3, H, 8, Dv + 1)
    sm_scale = D ** -0.5
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k[loc], expected_v[loc] = key, value
    ops.decode_attention_cpu(query, k_cache, v_cache, 1.0, 1.0, output, key, value, loc, attn_logits,
                             req_to_token, rpi, seq_lens, sm_scale, logit_cap, False, 0, None, None)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    for i, (r, s) in enumerate(zip(rpi.tolist(), seq_lens.tolist())):
        idx = req_to_token[r, :s].long()
        want = naive_attention(query[i:i + 1], expected_k[idx], expected_v[idx], [[True] * s], sm_scale, logit_cap)
        torch.testing.assert_close(output[i:i + 1].double(), want, rtol=1e-5, atol=1e-5)


def extend_case(g, tree: bool):
    H, Hkv, D, slots = 4, 2, 8, 96
    k_buffer, v_buffer = torch.randn(slots, Hkv, D, generator=g), torch.randn(slots, Hkv, D, generator=g)
    req_to_token = torch.randperm(slots, generator=g).to(torch.int32).view(4, 24)
    rpi = torch.tensor([1, 3], dtype=torch.int64)
    ext_lens = [4, 4] if tree else [3, 6]
    prefix_lens = [5, 0] if not tree else [5, 9]
    seq_lens = torch.tensor([p + e for p, e in zip(prefix_lens, ext_lens)], dtype=torch.int64)
    start_loc = torch.tensor([0, ext_lens[0]], dtype=torch.int32)
    T = sum(ext_lens)
    q, k, v = (torch.randn(T, H, D, generator=g), torch.randn(T, Hkv, D, generator=g),
               torch.randn(T, Hkv, D, generator=g))
    # As SGLang does before calling: the extend's own K/V are already in the cache.
    for i, (r, p, e) in enumerate(zip(rpi.tolist(), prefix_lens, ext_lens)):
        rows = req_to_token[r, p: p + e].long()
        k_buffer[rows] = k[start_loc[i]: start_loc[i] + e]
        v_buffer[rows] = v[start_loc[i]: start_loc[i] + e]
    masks = None
    if tree:  # a chain 0 -> 1 and a branch 0 -> 2 -> 3: node 3 must not see node 1
        one = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        two = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
        masks = [one, two]
    return dict(q=q, k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token, rpi=rpi,
                seq_lens=seq_lens, ext_lens=ext_lens, prefix_lens=prefix_lens, start_loc=start_loc, masks=masks)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("logit_cap", [0.0, 3.0])
def test_extend_attention_sees_prefix_and_causal_or_tree_extend(tree, logit_cap):
    c = extend_case(gen(40), tree)
    T, H, D = c["q"].shape
    o = torch.zeros(T, H, D)
    ext_lens = torch.tensor(c["ext_lens"], dtype=torch.int32)
    tree_mask = torch.cat([m.flatten() for m in c["masks"]]) if tree else None
    sm_scale = D ** -0.5
    ops.extend_attention_cpu(c["q"], c["k"], c["v"], o, c["k_buffer"], c["v_buffer"], 1.0, 1.0,
                             c["req_to_token"], c["rpi"], c["seq_lens"], ext_lens, c["start_loc"],
                             max(c["ext_lens"]), sm_scale, logit_cap, False, 0, None, None, tree_mask, True)
    for i, (r, p, e) in enumerate(zip(c["rpi"].tolist(), c["prefix_lens"], c["ext_lens"])):
        idx = c["req_to_token"][r, : p + e].long()
        visible = [[True] * p + [bool(c["masks"][i][m, j]) if tree else j <= m for j in range(e)]
                   for m in range(e)]
        s = int(c["start_loc"][i])
        want = naive_attention(c["q"][s: s + e], c["k_buffer"][idx], c["v_buffer"][idx], visible, sm_scale,
                               logit_cap)
        torch.testing.assert_close(o[s: s + e].double(), want, rtol=1e-5, atol=1e-5)


def test_extend_attention_over_an_mla_latent_cache_attends_to_the_extend_only():
    # MLA's prefill (DeepSeek-V3, Kimi): per-head keys and values expanded from
    # the latent, while the cache holds the latent itself (one wider "head").
    # Without a cached prefix the result is causal attention over the extend;
    # with one, the cache cannot stand in for keys, so it is refused.
    g = gen(42)
    H, D, Dv, latent, slots = 4, 12, 8, 20, 64
    k_buffer, v_buffer = torch.randn(slots, 1, latent, generator=g), torch.randn(slots, 1, latent - 4, generator=g)
    req_to_token = torch.randperm(slots, generator=g).to(torch.int32).view(4, 16)
    rpi = torch.tensor([2, 0], dtype=torch.int64)
    ext_lens = [5, 3]
    start_loc = torch.tensor([0, 5], dtype=torch.int32)
    T = sum(ext_lens)
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g), torch.randn(T, H, Dv, generator=g)
    o = torch.zeros(T, H, Dv)
    sm_scale = D ** -0.5

    def run(seq_lens):
        ops.extend_attention_cpu(q, k, v, o, k_buffer, v_buffer, 1.0, 1.0, req_to_token, rpi,
                                 torch.tensor(seq_lens, dtype=torch.int64), torch.tensor(ext_lens, dtype=torch.int32),
                                 start_loc, max(ext_lens), sm_scale, 0.0, False, 0, None, None, None, True)

    run(ext_lens)
    for s, e in zip(start_loc.tolist(), ext_lens):
        visible = [[j <= m for j in range(e)] for m in range(e)]
        want = naive_attention(q[s: s + e], k[s: s + e], v[s: s + e], visible, sm_scale, 0.0)
        torch.testing.assert_close(o[s: s + e].double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="cached prefix of 2 tokens"):
        run([ext_lens[0] + 2, ext_lens[1]])


def test_attention_with_sinks_and_a_sliding_window():
    # gpt-oss: every other layer sees only the last `window` tokens, and each
    # head has a sink logit. Checked over a cached prefix and causal extend
    # (prefill) and one decode step.
    c = extend_case(gen(41), False)
    T, H, D = c["q"].shape
    sinks, window, sm_scale = torch.randn(H, generator=gen(43)), 4, D ** -0.5
    o = torch.zeros(T, H, D)
    ops.extend_attention_cpu(c["q"], c["k"], c["v"], o, c["k_buffer"], c["v_buffer"], 1.0, 1.0,
                             c["req_to_token"], c["rpi"], c["seq_lens"], torch.tensor(c["ext_lens"]),
                             c["start_loc"], 6, sm_scale, 0.0, False, window, None, sinks, None, True)
    for i, (r, p, e) in enumerate(zip(c["rpi"].tolist(), c["prefix_lens"], c["ext_lens"])):
        idx = c["req_to_token"][r, : p + e].long()
        visible = [[j <= p + m and p + m - j < window for j in range(p + e)] for m in range(e)]
        s = int(c["start_loc"][i])
        want = naive_attention(c["q"][s: s + e], c["k_buffer"][idx], c["v_buffer"][idx], visible, sm_scale, 0.0,
                               sinks)
        torch.testing.assert_close(o[s: s + e].double(), want, rtol=1e-5, atol=1e-5)
    r, n = int(c["rpi"][0]), int(c["seq_lens"][0])
    out = torch.zeros(1, H, D)
    ops.decode_attention_cpu(c["q"][:1], c["k_buffer"], c["v_buffer"], 1.0, 1.0, out, None, None,
                             torch.zeros(1, dtype=torch.int64), torch.zeros(1, H, 8, D + 1), c["req_to_token"],
                             c["rpi"][:1], c["seq_lens"][:1], sm_scale, 0.0, False, window, None, sinks)
    idx = c["req_to_token"][r, :n].long()
    want = naive_attention(c["q"][:1], c["k_buffer"][idx], c["v_buffer"][idx],
                           [[n - 1 - j < window for j in range(n)]], sm_scale, 0.0, sinks)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_attention_refuses_what_it_does_not_implement():
    c = extend_case(gen(41), True)
    T, H, D = c["q"].shape
    tree_mask = torch.cat([m.flatten() for m in c["masks"]])
    with pytest.raises(NotImplementedError, match="sliding window with a tree mask"):
        ops.extend_attention_cpu(c["q"], c["k"], c["v"], torch.zeros(T, H, D), c["k_buffer"], c["v_buffer"],
                                 1.0, 1.0, c["req_to_token"], c["rpi"], c["seq_lens"],
                                 torch.tensor(c["ext_lens"]), c["start_loc"], 4, 0.3, 0.0, False, 128, None,
                                 None, tree_mask, True)
    with pytest.raises(NotImplementedError, match="cross-attention"):
        ops.extend_attention_cpu(c["q"], c["k"], c["v"], torch.zeros(T, H, D), c["k_buffer"], c["v_buffer"],
                                 1.0, 1.0, c["req_to_token"], c["rpi"], c["seq_lens"],
                                 torch.tensor(c["ext_lens"]), c["start_loc"], 4, 0.3, 0.0, True, 0, None,
                                 None, None, True)


# ------------------------------------------------------- server-process wiring

def test_cpu_ops_environment_only_on_cpu():
    env = server_environment({"PYTHONPATH": "/x"}, cpu=True, cpu_ops=True)
    assert env[CPU_OPS_SWITCH] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SGLANG_SITE_DIR), "/x"]
    assert CPU_OPS_SWITCH not in server_environment({}, cpu=True)
    base = {"PATH": "/bin"}
    assert server_environment(base, cpu=False, cpu_ops=True) == base


def run_site(env: dict) -> dict:
    probe = ("import json, sys, torch\n"
             "info = {'installed': 'tasks.server.cpu.spec_ops' in sys.modules,\n"
             "        'ops': [n for n in %r if hasattr(torch.ops.sgl_kernel, n)]}\n"
             "import importlib.util\n"
             "info['flashinfer'] = importlib.util.find_spec('flashinfer') is not None\n"
             "if info['installed']:\n"
             "    from sglang.srt.runtime_context import get_platform\n"
             "    from sglang.srt.utils.common import cpu_has_amx_support\n"
             "    info.update(has_amx=get_platform().has_amx, layers_amx=cpu_has_amx_support())\n"
             "print(json.dumps(info))\n") % (list(SCHEMAS),)
    env = dict(env, PYTHONPATH=os.pathsep.join([env.get("PYTHONPATH", ""), str(REPO_ROOT)]))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sitecustomize_installs_in_server_processes_only_when_asked():
    on = run_site(server_environment(cpu=True, cpu_ops=True))
    assert on["installed"] and sorted(on["ops"]) == sorted(SCHEMAS)
    assert on["flashinfer"] is False  # installed here, left out of a CPU server's processes
    # SGLang keeps intel_amx, but the model layers still see no AMX.
    assert on["has_amx"] is True and on["layers_amx"] is False
    env = server_environment(cpu=True, cpu_ops=True)
    env.pop(CPU_OPS_SWITCH)
    off = run_site(env)
    assert not off["installed"] and off["ops"] == []
