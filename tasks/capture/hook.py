"""The forward hooks that run inside the SGLang scheduler process.

Loaded by stock SGLang through `--forward-hooks`: `make_capture_hook` on the
target architecture's decoder stack (tasks/target/architectures.py: `model`
for Llama and most classes, `language_model.model` for Kimi-K2.5), and
`make_batch_hook` on that stack's first decoder layer. In capture mode
(`--enable-return-aux-hidden-states`) the decoder stack returns
`(final_hidden, aux)` over the flat token axis of a batch, `aux` being a
list of K [T, H] tensors or one packed [T, K*H] tensor (DeepSeek-V3, Kimi);
`forward_batch.rids` and `extend_{prefix,seq}_lens_cpu` say which tokens
belong to which request. Each prefill piece of a request the pipeline issued
is handed to a background writer (`tasks.capture.writer`), which writes it
with `tasks.capture.dump.write_chunk`, keyed by its rid, while the next batch
runs.

SGLang registers hooks without keyword arguments, and some classes call
their decoder stack by keyword (Qwen3-VL) or with `input_ids=None`
(multimodal wrappers), so the stack's own arguments may hold neither the
batch nor the ids. Every class calls its decoder layers positionally with
the forward batch among the arguments: the first layer's hook keeps it for
the stack's hook of the same forward, and token ids come from
`forward_batch.input_ids`.

With data-parallel attention each attention-DP group is its own scheduler
with its own requests, and at the stack's output a group holds only its own
tokens, replicated over its attention-TP ranks: the first rank of each
attention-TP group writes (not only TP rank 0, which would drop every other
group's requests).

The hook must never take the server down: a failure is logged and the
request simply has no dump, which the pipeline detects and retries.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from tasks.capture.dump import RID_PREFIX, check_rid_prefix, is_safe_rid
from tasks.capture.writer import DEFAULT_MAX_PENDING_BYTES, DumpWriter
from tasks.target.layers import FINAL_STATE_NORM

logger = logging.getLogger("eagle3.capture_hook")

# Only plain prefill passes carry prompt tokens; MIXED batches add decode
# tokens of other requests, which the rid filter drops.
_CAPTURE_MODES = ("EXTEND", "MIXED")

# The forward batch the first decoder layer saw, for the stack's hook of the
# same forward (one scheduler thread runs one forward at a time).
_current = threading.local()


class CaptureLayoutError(RuntimeError):
    """The decoder stack's output does not fit the batch it was given."""


def _parallel_ranks() -> dict:
    """This process's ranks; all zero where SGLang's parallel state is not
    initialised (unit tests)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return {"attn_tp_rank": int(p.attn_tp_rank), "attn_cp_rank": int(p.attn_cp_rank),
                "attn_cp_size": int(getattr(p, "attn_cp_size", 1))}
    except Exception:
        return {"attn_tp_rank": 0, "attn_cp_rank": 0, "attn_cp_size": 1}


def writes_on_this_rank(ranks: dict) -> bool:
    """The first rank of each attention-TP group writes its group's
    requests; every other rank holds copies of the same tokens. Attention
    context parallelism splits a request's tokens over ranks: refused until
    the pieces are reassembled."""
    if ranks["attn_cp_size"] > 1:
        raise RuntimeError("capture does not support attention context parallelism (attn_cp_size "
                           f"{ranks['attn_cp_size']}): each rank would hold part of a request's tokens")
    return ranks["attn_tp_rank"] == 0 and ranks["attn_cp_rank"] == 0


def _find_batch(args):
    """The ForwardBatch among a module's positional arguments, if any."""
    for a in args:
        if hasattr(a, "forward_mode") and hasattr(a, "extend_seq_lens_cpu"):
            return a
    return None


def make_batch_hook(config: dict):
    """Hook factory for the first decoder layer: keeps the forward batch."""

    def hook(module, args, output):
        batch = _find_batch(args)
        if batch is not None:
            _current.batch = batch
        return None

    return hook


def make_capture_hook(config: dict):
    """Hook factory named in `--forward-hooks`.

    config: `dump_dir` (required), `rid_prefix` (rids to capture; default
    RID_PREFIX, the public one: the launcher gives each server a random
    one), `capture_all` (also capture rids the pipeline did not issue,
    such as SGLang's health checks; unsafe rids are refused regardless),
    `max_pending_bytes` (copies waiting for the writer before the forward
    blocks; default 1 GiB). The hook's `writer` attribute is its DumpWriter.
    """
    dump_dir = Path(config["dump_dir"])
    dump_dir.mkdir(parents=True, exist_ok=True)
    prefix = check_rid_prefix(config.get("rid_prefix", RID_PREFIX))
    capture_all = bool(config.get("capture_all", False))
    if not writes_on_this_rank(_parallel_ranks()):
        return lambda module, args, output: None
    writer = DumpWriter(dump_dir, max_pending_bytes=int(config.get("max_pending_bytes", DEFAULT_MAX_PENDING_BYTES)))

    def wanted(rid) -> bool:
        if not isinstance(rid, str) or not (capture_all or rid.startswith(prefix)):
            return False
        if not is_safe_rid(rid):
            logger.warning("capture hook: refusing unsafe rid %r (nothing written)", rid[:200])
            return False
        return True

    def hook(module, args, output):
        try:
            _capture(module, args, output)
        except Exception:
            logger.exception("capture hook failed; the affected requests have no dump")
        finally:
            _current.batch = None
        return None

    def _capture(module, args, output):
        if not isinstance(output, tuple) or len(output) != 2:
            return  # capture mode off: nothing to write
        forward_batch = _find_batch(args) or getattr(_current, "batch", None)
        mode = getattr(getattr(forward_batch, "forward_mode", None), "name", None)
        if mode not in _CAPTURE_MODES:
            return
        rids = forward_batch.rids or []
        if not any(wanted(r) for r in rids):
            return
        final, aux_list = output
        aux_layer_ids = [i - 1 for i in getattr(module, "layers_to_capture", [])]
        aux = _stack(aux_list, len(aux_layer_ids))
        ids = forward_batch.input_ids
        seq_lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
        # Padded batches (data-parallel attention, graphs) may carry more rows
        # than tokens, never fewer.
        if not (aux.shape[0] == final.shape[0] and final.shape[0] >= sum(seq_lens) and ids.shape[0] >= sum(seq_lens)):
            raise CaptureLayoutError(
                f"decoder stack output does not fit its batch: aux {tuple(aux.shape)}, final {tuple(final.shape)}, "
                f"ids {tuple(ids.shape)}, {sum(seq_lens)} tokens in {len(seq_lens)} requests")
        offset = 0
        for rid, prefix_len, seq_len in zip(rids, forward_batch.extend_prefix_lens_cpu, seq_lens):
            if wanted(rid):
                sl = slice(offset, offset + seq_len)
                try:
                    writer.submit(rid, int(prefix_len), ids[sl], aux[sl], final[sl], aux_layer_ids, FINAL_STATE_NORM)
                except Exception:
                    logger.exception("capture hook: handing rid %s to the writer failed; it has no dump", rid)
            offset += seq_len

    hook.writer = writer
    return hook


def _stack(aux_list, num_layers: int):
    """[T, K, H] from SGLang's list of K [T, H] tensors (or a packed [T, K*H])."""
    import torch

    if isinstance(aux_list, torch.Tensor):
        return aux_list.unflatten(-1, (num_layers, -1))
    return torch.stack(list(aux_list), dim=1)
