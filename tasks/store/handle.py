"""One store, opened: its directory, its manifest and its ledger, taken
together so that code working on a store opens it once and cannot pair one
store's manifest with another's ledger."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.store.ledger.index import Ledger
from tasks.store.ledger.open import open_ledger, open_store
from tasks.store.manifest import read_manifest


@dataclass(frozen=True)
class Store:
    path: Path
    manifest: dict
    ledger: Ledger

    @property
    def dtype(self) -> str:
        """The storage dtype of its hidden states: bfloat16 or float8_e4m3fn."""
        return self.manifest["dtype"]

    @classmethod
    def open(cls, path: Path) -> Store:
        """An existing store. StoreError naming the path when it has no
        manifest or one of another format."""
        path = Path(path)
        # The manifest first: opening the ledger of a directory that is not a
        # store would create an empty SQLite index there.
        manifest = read_manifest(path)
        return cls(path, manifest, open_ledger(path))

    @classmethod
    def create(cls, path: Path, manifest: dict, ledger_url: str | None = None) -> Store:
        """Create the store, or check that an existing one was built the same
        way and record this run's sources (open_store; ledger_url as there)."""
        path = Path(path)
        ledger = open_store(path, manifest, ledger_url)
        return cls(path, read_manifest(path), ledger)
