"""Pruning: take samples out of a store on purpose, e.g. those whose source
rows are gone (removed or edited in the dataset; see verification's GONE).

A shard is never edited in place: the shards holding pruned samples are
written again without them (each kept sample checked against its ledger
checksum first, so pruning never launders a corrupt sample into a fresh
shard), the ledger swaps old for new in one transaction, and only then is the
old file removed. A crash in between leaves at worst an orphan file, which
verification reports and nothing trusts.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

from safetensors import safe_open

from tasks.store.handle import Store
from tasks.store.lock import hold_lock
from tasks.store.manifest import StoreError
from tasks.store.shards import FORMAT, shard_dtypes, shard_path, write_shard

logger = logging.getLogger("eagle3.prune")


def prune_samples(store: Path, sample_ids: Iterable[str]) -> dict:
    """Remove these samples from the store. Returns pruned (samples) and
    rewritten / removed (shards)."""
    store = Path(store)
    wanted = set(sample_ids)
    with hold_lock(store, "prune samples"):
        opened = Store.open(store)
        samples = opened.ledger.samples()
        unknown = wanted - set(samples.sample_id)
        if unknown:
            raise StoreError(f"{len(unknown)} samples to prune are not in {store} (e.g. {sorted(unknown)[0]})")
        out = {"pruned": 0, "rewritten": 0, "removed": 0}
        for name in sorted(set(samples[samples.sample_id.isin(wanted)].shard)):
            mine = samples[samples.shard == name]
            keep = mine[~mine.sample_id.isin(wanted)]
            new, rows = (None, []) if keep.empty else _rewrite_without(opened, name, keep)
            opened.ledger.replace_shard(name, new, rows)
            shard_path(store, name).unlink(missing_ok=True)
            out["pruned"] += len(mine) - len(keep)
            out["rewritten" if new else "removed"] += 1
            logger.info("pruned %d samples from %s%s", len(mine) - len(keep), name,
                        f" -> {new.name}" if new else " (removed: nothing left)")
        return out


def _rewrite_without(store: Store, name: str, keep):
    sources = set(keep.source)
    if len(sources) != 1:
        raise StoreError(f"shard {name} holds samples of {len(sources)} sources; cannot rewrite it")
    # The kept samples' tensors are copied as stored (FP8 values and their
    # scales included), never converted: the new shard holds the same bytes
    # per sample, so every checksum still holds.
    with safe_open(str(shard_path(store.path, name)), framework="pt") as f:
        fmt = (f.metadata() or {}).get("format")
        if fmt != FORMAT:
            raise StoreError(f"shard {name} is {fmt}, but the store's manifest says {FORMAT}: "
                             "run verification and repair the store before pruning")
        dtypes = shard_dtypes(store.dtype)
        t = {k: f.get_tensor(k) for k in dtypes}
    items = []
    for s in keep.itertuples():
        a, b = int(s.token_offset), int(s.token_offset + s.num_tokens)
        items.append({"sample_id": s.sample_id, "source_row": int(s.source_row),
                      "input_ids": t["input_ids"][a:b].numpy(), "loss_mask": t["loss_mask"][a:b].numpy(),
                      **{k: t[k][a:b] for k in dtypes if k not in ("input_ids", "loss_mask", "offsets")}})
    new, rows = write_shard(store.path, items, source=sources.pop(), dtype=store.dtype, stored=True)
    bad = [r["sample_id"] for r, s in zip(rows, keep.itertuples()) if r["checksum"] != s.checksum]
    if bad:
        shard_path(store.path, new.name).unlink(missing_ok=True)
        raise StoreError(f"shard {name}: {len(bad)} samples to keep no longer match their checksums "
                         f"(e.g. {bad[0]}); run verification and repair the store before pruning")
    return new, rows


def prune_gone(store: Path) -> dict:
    """Verify against the sources, then prune every GONE sample (no row of
    the sources gives it any more). Returns prune_samples' counts and the
    pruned ids."""
    from tasks.store.verification import verify_store

    report = verify_store(Path(store), recheck_source=True, write_report=False)
    gone = report.samples[report.samples.status == "GONE"].sample_id.tolist()
    return {**prune_samples(Path(store), gone), "sample_ids": gone} if gone else \
        {"pruned": 0, "rewritten": 0, "removed": 0, "sample_ids": []}
