"""Stable keys for the flows' Prefect artifacts. With a key, an artifact
shows on the UI's Artifacts page and each run adds a version of it; the
key names the kind and the store or run directory it describes."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path


def artifact_key(kind: str, path: str | Path) -> str:
    """`<kind>-<last two path parts>-<hash of the whole path>`, in the
    lowercase letters, digits and dashes Prefect allows."""
    resolved = str(Path(path).resolve())
    tail = "-".join(Path(resolved).parts[-2:])
    slug = re.sub(r"[^a-z0-9]+", "-", tail.lower()).strip("-")[:40]
    return f"{kind}-{slug}-{hashlib.sha256(resolved.encode()).hexdigest()[:8]}"
