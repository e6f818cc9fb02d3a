"""EAGLE-3 speculative decoding in stock SGLang on a CPU without the CPU kernel build.

SGLang's CPU speculative path is the Intel one: the `intel_amx` attention
backend and eleven `torch.ops.sgl_kernel.*_cpu` operators that only the
source-built CPU sgl_kernel has; the PyPI wheel (CUDA-only) lacks them. This
module gives them plain-PyTorch implementations with the semantics of
`sgl-kernel/csrc/cpu/` (speculative_decoding.cpp, decode.cpp, extend.cpp,
kvcache.cpp) and the argument order of the installed `sgl_kernel` wrappers and
`intel_amx_backend.py` callers. Correct first: the attention loops over
sequences in Python.

`install()` registers the missing operators and keeps `--attention-backend
intel_amx` on a CPU without AMX. It is called in every server process by
`tasks/server/cpu/sglang_site/sitecustomize.py`, only on a machine without a GPU.
"""
from __future__ import annotations

import ctypes

import torch

from tasks.server.cpu.dflash import dflash_on_cpu

# SGLang's TreeMaskMode values. FULL_MASK: per request n rows of seq_len + n
# columns; QLEN_ONLY (what SGLang uses on a CPU): [bs * n * n], drafts only.
TREE_MASK_FULL, TREE_MASK_QLEN_ONLY = 0, 1


# ---------------------------------------------------------------- KV cache moves

def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """For every KV buffer b (given by its base address and row size in
    bytes): buf_b[tgt_loc[i]] = buf_b[src_loc[i]]. All sources are read before
    any target is written, so overlapping locations are safe."""
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"tgt_loc has {tgt_loc.numel()} entries, src_loc {src_loc.numel()}")
    if data_ptrs.numel() != strides.numel():
        raise ValueError(f"{data_ptrs.numel()} buffer addresses but {strides.numel()} strides")
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    rows_needed = int(torch.maximum(tgt.max(), src.max())) + 1
    # The pool hands over raw addresses; view just the rows this copy touches.
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows_needed * stride)).from_address(ptr)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(rows_needed, stride)
        rows[tgt] = rows[src]  # the gather copies every source row before the scatter


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th run of out_cache_loc."""
    rows, cols = _segments(req_pool_indices, start_offset, end_offset)
    flat = req_to_token.view(-1)
    flat[rows * pool_len + cols] = out_cache_loc[: cols.numel()].to(flat.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """out_cache_loc = concat_i req_to_token[req_pool_indices[i], start[i]:end[i]]."""
    rows, cols = _segments(req_pool_indices, start_offset, end_offset)
    out_cache_loc[: cols.numel()] = req_to_token.view(-1)[rows * pool_len + cols].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                           seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                                           pool_len: int, topk: int, num_steps: int) -> None:
    """out_cache_loc[i] = the topk*num_steps slots reserved after seq_lens[i]
    in request i's row of req_to_token."""
    span = topk * num_steps
    if out_cache_loc.numel() != req_pool_indices.numel() * span:
        raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} entries, expected "
                         f"{req_pool_indices.numel()} requests x {span}")
    start = req_pool_indices.long() * pool_len + seq_lens.long()
    idx = start[:, None] + torch.arange(span)
    out_cache_loc.view(-1, span)[:] = req_to_token.view(-1)[idx].to(out_cache_loc.dtype)


def build_draft_decode_metadata_cpu(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                    seq_lens: torch.Tensor, topk: int, num_steps: int,
                                    pool_len: int) -> torch.Tensor:
    """A [num_seqs*topk, pool_len] req_to_token for multi-step draft decode:
    row b*topk+k holds request b's committed prefix followed by candidate k's
    num_steps draft slots (laid out at seq_len + k*num_steps). Entries past
    seq_len + num_steps are undefined (zero here)."""
    num_seqs = req_pool_indices.numel()
    out = torch.zeros(num_seqs * topk, pool_len, dtype=req_to_token.dtype)
    flat = req_to_token.view(-1)
    for b, (row, sl) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        src = flat[row * pool_len: row * pool_len + pool_len]
        for k in range(topk):
            dst = out[b * topk + k]
            dst[:sl] = src[:sl]
            dst[sl: sl + num_steps] = src[sl + k * num_steps: sl + (k + 1) * num_steps]
    return out


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor) -> None:
    """Compact the accepted tokens' slots: out_cache_loc at every accept_index
    entry that is not -1, in order."""
    idx = accept_index.reshape(-1).long()
    picked = out_cache_loc[idx[idx > -1]]
    accept_out_cache_loc[: picked.numel()] = picked.to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor,
                          bonus_tokens: torch.Tensor, accept_stride: int) -> None:
    """bonus_tokens[i] = the last accepted token of request i (accept_lens counts the bonus)."""
    idx = torch.arange(accept_lens.numel()) * accept_stride + accept_lens.long() - 1
    bonus_tokens[:] = accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype)


def _segments(req_pool_indices, start_offset, end_offset):
    """Row and column of every element of the runs [start[i], end[i]) of row
    req_pool_indices[i], concatenated in request order."""
    start, lens = start_offset.long(), (end_offset.long() - start_offset.long())
    if bool((lens < 0).any()):
        raise ValueError("end_offset is before start_offset for some request")
    rows = torch.repeat_interleave(req_pool_indices.long(), lens)
    run_start = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    cols = torch.repeat_interleave(start, lens) + torch.arange(int(lens.sum())) - run_start
    return rows, cols


# ------------------------------------------------------------------ draft tree

def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                    verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
                                    positions: torch.Tensor, retrive_index: torch.Tensor,
                                    retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                                    topk: int, depth: int, draft_token_num: int,
                                    tree_mask_mode: int) -> None:
    """Build the draft token tree for target verification: the tree attention
    mask, each draft token's position, and the retrieval links (index, first
    child, next sibling; the caller pre-fills the links with -1)."""
    if tree_mask_mode not in (TREE_MASK_FULL, TREE_MASK_QLEN_ONLY):
        raise NotImplementedError(f"tree_mask_mode {tree_mask_mode} (bit-packed) is not supported on CPU")
    n = draft_token_num
    parents = parent_list.reshape(parent_list.shape[0], -1).tolist()
    selected = selected_index.reshape(selected_index.shape[0], -1).tolist()
    seq_lens = verified_seq_len.tolist()
    bs = len(seq_lens)
    ri, rnt, rns = retrive_index.view(-1), retrive_next_token.view(-1), retrive_next_sibling.view(-1)
    mask_offset = 0  # FULL_MASK: rows of seq_len + n columns, per request in turn
    for b in range(bs):
        off, seq_len, sel, par = b * n, seq_lens[b], selected[b], parents[b]
        positions[off] = seq_len
        ri[off] = off
        for i in range(n - 1, 0, -1):
            ri[off + i] = off + i
            parent_tb = sel[i - 1] // topk
            # Tree slot of the parent: 0 is the root, slot c+1 holds sel[c].
            parent_pos = 0 if parent_tb == 0 else _slot_of(sel, par[parent_tb]) + 1
            if parent_pos == 0 and parent_tb > 0:
                continue  # parent not selected: the C++ kernel skips the node too
            first = int(rnt[off + parent_pos])
            rnt[off + parent_pos] = i
            if first != -1:
                rns[off + i] = first
        row_len = n if tree_mask_mode == TREE_MASK_QLEN_ONLY else seq_len + n
        base = off * n if tree_mask_mode == TREE_MASK_QLEN_ONLY else mask_offset + seq_len
        for tid in range(n):
            row = base + tid * row_len
            tree_mask[row] = True  # the root (bonus) token
            tree_mask[row + 1: row + n] = False
            if tid == 0:
                continue
            position, cur = 0, tid - 1
            while True:
                position += 1
                tree_mask[row + cur + 1] = True
                parent_tb = sel[cur] // topk
                if parent_tb == 0:
                    break
                cur = _slot_of(sel, par[parent_tb])
                if cur < 0:
                    raise ValueError(f"draft tree of request {b}: parent draft token {par[parent_tb]} is not selected")
            positions[off + tid] = position + seq_len
        mask_offset += n * (seq_len + n)


def _slot_of(selected: list[int], token_idx: int) -> int:
    return selected.index(token_idx) if token_idx in selected else -1


def verify_tree_greedy_cpu(predicts: torch.Tensor, accept_index: torch.Tensor,
                           accept_token_num: torch.Tensor, candidates: torch.Tensor,
                           retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                           retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """Greedy verification: per request, follow the longest root path whose
    draft tokens equal the target's argmax. Writes predicts (by flat draft
    index), accept_index (flat indices of accepted tokens; the caller pre-fills
    -1) and accept_token_num (accepted drafts, bonus excluded)."""
    bs, n = candidates.shape
    num_spec_step = accept_index.shape[1]
    cand, ri = candidates.tolist(), retrive_index.tolist()
    rnt, rns = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    for b in range(bs):
        last = ri[b][0]
        accept_index[b, 0] = last
        correct, cur = 0, 0
        for _ in range(1, num_spec_step):
            cur = rnt[b][cur]
            while cur != -1:
                if cand[b][cur] == target[last]:
                    predicts[last] = target[last]
                    correct += 1
                    accept_index[b, correct] = ri[b][cur]
                    last = ri[b][cur]
                    break
                cur = rns[b][cur]
            if cur == -1:
                break
        accept_token_num[b] = correct
        predicts[last] = target[last]


# -------------------------------------------------------------------- attention

def decode_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         k_scale: float, v_scale: float, output: torch.Tensor,
                         key: torch.Tensor | None, value: torch.Tensor | None, loc: torch.Tensor,
                         attn_logits: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         sm_scale: float, logit_cap: float, is_cross_attention: bool,
                         sliding_window_size: int, encoder_lens: torch.Tensor | None,
                         sinks: torch.Tensor | None) -> None:
    """One query token per sequence: first store the new key/value at `loc`
    (when given), then attend over the sequence's seq_lens[i] cached tokens.
    attn_logits is the C++ kernel's split-KV scratch; nothing reads it after."""
    _refuse_unsupported("decode_attention_cpu", is_cross_attention, encoder_lens)
    if key is not None:
        if value is None:
            raise ValueError("decode_attention_cpu: key given without value")
        k_cache[loc.long()] = key.reshape(-1, *k_cache.shape[1:]).to(k_cache.dtype)
        v_cache[loc.long()] = value.reshape(-1, *v_cache.shape[1:]).to(v_cache.dtype)
    rows = req_to_token.view(-1)
    pool_len = req_to_token.shape[1]
    for i, (req, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        slots = rows[req * pool_len: req * pool_len + seq_len].long()
        visible = _in_window(torch.tensor([seq_len - 1]), seq_len, sliding_window_size)
        output[i] = _attend(query[i: i + 1], k_cache[slots], v_cache[slots], k_scale, v_scale,
                            sm_scale, logit_cap, visible, sinks)[0].to(output.dtype)


def extend_attention_cpu(q_extend: torch.Tensor, k_extend: torch.Tensor | None,
                         v_extend: torch.Tensor | None, o_extend: torch.Tensor,
                         k_buffer: torch.Tensor, v_buffer: torch.Tensor, k_scale: float, v_scale: float,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
                         extend_start_loc: torch.Tensor, max_len_extend: int, sm_scale: float,
                         logit_cap: float, is_cross_attention: bool, sliding_window_size: int,
                         encoder_lens: torch.Tensor | None, sinks: torch.Tensor | None,
                         tree_mask: torch.Tensor | None, is_causal: bool) -> None:
    """Sequence i's extend_seq_lens[i] new tokens (rows extend_start_loc[i]...
    of q/k/v_extend) attend to its cached prefix (the first seq_lens[i] -
    extend_seq_lens[i] slots of its req_to_token row) and to the new tokens:
    causally, or as a QLEN_ONLY tree mask ([sum n_i*n_i], row = query) says."""
    _refuse_unsupported("extend_attention_cpu", is_cross_attention, encoder_lens)
    if tree_mask is not None and sliding_window_size > 0:
        # A tree's nodes sit at their depth, not at their row: the window
        # below would be measured from the wrong positions.
        raise NotImplementedError("extend_attention_cpu: a sliding window with a tree mask is not implemented here")
    # MLA's prefill runs as multi-head attention over keys and values expanded
    # from the latent, while the cache holds the latent itself (one 576-wide
    # "head" on DeepSeek-V3): the cache cannot be read as this call's keys.
    # SGLang takes that path only for requests without a cached prefix, and
    # the upstream kernel then skips the prefix; a prefix here would be
    # attention over the wrong tokens, so it is refused below.
    latent_cache = k_extend is not None and k_extend[:1].numel() != k_buffer[:1].numel()
    if k_extend is not None and not latent_cache:
        k_extend = k_extend.reshape(-1, *k_buffer.shape[1:])
        v_extend = v_extend.reshape(-1, *v_buffer.shape[1:])
    elif latent_cache:
        k_extend = k_extend.reshape(q_extend.shape[0], -1, q_extend.shape[-1])
        v_extend = v_extend.reshape(q_extend.shape[0], k_extend.shape[1], -1)
    rows = req_to_token.view(-1)
    pool_len = req_to_token.shape[1]
    mask_offset = 0
    for req, seq_len, ext_len, start in zip(req_pool_indices.tolist(), seq_lens.tolist(),
                                            extend_seq_lens.tolist(), extend_start_loc.tolist()):
        prefix_len = seq_len - ext_len
        slots = rows[req * pool_len: req * pool_len + seq_len].long()
        if latent_cache:
            if prefix_len:
                raise NotImplementedError(
                    f"extend_attention_cpu: keys of {k_extend.shape[1]} heads x {k_extend.shape[2]} against a "
                    f"latent cache of {tuple(k_buffer.shape[1:])} with a cached prefix of {prefix_len} tokens: "
                    "SGLang's MLA sends prefixed requests down its absorbed path, not this one")
            keys, values = k_extend[start: start + ext_len], v_extend[start: start + ext_len]
        elif k_extend is not None:
            keys = torch.cat([k_buffer[slots[:prefix_len]].to(k_extend.dtype), k_extend[start: start + ext_len]])
            values = torch.cat([v_buffer[slots[:prefix_len]].to(v_extend.dtype), v_extend[start: start + ext_len]])
        else:  # KV-shared layers: another layer already wrote this extend's K/V
            keys, values = k_buffer[slots], v_buffer[slots]
        visible = torch.ones(ext_len, seq_len, dtype=torch.bool)
        if tree_mask is not None:
            visible[:, prefix_len:] = tree_mask[mask_offset: mask_offset + ext_len * ext_len].view(ext_len, ext_len)
            mask_offset += ext_len * ext_len
        elif is_causal:
            visible[:, prefix_len:] = torch.ones(ext_len, ext_len, dtype=torch.bool).tril()
        window = _in_window(torch.arange(prefix_len, seq_len), seq_len, sliding_window_size)
        if window is not None:
            visible &= window
        o_extend[start: start + ext_len] = _attend(
            q_extend[start: start + ext_len], keys, values, k_scale, v_scale, sm_scale, logit_cap, visible, sinks,
        ).to(o_extend.dtype)


def _in_window(query_pos: torch.Tensor, seq_len: int, window: int) -> torch.Tensor | None:
    """[M, seq_len]: key j is inside a query's sliding window when
    0 <= pos - j < window (gpt-oss's sliding layers; the backend passes
    SGLang's window + 1, i.e. the model's own window); None for no window."""
    if window <= 0:
        return None
    return (query_pos[:, None] - torch.arange(seq_len)[None, :]) < window


def _attend(q, k, v, k_scale, v_scale, sm_scale, logit_cap, visible, sinks=None):
    """Softmax attention in float32. q [M, H, D], k [N, Hkv, D], v [N, Hkv, Dv],
    visible [M, N] or None; query heads share KV heads in groups (GQA).
    sinks [H]: a per-head logit that joins every softmax's denominator and
    attends to nothing (gpt-oss)."""
    group = q.shape[1] // k.shape[1]
    kf = (k.float() * k_scale).repeat_interleave(group, dim=1)
    vf = (v.float() * v_scale).repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), kf) * sm_scale
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hmn,nhd->mhd", weights, vf)


def _refuse_unsupported(op, is_cross_attention, encoder_lens):
    # No target or drafter we serve uses these; failing loudly beats
    # attending over the wrong tokens.
    if is_cross_attention or encoder_lens is not None:
        raise NotImplementedError(f"{op}: cross-attention / encoder_lens are not implemented here")


# ----------------------------------------------------------------- registration

# Schemas follow the argument order of sgl_kernel 0.4.10's Python wrappers and
# SGLang 0.5.23's intel_amx backend, which are what call these.
SCHEMAS = {
    "copy_all_layer_kv_cache_cpu":
        "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
    "decode_attention_cpu":
        "(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float k_scale, float v_scale, "
        "Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor(d!) attn_logits, "
        "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, "
        "bool is_cross_attention, int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()",
    "extend_attention_cpu":
        "(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, Tensor k_buffer, "
        "Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, Tensor req_pool_indices, "
        "Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend, "
        "float sm_scale, float logit_cap, bool is_cross_attention, int sliding_window_size, "
        "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()",
    "verify_tree_greedy_cpu":
        "(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, Tensor candidates, "
        "Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
        "Tensor target_predict) -> ()",
    "build_tree_kernel_efficient_cpu":
        "(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, Tensor(a!) tree_mask, "
        "Tensor(b!) positions, Tensor(c!) retrive_index, Tensor(d!) retrive_next_token, "
        "Tensor(e!) retrive_next_sibling, int topk, int depth, int draft_token_num, "
        "int tree_mask_mode) -> ()",
    "assign_req_to_token_pool_cpu":
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor out_cache_loc, int pool_len) -> ()",
    "build_draft_decode_metadata_cpu":
        "(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int topk, int num_steps, "
        "int pool_len) -> Tensor",
    "fill_bonus_tokens_cpu":
        "(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, int accept_stride) -> ()",
    "fill_accept_out_cache_loc_cpu":
        "(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc) -> ()",
    "assign_draft_cache_locs_contiguous_cpu":
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens, Tensor(a!) out_cache_loc, "
        "int pool_len, int topk, int num_steps) -> ()",
    "assign_extend_cache_locs_cpu":
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor(a!) out_cache_loc, int pool_len) -> ()",
}

_LIBRARIES: list[torch.library.Library] = []  # a Library unregisters its ops when collected


def register_ops() -> list[str]:
    """Register the implementations above for the operators torch.ops.sgl_kernel
    does not have yet; returns the names registered."""
    missing = [name for name in SCHEMAS if not hasattr(torch.ops.sgl_kernel, name)]
    if missing:
        lib = torch.library.Library("sgl_kernel", "FRAGMENT")
        for name in missing:
            lib.define(name + SCHEMAS[name])
            lib.impl(name, globals()[name], "CPU")
        _LIBRARIES.append(lib)
    return missing


def keep_intel_amx_backend() -> None:
    """Make SGLang keep `--attention-backend intel_amx` without AMX.

    SGLang reads the platform fact `has_amx` only to downgrade that backend
    (and for gpt-oss); the model layers ask `cpu_has_amx_support()` itself,
    which stays False, so they keep their plain torch paths."""
    from sglang.srt.runtime_context import override_platform

    override_platform(has_amx=True).install()


def install() -> list[str]:
    """Everything a server process needs for EAGLE-3 on this CPU."""
    import sgl_kernel  # noqa: F401  # load the wheel's own ops first: only what it lacks is added

    registered = register_ops()
    keep_intel_amx_backend()
    cpu_parallel_groups_without_nccl()
    cuda_synchronize_without_a_gpu()
    dflash_on_cpu()  # DFlash's own stand-ins
    return registered


def cuda_synchronize_without_a_gpu() -> None:
    """SGLang 0.5.23's MLA drafter (kimi_k25_eagle3.py set_embed, on sharing
    the target's embedding) calls torch.cuda.synchronize(), which fails a
    CPU server's start ("Cannot re-initialize CUDA in forked subprocess").
    Only installed where there is no GPU: there is nothing to wait for."""
    torch.cuda.synchronize = lambda device=None: None


def cpu_parallel_groups_without_nccl() -> None:
    """SGLang 0.5.23 builds a PyNccl communicator for its tensor-parallel
    group on every platform but NPU and XPU, which on a CPU device fails the
    start of any server with tp > 1 ("Expected a cuda device, but got:
    cpu"); gloo carries the CPU engine's collectives. Off on a GPU machine."""
    from sglang.srt.distributed import parallel_state

    original = parallel_state.init_model_parallel_group

    def without_nccl(*args, **kwargs):
        kwargs["use_pynccl"] = False
        return original(*args, **kwargs)

    parallel_state.init_model_parallel_group = without_nccl
