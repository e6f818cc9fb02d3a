"""The ledger in SQLite, `<store>/ledger.sqlite`: the default backend."""
from __future__ import annotations

import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Sequence

import pandas as pd

from tasks.store.ledger.index import CANARY_COLUMNS, Ledger
from tasks.store.manifest import StoreError
from tasks.store.shards import ShardInfo

# Ids bound in one statement of captured_among, each twice: under SQLite's
# limit of 32,766 variables.
IDS_PER_QUERY = 10_000

SCHEMA = """
CREATE TABLE IF NOT EXISTS shards(
    name TEXT PRIMARY KEY, sha256 TEXT NOT NULL, bytes INTEGER NOT NULL,
    num_samples INTEGER NOT NULL, num_tokens INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS samples(
    sample_id TEXT PRIMARY KEY, source TEXT NOT NULL, source_row INTEGER NOT NULL,
    shard TEXT NOT NULL REFERENCES shards(name), position INTEGER NOT NULL,
    token_offset INTEGER NOT NULL, num_tokens INTEGER NOT NULL,
    num_loss_tokens INTEGER NOT NULL, checksum TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS samples_by_shard ON samples(shard, position);
CREATE TABLE IF NOT EXISTS quarantine(
    source TEXT NOT NULL, source_row INTEGER NOT NULL, sample_id TEXT NOT NULL DEFAULT '',
    reason TEXT NOT NULL, attempts INTEGER NOT NULL, at REAL NOT NULL,
    PRIMARY KEY(source, source_row, sample_id));
CREATE TABLE IF NOT EXISTS crashes(
    sample_id TEXT PRIMARY KEY, count INTEGER NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS retired(sample_id TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS canaries(
    shard TEXT NOT NULL REFERENCES shards(name), sample_id TEXT PRIMARY KEY REFERENCES samples(sample_id),
    positions INTEGER NOT NULL, worst_deviation REAL NOT NULL, worst_ratio REAL NOT NULL,
    profile TEXT NOT NULL, profile_outlier TEXT NOT NULL, at REAL NOT NULL);
"""
# The quarantine of a store made when a row gave one sample (its key the row):
# kept, each record under its sample (or the row's, '').
QUARANTINE_BY_SAMPLE = """
ALTER TABLE quarantine RENAME TO quarantine_by_row;
CREATE TABLE quarantine(
    source TEXT NOT NULL, source_row INTEGER NOT NULL, sample_id TEXT NOT NULL DEFAULT '',
    reason TEXT NOT NULL, attempts INTEGER NOT NULL, at REAL NOT NULL,
    PRIMARY KEY(source, source_row, sample_id));
INSERT INTO quarantine SELECT source, source_row, COALESCE(sample_id, ''), reason, attempts, at FROM quarantine_by_row;
DROP TABLE quarantine_by_row;
"""
INSERT_CANARY = ("INSERT INTO canaries VALUES (:shard,:sample_id,:positions,:worst_deviation,:worst_ratio,:profile,"
                 ":profile_outlier,:at)")


class SqliteLedger(Ledger):
    """`<store>/ledger.sqlite`. One short connection per call, so it can be
    used from many threads. Keep such a store on a local or POSIX
    filesystem (SQLite's locking is unreliable on NFS)."""

    def __init__(self, store: Path):
        self.store = Path(store)
        self.path = self.store / "ledger.sqlite"
        with closing(self._connect()) as db, db:
            db.executescript(SCHEMA)
            keyed = [r[1] for r in db.execute("PRAGMA table_info(quarantine)") if r[5]]
            if "sample_id" not in keyed:  # a store of one record a row: each sample's its own
                db.executescript(QUARANTINE_BY_SAMPLE)

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=120)

    def _rows(self, sql: str, args=()) -> list[tuple]:
        with closing(self._connect()) as db:
            return db.execute(sql, args).fetchall()

    def _frame(self, sql: str) -> pd.DataFrame:
        with closing(self._connect()) as db:
            return pd.read_sql_query(sql, db)

    def stored_ids(self) -> set[str]:
        return {r[0] for r in self._rows("SELECT sample_id FROM samples")}

    def commit_shard(self, shard: ShardInfo, rows: list[dict], canaries: list[dict] = ()) -> None:
        try:
            with closing(self._connect()) as db, db:
                db.execute("INSERT INTO shards VALUES (?,?,?,?,?,?)",
                           (shard.name, shard.sha256, shard.bytes, shard.num_samples, shard.num_tokens, time.time()))
                db.executemany(
                    "INSERT INTO samples VALUES (:sample_id,:source,:source_row,:shard,:position,"
                    ":token_offset,:num_tokens,:num_loss_tokens,:checksum)", rows)
                # Its own record, and its row's (a row that gave none before).
                db.executemany("DELETE FROM quarantine WHERE source=? AND source_row=? AND sample_id IN (?, '')",
                               [(r["source"], r["source_row"], r["sample_id"]) for r in rows])
                db.executemany(INSERT_CANARY, [{"at": time.time(), **c} for c in canaries])
        except sqlite3.IntegrityError as e:
            # Plain INSERTs: what is committed stays as committed; the whole
            # transaction was rolled back. Name what was already there.
            ids = [r["sample_id"] for r in rows]
            taken = sorted({i for (i,) in self._rows(
                f"SELECT sample_id FROM samples WHERE sample_id IN ({','.join('?' * len(ids))})", ids)})
            what = f"samples {', '.join(taken[:5])}{' ...' if len(taken) > 5 else ''}" if taken else "the shard"
            raise StoreError(f"cannot commit shard {shard.name} to {self.path}: {e}: {what} already committed "
                             f"(a committed shard or sample is never replaced; is another run writing "
                             f"this store?)") from None

    def replace_shard(self, old: str, new: ShardInfo | None, rows: list[dict]) -> None:
        with closing(self._connect()) as db, db:
            kept = [r["sample_id"] for r in rows] if new is not None else []
            moved = [dict(zip(CANARY_COLUMNS, c)) | {"shard": new.name} for c in db.execute(
                f"SELECT * FROM canaries WHERE shard=? AND sample_id IN ({','.join('?' * len(kept))})", [old, *kept])]
            db.execute("DELETE FROM canaries WHERE shard=?", (old,))
            db.execute("DELETE FROM samples WHERE shard=?", (old,))
            if db.execute("DELETE FROM shards WHERE name=?", (old,)).rowcount != 1:
                raise StoreError(f"shard {old} is not committed in {self.path}")
            if new is not None:
                db.execute("INSERT INTO shards VALUES (?,?,?,?,?,?)",
                           (new.name, new.sha256, new.bytes, new.num_samples, new.num_tokens, time.time()))
                db.executemany(
                    "INSERT INTO samples VALUES (:sample_id,:source,:source_row,:shard,:position,"
                    ":token_offset,:num_tokens,:num_loss_tokens,:checksum)", rows)
                db.executemany(INSERT_CANARY, moved)

    def retire_shard(self, name: str) -> None:
        with closing(self._connect()) as db, db:
            db.execute("INSERT OR IGNORE INTO retired SELECT sample_id FROM samples WHERE shard=?", (name,))
            db.execute("DELETE FROM canaries WHERE shard=?", (name,))
            db.execute("DELETE FROM samples WHERE shard=?", (name,))
            if db.execute("DELETE FROM shards WHERE name=?", (name,)).rowcount != 1:
                raise StoreError(f"shard {name} is not committed in {self.path}")

    def retired_ids(self) -> set[str]:
        return {r[0] for r in self._rows("SELECT sample_id FROM retired")}

    def captured_among(self, sample_ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        ids = list(sample_ids)
        for i in range(0, len(ids), IDS_PER_QUERY):
            chunk = ids[i: i + IDS_PER_QUERY]
            marks = ",".join("?" * len(chunk))
            found |= {r[0] for r in self._rows(f"SELECT sample_id FROM samples WHERE sample_id IN ({marks}) UNION "
                                               f"SELECT sample_id FROM retired WHERE sample_id IN ({marks})",
                                               (*chunk, *chunk))}
        return found

    def forget_retired(self) -> None:
        with closing(self._connect()) as db, db:
            db.execute("DELETE FROM retired")

    def quarantine(self, rows: list[dict]) -> None:
        with closing(self._connect()) as db, db:
            db.executemany(
                "INSERT OR REPLACE INTO quarantine VALUES (:source,:source_row,:sample_id,:reason,:attempts,:at)",
                [{"attempts": 0, "at": time.time(), **r, "sample_id": r.get("sample_id") or ""} for r in rows])

    def record_crash(self, sample_ids: list[str]) -> dict[str, int]:
        with closing(self._connect()) as db, db:
            db.executemany("INSERT INTO crashes VALUES (?, 1, ?) ON CONFLICT(sample_id) DO UPDATE SET "
                           "count = count + 1, at = excluded.at", [(i, time.time()) for i in sample_ids])
            return dict(db.execute(f"SELECT sample_id, count FROM crashes WHERE sample_id IN "
                                   f"({','.join('?' * len(sample_ids))})", sample_ids).fetchall())

    def crash_counts(self) -> dict[str, int]:
        return dict(self._rows("SELECT sample_id, count FROM crashes"))

    def summary(self) -> dict:
        samples, tokens, loss = self._rows(
            "SELECT COUNT(*), COALESCE(SUM(num_tokens),0), COALESCE(SUM(num_loss_tokens),0) FROM samples")[0]
        shards, nbytes, newest = self._rows("SELECT COUNT(*), COALESCE(SUM(bytes),0), MAX(created) FROM shards")[0]
        quarantined = self._rows("SELECT COUNT(*) FROM quarantine")[0][0]
        return {"samples": samples, "tokens": tokens, "loss_tokens": loss, "shards": shards,
                "bytes": nbytes, "quarantined": quarantined, "newest_shard": newest}

    def shards(self) -> pd.DataFrame:
        return self._frame("SELECT * FROM shards")

    def samples(self) -> pd.DataFrame:
        return self._frame("SELECT * FROM samples ORDER BY shard, position")

    def quarantined(self) -> pd.DataFrame:
        return self._frame("SELECT source, source_row, NULLIF(sample_id, '') AS sample_id, reason, attempts, at "
                           "FROM quarantine")

    def canaries(self, latest: int | None = None) -> pd.DataFrame:
        if latest is None:
            return self._frame("SELECT * FROM canaries ORDER BY at, sample_id")
        return self._frame(f"SELECT * FROM (SELECT * FROM canaries ORDER BY at DESC, sample_id DESC "
                           f"LIMIT {int(latest)}) ORDER BY at, sample_id")

    def sample_index(self) -> list[tuple]:
        return self._rows("SELECT sample_id, shard, token_offset, num_tokens, num_loss_tokens, source_row, "
                          "checksum FROM samples ORDER BY shard, position")

    def shard_index(self, sample_id: str) -> list[tuple]:
        return self._rows("SELECT sample_id, shard, token_offset, num_tokens, num_loss_tokens, source_row, checksum "
                          "FROM samples WHERE shard = (SELECT shard FROM samples WHERE sample_id = ?) "
                          "ORDER BY position", (sample_id,))
