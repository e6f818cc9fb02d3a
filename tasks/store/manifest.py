"""The store's manifest: what produced its data, and the rule for adding to it.

    <store>/manifest.json     target (name, config hash, weights fingerprint, architecture),
                              tokenizer and chat-template hashes, aux layer ids
                              in both conventions, final state post-norm,
                              hidden size, dtype (the storage dtype of the hidden
                              states: bfloat16, or float8_e4m3fn with per-token
                              scales; see tasks/store/shards.py), max length and
                              policy, how conversations were rendered
                              (`chat`: tasks/data/chat.py ChatRender), SGLang
                              version, sources, and for a
                              source of regenerated answers what they were
                              made from (`regenerated`: source -> its
                              provenance.json, tasks/regeneration/answer_store.py)

Two runs may write into the same store only if the keys in IDENTITY_KEYS are
equal: the format and the storage dtype among them, so one store never mixes
bf16 and FP8 shards. A store of another format is neither read nor added to.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Sequence

from tasks.data.chat import template_text
from tasks.durable import replace_durably
from tasks.failures import Permanent
from tasks.store.shards import BF16, FORMAT, STORAGE_DTYPES, file_sha256
from tasks.target.architectures import Architecture
from tasks.target.fingerprint import weights_fingerprint

# What must be equal for two runs to write into the same store.
IDENTITY_KEYS = ("format", "target", "architecture", "tokenizer", "aux_layers", "hidden_size", "dtype",
                 "max_length", "max_length_policy", "chat")


class StoreError(RuntimeError):
    pass


class StoreMismatch(Permanent, StoreError):
    """The run would add data made another way than the store's: it needs a
    store directory of its own."""


# The run settings each identity key comes from, named in a refusal.
IDENTITY_SETTINGS = {"target": "server.model", "architecture": "server.model", "tokenizer": "server.model",
                     "hidden_size": "server.model", "aux_layers": "capture.aux_layer_ids", "dtype": "store.dtype",
                     "max_length": "capture.max_length", "max_length_policy": "capture.max_length_policy",
                     "chat": "capture.thinking, turns, missing_reasoning, unwanted_reasoning, template_date, "
                             "chat_template_kwargs, reasoning_start/end"}


def build_manifest(model_path: Path, tokenizer, aux_layers, architecture: Architecture, *, max_length: int,
                   policy: str, sources: Sequence[str], dtype: str = BF16,
                   regenerated: dict[str, dict] | None = None, chat: dict | None = None) -> dict:
    """What produced the data. The keys in IDENTITY_KEYS must match for a run
    to add to an existing store. `dtype`, the storage dtype of the hidden
    states: bfloat16 (default) or float8_e4m3fn (half the bytes;
    tasks/store/fp8.py). `regenerated`: the provenance of each source that
    is a directory of the target's own answers. `chat`: how its
    conversations are rendered (ChatRender.record()), which a later run
    and the verification render them with again."""
    from importlib.metadata import version

    if dtype not in STORAGE_DTYPES:
        raise StoreError(f"storage dtype {dtype!r} is not supported: choose one of {', '.join(STORAGE_DTYPES)}")
    model_path = Path(model_path)
    config = json.loads((model_path / "config.json").read_text())
    sizes = architecture.sizes(config)
    return {
        "format": FORMAT,
        "target": {"name": model_path.name, "config_sha256": file_sha256(model_path / "config.json"),
                   "weights_sha256": weights_fingerprint(model_path),
                   "architectures": config.get("architectures"), "num_hidden_layers": sizes["num_hidden_layers"],
                   "vocab_size": sizes.get("vocab_size")},
        "architecture": architecture.as_record(),
        "target_path": str(model_path.resolve()),
        "tokenizer": {"sha256": file_sha256(model_path / "tokenizer.json"),
                      "chat_template_sha256": hashlib.sha256(template_text(tokenizer.chat_template).encode()).hexdigest()},
        "aux_layers": aux_layers.as_record(),
        "hidden_size": sizes["hidden_size"],
        "dtype": dtype,
        "max_length": max_length,
        "max_length_policy": policy,
        "chat": chat,
        "sglang_version": version("sglang"),
        "sources": sorted(str(s) for s in sources),
        "regenerated": dict(regenerated or {}),
    }


def manifest_path(store: Path) -> Path:
    return Path(store) / "manifest.json"


def read_manifest(store: Path) -> dict:
    """The manifest of an existing store whose format this version reads."""
    path = manifest_path(store)
    if not path.exists():
        raise StoreError(f"{store} is not a store: no manifest.json")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise StoreMismatch(f"store {store} is format {manifest.get('format')!r}; this version reads only {FORMAT}: "
                         f"extract its data again into a new store")
    return manifest


def create_or_check(store: Path, manifest: dict) -> None:
    """Create the store's manifest, or check that an existing store was built
    the same way (and record new sources). Refuses to mix data from
    different models, tokenizers, layers or length policies."""
    store = Path(store)
    (store / "shards").mkdir(parents=True, exist_ok=True)
    path = manifest_path(store)
    if not path.exists():
        write_json_atomic(path, manifest)
        return
    existing = json.loads(path.read_text())
    target, new_target = existing.get("target") or {}, manifest.get("target") or {}
    # A message of its own: a fine-tune keeps its base model's config.json,
    # so the weights fingerprint is the only part of the target that differs.
    if (target.get("weights_sha256") != new_target.get("weights_sha256")
            and {**target, "weights_sha256": None} == {**new_target, "weights_sha256": None}):
        raise StoreMismatch(
            f"store {store} was captured from other weights than {manifest.get('target_path')} (same config.json, "
            f"weights fingerprint {target.get('weights_sha256', '')[:12]} vs {new_target.get('weights_sha256', '')[:12]}: "
            "a fine-tune, or a re-download that changed?). States from two models must not mix: use a new store "
            "directory for this run.")
    diff = [k for k in IDENTITY_KEYS if existing.get(k) != manifest.get(k)]
    if diff:
        raise StoreMismatch(
            f"store {store} was built with different {', '.join(diff)}: "
            + "; ".join(f"{k}{f' ({IDENTITY_SETTINGS[k]})' if k in IDENTITY_SETTINGS else ''}: store has "
                        f"{existing.get(k)!r}, this run {manifest.get(k)!r}" for k in diff)
            + ". Use a new store directory for this run."
        )
    updated = {**existing, "sources": sorted(set(existing.get("sources", [])) | set(manifest.get("sources", []))),
               "regenerated": {**existing.get("regenerated", {}), **manifest.get("regenerated", {})}}
    if updated != existing:
        write_json_atomic(path, updated)


def write_json_atomic(path: Path, data: dict) -> None:
    replace_durably(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n"))


def write_json_once(path: Path, data: dict) -> bool:
    """Create `path` holding `data` unless it exists; whether this call made
    it. Of two processes creating it at once, the first link wins and the
    other must read what it wrote (a rename would let the second replace a
    record the first already acts on)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    write_json_atomic(tmp, data)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
