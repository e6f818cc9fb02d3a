"""The training record an export carries in its config.json (`eagle3_training`,
`dflash_training`): what the drafter was trained for, on what, and how, in
terms that mean the same on another machine. The drafter folder is what a
user publishes: a path of the machine that trained it names nothing to its
readers, so the record names the target as a user finds it, the data by
its file names, and fingerprints both.

    target                  the target's name (target_name)
    target_quantized        true where that is the base of the quantised checkpoint
                            it was trained on (the weights fingerprint is the
                            checkpoint's, not the base's)
    target_weights_sha256   its weights' fingerprint (tasks/target/fingerprint.py,
                            the store manifest's), what flows.evaluate and
                            train.init_from check a target against
    target_license          the licence the target's own card states, or None
    data                    the store by its folder name: samples, tokens, dtype,
                            aux layers, the fingerprint of its samples, the
                            dataset files' names, how the answers were made
    steps, heldout          training's steps and held-out figures
    config                  the run's settings (TrainConfig.identity), a path by
                            its last part
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

TARGET_WEIGHTS = "target_weights_sha256"
# What only the user can say (the licence of a target whose card states
# none, the hub id of a local target): the publish command refuses a folder
# that still holds it.
FILL_IN = "FILL-IN"
logger = logging.getLogger("eagle3.training")
# A model in the hub's cache: .../models--<org>--<name>/snapshots/<revision>/
_HUB_CACHE = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def card_metadata(path: Path) -> dict:
    """The metadata block (YAML between `---` lines) of a model card, {} if
    there is none."""
    import yaml

    text = Path(path).read_text(errors="replace") if Path(path).is_file() else ""
    if not text.startswith("---\n"):
        return {}
    head, sep, _ = text[4:].partition("\n---")
    try:
        meta = yaml.safe_load(head) if sep else None
    except yaml.YAMLError:
        return {}  # a card is documentation: one that does not parse states nothing
    return meta if isinstance(meta, dict) else {}


def is_hub_id(name: str) -> bool:
    """`org/name`, as a model hub names a repository."""
    return bool(_HUB_ID.match(name or ""))


def target_name(target: Path) -> str:
    """The target as a user finds it: its hub id where the checkpoint says
    it (a snapshot in the hub's cache; `_name_or_path` in its config.json;
    the base_model of a checkpoint its card calls a quantisation of it),
    else its folder's name."""
    target = Path(target)
    found = _HUB_CACHE.search(str(target.resolve()))
    if found:
        return f"{found['org']}/{found['name']}"
    config = json.loads((target / "config.json").read_text())
    named = str(config.get("_name_or_path") or "")
    # A relative path that is a folder here (output/checkpoint-500) is no hub id.
    if is_hub_id(named) and not Path(named).exists():
        return named
    card = card_metadata(target / "README.md")
    base = card.get("base_model")
    if card.get("base_model_relation") == "quantized" and isinstance(base, str) and is_hub_id(base):
        return base
    return target.name


def target_license(target: Path) -> str | None:
    """The licence the target's card states (its `license` metadata)."""
    card = card_metadata(Path(target) / "README.md")
    return str(card["license"]) if card.get("license") else None


def portable(value):
    """`value` with every absolute path replaced by its last part."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v) for v in value]
    if isinstance(value, str) and value.startswith("/") and len(value) > 1:
        return Path(value).name
    return value


def data_record(store: Path) -> dict:
    """What the drafter was trained on, from the store's manifest and index.
    Its fingerprint is over the store's sample ids, which are hashes of
    each sample's rendered tokens (tasks/data/dataset.py sample_id): the same for
    the same data however it was sharded, and cheap where hashing a
    dataset of hundreds of GB would not be."""
    from tasks.store.ledger.open import open_ledger

    store = Path(store)
    manifest = json.loads((store / "manifest.json").read_text())
    ledger = open_ledger(store)
    summary = ledger.summary()
    ids = "\n".join(sorted(ledger.samples().sample_id)).encode()
    regenerated = [{"into": Path(into).name, "from": Path(made.get("source") or "").name,
                    **{k: made.get("settings", {}).get(k) for k in ("temperature", "max_new_tokens", "thinking")}}
                   for into, made in (manifest.get("regenerated") or {}).items()]
    return {"store": store.name, "samples": summary["samples"], "tokens": summary["tokens"],
            "samples_sha256": hashlib.sha256(ids).hexdigest(), "dtype": manifest.get("dtype"),
            "aux_layers": manifest["aux_layers"].get("sglang_layer_output_ids"),
            "sources": sorted(Path(s).name for s in manifest.get("sources", [])), "regenerated": regenerated}


def export_record(target: Path, store: Path, manifest: dict, steps: int, heldout: dict, config: dict) -> dict:
    """The record an export of a drafter trained on `store` (whose manifest
    is `manifest`) for `target` carries. What cannot be read (a store whose
    index this process cannot open) is recorded as unknown, with a warning:
    the record documents an export and must never stop it."""
    try:
        data = data_record(store)
    except Exception as e:  # noqa: BLE001 - documentation only; the reason is logged
        logger.warning("the export records no data: %s: %s", type(e).__name__, e)
        data = None
    name, card = target_name(target), card_metadata(Path(target) / "README.md")
    # Named by the base of a quantised checkpoint: the weights it trained on are not the base's.
    quantized = card.get("base_model_relation") == "quantized" and card.get("base_model") == name
    return {"target": name, "target_quantized": quantized or None,
            TARGET_WEIGHTS: manifest.get("target", {}).get("weights_sha256"),
            "target_license": target_license(target), "data": data, "steps": steps,
            "heldout": heldout, "config": portable(config)}


def served_target(record: dict, target: Path) -> str | None:
    """Why `target` is not the one a drafter's `record` was trained for, or
    None. By the weights' fingerprint (a fine-tune keeps its base's
    config.json); a record without one (an older export) by its path."""
    from tasks.target.fingerprint import weights_fingerprint

    recorded = record.get(TARGET_WEIGHTS)
    if recorded:
        found = weights_fingerprint(target)
        return None if found == recorded else f"weights fingerprint {found[:12]}..., not {recorded[:12]}..."
    theirs = Path(record["target"])
    if theirs.is_absolute() and theirs.resolve() != Path(target).resolve():  # an export that recorded a path
        return f"the drafter records no weights fingerprint, and its target {theirs} is not this one"
    # A store captured before fingerprints: its name, as init_from does, with a warning.
    logger.warning("the drafter records no target weights fingerprint: only its target's name (%s) is checked",
                   record["target"])
    return None if theirs.name in (Path(target).name, target_name(target).split("/")[-1]) else (
        f"the drafter records no weights fingerprint, and its target {record['target']} is not {target_name(target)}")
