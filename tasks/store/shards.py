"""Shards: the packed sample files of a store.

    <store>/shards/shard-<hash>[-<writer>].safetensors

A shard packs whole samples along the token axis, without padding; in file
order:

    input_ids           int32 [T]
    loss_mask           uint8 [T]
    offsets             int64 [S + 1]     sample s = tokens offsets[s]:offsets[s+1]
    aux_hidden_states   bf16  [T, N, H]   (the manifest's N >= 3 layers, ascending)
    final_hidden_state  bf16  [T, H]      (after the final norm)

or, in a store whose manifest says `dtype: float8_e4m3fn` (tasks/store/fp8.py):

    aux_hidden_states   float8_e4m3fn [T, N, H]
    final_hidden_state  float8_e4m3fn [T, H]
    aux_scale           float32 [T, N]    value = e4m3 * scale, per token and layer
    final_scale         float32 [T]

with metadata `format`, `sample_ids` (JSON list, shard order = batch order).
Shards are written to a temp name, fsynced and linked to their final name
(never over an existing file: a committed shard is never replaced); a shard
counts only once the ledger has committed it (tasks/store/ledger/), so a
killed run leaves nothing a rerun would trust. The ledger records each shard's sha256.

A sample's `checksum` is an xxh3_128 (xxhash) of its bytes in the shard,
tensor by tensor in CHECKSUM_ORDER (ids int32 LE, mask uint8, the hidden
tensors raw, then the scales), so one sample can be checked without the rest.

Why xxh3_128: the per-sample checksum guards against corruption, not
tampering (the shard's sha256, recorded in the ledger, is the cryptographic
check), and it runs over every stored byte on the extraction path. Measured on
this machine (SHA-NI): xxh3_128 22 GB/s, sha256 1.4-2.0, blake2b 0.7-1.4 GB/s
on one core. xxhash is already a dependency of SGLang.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import torch
import xxhash

from tasks.store import fp8

FORMAT = "eagle3-capture-store/2"

BF16 = "bfloat16"
FP8 = "float8_e4m3fn"
# How a store keeps hidden states (its manifest's "dtype"): the one list of them.
StorageDtype = Literal["bfloat16", "float8_e4m3fn"]
STORAGE_DTYPES = typing.get_args(StorageDtype)
CHECKSUM_ORDER = ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_state", "aux_scale", "final_scale")
_SAFETENSORS_DTYPE = {torch.int32: "I32", torch.uint8: "U8", torch.int64: "I64", torch.bfloat16: "BF16",
                      torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32"}


def shard_dtypes(dtype: str = BF16) -> dict[str, torch.dtype]:
    """The tensors of a shard, in file order, and their dtypes: the writer, the
    reader and the verifier all use this."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype {dtype!r} is not part of {FORMAT} (choose one of {STORAGE_DTYPES})")
    out = {"input_ids": torch.int32, "loss_mask": torch.uint8, "offsets": torch.int64}
    if dtype == BF16:
        return {**out, "aux_hidden_states": torch.bfloat16, "final_hidden_state": torch.bfloat16}
    return {**out, "aux_hidden_states": fp8.STORAGE_DTYPE, "final_hidden_state": fp8.STORAGE_DTYPE,
            "aux_scale": fp8.SCALE_DTYPE, "final_scale": fp8.SCALE_DTYPE}


def shard_shapes(num_tokens: int, num_samples: int, num_aux: int, hidden: int) -> dict[str, tuple]:
    return {"input_ids": (num_tokens,), "loss_mask": (num_tokens,), "offsets": (num_samples + 1,),
            "aux_hidden_states": (num_tokens, num_aux, hidden), "final_hidden_state": (num_tokens, hidden),
            "aux_scale": (num_tokens, num_aux), "final_scale": (num_tokens,)}


def bytes_per_token(hidden_size: int, num_aux: int = 3, dtype: str = BF16) -> int:
    """Stored bytes per token: (3 aux + 1 final) x H values, an int32 id, a mask
    byte, and under FP8 a float32 scale per aux layer and for the final state."""
    if dtype == FP8:
        return (num_aux + 1) * hidden_size + (num_aux + 1) * 4 + 4 + 1
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


def _raw(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as stored (little-endian, as safetensors), no copy."""
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)


def sample_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """The checksum of one sample's slices (name -> tensor, as stored)."""
    h = xxhash.xxh3_128()
    for name in CHECKSUM_ORDER:
        if name in tensors:
            h.update(_raw(tensors[name]))
    return h.hexdigest()


WRITER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


def shard_name(sample_ids: Sequence[str], writer: str = "") -> str:
    """The shard's name: a hash of its sample ids, then, in a store many
    nodes write, the writing node's name. Two nodes given the same samples
    (a node taken for dead that still runs, and the one its work went to)
    then never write one path: the ledger commits one of the two shards and
    the other writer removes its own file, never the winner's."""
    if writer and not WRITER_NAME.match(writer):
        raise ValueError(f"writer name {writer!r}: use 1-40 of a-z, 0-9 and '-', starting with a letter or digit")
    digest = hashlib.sha256("\n".join(sample_ids).encode()).hexdigest()[:20]
    return f"shard-{digest}-{writer}" if writer else f"shard-{digest}"


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
    """Same metadata and the same tensors (dtype, shape, raw bytes), whatever
    the header's key order or padding. Raw bytes, not torch.equal: that does
    not support every stored dtype (FP8), and NaN != NaN."""
    try:
        ha, hb = _header(a), _header(b)
        if ha.pop("__metadata__", {}) != hb.pop("__metadata__", {}) or ha.keys() != hb.keys():
            return False
        if any((ha[k]["dtype"], ha[k]["shape"]) != (hb[k]["dtype"], hb[k]["shape"]) for k in ha):
            return False
        with open(a, "rb") as fa, open(b, "rb") as fb:
            start_a, start_b = 8 + int.from_bytes(fa.read(8), "little"), 8 + int.from_bytes(fb.read(8), "little")
            for k in ha:
                (a0, a1), (b0, b1) = ha[k]["data_offsets"], hb[k]["data_offsets"]
                if a1 - a0 != b1 - b0:
                    return False
                fa.seek(start_a + a0)
                fb.seek(start_b + b0)
                left = a1 - a0
                while left:
                    n = min(left, 1 << 24)
                    ca, cb = fa.read(n), fb.read(n)
                    if len(ca) != n or ca != cb:
                        return False
                    left -= n
    except Exception:  # an unreadable file is not the same content
        return False
    return True


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size))


def remove_uncommitted(store: Path, name: str) -> None:
    """Remove a shard file the ledger does not name (the caller checks
    that): what an interrupted run left under a name this run needs."""
    shard_path(store, name).unlink(missing_ok=True)


def remove_leaked_temps(store: Path) -> list[str]:
    """Delete the temp files of shards whose writing never finished (the
    writer was SIGKILLed: an exception removes its own). Call only while
    holding the store's lock: then no one else is writing one."""
    removed = []
    shards = Path(store) / "shards"
    if shards.is_dir():
        for path in shards.iterdir():
            # `.<shard name>.safetensors.<pid>.<thread>`, as write_shard names them
            if path.name.startswith(".") and ".safetensors." in path.name and path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path.name)
    return removed


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def write_shard(store: Path, items: list[dict], *, source: str, dtype: str = BF16,
                workers: int | None = None, stored: bool = False, writer: str = "") -> tuple[ShardInfo, list[dict]]:
    """Pack samples into one shard, durably. items: sample_id, source_row,
    input_ids, loss_mask, aux_hidden_states [n,3,H], final_hidden_state [n,H].
    Returns the shard and the ledger rows to commit for it.

    The file layout is known from the lengths alone, so `workers` threads
    convert (or quantize) each sample and write it straight to its place
    (pwrite), while one more thread hashes the file in order as the pieces
    land: no concatenated copy of the shard, and the GIL-free parts (torch
    casts, pwrite, hashing) run in parallel.

    With `stored`, the items' hidden tensors are already as stored (the
    storage dtype, and under FP8 also aux_scale [n,3] and final_scale [n]):
    they are copied byte for byte, never converted, so rewriting a shard
    (tasks/store/prune.py) keeps every sample's checksum. `writer` names the
    node writing, in a store many nodes write (`shard_name`)."""
    if not items:
        raise ValueError("no samples to write")
    dtypes = shard_dtypes(dtype)
    lengths, num_aux, hidden = _check_items(items)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    sample_ids = [it["sample_id"] for it in items]
    name = shard_name(sample_ids, writer)
    ids = torch.cat([torch.as_tensor(np.asarray(it["input_ids"])).to(torch.int32) for it in items])
    masks = torch.cat([torch.as_tensor(np.asarray(it["loss_mask"])).to(torch.uint8) for it in items])
    small = {"input_ids": ids, "loss_mask": masks, "offsets": torch.from_numpy(offsets)}
    shapes = shard_shapes(int(offsets[-1]), len(items), num_aux, hidden)
    header, starts, total = _layout(dtypes, shapes, {"format": FORMAT, "sample_ids": json.dumps(sample_ids)})
    row_bytes = {k: int(np.prod(shapes[k][1:], dtype=np.int64)) * dtypes[k].itemsize for k in dtypes}

    checksums: list[str | None] = [None] * len(items)

    def one(k: int) -> dict[str, torch.Tensor]:
        it = items[k]
        if stored:
            out = {key: it[key].contiguous() for key in dtypes if key not in small}
            for key, t in out.items():
                if t.dtype != dtypes[key]:
                    raise ValueError(f"sample {it['sample_id']}: stored {key} is {t.dtype}, the shard holds "
                                     f"{dtypes[key]}")
        elif dtype == FP8:
            aux, aux_scale = fp8.quantize(it["aux_hidden_states"])
            final, final_scale = fp8.quantize(it["final_hidden_state"])
            out = {"aux_hidden_states": aux, "final_hidden_state": final, "aux_scale": aux_scale,
                   "final_scale": final_scale}
        else:
            out = {"aux_hidden_states": it["aux_hidden_states"].to(torch.bfloat16).contiguous(),
                   "final_hidden_state": it["final_hidden_state"].to(torch.bfloat16).contiguous()}
        for key, t in out.items():
            _pwrite(fd, _raw(t), starts[key] + int(offsets[k]) * row_bytes[key])
        a, b = int(offsets[k]), int(offsets[k + 1])
        checksums[k] = sample_checksum({"input_ids": ids[a:b], "loss_mask": masks[a:b], **out})
        return out

    path = shard_path(store, name)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, total)
        _pwrite(fd, header, 0)
        for key, t in small.items():
            _pwrite(fd, _raw(t), starts[key])
        with ThreadPoolExecutor(max_workers=workers or default_workers(), thread_name_prefix="shard") as pool, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-sha") as hasher:
            parts = [pool.submit(one, k) for k in range(len(items))]
            digest = hasher.submit(_hash_in_file_order, header, small, parts, dtypes)
            for p in parts:
                p.result()  # re-raises a worker's error
            sha = digest.result()
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    sha = _link_new(tmp, path, sha)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the link itself survives a crash
    finally:
        os.close(dir_fd)
    shard = ShardInfo(name, sha, path.stat().st_size, len(items), int(offsets[-1]))
    rows = []
    for k, it in enumerate(items):
        a, b = int(offsets[k]), int(offsets[k + 1])
        rows.append({
            "sample_id": it["sample_id"], "source": source, "source_row": int(it["source_row"]),
            "shard": name, "position": k, "token_offset": a, "num_tokens": b - a,
            "num_loss_tokens": int(masks[a:b].sum()), "checksum": checksums[k],
        })
    return shard, rows


def _check_items(items: list[dict]) -> tuple[list[int], int, int]:
    first = items[0]
    num_aux, hidden = int(first["aux_hidden_states"].shape[1]), int(first["final_hidden_state"].shape[-1])
    lengths = []
    for it in items:
        n = len(it["input_ids"])
        if (len(it["loss_mask"]) != n or tuple(it["aux_hidden_states"].shape) != (n, num_aux, hidden)
                or tuple(it["final_hidden_state"].shape) != (n, hidden) or n == 0):
            raise ValueError(
                f"sample {it['sample_id']}: shapes do not fit one shard (ids {n}, mask {len(it['loss_mask'])}, aux "
                f"{tuple(it['aux_hidden_states'].shape)}, final {tuple(it['final_hidden_state'].shape)}; expected "
                f"n > 0, [n, {num_aux}, {hidden}], [n, {hidden}]): the capture that produced it is inconsistent")
        lengths.append(n)
    return lengths, num_aux, hidden


def _layout(dtypes: dict, shapes: dict, metadata: dict) -> tuple[bytes, dict[str, int], int]:
    """The safetensors header (u64 LE size, JSON, space-padded to 8 bytes so
    every tensor starts aligned) and each tensor's absolute file offset."""
    entries, starts, at = {}, {}, 0
    for key, dtype in dtypes.items():
        size = int(np.prod(shapes[key], dtype=np.int64)) * dtype.itemsize
        entries[key] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shapes[key]), "data_offsets": [at, at + size]}
        starts[key] = at
        at += size
    text = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    header = len(text).to_bytes(8, "little") + text
    return header, {k: v + len(header) for k, v in starts.items()}, len(header) + at


def _pwrite(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _hash_in_file_order(header: bytes, small: dict, parts: list, dtypes: dict) -> str:
    h = hashlib.sha256(header)
    for key in dtypes:
        if key in small:
            h.update(_raw(small[key]))
        else:
            for p in parts:  # each sample's piece, as soon as its worker has written it
                h.update(_raw(p.result()[key]))
    return h.hexdigest()
