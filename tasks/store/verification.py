"""Verify a store: every shard file and every sample, against the ledger and
against a fresh tokenisation of the source data.

Per file: present, size and sha256 as recorded, readable, the manifest's
format, the tensors the contract names (for the store's storage dtype: FP8
scales included) with their dtypes and shapes, offsets consistent, the sample
list equal to the ledger's. Per sample: tokens recounted from the file equal
the index, loss tokens recounted, checksum, finiteness (FP8: of the stored
values and of the scales, which must also be positive). A sample inside a
missing, unreadable or inconsistent shard FAILs.

Against the sources, samples are matched by their id (their content), not by
row number, so inserting or moving rows changes nothing. A sample no source
row gives any more (row removed or edited) is GONE: verification does not
pass until it is pruned (`prune_gone`, tasks/store/prune.py). A sample whose
source file is missing or unreadable is SOURCE_MISSING: reported, checked
against its shard alone, not failed (its data is still what was captured).
Files in shards/ that the ledger does not name are reported as orphans (a
killed run's leftovers) and never trusted.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from safetensors import safe_open

from tasks.data.chat import store_chat
from tasks.data.dataset import prepare_samples, sample_id
from tasks.failures import Permanent
from tasks.store.handle import Store
from tasks.store.manifest import write_json_atomic
from tasks.target.architectures import load_tokenizer
from tasks.store.shards import FORMAT, file_sha256, sample_checksum, shard_dtypes, shard_path, shard_shapes


@dataclass
class VerifyReport:
    ok: bool
    files: pd.DataFrame  # shard, status, samples, tokens, bytes, canaries, canary_worst_ratio, problems
    samples: pd.DataFrame  # sample_id, shard, source_row, tokens, status, problems
    paths: dict
    canary: dict = field(default_factory=dict)  # canary_summary

    def failures(self) -> str:
        bad_files = self.files[self.files.status == "FAIL"]
        bad_samples = self.samples[self.samples.status.isin(["FAIL", "GONE"])]
        lines = [f"{r.shard}: {r.problems}" for r in bad_files.itertuples()]
        lines += [f"sample {r.sample_id} (row {r.source_row}, {r.shard}) {r.status}: {r.problems}"
                  for r in bad_samples.head(50).itertuples()]
        return "\n".join(lines)


@dataclass
class FreshSources:
    """A fresh tokenisation of the sources: what each row gives now."""

    errors: dict[str, str]  # source -> why it could not be read
    by_id: dict[str, tuple[str, int]]  # sample id -> (source, row), first occurrence
    by_row: dict[tuple[str, int], list[str]]  # (source, row) -> its sample ids (one per group of turns)
    fatal: str | None = None  # why no source could be re-tokenised at all


def _fresh_samples(manifest: dict, sources: list[str]) -> FreshSources:
    fresh = FreshSources({}, {}, {})
    try:
        tokenizer = load_tokenizer(manifest["target_path"])
    except Exception as e:  # a missing or broken tokenizer: report it, per sample
        reason = (f"cannot re-tokenise: tokenizer at {manifest.get('target_path')} does not load ({e}); "
                  f"verify with recheck_source=False to check the shards alone")
        fresh.fatal = reason
        return fresh
    for source in sources:
        try:
            samples, _ = prepare_samples(Path(source), tokenizer, max_length=manifest["max_length"],
                                         policy=manifest["max_length_policy"], chat=store_chat(manifest))
        except (OSError, ValueError) as e:
            fresh.errors[source] = f"source {source} is missing or unreadable (moved?): {e}"
            continue
        for sample in samples:
            fresh.by_id.setdefault(sample.sample_id, (source, sample.source_row))
            fresh.by_row.setdefault((source, sample.source_row), []).append(sample.sample_id)
    return fresh


def verify_store(store: Path, *, recheck_source: bool = True, write_report: bool = True) -> VerifyReport:
    opened = Store.open(store)
    store, manifest = opened.path, opened.manifest
    shards = opened.ledger.shards()
    samples = opened.ledger.samples()
    # Every source the store was built from: a sample moved to another of
    # them (a renamed file extracted again) is still found.
    sources = sorted(set(samples.source) | set(manifest.get("sources", [])))
    fresh = _fresh_samples(manifest, sources) if recheck_source else None
    hidden = manifest["hidden_size"]
    num_aux = len(manifest["aux_layers"]["sglang_layer_output_ids"])
    canaries = opened.ledger.canaries()
    file_rows, sample_rows = [], []

    for shard in shards.itertuples():
        mine = samples[samples.shard == shard.name]
        problems, per_sample, content_ids = _check_shard(store, shard, mine, hidden, num_aux, opened.dtype)
        for s in mine.itertuples():
            p = per_sample.get(s.sample_id, [])
            if fresh is not None and content_ids.get(s.sample_id, s.sample_id) != s.sample_id:
                # Matching by id is sound only if the id is the content's.
                p.append(f"tokens and mask in the file give id {content_ids[s.sample_id]}, not {s.sample_id}")
            status, note = _against_source(s, fresh) if fresh is not None else ("OK", "")
            sample_rows.append({"sample_id": s.sample_id, "shard": shard.name, "source_row": int(s.source_row),
                                "tokens": int(s.num_tokens), "status": "FAIL" if p else status,
                                "problems": "; ".join(p + ([note] if note else []))})
        checked = canaries[canaries.shard == shard.name]
        held = set(mine.sample_id)
        problems += [f"canary {c.sample_id} outside its bound ({c.worst_ratio:.2f})" for c in checked.itertuples()
                     if c.worst_ratio > 1]
        problems += [f"canary {c.sample_id} names a sample this file does not hold" for c in checked.itertuples()
                     if c.sample_id not in held]
        file_rows.append({"shard": shard.name, "status": "FAIL" if problems or any(per_sample.values()) else "OK",
                          "samples": len(mine), "tokens": int(mine.num_tokens.sum()), "bytes": int(shard.bytes),
                          "canaries": len(checked),
                          "canary_worst_ratio": float(checked.worst_ratio.max()) if len(checked) else 0.0,
                          "problems": "; ".join(problems)})
    orphan_names = sorted(p.name.removesuffix(".safetensors") for p in (store / "shards").glob("shard-*.safetensors"))
    for name in sorted(set(orphan_names) - set(shards.name)):
        file_rows.append({"shard": name, "status": "ORPHAN", "samples": 0, "tokens": 0,
                          "bytes": shard_path(store, name).stat().st_size, "canaries": 0, "canary_worst_ratio": 0.0,
                          "problems": "not in the ledger (left by an interrupted run); ignored"})
    for s in samples[~samples.shard.isin(shards.name)].itertuples():
        sample_rows.append({"sample_id": s.sample_id, "shard": s.shard, "source_row": int(s.source_row),
                            "tokens": int(s.num_tokens), "status": "FAIL", "problems": "its shard is not in the ledger"})

    files_df = pd.DataFrame(file_rows, columns=["shard", "status", "samples", "tokens", "bytes", "canaries",
                                                "canary_worst_ratio", "problems"])
    samples_df = pd.DataFrame(sample_rows, columns=["sample_id", "shard", "source_row", "tokens", "status", "problems"])
    ok = not (files_df.status == "FAIL").any() and not samples_df.status.isin(["FAIL", "GONE"]).any()
    report = VerifyReport(ok, files_df, samples_df, {}, canary_summary(canaries[canaries.shard.isin(shards.name)]))
    if write_report:
        report.paths = _write_report(store, report)
    return report


def _check_shard(store: Path, shard, mine: pd.DataFrame, hidden: int, num_aux: int,
                 dtype: str) -> tuple[list[str], dict, dict]:
    """File problems, problems per sample, and the id each sample's tokens
    and mask in the file give (its content address)."""
    path = shard_path(store, shard.name)
    per_sample: dict[str, list[str]] = {sid: [] for sid in mine.sample_id}
    content_ids: dict[str, str] = {}

    def every_sample_fails(problems: list[str], why: str) -> tuple[list[str], dict, dict]:
        for p in per_sample.values():
            p.append(why)
        return problems, per_sample, content_ids

    if not path.exists():
        return every_sample_fails([f"file missing: {path}"], "its shard file is missing")
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
            if fmt != FORMAT:
                return every_sample_fails(problems + [f"format {fmt!r}, but the store's manifest says {FORMAT!r}"],
                                          "its shard's format is not the store's")
            dtypes = shard_dtypes(dtype)
            missing = sorted(set(dtypes) - set(f.keys()))
            if missing:
                return every_sample_fails(
                    problems + [f"tensors {missing} missing (a {fmt} {dtype} shard has {list(dtypes)})"],
                    "its shard's tensors are missing")
            t = {k: f.get_tensor(k) for k in dtypes}
    except Exception as e:
        return every_sample_fails(problems + [f"unreadable as a store shard: {e}"], "its shard file is unreadable")
    for k, expected_dtype in dtypes.items():
        if t[k].dtype != expected_dtype:
            problems.append(f"{k} is {t[k].dtype}, expected {expected_dtype}")
    if t["input_ids"].ndim != 1:
        return every_sample_fails(problems + [f"input_ids shape {tuple(t['input_ids'].shape)}, expected [T]"],
                                  "its shard is inconsistent")
    n_tok, off = t["input_ids"].shape[0], t["offsets"]
    expected = shard_shapes(n_tok, max(off.numel() - 1, 0), num_aux, hidden)
    for k in dtypes:
        if k not in ("input_ids", "offsets") and tuple(t[k].shape) != expected[k]:
            problems.append(f"{k} shape {tuple(t[k].shape)}, expected {expected[k]}")
    if off.ndim != 1 or off.numel() == 0 or off[0] != 0 or off[-1] != n_tok or (off[1:] < off[:-1]).any():
        problems.append(f"offsets inconsistent with {n_tok} tokens")
    try:
        ids_in_file = json.loads(meta.get("sample_ids", "[]"))
        if not isinstance(ids_in_file, list) or not all(isinstance(i, str) for i in ids_in_file):
            raise ValueError("not a list of ids")
    except ValueError as e:
        return every_sample_fails(problems + [f"sample_ids metadata is corrupt: {e}"],
                                  "its shard's sample list is corrupt")
    if ids_in_file != list(mine.sample_id):
        problems.append(f"samples in file ({len(ids_in_file)}) differ from the ledger's ({len(mine)})")
    if off.ndim == 1 and len(ids_in_file) != off.numel() - 1:
        problems.append(f"{len(ids_in_file)} sample ids for {off.numel() - 1} offset ranges")
    if n_tok != shard.num_tokens or len(ids_in_file) != shard.num_samples:
        problems.append(f"file has {len(ids_in_file)} samples / {n_tok} tokens, ledger says "
                        f"{shard.num_samples} / {shard.num_tokens}")
    if any("shape" in p or "offset" in p or " is torch." in p for p in problems):
        return every_sample_fails(problems, "its shard's layout is inconsistent")
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
        piece = {name: t[name][a:b] for name in dtypes if name != "offsets"}
        ids, mask = piece["input_ids"], piece["loss_mask"]
        if int(mask.sum()) != s.num_loss_tokens:
            p.append(f"recounted {int(mask.sum())} loss tokens, index says {s.num_loss_tokens}")
        if sample_checksum(piece) != s.checksum:
            p.append("checksum differs")
        values = [piece["aux_hidden_states"], piece["final_hidden_state"]]
        if not all(bool(torch.isfinite(v.float()).all()) for v in values):
            p.append("non-finite values")
        scales = [piece[name] for name in ("aux_scale", "final_scale") if name in piece]
        if not all(bool((torch.isfinite(v) & (v > 0)).all()) for v in scales):
            p.append("FP8 scales not all finite and positive")
        content_ids[s.sample_id] = sample_id(ids.numpy(), mask.numpy())
    return problems, per_sample, content_ids


def _against_source(s, fresh: FreshSources) -> tuple[str, str]:
    """(status, note) of one stored sample against the sources now. Its
    checksum and id already tie its tokens to its id, so finding the id is
    finding its tokens."""
    if fresh.fatal:
        return "FAIL", fresh.fatal
    found = fresh.by_id.get(s.sample_id)
    if found is not None:
        source, row = found
        if (source, row) == (s.source, int(s.source_row)):
            return "OK", ""
        where = f"row {row}" if source == s.source else f"{source} row {row}"
        return "OK", f"moved: source row {s.source_row} is now {where}"
    if s.source in fresh.errors:
        return "SOURCE_MISSING", f"{fresh.errors[s.source]}; checked against its shard only"
    now = fresh.by_row.get((s.source, int(s.source_row)))
    if now is None:
        return "GONE", (f"source row {s.source_row} no longer gives a sample and no row of the sources gives "
                        f"this one (removed?); prune it with `python -m flows.verify --prune-gone`")
    return "GONE", (f"source changed: row {s.source_row} now gives sample {', '.join(now)}, and no row gives this one "
                    f"(edited?); prune it with `python -m flows.verify --prune-gone`")


def canary_summary(canaries: pd.DataFrame) -> dict:
    """The capture canary over the store (tasks/capture/canary.py): samples
    whose final state was checked against the server's own logprobs when
    captured, their worst deviation (in logprob, and as a share of its
    bound), and aux profiles that stood out."""
    return {"samples": len(canaries), "positions": int(canaries.positions.sum()) if len(canaries) else 0,
            "worst_deviation": float(canaries.worst_deviation.max()) if len(canaries) else 0.0,
            "worst_ratio": float(canaries.worst_ratio.max()) if len(canaries) else 0.0,
            "profile_outliers": int((canaries.profile_outlier != "").sum()) if len(canaries) else 0}


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
               "gone_samples": int((report.samples.status == "GONE").sum()),
               "source_missing_samples": int((report.samples.status == "SOURCE_MISSING").sum()),
               "tokens": int(report.samples.tokens.sum()) if len(report.samples) else 0,
               "canary": report.canary, **paths}
    write_json_atomic(out / "latest.json", summary)  # training trusts it: never torn
    paths["summary_report"] = str(out / "latest.json")
    return paths


class StoreNotVerified(Permanent, RuntimeError):
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
        gone = summary.get("gone_samples") or 0
        raise StoreNotVerified(f"store {store} failed its last verification "
                               f"({summary.get('failed_files')} files, {summary.get('failed_samples')} samples"
                               + (f", {gone} samples whose source rows are gone" if gone else "")
                               + f"; see {summary.get('files_report')}): re-extract or repair it"
                               + (" (`python -m flows.verify --prune-gone` removes the gone ones)" if gone else "")
                               + ", then verify again")
    now = Store.open(store).ledger.summary()
    samples = now["samples"]
    if samples != summary.get("samples") or (now["newest_shard"] or 0) > summary.get("time", 0):
        raise StoreNotVerified(f"store {store} changed since its last verification ({summary.get('samples')} "
                               f"samples verified, {samples} stored now): verify it again")
    return summary
