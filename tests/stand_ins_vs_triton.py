"""The CPU stand-ins of tasks/server/cpu/spec_ops.py against the Triton
kernels SGLang 0.5.23 runs for the same jobs on a GPU, on the same inputs.

Why: a CPU server here is a rehearsal of a GPU one. The stand-ins were
written from sgl-kernel's C++ CPU sources; if one of them meant something
else than the kernel a GPU runs (an off-by-one in a slot range, a tree
mask read by columns, a draft laid out per step rather than per branch),
the CPU runs would test a speculative decoder that no GPU runs, and pass.
So each check below launches the GPU kernel itself, on CPU tensors, under
Triton's interpreter, and the stand-in on copies of the same inputs.

Only ever imported by tests/triton_interpreter.py's child process
(TRITON_INTERPRET=1 set before triton loads, SGLANG_USE_CPU_ENGINE unset
so SGLang's kernel modules import without sgl_kernel). The kernels are
launched directly, or through SGLang's plain-Python launchers: the *_func
dispatchers would pick the CPU branch, i.e. the stand-ins themselves.

Every check returns JSON facts, among them a negative control: the
stand-in rerun with one input deliberately wrong (a seq_len off by one, a
request order reversed, ...). The test asserts that control DIFFERS from
the kernel, so a comparison that compared nothing (both sides untouched,
an empty slice) cannot pass.

File:line references are to site-packages/sglang/ of sglang 0.5.23.
"""
from __future__ import annotations

import torch
import triton

import tasks.server.cpu.spec_ops as so
from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_tiled
from sglang.kernels.ops.speculative.cache_locs import (
    assign_draft_cache_locs_contiguous,
    assign_extend_cache_locs,
    generate_draft_decode_kv_indices,
)
from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc, fill_bonus_tokens
from sglang.kernels.ops.speculative.spec_tree import (
    TreeMaskMode,
    sgl_build_tree_kernel_triton,
    verify_tree_greedy_triton,
)
from sglang.srt.mem_cache.allocation import assign_req_to_token_pool

# Fills output buffers before a kernel runs, so an untouched entry shows.
SENTINEL = -7


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pool(g: torch.Generator, rows: int = 4, pool_len: int = 48) -> torch.Tensor:
    # Distinct slot numbers everywhere: a slot read from the wrong row or
    # column then always shows as a different value.
    return torch.randperm(rows * pool_len, generator=g).int().view(rows, pool_len)


def _int_facts(triton_out: torch.Tensor, stand_in_out: torch.Tensor, controls: dict) -> dict:
    """Facts about an exact comparison: equal, how many entries, the first
    mismatches (flat index, kernel's, stand-in's), whether the kernel wrote
    every compared entry (none left at SENTINEL), and for each negative
    control (name -> the stand-in's output from a wrong input) whether it
    equals the kernel's output all the same."""
    a, b = triton_out.long().flatten(), stand_in_out.long().flatten()
    diff = (a != b).nonzero().flatten()[:5].tolist()
    return {
        "equal": bool(torch.equal(a, b)),
        "compared": a.numel(),
        "first_mismatches": [[i, int(a[i]), int(b[i])] for i in diff],
        "triton_wrote_all": bool((a != SENTINEL).all()),
        "controls_equal": {name: bool(torch.equal(a, c.long().flatten())) for name, c in controls.items()},
    }


# ------------------------------------------------------- slot bookkeeping

# GPU kernel: srt/mem_cache/allocation.py:692 assign_req_to_token_pool (@triton.jit)
def assign_req_to_token_pool_check() -> dict:
    g = _gen(0)
    pool_len = 48
    r2t = _pool(g, pool_len=pool_len)
    rpi = torch.tensor([2, 0, 3])
    start, end = torch.tensor([3, 0, 5]), torch.tensor([7, 2, 14])  # runs of 4, 2 and 9 slots
    loc = torch.randint(1000, 2000, (int((end - start).sum()),), generator=g)

    def stand_in(req_pool_indices):
        out = r2t.clone()
        so.assign_req_to_token_pool_cpu(req_pool_indices, out, start, end, loc, pool_len)
        return out

    tri = r2t.clone()
    assign_req_to_token_pool[(3,)](rpi, tri, start, end, loc, pool_len, triton.next_power_of_2(3))
    return _int_facts(tri, stand_in(rpi), {"requests_reversed": stand_in(rpi.flip(0))})


# GPU kernel: kernels/ops/speculative/cache_locs.py:500 assign_extend_cache_locs (@triton.jit)
def assign_extend_cache_locs_check() -> dict:
    g = _gen(1)
    pool_len = 48
    r2t = _pool(g, pool_len=pool_len)
    rpi = torch.tensor([2, 0, 3])
    start, end = torch.tensor([3, 0, 5]), torch.tensor([7, 2, 14])
    n = int((end - start).sum())

    def stand_in(start_offset, end_offset):
        out = torch.full((n,), SENTINEL, dtype=torch.int64)
        so.assign_extend_cache_locs_cpu(rpi, r2t, start_offset, end_offset, out, pool_len)
        return out

    tri = torch.full((n,), SENTINEL, dtype=torch.int64)
    assign_extend_cache_locs[(3,)](rpi, r2t, start, end, tri, pool_len, triton.next_power_of_2(3))
    return _int_facts(tri, stand_in(start, end), {"offsets_plus_one": stand_in(start + 1, end + 1)})


# GPU kernel: kernels/ops/speculative/cache_locs.py:43 assign_draft_cache_locs_contiguous (@triton.jit)
def assign_draft_cache_locs_contiguous_check() -> dict:
    g = _gen(2)
    pool_len = 48
    r2t = _pool(g, pool_len=pool_len)
    rpi, seq_lens = torch.tensor([2, 0, 3]), torch.tensor([5, 11, 2])
    topk, steps = 2, 3

    def stand_in(lens):
        out = torch.full((3 * topk * steps,), SENTINEL, dtype=torch.int64)
        so.assign_draft_cache_locs_contiguous_cpu(rpi, r2t, lens, out, pool_len, topk, steps)
        return out

    tri = torch.full((3 * topk * steps,), SENTINEL, dtype=torch.int64)
    assign_draft_cache_locs_contiguous[(3,)](rpi, r2t, seq_lens, tri, pool_len, topk, steps)
    return _int_facts(tri, stand_in(seq_lens), {"seq_lens_plus_one": stand_in(seq_lens + 1)})


# GPU kernel: kernels/ops/speculative/cache_locs.py:161 generate_draft_decode_kv_indices (@triton.jit;
# launched as in srt/layers/attention/triton_backend.py:2595)
def build_draft_decode_metadata_check() -> dict:
    """The two describe the same draft-decode KV in different layouts: the
    kernel writes, per draft step i, flat kv_indices/kv_indptr where branch
    (request b, candidate k) sees seq_len_b + i + 1 slots; the stand-in (what
    intel_amx_backend.py:438 calls) writes one req_to_token-like row per
    branch, whose first seq_len_b + i + 1 entries must be those slots."""
    g = _gen(3)
    pool_len = 48
    r2t = _pool(g, pool_len=pool_len)
    rpi, seq_lens = torch.tensor([2, 0, 3]), torch.tensor([5, 11, 2])
    bs = 3
    facts = {}
    for topk in (1, 2):
        steps = 3
        branches = bs * topk
        kv_indices = torch.full((steps, int(seq_lens.sum()) * topk + branches * steps), SENTINEL, dtype=torch.int64)
        kv_indptr = torch.zeros((steps, branches + 1), dtype=torch.int32)
        positions = seq_lens.repeat_interleave(topk)  # a draft decode's positions: seq_len per branch
        generate_draft_decode_kv_indices[(steps, bs, topk)](
            rpi, r2t, seq_lens, kv_indices, kv_indptr, positions, pool_len, kv_indices.shape[1],
            kv_indptr.shape[1], triton.next_power_of_2(bs), triton.next_power_of_2(steps),
            triton.next_power_of_2(branches), 1)

        lens = seq_lens.repeat_interleave(topk)

        def as_kernel_layout(meta):
            # The stand-in's rows, cut at seq_len + step + 1 and concatenated step by step as the kernel lays them out.
            return torch.cat([meta[j, :int(n)] for i in range(steps) for j, n in enumerate(lens + i + 1)]).long()

        tri = torch.cat([kv_indices[i, :int(kv_indptr[i, -1])] for i in range(steps)])
        indptr_ok = all(torch.equal(kv_indptr[i, 1:].long(), torch.cumsum(lens + i + 1, 0)) for i in range(steps))
        meta = so.build_draft_decode_metadata_cpu(r2t, rpi, seq_lens, topk, steps, pool_len)
        # Not seq_lens off by one as a control: with topk 1 the drafts follow the prefix
        # contiguously, so a prefix one longer reads the very same slots.
        control = so.build_draft_decode_metadata_cpu(r2t, rpi.flip(0), seq_lens, topk, steps, pool_len)
        facts[f"topk{topk}"] = {**_int_facts(tri, as_kernel_layout(meta),
                                             {"requests_reversed": as_kernel_layout(control)}),
                                "kv_indptr_is_cumsum_of_seq_len_plus_step": indptr_ok}
    return facts


# GPU kernel: kernels/ops/speculative/eagle.py:56 fill_accept_out_cache_loc (@triton.jit)
def fill_accept_out_cache_loc_check() -> dict:
    g = _gen(4)
    accept_index = torch.tensor([[0, 1, -1, -1], [4, 6, 7, -1], [8, -1, -1, -1]], dtype=torch.int32)
    out_cache_loc = torch.randint(0, 1000, (12,), generator=g)
    n_accepted = int((accept_index != -1).sum())
    size = accept_index.numel()

    def stand_in(locs):
        out = torch.full((size,), SENTINEL, dtype=torch.int64)
        so.fill_accept_out_cache_loc_cpu(accept_index, locs, out)
        return out[:n_accepted]

    tri = torch.full((size,), SENTINEL, dtype=torch.int64)
    fill_accept_out_cache_loc[(size,)](accept_index, out_cache_loc, tri, triton.next_power_of_2(size))
    # Only the first n_accepted entries are written, by either.
    return _int_facts(tri[:n_accepted], stand_in(out_cache_loc), {"slots_shifted": stand_in(out_cache_loc.roll(1))})


# GPU kernel: kernels/ops/speculative/eagle.py:14 fill_bonus_tokens (@triton.jit)
def fill_bonus_tokens_check() -> dict:
    g = _gen(5)
    accept_tokens = torch.randint(0, 100, (3, 4), generator=g)
    accept_lens = torch.tensor([2, 3, 1], dtype=torch.int32)  # counts the bonus token

    def stand_in(lens):
        out = torch.full((3,), SENTINEL, dtype=torch.int32)
        so.fill_bonus_tokens_cpu(accept_tokens, lens, out, 4)
        return out

    tri = torch.full((3,), SENTINEL, dtype=torch.int32)
    fill_bonus_tokens[(3,)](accept_tokens, accept_lens, tri, 4)
    return _int_facts(tri, stand_in(accept_lens), {"accept_lens_plus_one": stand_in(accept_lens + 1)})


# GPU kernel: kernels/ops/kvcache/cache_move.py:146 copy_all_layer_kv_cache_tiled (@triton.jit)
def copy_all_layer_kv_cache_check() -> dict:
    """The copy works on raw base addresses and row sizes in bytes; two
    buffers of different dtypes and a chained overlap (slot 2 and 3 are
    both read and written) test that all sources are read first."""
    g = _gen(6)
    buffers = [torch.randn(16, 2, 8, generator=g), torch.randn(16, 2, 8, generator=g).bfloat16()]
    tgt, src = torch.tensor([1, 2, 3]), torch.tensor([2, 3, 9])

    def addresses(bufs):
        ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
        strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
        return ptrs, strides

    def as_bits(bufs):  # bit patterns, so that "equal" means byte-for-byte
        return torch.cat([b.view(torch.int16).flatten() if b.dtype == torch.bfloat16 else b.view(torch.int32).flatten()
                          for b in bufs])

    def stand_in(t, s):
        bufs = [b.clone() for b in buffers]
        ptrs, strides = addresses(bufs)
        so.copy_all_layer_kv_cache_cpu(ptrs.view(torch.int64), strides, t, s)
        return as_bits(bufs)

    tri_bufs = [b.clone() for b in buffers]
    ptrs, strides = addresses(tri_bufs)
    bytes_per_tile = 128
    copy_all_layer_kv_cache_tiled[(len(tri_bufs), triton.cdiv(int(strides.max()), bytes_per_tile))](
        ptrs, strides, tgt, src, 3, triton.next_power_of_2(3), BYTES_PER_TILE=bytes_per_tile)
    facts = _int_facts(as_bits(tri_bufs), stand_in(tgt, src), {"direction_swapped": stand_in(src, tgt)})
    facts["triton_changed_the_buffers"] = not torch.equal(as_bits(tri_bufs), as_bits(buffers))
    del facts["triton_wrote_all"]  # raw float bits: the sentinel means nothing here
    return facts


# ------------------------------------------------------------ draft tree

# A two-request draft tree, topk 2, depth 3, 4 verify tokens (root + 3 drafts).
# Request 0 is a chain (root -> draft 0 -> 3 -> 6); request 1 a root with drafts 0
# and 1 and 2 under draft 0.
TREE_PARENTS = torch.tensor([[-1, 0, 1, 3, 4], [-1, 0, 1, 2, 5]])  # [bs, topk * (depth - 1) + 1]
TREE_SELECTED = torch.tensor([[0, 3, 6], [0, 1, 2]])               # [bs, n - 1], sorted draft indices
TREE_TOPK, TREE_DEPTH, TREE_N = 2, 3, 4
TREE_SEQ_LENS = torch.tensor([5, 9])


def _tree_outputs(build, mode: int, seq_lens=TREE_SEQ_LENS, selected=TREE_SELECTED) -> dict:
    n, bs = TREE_N, 2
    numel = bs * n * n + (int(seq_lens.sum()) * n if mode == int(TreeMaskMode.FULL_MASK) else 0)
    out = {"tree_mask": torch.ones(numel, dtype=torch.bool),  # True: an entry left unwritten reads as visible
           "positions": torch.full((bs * n,), SENTINEL, dtype=torch.long),
           "retrive_index": torch.full((bs, n), SENTINEL, dtype=torch.long),
           # The caller's contract: the links come pre-filled with -1 ("none").
           "retrive_next_token": torch.full((bs, n), -1, dtype=torch.long),
           "retrive_next_sibling": torch.full((bs, n), -1, dtype=torch.long)}
    build(TREE_PARENTS, selected, seq_lens, *out.values(), TREE_TOPK, TREE_DEPTH, n, mode)
    return out


# GPU kernel: kernels/ops/speculative/spec_tree.py:318 sgl_build_tree_kernel_triton, launching
# sgl_build_tree_kernel_efficient_triton (:53). SGLang runs it on XPU; on CUDA the same job is a JIT
# CUDA kernel (kernels/ops/speculative/tree.py:30), which no interpreter can run.
def build_tree_kernel_efficient_check() -> dict:
    def triton_build(*args):
        sgl_build_tree_kernel_triton(*args[:-1], TreeMaskMode(args[-1]))

    # Request 0 as root -> drafts 0 and 1, draft 3 under draft 0: another shape, other links.
    other_selected = torch.tensor([[0, 1, 3], [0, 1, 2]])
    facts = {}
    for mode in (int(TreeMaskMode.FULL_MASK), int(TreeMaskMode.QLEN_ONLY)):
        tri = _tree_outputs(triton_build, mode)
        cpu = _tree_outputs(so.build_tree_kernel_efficient_cpu, mode)
        controls = {"seq_lens_plus_one": _tree_outputs(so.build_tree_kernel_efficient_cpu, mode, TREE_SEQ_LENS + 1),
                    "other_selected_drafts": _tree_outputs(so.build_tree_kernel_efficient_cpu, mode,
                                                           selected=other_selected)}
        # A longer prefix makes FULL_MASK's mask longer: compare the part the kernel's covers.
        cut = tri["tree_mask"].numel()
        facts[TreeMaskMode(mode).name] = {
            name: _int_facts(tri[name], cpu[name], {c: out[name][:cut] if name == "tree_mask" else out[name]
                                                    for c, out in controls.items()})
            for name in tri}
    return facts


# GPU kernel: kernels/ops/speculative/spec_tree.py:447 verify_tree_greedy_triton, launching
# verify_tree_greedy_kernel_triton (:211). XPU's; CUDA runs kernels/ops/speculative/tree.py:61 (JIT CUDA).
def verify_tree_greedy_check() -> dict:
    tree = _tree_outputs(so.build_tree_kernel_efficient_cpu, int(TreeMaskMode.QLEN_ONLY))
    ri, rnt, rns = tree["retrive_index"], tree["retrive_next_token"], tree["retrive_next_sibling"]
    candidates = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    # Request 0's target agrees with its whole chain of 3 drafts; request 1's with one
    # draft (22, the second child of the root), after a sibling that does not match.
    target = torch.tensor([[11, 12, 13, 99], [22, 98, 97, 96]])

    def outputs(verify, target_predict):
        predicts = torch.full((2 * TREE_N,), SENTINEL, dtype=torch.int32)
        accept_index = torch.full((2, TREE_DEPTH + 1), -1, dtype=torch.int32)  # the caller's -1 pre-fill
        accept_num = torch.full((2,), SENTINEL, dtype=torch.int32)
        verify(predicts, accept_index, accept_num, candidates, ri, rnt, rns, target_predict)
        return {"predicts": predicts, "accept_index": accept_index, "accept_token_num": accept_num}

    tri = outputs(verify_tree_greedy_triton, target)
    cpu = outputs(so.verify_tree_greedy_cpu, target)
    ctl = outputs(so.verify_tree_greedy_cpu, target.roll(1, dims=1))
    facts = {name: _int_facts(tri[name], cpu[name], {"target_shifted": ctl[name]}) for name in tri}
    facts["accept_token_num_triton"] = tri["accept_token_num"].tolist()
    return facts


# ---------------------------------------------------------------- attention

def _attention_facts(triton_out: torch.Tensor, stand_in_out: torch.Tensor, controls: dict, **context) -> dict:
    """max |kernel - stand-in|, the kernel output's magnitude (a bf16 ulp is
    relative to it), and each negative control's max difference."""
    t = triton_out.float()
    return {"max_abs_diff": (t - stand_in_out.float()).abs().max().item(),
            "max_abs_out": t.abs().max().item(),
            "finite": bool(torch.isfinite(t).all() and torch.isfinite(stand_in_out.float()).all()),
            "compared": t.numel(),
            "controls": {name: (t - c.float()).abs().max().item() for name, c in controls.items()},
            **context}


def _requests_in_pool(g, req_pool_indices, seq_lens, rows, pool_len, num_slots):
    """A req_to_token whose requests hold distinct, shuffled slots (slot 0,
    SGLang's padding slot, unused), so a slot read for the wrong token shows."""
    req_to_token = torch.zeros(rows, pool_len, dtype=torch.int32)
    perm = torch.randperm(num_slots - 1, generator=g) + 1
    off = 0
    for r, n in zip(req_pool_indices.tolist(), seq_lens.tolist()):
        req_to_token[r, :n] = perm[off:off + n].int()
        off += n
    return req_to_token


def _decode(dtype, head_dim, num_heads, num_kv_heads, seq_lens=(5, 9), seed=0, mla_kv_lora=None):
    """decode_attention_fwd (the Triton backend's decode) vs decode_attention_cpu.
    With mla_kv_lora: the MLA latent cache (one KV "head" of kv_lora + rope,
    values its first kv_lora columns, as MLATokenToKVPool hands them over)."""
    g = _gen(seed)
    num_slots, bs, max_kv_splits = 64, len(seq_lens), 4
    if mla_kv_lora is None:
        k_buf = torch.randn(num_slots, num_kv_heads, head_dim, generator=g).to(dtype)
        v_buf = torch.randn(num_slots, num_kv_heads, head_dim, generator=g).to(dtype)
        sm_scale, v_dim = head_dim ** -0.5, head_dim
    else:
        k_buf = torch.randn(num_slots, 1, head_dim, generator=g).to(dtype)
        v_buf = k_buf[..., :mla_kv_lora]
        sm_scale, v_dim = 0.1, mla_kv_lora  # an MLA model's scale is 1/sqrt(qk_nope + rope), not of the latent
    q = torch.randn(bs, num_heads, head_dim, generator=g).to(dtype)
    rpi, sl = torch.tensor([2, 0]), torch.tensor(seq_lens)
    req_to_token = _requests_in_pool(g, rpi, sl, 4, 32, num_slots)
    # The Triton backend's view of the same requests: flat kv_indices, one run per request.
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(sl, 0)
    kv_indices = torch.cat([req_to_token[r, :n] for r, n in zip(rpi.tolist(), seq_lens)]).long()

    tri = torch.empty(bs, num_heads, v_dim, dtype=dtype)
    decode_attention_fwd(q, k_buf, v_buf, tri, kv_indptr, kv_indices,
                         torch.empty(bs, num_heads, max_kv_splits, v_dim), torch.empty(bs, num_heads, max_kv_splits),
                         torch.full((bs,), max_kv_splits, dtype=torch.int32), max_kv_splits, sm_scale, 1.0, 1.0,
                         has_mla=mla_kv_lora is not None)

    def stand_in(lens):
        out = torch.empty(bs, num_heads, v_dim, dtype=dtype)
        # key/value None: the new token's K/V are already in the cache, as the kernel expects.
        so.decode_attention_cpu(q, k_buf, v_buf, 1.0, 1.0, out, None, None, torch.empty(0, dtype=torch.long),
                                torch.empty(0), req_to_token, rpi, lens, sm_scale, 0.0, False, 0, None, None)
        return out

    return _attention_facts(tri, stand_in(sl), {"seq_lens_minus_one": stand_in(sl - 1)},
                            max_abs_v=v_buf.float().abs().max().item())


# GPU kernel: kernels/ops/attention/decode_attention.py:1191 decode_attention_fwd, launching
# _fwd_kernel_stage1 (:235, MHA) or _fwd_grouped_kernel_stage1 (:530, GQA/MLA), then _fwd_kernel_stage2 (:935)
def decode_attention_check() -> dict:
    facts = {}
    for layout, kv_heads in (("gqa", 1), ("mha", 2)):  # 2 query heads sharing 1 KV head, or one each
        for dtype in (torch.float32, torch.bfloat16):
            for head_dim in (64, 128):
                facts[f"{layout}-{str(dtype).split('.')[1]}-d{head_dim}"] = _decode(dtype, head_dim, 2, kv_heads)
    return facts


# GPU kernel: the same decode_attention_fwd (decode_attention.py:1191) with has_mla=True, i.e.
# _fwd_grouped_kernel_stage1 (:530) over the latent cache, as the Triton backend runs an MLA decode
def mla_decode_attention_check() -> dict:
    return {"float32-kv_lora512-rope64": _decode(torch.float32, 512 + 64, 2, 1, mla_kv_lora=512)}


def _extend(dtype, tree, head_dim=128, num_heads=2, num_kv_heads=1, prefix=(3, 6), ext=(4, 2), seed=0):
    """extend_attention_fwd (the Triton backend's extend / target verify) vs
    extend_attention_cpu: each request's new tokens see its cached prefix and
    each other, causally or as a draft tree's mask says."""
    g = _gen(seed)
    num_slots, bs = 64, len(prefix)
    seq = torch.tensor([p + e for p, e in zip(prefix, ext)], dtype=torch.int32)
    ext_t = torch.tensor(ext, dtype=torch.int32)
    k_buf = torch.randn(num_slots, num_kv_heads, head_dim, generator=g).to(dtype)
    v_buf = torch.randn(num_slots, num_kv_heads, head_dim, generator=g).to(dtype)
    total = sum(ext)
    q = torch.randn(total, num_heads, head_dim, generator=g).to(dtype)
    k_ext = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    v_ext = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    rpi = torch.tensor([1, 3])
    req_to_token = _requests_in_pool(g, rpi, seq, 4, 32, num_slots)
    # SGLang writes the new tokens' K/V into the cache before attention; both sides may read either.
    start = 0
    for r, p, e in zip(rpi.tolist(), prefix, ext):
        slots = req_to_token[r, p:p + e].long()
        k_buf[slots], v_buf[slots] = k_ext[start:start + e], v_ext[start:start + e]
        start += e
    # A draft tree per request, row = query: 0 is the root, token i sees the root and itself,
    # and odd i also its left neighbour; so for 4 tokens 1 and 2 are siblings and 3 is 2's child.
    qlen_masks = []
    for e in ext:
        m = torch.eye(e, dtype=torch.bool)
        m[:, 0] = True
        for i in range(1, e, 2):
            m[i, i - 1] = True
        qlen_masks.append(m)

    qo_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(ext_t, 0)
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(torch.tensor(prefix), 0)
    kv_indices = torch.cat([req_to_token[r, :p] for r, p in zip(rpi.tolist(), prefix)]).long()
    custom_mask = mask_indptr = None
    if tree:
        # The GPU backend's FULL_MASK layout: per request ext rows of prefix + ext columns, prefix all visible.
        full = [torch.cat([torch.ones(e, p, dtype=torch.bool), m], 1).flatten()
                for p, e, m in zip(prefix, ext, qlen_masks)]
        custom_mask = torch.cat(full).to(torch.uint8)
        mask_indptr = torch.zeros(bs + 1, dtype=torch.int64)
        mask_indptr[1:] = torch.cumsum(torch.tensor([x.numel() for x in full]), 0)
    sm_scale = head_dim ** -0.5
    tri = torch.empty(total, num_heads, head_dim, dtype=dtype)
    extend_attention_fwd(q, k_ext, v_ext, tri, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices,
                         custom_mask, not tree, mask_indptr, max(ext), 1.0, 1.0, sm_scale=sm_scale)

    def stand_in(seq_lens, tree_mask, is_causal=True):
        out = torch.empty(total, num_heads, head_dim, dtype=dtype)
        # The CPU backend's QLEN_ONLY layout: ext x ext per request, drafts only.
        so.extend_attention_cpu(q, k_ext, v_ext, out, k_buf, v_buf, 1.0, 1.0, req_to_token, rpi, seq_lens, ext_t,
                                qo_indptr[:-1], max(ext), sm_scale, 0.0, False, 0, None, None, tree_mask, is_causal)
        return out

    tree_mask = torch.cat([m.flatten() for m in qlen_masks]) if tree else None
    controls = {"seq_lens_minus_one": stand_in(seq - 1, tree_mask)}
    if tree:
        controls["causal_instead_of_tree"] = stand_in(seq, None)
    return _attention_facts(tri, stand_in(seq, tree_mask), controls, max_abs_v=v_buf.float().abs().max().item())


# GPU kernel: kernels/ops/attention/extend_attention.py:916 extend_attention_fwd, launching _fwd_kernel (:375)
def extend_attention_check() -> dict:
    facts = {}
    for dtype in (torch.float32, torch.bfloat16):
        for tree in (False, True):
            facts[f"{'tree' if tree else 'causal'}-{str(dtype).split('.')[1]}"] = _extend(dtype, tree)
    return facts

