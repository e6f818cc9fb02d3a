"""Seal a store: export its index beside the shards, as files any reader
opens without the ledger's database (no PostgreSQL client, no server):

    <store>/index/shards.parquet, samples.parquet, quarantine.parquet, canaries.parquet
    <store>/index/ledger.sqlite     the same four tables (ledger/sqlite.py's schema: a
                                    row's own quarantine record has sample_id '', the
                                    parquet's null)
    <store>/index/sealed.json       when, from which backend, the counts, and
                                    each file's sha256

Taken under the store's lock, so no run commits while the tables are read and
the files are one snapshot. Each file is written to a temp name, fsynced and
renamed, and sealed.json is written last: a reader that finds sealed.json
finds the files it describes. Sealing again replaces the export.
"""
from __future__ import annotations

import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pandas as pd

from tasks.durable import replace_durably
from tasks.store.ledger.open import ledger_record, open_ledger
from tasks.store.ledger.sqlite import SCHEMA
from tasks.store.lock import hold_lock
from tasks.store.manifest import write_json_atomic
from tasks.store.shards import file_sha256

INDEX_DIR = "index"


def seal(store: Path) -> dict:
    """Export the index; returns sealed.json's content."""
    store = Path(store)
    with hold_lock(store, "seal the store's index"):
        ledger = open_ledger(store)
        tables = {"shards": ledger.shards(), "samples": ledger.samples(), "quarantine": ledger.quarantined(),
                  "canaries": ledger.canaries()}
        summary = ledger.summary()
        out = store / INDEX_DIR
        out.mkdir(exist_ok=True)
        for name, frame in tables.items():
            replace_durably(out / f"{name}.parquet", lambda tmp, f=frame: f.to_parquet(tmp, index=False))
        replace_durably(out / "ledger.sqlite", lambda tmp: _sqlite_copy(tmp, tables))
        files = sorted([f"{name}.parquet" for name in tables] + ["ledger.sqlite"])
        record = {"sealed_at": time.time(), "backend": ledger_record(store)["backend"], "summary": summary,
                  "files": {f: file_sha256(out / f) for f in files}}
        write_json_atomic(out / "sealed.json", record)
        return record


def _sqlite_copy(path: Path, tables: dict[str, pd.DataFrame]) -> None:
    with closing(sqlite3.connect(path)) as db, db:
        db.executescript(SCHEMA)
        for name, frame in tables.items():
            marks = ",".join("?" * len(frame.columns))
            # .tolist() gives Python ints and floats (sqlite3 takes no numpy scalars), None for NULL.
            rows = frame.astype(object).where(frame.notna(), None).values.tolist()
            if name == "quarantine":  # the schema keys a row's own record by sample_id '' (a NULL key repeats)
                at = list(frame.columns).index("sample_id")
                rows = [r[:at] + ["" if r[at] is None else r[at]] + r[at + 1:] for r in rows]
            db.executemany(f"INSERT INTO {name} ({','.join(frame.columns)}) VALUES ({marks})", rows)


