"""Shards: the packed sample files of a store.

    <store>/shards/shard-<hash>.safetensors

A shard packs whole samples along the token axis, without padding:

    input_ids           int32 [T]
    loss_mask           uint8 [T]
    aux_hidden_states   bf16  [T, 3, H]   (ascending layer order)
    final_hidden_state  bf16  [T, H]      (after the final norm)
    offsets             int64 [S + 1]     sample s = tokens offsets[s]:offsets[s+1]

with metadata `format`, `sample_ids` (JSON list, shard order). Shards are
written to a temp name, fsynced and linked to their final name (never
over an existing file: a committed shard is never replaced); a shard counts only once the
ledger has committed it (tasks/store/ledger.py), so a killed run leaves
nothing a rerun would trust.

A sample's `checksum` is the sha256 of its bytes in the shard (ids int32 LE,
mask uint8, aux and final as raw bf16), so one sample can be checked without
the rest.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes

FORMAT = "eagle3-capture-store/1"
HIDDEN_DTYPE = torch.bfloat16
# The tensors of a shard and their dtypes: the writer and the verifier both use this.
SHARD_DTYPES = {"input_ids": torch.int32, "loss_mask": torch.uint8, "aux_hidden_states": HIDDEN_DTYPE,
                "final_hidden_state": HIDDEN_DTYPE, "offsets": torch.int64}


def bytes_per_token(hidden_size: int, num_aux: int = 3) -> int:
    """Stored bytes per token: (3 aux + 1 final) x H bf16, an int32 id, a mask byte."""
    return (num_aux + 1) * hidden_size * 2 + 4 + 1


@dataclass
class ShardInfo:
    name: str
    sha256: str
    bytes: int
    num_samples: int
    num_tokens: int


def file_sha256(path: Path) -> str | None:
    """Streamed, so a multi-GB shard is never held in memory; None if absent."""
    path = Path(path)
    if not path.exists():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def sample_checksum(ids: torch.Tensor, mask: torch.Tensor, aux: torch.Tensor, final: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(ids.to(torch.int32).numpy().astype("<i4").tobytes())
    h.update(mask.to(torch.uint8).numpy().tobytes())
    for t in (aux, final):
        h.update(t.contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def shard_name(sample_ids: Sequence[str]) -> str:
    return "shard-" + hashlib.sha256("\n".join(sample_ids).encode()).hexdigest()[:20]


def shard_path(store: Path, name: str) -> Path:
    return Path(store) / "shards" / f"{name}.safetensors"


class ShardExists(RuntimeError):
    """A shard of that name, with other bytes, is already in the store."""

    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        super().__init__(f"{path} already exists with other content; a shard in the store is never replaced. "
                         f"If the ledger has not committed it, it is an interrupted run's leftover: "
                         f"remove_uncommitted() it and write again")


def _link_new(tmp: Path, path: Path, sha256: str) -> str:
    """Give the temp file its final name without ever replacing a file there:
    a committed shard must not change under its ledger entry. Returns the
    sha256 of the file now at `path` (an existing one with the same content
    is kept: safetensors orders header metadata by a hash map, so equal
    content need not mean equal bytes)."""
    try:
        os.link(tmp, path)
        return sha256
    except FileExistsError:
        existing = file_sha256(path)
        if existing != sha256 and not _same_content(path, tmp):
            raise ShardExists(path.name.removesuffix(".safetensors"), path) from None
        return existing
    finally:
        tmp.unlink(missing_ok=True)


def _same_content(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    try:
        if _metadata(a) != _metadata(b):
            return False
        ta, tb = load_file(a), load_file(b)
    except Exception:  # an unreadable file is not the same content
        return False
    return ta.keys() == tb.keys() and all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)


def _metadata(path: Path) -> dict:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)).get("__metadata__", {})


def remove_uncommitted(store: Path, name: str) -> None:
    """Remove a shard file the ledger does not name (the caller checks
    that): what an interrupted run left under a name this run needs."""
    shard_path(store, name).unlink(missing_ok=True)


def write_shard(store: Path, items: list[dict], *, source: str) -> tuple[ShardInfo, list[dict]]:
    """Pack samples into one shard, durably. items: sample_id, source_row,
    input_ids, loss_mask, aux_hidden_states [n,3,H], final_hidden_state [n,H].
    Returns the shard and the ledger rows to commit for it."""
    if not items:
        raise ValueError("no samples to write")
    ids = [torch.as_tensor(np.asarray(it["input_ids"]), dtype=SHARD_DTYPES["input_ids"]) for it in items]
    masks = [torch.as_tensor(np.asarray(it["loss_mask"]), dtype=SHARD_DTYPES["loss_mask"]) for it in items]
    aux = [it["aux_hidden_states"].to(SHARD_DTYPES["aux_hidden_states"]) for it in items]
    final = [it["final_hidden_state"].to(SHARD_DTYPES["final_hidden_state"]) for it in items]
    lengths = [len(t) for t in ids]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    sample_ids = [it["sample_id"] for it in items]
    name = shard_name(sample_ids)
    data = safetensors_bytes(
        {
            "input_ids": torch.cat(ids), "loss_mask": torch.cat(masks),
            "aux_hidden_states": torch.cat(aux), "final_hidden_state": torch.cat(final),
            "offsets": torch.from_numpy(offsets),
        },
        metadata={"format": FORMAT, "sample_ids": json.dumps(sample_ids)},
    )
    path = shard_path(store, name)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    sha256 = _link_new(tmp, path, hashlib.sha256(data).hexdigest())
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
    shard = ShardInfo(name, sha256, path.stat().st_size, len(items), int(offsets[-1]))
    rows = [
        {
            "sample_id": it["sample_id"], "source": source, "source_row": int(it["source_row"]),
            "shard": name, "position": k, "token_offset": int(offsets[k]), "num_tokens": lengths[k],
            "num_loss_tokens": int(masks[k].sum()),
            "checksum": sample_checksum(ids[k], masks[k], aux[k], final[k]),
        }
        for k, it in enumerate(items)
    ]
    return shard, rows
