"""The store: the on-disk data contract, written down once.

    <store>/manifest.json          what produced the data (model, tokenizer,
                                   layers in both conventions, dtype, ...)
    <store>/ledger.sqlite          the index and the single source of truth
                                   for progress, resume and verification
    <store>/shards/<name>.safetensors
    <store>/reports/               verification reports (Parquet + JSON)

A shard packs whole samples along the token axis, without padding:

    input_ids           int32 [T]
    loss_mask           uint8 [T]
    aux_hidden_states   bf16  [T, 3, H]   (ascending layer order)
    final_hidden_state  bf16  [T, H]      (after the final norm)
    offsets             int64 [S + 1]     sample s = tokens offsets[s]:offsets[s+1]

with metadata `format`, `sample_ids` (JSON list, shard order). Shards are
written to a temp name, fsynced and renamed; a shard counts only once its row
and its samples' rows are committed to the ledger in one transaction, so a
killed run leaves nothing a rerun would trust. Ledger tables:

    shards(name, sha256, bytes, num_samples, num_tokens, created)
    samples(sample_id, source, source_row, shard, position, token_offset,
            num_tokens, num_loss_tokens, checksum)
    quarantine(source, source_row, sample_id, reason, attempts, at)

`checksum` is the sha256 of a sample's bytes in the shard (ids int32 LE,
mask uint8, aux and final as raw bf16), so one sample can be checked without
the rest.
"""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

FORMAT = "eagle3-capture-store/1"
HIDDEN_DTYPE = torch.bfloat16
# The tensors of a shard and their dtypes: the writer and the verifier both use this.
SHARD_DTYPES = {"input_ids": torch.int32, "loss_mask": torch.uint8, "aux_hidden_states": HIDDEN_DTYPE,
                "final_hidden_state": HIDDEN_DTYPE, "offsets": torch.int64}
# What must be equal for two runs to write into the same store.
IDENTITY_KEYS = ("format", "target", "tokenizer", "aux_layers", "hidden_size", "dtype", "max_length", "max_length_policy")

SCHEMA = """
CREATE TABLE IF NOT EXISTS shards(
    name TEXT PRIMARY KEY, sha256 TEXT NOT NULL, bytes INTEGER NOT NULL,
    num_samples INTEGER NOT NULL, num_tokens INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS samples(
    sample_id TEXT PRIMARY KEY, source TEXT NOT NULL, source_row INTEGER NOT NULL,
    shard TEXT NOT NULL REFERENCES shards(name), position INTEGER NOT NULL,
    token_offset INTEGER NOT NULL, num_tokens INTEGER NOT NULL,
    num_loss_tokens INTEGER NOT NULL, checksum TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS quarantine(
    source TEXT NOT NULL, source_row INTEGER NOT NULL, sample_id TEXT,
    reason TEXT NOT NULL, attempts INTEGER NOT NULL, at REAL NOT NULL,
    PRIMARY KEY(source, source_row));
"""


class StoreError(RuntimeError):
    pass


def bytes_per_token(hidden_size: int, num_aux: int = 3) -> int:
    """Stored bytes per token: (3 aux + 1 final) x H bf16, an int32 id, a mask byte."""
    return (num_aux + 1) * hidden_size * 2 + 4 + 1


# --------------------------------------------------------------------- manifest

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


def build_manifest(model_path: Path, tokenizer, aux_layers, *, max_length: int, policy: str,
                   sources: Sequence[str]) -> dict:
    """What produced the data. The keys in IDENTITY_KEYS must match for a run
    to add to an existing store."""
    from importlib.metadata import version

    model_path = Path(model_path)
    config = json.loads((model_path / "config.json").read_text())
    return {
        "format": FORMAT,
        "target": {"name": model_path.name, "config_sha256": file_sha256(model_path / "config.json"),
                   "architectures": config.get("architectures"), "num_hidden_layers": config["num_hidden_layers"],
                   "vocab_size": config.get("vocab_size")},
        "target_path": str(model_path.resolve()),
        "tokenizer": {"sha256": file_sha256(model_path / "tokenizer.json"),
                      "chat_template_sha256": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()},
        "aux_layers": aux_layers.as_record(),
        "hidden_size": config["hidden_size"],
        "dtype": "bfloat16",
        "max_length": max_length,
        "max_length_policy": policy,
        "sglang_version": version("sglang"),
        "sources": sorted(str(s) for s in sources),
    }


def manifest_path(store: Path) -> Path:
    return Path(store) / "manifest.json"


def read_manifest(store: Path) -> dict:
    path = manifest_path(store)
    if not path.exists():
        raise StoreError(f"{store} is not a store: no manifest.json")
    return json.loads(path.read_text())


def open_store(store: Path, manifest: dict) -> "Ledger":
    """Create the store, or check that an existing one was built the same
    way, then return its ledger. Refuses to mix data from different models,
    tokenizers, layers or length policies."""
    store = Path(store)
    (store / "shards").mkdir(parents=True, exist_ok=True)
    path = manifest_path(store)
    if path.exists():
        existing = json.loads(path.read_text())
        diff = [k for k in IDENTITY_KEYS if existing.get(k) != manifest.get(k)]
        if diff:
            raise StoreError(
                f"store {store} was built with different {', '.join(diff)}: "
                + "; ".join(f"{k}: store has {existing.get(k)!r}, this run {manifest.get(k)!r}" for k in diff)
                + ". Use a new store directory for this run."
            )
        sources = sorted(set(existing.get("sources", [])) | set(manifest.get("sources", [])))
        if sources != existing.get("sources"):
            _write_json_atomic(path, {**existing, "sources": sources})
    else:
        _write_json_atomic(path, manifest)
    return Ledger(store)


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------- ledger

class Ledger:
    """The store's index in SQLite. One short connection per call, so it can
    be used from the threads Prefect runs mapped tasks in."""

    def __init__(self, store: Path):
        self.store = Path(store)
        self.path = self.store / "ledger.sqlite"
        with closing(self._connect()) as db, db:
            db.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=120)

    def query(self, sql: str, args: Sequence = ()) -> list[tuple]:
        with closing(self._connect()) as db:
            return db.execute(sql, args).fetchall()

    def stored_ids(self) -> set[str]:
        return {r[0] for r in self.query("SELECT sample_id FROM samples")}

    def commit_shard(self, shard: "ShardInfo", rows: list[dict]) -> None:
        with closing(self._connect()) as db, db:
            db.execute("INSERT OR REPLACE INTO shards VALUES (?,?,?,?,?,?)",
                       (shard.name, shard.sha256, shard.bytes, shard.num_samples, shard.num_tokens, time.time()))
            db.executemany(
                "INSERT INTO samples VALUES (:sample_id,:source,:source_row,:shard,:position,"
                ":token_offset,:num_tokens,:num_loss_tokens,:checksum)", rows)
            db.executemany("DELETE FROM quarantine WHERE source=? AND source_row=?",
                           [(r["source"], r["source_row"]) for r in rows])

    def quarantine(self, rows: list[dict]) -> None:
        """rows: source, source_row, sample_id (or None), reason, attempts."""
        with closing(self._connect()) as db, db:
            db.executemany(
                "INSERT OR REPLACE INTO quarantine VALUES (:source,:source_row,:sample_id,:reason,:attempts,:at)",
                [{"sample_id": None, "attempts": 0, "at": time.time(), **r} for r in rows])

    def summary(self) -> dict:
        samples, tokens, loss = self.query(
            "SELECT COUNT(*), COALESCE(SUM(num_tokens),0), COALESCE(SUM(num_loss_tokens),0) FROM samples")[0]
        shards, nbytes = self.query("SELECT COUNT(*), COALESCE(SUM(bytes),0) FROM shards")[0]
        quarantined = self.query("SELECT COUNT(*) FROM quarantine")[0][0]
        return {"samples": samples, "tokens": tokens, "loss_tokens": loss, "shards": shards,
                "bytes": nbytes, "quarantined": quarantined}

    def table(self, name: str):
        import pandas as pd

        with closing(self._connect()) as db:
            return pd.read_sql_query(f"SELECT * FROM {name}", db)


# ----------------------------------------------------------------------- shards

@dataclass
class ShardInfo:
    name: str
    sha256: str
    bytes: int
    num_samples: int
    num_tokens: int


def sample_checksum(ids: torch.Tensor, mask: torch.Tensor, aux: torch.Tensor, final: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(ids.to(torch.int32).numpy().astype("<i4").tobytes())
    h.update(mask.to(torch.uint8).numpy().tobytes())
    for t in (aux, final):
        h.update(t.contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def shard_name(sample_ids: Sequence[str]) -> str:
    return "shard-" + hashlib.sha256("\n".join(sample_ids).encode()).hexdigest()[:20]


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
    path = Path(store) / "shards" / f"{name}.safetensors"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
    shard = ShardInfo(name, hashlib.sha256(data).hexdigest(), len(data), len(items), int(offsets[-1]))
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


def shard_path(store: Path, name: str) -> Path:
    return Path(store) / "shards" / f"{name}.safetensors"


# ----------------------------------------------------------------------- reader

class StoreReader:
    """Random access to stored samples. `reader[i]` reads only sample i's
    slices (safetensors maps the file; nothing else is loaded)."""

    def __init__(self, store: Path, *, max_open_shards: int = 64):
        self.store = Path(store)
        self.manifest = read_manifest(self.store)
        rows = Ledger(self.store).query(
            "SELECT sample_id, shard, token_offset, num_tokens, num_loss_tokens, source_row "
            "FROM samples ORDER BY shard, position")
        self.sample_ids = [r[0] for r in rows]
        self._shards = [r[1] for r in rows]
        self._offsets = np.array([r[2] for r in rows], dtype=np.int64)
        self.num_tokens = np.array([r[3] for r in rows], dtype=np.int64)
        self.num_loss_tokens = np.array([r[4] for r in rows], dtype=np.int64)
        self._open: OrderedDict[str, object] = OrderedDict()
        self._max_open = max_open_shards
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.sample_ids)

    def _handle(self, shard: str):
        with self._lock:
            f = self._open.pop(shard, None)
            if f is None:
                f = safe_open(str(shard_path(self.store, shard)), framework="pt")
                if len(self._open) >= self._max_open:
                    self._open.popitem(last=False)
            self._open[shard] = f
            return f

    def __getitem__(self, i: int) -> dict:
        f = self._handle(self._shards[i])
        a, b = int(self._offsets[i]), int(self._offsets[i] + self.num_tokens[i])
        return {
            "sample_id": self.sample_ids[i],
            "input_ids": f.get_slice("input_ids")[a:b],
            "loss_mask": f.get_slice("loss_mask")[a:b],
            "aux_hidden_states": f.get_slice("aux_hidden_states")[a:b],
            "final_hidden_state": f.get_slice("final_hidden_state")[a:b],
        }
