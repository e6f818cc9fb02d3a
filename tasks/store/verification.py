"""Verify a store: every shard file and every sample, against the ledger and
against a fresh tokenisation of the source data.

Per file: present, size and sha256 as recorded, readable, a format this
version reads and the manifest's, the tensors the contract names (for that
format and the store's storage dtype: FP8 scales included) with their dtypes
and shapes, offsets consistent, the sample list equal to the ledger's. Per
sample: tokens recounted from the file equal the index and a fresh
tokenisation of its source row, loss tokens recounted, checksum (by the hash
the shard's format names), finiteness (FP8: of the stored values and of the
scales, which must also be positive). Files in shards/ that the ledger does not name are
reported as orphans (a killed run's leftovers) and never trusted.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from safetensors import safe_open

from tasks.data.dataset import prepare_samples
from tasks.store.ledger import open_ledger
from tasks.store.manifest import read_manifest
from tasks.store.shards import BF16, FORMAT_V1, file_sha256, sample_checksum, shard_dtypes, shard_path, shard_shapes


@dataclass
class VerifyReport:
    ok: bool
    files: pd.DataFrame  # shard, status, samples, tokens, bytes, problems
    samples: pd.DataFrame  # sample_id, shard, source_row, tokens, status, problems
    paths: dict

    def failures(self) -> str:
        bad_files = self.files[self.files.status == "FAIL"]
        bad_samples = self.samples[self.samples.status == "FAIL"]
        lines = [f"{r.shard}: {r.problems}" for r in bad_files.itertuples()]
        lines += [f"sample {r.sample_id} (row {r.source_row}, {r.shard}): {r.problems}"
                  for r in bad_samples.head(50).itertuples()]
        return "\n".join(lines)


def _fresh_samples(manifest: dict, sources: list[str]) -> dict[str, dict]:
    """source -> {row: Sample} from a fresh tokenisation (None if unreadable)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(manifest["target_path"])
    out = {}
    for source in sources:
        try:
            samples, _ = prepare_samples(Path(source), tokenizer, max_length=manifest["max_length"],
                                         policy=manifest["max_length_policy"])
            out[source] = {s.source_row: s for s in samples}
        except (OSError, ValueError) as e:
            out[source] = e
    return out


def verify_store(store: Path, *, recheck_source: bool = True, write_report: bool = True) -> VerifyReport:
    store = Path(store)
    manifest = read_manifest(store)
    ledger = open_ledger(store)
    shards = ledger.shards()
    samples = ledger.samples()
    fresh = _fresh_samples(manifest, sorted(samples.source.unique())) if recheck_source else {}
    hidden = manifest["hidden_size"]
    store_format, storage = manifest.get("format", FORMAT_V1), manifest.get("dtype", BF16)
    file_rows, sample_rows = [], []

    for shard in shards.itertuples():
        mine = samples[samples.shard == shard.name]
        problems, per_sample = _check_shard(store, shard, mine, hidden, fresh, store_format, storage)
        file_rows.append({"shard": shard.name, "status": "FAIL" if problems or any(per_sample.values()) else "OK",
                          "samples": len(mine), "tokens": int(mine.num_tokens.sum()), "bytes": int(shard.bytes),
                          "problems": "; ".join(problems)})
        for s in mine.itertuples():
            p = per_sample.get(s.sample_id, [])
            sample_rows.append({"sample_id": s.sample_id, "shard": shard.name, "source_row": int(s.source_row),
                                "tokens": int(s.num_tokens), "status": "FAIL" if p else "OK",
                                "problems": "; ".join(p)})
    orphan_names = sorted(p.name.removesuffix(".safetensors") for p in (store / "shards").glob("shard-*.safetensors"))
    for name in sorted(set(orphan_names) - set(shards.name)):
        file_rows.append({"shard": name, "status": "ORPHAN", "samples": 0, "tokens": 0,
                          "bytes": shard_path(store, name).stat().st_size,
                          "problems": "not in the ledger (left by an interrupted run); ignored"})
    for s in samples[~samples.shard.isin(shards.name)].itertuples():
        sample_rows.append({"sample_id": s.sample_id, "shard": s.shard, "source_row": int(s.source_row),
                            "tokens": int(s.num_tokens), "status": "FAIL", "problems": "its shard is not in the ledger"})

    files_df = pd.DataFrame(file_rows, columns=["shard", "status", "samples", "tokens", "bytes", "problems"])
    samples_df = pd.DataFrame(sample_rows, columns=["sample_id", "shard", "source_row", "tokens", "status", "problems"])
    ok = not (files_df.status == "FAIL").any() and not (samples_df.status == "FAIL").any()
    report = VerifyReport(ok, files_df, samples_df, {})
    if write_report:
        report.paths = _write_report(store, report)
    return report


def _check_shard(store: Path, shard, mine: pd.DataFrame, hidden: int, fresh: dict, store_format: str,
                 storage: str) -> tuple[list[str], dict]:
    path = shard_path(store, shard.name)
    per_sample: dict[str, list[str]] = {sid: [] for sid in mine.sample_id}
    if not path.exists():
        return [f"file missing: {path}"], per_sample
    problems = []
    size = path.stat().st_size
    if size != shard.bytes:
        problems.append(f"size {size} bytes, ledger says {shard.bytes}")
    if file_sha256(path) != shard.sha256:
        problems.append("sha256 differs from the ledger (file changed or corrupted)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            fmt = meta.get("format")
            if fmt != store_format:
                return problems + [f"format {fmt!r}, but the store's manifest says {store_format!r}"], per_sample
            dtypes = shard_dtypes(storage, fmt)
            missing = sorted(set(dtypes) - set(f.keys()))
            if missing:
                return problems + [f"tensors {missing} missing (a {fmt} {storage} shard has {list(dtypes)})"], per_sample
            t = {k: f.get_tensor(k) for k in dtypes}
    except Exception as e:
        return problems + [f"unreadable as a store shard: {e}"], per_sample
    for k, dtype in dtypes.items():
        if t[k].dtype != dtype:
            problems.append(f"{k} is {t[k].dtype}, expected {dtype}")
    n_tok, off = t["input_ids"].shape[0], t["offsets"]
    expected = shard_shapes(n_tok, off.numel() - 1, 3, hidden)
    for k in dtypes:
        if k not in ("input_ids", "offsets") and tuple(t[k].shape) != expected[k]:
            problems.append(f"{k} shape {tuple(t[k].shape)}, expected {expected[k]}")
    if off.numel() == 0 or off[0] != 0 or off[-1] != n_tok or (off[1:] < off[:-1]).any():
        problems.append(f"offsets inconsistent with {n_tok} tokens")
    ids_in_file = json.loads(meta.get("sample_ids", "[]"))
    if ids_in_file != list(mine.sample_id):
        problems.append(f"samples in file ({len(ids_in_file)}) differ from the ledger's ({len(mine)})")
    if n_tok != shard.num_tokens or len(ids_in_file) != shard.num_samples:
        problems.append(f"file has {len(ids_in_file)} samples / {n_tok} tokens, ledger says "
                        f"{shard.num_samples} / {shard.num_tokens}")
    if problems and any("shape" in p or "offsets" in p for p in problems):
        return problems, per_sample
    position = {sid: k for k, sid in enumerate(ids_in_file)}
    for s in mine.itertuples():
        p = per_sample[s.sample_id]
        k = position.get(s.sample_id)
        if k is None:
            p.append("not in the shard file")
            continue
        a, b = int(off[k]), int(off[k + 1])
        if b - a != s.num_tokens:
            p.append(f"recounted {b - a} tokens in the file, index says {s.num_tokens}")
        if a != s.token_offset:
            p.append(f"starts at token {a} in the file, index says {s.token_offset}")
        mine = {k: t[k][a:b] for k in dtypes if k != "offsets"}
        ids, mask = mine["input_ids"], mine["loss_mask"]
        if int(mask.sum()) != s.num_loss_tokens:
            p.append(f"recounted {int(mask.sum())} loss tokens, index says {s.num_loss_tokens}")
        if sample_checksum(mine, fmt) != s.checksum:
            p.append("checksum differs")
        values = [mine["aux_hidden_states"], mine["final_hidden_state"]]
        if not all(bool(torch.isfinite(v.float()).all()) for v in values):
            p.append("non-finite values")
        scales = [mine[k] for k in ("aux_scale", "final_scale") if k in mine]
        if not all(bool((torch.isfinite(v) & (v > 0)).all()) for v in scales):
            p.append("FP8 scales not all finite and positive")
        src = fresh.get(s.source) if fresh else None
        if isinstance(src, Exception):
            p.append(f"source unreadable: {src}")
        elif src is not None:
            again = src.get(int(s.source_row))
            if again is None:
                p.append(f"source row {s.source_row} no longer gives a sample")
            elif again.num_tokens != b - a or not torch.equal(torch.from_numpy(again.input_ids), ids) \
                    or again.sample_id != s.sample_id:
                p.append(f"source changed: fresh tokenisation of row {s.source_row} gives "
                         f"{again.num_tokens} tokens / id {again.sample_id}, stored {b - a} / {s.sample_id}")
    return problems, per_sample


def _write_report(store: Path, report: VerifyReport) -> dict:
    out = store / "reports"
    out.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    paths = {"files_report": str(out / f"verify-{stamp}-files.parquet"),
             "samples_report": str(out / f"verify-{stamp}-samples.parquet")}
    report.files.to_parquet(paths["files_report"], index=False)
    report.samples.to_parquet(paths["samples_report"], index=False)
    summary = {"ok": report.ok, "time": time.time(), "files": len(report.files),
               "failed_files": int((report.files.status == "FAIL").sum()),
               "samples": len(report.samples), "failed_samples": int((report.samples.status == "FAIL").sum()),
               "tokens": int(report.samples.tokens.sum()) if len(report.samples) else 0, **paths}
    (out / "latest.json").write_text(json.dumps(summary, indent=2) + "\n")
    paths["summary_report"] = str(out / "latest.json")
    return paths


class StoreNotVerified(RuntimeError):
    """Training refuses data that no passing verification covers."""


def require_verified(store: Path) -> dict:
    """The latest verification summary, if it passed and covers every sample
    and shard the ledger holds now; otherwise StoreNotVerified saying why."""
    store = Path(store)
    latest = store / "reports" / "latest.json"
    if not latest.exists():
        raise StoreNotVerified(f"store {store} has no verification report ({latest}): "
                               f"run `python -m flows.verify --store {store}` first")
    summary = json.loads(latest.read_text())
    if not summary.get("ok"):
        raise StoreNotVerified(f"store {store} failed its last verification "
                               f"({summary.get('failed_files')} files, {summary.get('failed_samples')} samples; "
                               f"see {summary.get('files_report')}): re-extract or repair it, then verify again")
    now = open_ledger(store).summary()
    samples = now["samples"]
    if samples != summary.get("samples") or (now["newest_shard"] or 0) > summary.get("time", 0):
        raise StoreNotVerified(f"store {store} changed since its last verification ({summary.get('samples')} "
                               f"samples verified, {samples} stored now): verify it again")
    return summary
