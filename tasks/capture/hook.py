"""The forward hook that runs inside the SGLang scheduler process.

Loaded by stock SGLang through `--forward-hooks` on the target architecture's
decoder stack (`model` for LlamaModel and its kin). In capture mode
(`--enable-return-aux-hidden-states`) that module returns
`(final_hidden, [aux_0, aux_1, aux_2])` over the flat token axis of a batch;
`forward_batch.rids` and `extend_{prefix,seq}_lens_cpu` say which tokens
belong to which request. Each prefill piece of a request the pipeline issued
is handed to a background writer (`tasks.capture.writer`), which writes it
with `tasks.capture.dump.write_chunk`, keyed by its rid, while the next batch
runs.

The hook must never take the server down: a failure is logged and the
request simply has no dump, which the pipeline detects and retries.
"""
from __future__ import annotations

import logging
from pathlib import Path

from tasks.capture.dump import RID_PREFIX, is_safe_rid
from tasks.capture.writer import DEFAULT_MAX_PENDING_BYTES, DumpWriter
from tasks.target.layers import FINAL_STATE_NORM

logger = logging.getLogger("eagle3.capture_hook")

# Only plain prefill passes carry prompt tokens; MIXED batches add decode
# tokens of other requests, which the rid filter drops.
_CAPTURE_MODES = ("EXTEND", "MIXED")


def _tensor_parallel_rank() -> int:
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # not initialised (unit tests) or not SGLang
        return 0


def make_capture_hook(config: dict):
    """Hook factory named in `--forward-hooks`.

    config: `dump_dir` (required), `rid_prefix` (rids to capture; default
    RID_PREFIX), `capture_all` (also capture rids the pipeline did not issue,
    such as SGLang's health checks; unsafe rids are refused regardless),
    `max_pending_bytes` (copies waiting for the writer before the forward
    blocks; default 1 GiB). The hook's `writer` attribute is its DumpWriter.
    """
    dump_dir = Path(config["dump_dir"])
    dump_dir.mkdir(parents=True, exist_ok=True)
    prefix = str(config.get("rid_prefix", RID_PREFIX))
    capture_all = bool(config.get("capture_all", False))
    # Every tensor-parallel rank holds the full residual stream after the
    # all-reduce; rank 0 alone writes so each token is stored once.
    if _tensor_parallel_rank() != 0:
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
        return None

    def _capture(module, args, output):
        if not isinstance(output, tuple) or len(output) != 2:
            return  # capture mode off: nothing to write
        forward_batch = args[2] if len(args) > 2 else None
        mode = getattr(getattr(forward_batch, "forward_mode", None), "name", None)
        if mode not in _CAPTURE_MODES:
            return
        rids = forward_batch.rids or []
        if not any(wanted(r) for r in rids):
            return
        final, aux_list = output
        aux_layer_ids = [i - 1 for i in getattr(module, "layers_to_capture", [])]
        aux = _stack(aux_list, len(aux_layer_ids))
        ids = args[0]
        offset = 0
        for rid, prefix_len, seq_len in zip(
            rids, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
        ):
            seq_len = int(seq_len)
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
