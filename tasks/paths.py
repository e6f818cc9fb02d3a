"""Where the project keeps what it builds and ships.

Everything heavy (converted checkpoints, the libcuda stub, test models) lives
in one git-ignored cache so a clean clone stays small and set-up is idempotent.
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"


def cache_root() -> Path:
    """`$EAGLE3_CACHE_DIR`, else `.cache/` in the repository."""
    root = Path(os.environ.get("EAGLE3_CACHE_DIR", REPO_ROOT / ".cache"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def default_dump_root() -> Path:
    """Captures are written once and read back at once: RAM-backed /dev/shm
    keeps them off the disk that holds the store, where it exists."""
    shm = Path("/dev/shm")
    return shm / "eagle3-dumps" if shm.is_dir() else cache_root() / "dumps"
