"""The ledger: the store's index, and the single source of truth for
progress, resume and verification. A sample is stored when, and only when,
the ledger has committed its shard.

`Ledger` names the operations the rest of the project uses; no SQL lives
outside a backend. `open_ledger(store)` gives the store's backend, as
`<store>/ledger.json` records it: SQLite (`<store>/ledger.sqlite`, the
default, and what a store without ledger.json has) for a store on one
machine's local filesystem; PostgreSQL (tasks/store/ledger_postgres.py) for
one that many machines write. Tables, in every backend:

    shards(name, sha256, bytes, num_samples, num_tokens, created)
    samples(sample_id, source, source_row, shard, position, token_offset,
            num_tokens, num_loss_tokens, checksum)
    quarantine(source, source_row, sample_id, reason, attempts, at)
    crashes(sample_id, count, at)      samples in flight when the server died
"""
from __future__ import annotations

import abc
import json
import os
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path

import pandas as pd

from tasks.store.manifest import StoreError, create_or_check, write_json_atomic
from tasks.store.shards import ShardInfo

SHARD_COLUMNS = ["name", "sha256", "bytes", "num_samples", "num_tokens", "created"]
SAMPLE_COLUMNS = ["sample_id", "source", "source_row", "shard", "position", "token_offset", "num_tokens",
                  "num_loss_tokens", "checksum"]
QUARANTINE_COLUMNS = ["source", "source_row", "sample_id", "reason", "attempts", "at"]


class Ledger(abc.ABC):
    """The index of one store. Safe to call from the threads Prefect runs
    mapped tasks in."""

    store: Path

    @abc.abstractmethod
    def stored_ids(self) -> set[str]:
        """Every committed sample id."""

    @abc.abstractmethod
    def commit_shard(self, shard: ShardInfo, rows: list[dict]) -> None:
        """In one transaction: the shard, its samples (rows as made by
        `write_shard`), and the end of any quarantine of their source rows."""

    def has_shard(self, name: str) -> bool:
        return name in set(self.shards().name)

    @abc.abstractmethod
    def replace_shard(self, old: str, new: ShardInfo | None, rows: list[dict]) -> None:
        """In one transaction: drop shard `old` and its samples, commit `new`
        (None: nothing) with rows. Only pruning (tasks/store/prune.py) does
        this, under the store's lock; commit_shard never replaces."""

    @abc.abstractmethod
    def quarantine(self, rows: list[dict]) -> None:
        """rows: source, source_row, sample_id (or None), reason, attempts."""

    @abc.abstractmethod
    def record_crash(self, sample_ids: list[str]) -> dict[str, int]:
        """Count one more server crash against each sample that was in
        flight when it happened; returns their counts. Kept across runs: a
        sample that kills the server kills it again on every rerun."""

    @abc.abstractmethod
    def crash_counts(self) -> dict[str, int]:
        """Server crashes each sample was in flight at, for every sample
        that was in flight at one."""

    @abc.abstractmethod
    def summary(self) -> dict:
        """samples, tokens, loss_tokens, shards, bytes, quarantined, and
        newest_shard (its `created` time, None for an empty store)."""

    @abc.abstractmethod
    def shards(self) -> pd.DataFrame:
        """One row per committed shard (SHARD_COLUMNS)."""

    @abc.abstractmethod
    def samples(self) -> pd.DataFrame:
        """One row per committed sample (SAMPLE_COLUMNS), by shard and position."""

    @abc.abstractmethod
    def quarantined(self) -> pd.DataFrame:
        """One row per quarantined source row (QUARANTINE_COLUMNS)."""

    @abc.abstractmethod
    def sample_index(self) -> list[tuple]:
        """(sample_id, shard, token_offset, num_tokens, num_loss_tokens,
        source_row, checksum) per sample, by shard and position: what a
        reader needs."""


SCHEMA = """
CREATE TABLE IF NOT EXISTS shards(
    name TEXT PRIMARY KEY, sha256 TEXT NOT NULL, bytes INTEGER NOT NULL,
    num_samples INTEGER NOT NULL, num_tokens INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS samples(
    sample_id TEXT PRIMARY KEY, source TEXT NOT NULL, source_row INTEGER NOT NULL,
    shard TEXT NOT NULL REFERENCES shards(name), position INTEGER NOT NULL,
    token_offset INTEGER NOT NULL, num_tokens INTEGER NOT NULL,
    num_loss_tokens INTEGER NOT NULL, checksum TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS quarantine(
    source TEXT NOT NULL, source_row INTEGER NOT NULL, sample_id TEXT,
    reason TEXT NOT NULL, attempts INTEGER NOT NULL, at REAL NOT NULL,
    PRIMARY KEY(source, source_row));
CREATE TABLE IF NOT EXISTS crashes(
    sample_id TEXT PRIMARY KEY, count INTEGER NOT NULL, at REAL NOT NULL);
"""


class SqliteLedger(Ledger):
    """`<store>/ledger.sqlite`. One short connection per call, so it can be
    used from many threads. Keep such a store on a local or POSIX
    filesystem (SQLite's locking is unreliable on NFS)."""

    def __init__(self, store: Path):
        self.store = Path(store)
        self.path = self.store / "ledger.sqlite"
        with closing(self._connect()) as db, db:
            db.executescript(SCHEMA)

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

    def commit_shard(self, shard: ShardInfo, rows: list[dict]) -> None:
        try:
            with closing(self._connect()) as db, db:
                db.execute("INSERT INTO shards VALUES (?,?,?,?,?,?)",
                           (shard.name, shard.sha256, shard.bytes, shard.num_samples, shard.num_tokens, time.time()))
                db.executemany(
                    "INSERT INTO samples VALUES (:sample_id,:source,:source_row,:shard,:position,"
                    ":token_offset,:num_tokens,:num_loss_tokens,:checksum)", rows)
                db.executemany("DELETE FROM quarantine WHERE source=? AND source_row=?",
                               [(r["source"], r["source_row"]) for r in rows])
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
            db.execute("DELETE FROM samples WHERE shard=?", (old,))
            if db.execute("DELETE FROM shards WHERE name=?", (old,)).rowcount != 1:
                raise StoreError(f"shard {old} is not committed in {self.path}")
            if new is not None:
                db.execute("INSERT INTO shards VALUES (?,?,?,?,?,?)",
                           (new.name, new.sha256, new.bytes, new.num_samples, new.num_tokens, time.time()))
                db.executemany(
                    "INSERT INTO samples VALUES (:sample_id,:source,:source_row,:shard,:position,"
                    ":token_offset,:num_tokens,:num_loss_tokens,:checksum)", rows)

    def quarantine(self, rows: list[dict]) -> None:
        with closing(self._connect()) as db, db:
            db.executemany(
                "INSERT OR REPLACE INTO quarantine VALUES (:source,:source_row,:sample_id,:reason,:attempts,:at)",
                [{"sample_id": None, "attempts": 0, "at": time.time(), **r} for r in rows])

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
        return self._frame("SELECT * FROM quarantine")

    def sample_index(self) -> list[tuple]:
        return self._rows("SELECT sample_id, shard, token_offset, num_tokens, num_loss_tokens, source_row, "
                          "checksum FROM samples ORDER BY shard, position")


LEDGER_JSON = "ledger.json"


def ledger_record(store: Path) -> dict:
    """What `<store>/ledger.json` says ({"backend": "sqlite"} without one)."""
    path = Path(store) / LEDGER_JSON
    if not path.exists():
        return {"backend": "sqlite"}
    return json.loads(path.read_text())


def open_ledger(store: Path) -> Ledger:
    """The ledger of an existing (or new) store, in the backend it records."""
    store = Path(store)
    record = ledger_record(store)
    if record["backend"] == "sqlite":
        return SqliteLedger(store)
    if record["backend"] == "postgres":
        from tasks.store.ledger_postgres import PostgresLedger, resolve_url

        return PostgresLedger(store, resolve_url(record["url"]), record["schema"])
    raise StoreError(f"{store}/{LEDGER_JSON} names ledger backend {record['backend']!r}; this version knows "
                     f"sqlite and postgres")


def open_store(store: Path, manifest: dict, ledger_url: str | None = None) -> Ledger:
    """Create the store, or check that an existing one was built the same
    way (tasks/store/manifest.py), then return its ledger.

    ledger_url: None keeps the store's backend (SQLite for a new store); a
    postgresql:// URL, or "env" for the one in $EAGLE3_LEDGER_URL, puts a new
    store's index in PostgreSQL (its own schema) and must name the server an
    existing store already uses."""
    store = Path(store)
    existed = (store / "manifest.json").exists()
    create_or_check(store, manifest)
    if ledger_url is not None:
        _choose_postgres(store, ledger_url, existed)
    return open_ledger(store)


def _choose_postgres(store: Path, ledger_url: str, existed: bool) -> None:
    import secrets

    from tasks.store.ledger_postgres import URL_ENV, PostgresLedger, _same_server, describe, public_url

    if ledger_url == "env":
        ledger_url = os.environ.get(URL_ENV) or ""
        if not ledger_url:
            raise StoreError(f"ledger_url is 'env' but ${URL_ENV} is not set: set it to postgresql://user:password@host:port/dbname")
    recorded = ledger_record(store)
    if recorded["backend"] == "postgres":
        if not _same_server(recorded["url"], ledger_url):
            raise StoreError(f"store {store} keeps its ledger at {describe(recorded['url'])}, not "
                             f"{describe(ledger_url)}: use that server, or a new store directory")
        return
    if existed and (store / "ledger.sqlite").exists():
        raise StoreError(f"store {store} already keeps its ledger in SQLite ({store}/ledger.sqlite); a store's "
                         f"index does not move: use a new store directory for a PostgreSQL ledger")
    # The password stays out of the store (see ledger_postgres.py); the schema
    # is random so two stores never share tables, wherever they are mounted.
    record = {"backend": "postgres", "url": public_url(ledger_url), "schema": f"eagle3_{secrets.token_hex(6)}"}
    # Reach the server and make the tables before recording the choice: a
    # wrong URL or a server that is down leaves no ledger.json to undo.
    PostgresLedger(store, ledger_url, record["schema"])
    tmp = store / f".{LEDGER_JSON}.{os.getpid()}.{threading.get_ident()}"
    write_json_atomic(tmp, record)
    try:
        # Created once: of two runs creating the store at once, the first
        # link wins and the other uses its schema (a rename would let the
        # second replace a schema the first is already writing).
        os.link(tmp, store / LEDGER_JSON)
    except FileExistsError:
        _choose_postgres(store, ledger_url, existed)
    finally:
        tmp.unlink()
