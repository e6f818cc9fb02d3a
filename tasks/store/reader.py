"""Random access to a store's samples, straight from its shards."""
from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
from safetensors import safe_open

from tasks.failures import Permanent
from tasks.store import fp8
from tasks.store.handle import Store
from tasks.store.shards import FP8, sample_checksum, shard_path


class CorruptSample(Permanent, RuntimeError):
    """A sample's bytes no longer match the checksum its shard was
    committed with."""


class StoreReader:
    """`reader[i]` reads only sample i's slices (safetensors maps the file;
    nothing else is loaded). Hidden states come back as bf16 whatever the
    store keeps: an FP8 store's values are scaled back here.

    With `verify_checksums`, every sample read is checked against the
    checksum the ledger committed for it, so a shard changed after its
    verification (a flipped bit, a copy gone wrong) stops a training run
    instead of training it silently; xxh3 costs ~1 s per 20 GB."""

    def __init__(self, store: Path, *, max_open_shards: int = 64, verify_checksums: bool = False,
                 index: bool = True):
        """index=False: no sample index (len 0); samples are read by their
        ledger rows (`read_row`), looked up by the caller."""
        opened = Store.open(store)
        self.store, self.manifest, self.ledger = opened.path, opened.manifest, opened.ledger
        rows = opened.ledger.sample_index() if index else []
        self.sample_ids = [r[0] for r in rows]
        self._shards = [r[1] for r in rows]
        self._offsets = np.array([r[2] for r in rows], dtype=np.int64)
        self.num_tokens = np.array([r[3] for r in rows], dtype=np.int64)
        self.num_loss_tokens = np.array([r[4] for r in rows], dtype=np.int64)
        self._verify = verify_checksums
        self._checksums = [r[6] for r in rows] if verify_checksums else None
        self._open: OrderedDict[str, object] = OrderedDict()
        self._max_open = max_open_shards
        self._lock = threading.Lock()
        self._fp8 = opened.dtype == FP8

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

    def close_shard(self, shard: str) -> None:
        """Unmap `shard` (a removed file's blocks stay allocated while it is
        mapped: a spool's budget counts them)."""
        with self._lock:
            self._open.pop(shard, None)

    def __getitem__(self, i: int) -> dict:
        return self.read_row(self.sample_ids[i], self._shards[i], int(self._offsets[i]), int(self.num_tokens[i]),
                             self._checksums[i] if self._checksums is not None else None)

    def read_row(self, sample_id: str, shard: str, offset: int, num_tokens: int, checksum: str | None) -> dict:
        """A sample by its ledger row; checked against `checksum` where the
        reader verifies checksums."""
        f = self._handle(shard)
        a, b = offset, offset + num_tokens
        out = {
            "sample_id": sample_id,
            "input_ids": f.get_slice("input_ids")[a:b],
            "loss_mask": f.get_slice("loss_mask")[a:b],
            "aux_hidden_states": f.get_slice("aux_hidden_states")[a:b],
            "final_hidden_state": f.get_slice("final_hidden_state")[a:b],
        }
        scales = {n: f.get_slice(n)[a:b] for n in ("aux_scale", "final_scale")} if self._fp8 else {}
        if self._verify:
            stored = {k: v for k, v in out.items() if k != "sample_id"} | scales
            if sample_checksum(stored) != checksum:
                raise CorruptSample(
                    f"sample {sample_id} in {shard_path(self.store, shard)}: its bytes no longer "
                    "match the checksum committed with it (the shard changed after it was written); run "
                    f"`python -m flows.verify --store {self.store}` to see what is damaged, then re-extract it")
        if self._fp8:
            out["aux_hidden_states"] = fp8.dequantize(out["aux_hidden_states"], scales["aux_scale"])
            out["final_hidden_state"] = fp8.dequantize(out["final_hidden_state"], scales["final_scale"])
        return out
