"""The ledger in PostgreSQL: for a store many machines write at once (SQLite
must not sit on NFS). Same tables and semantics as sqlite.py's
`SqliteLedger`; each store has its own schema, so several stores can share
one database.

What the store records (`<store>/ledger.json`): the backend, the URL without
its password, and the schema. The password is never written into the store:
it comes from `EAGLE3_LEDGER_URL` (a full URL, used when set) or from libpq's
own PGPASSWORD / ~/.pgpass, so a store directory can be copied or shared
without leaking it.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Sequence

import pandas as pd

from tasks.store.ledger.index import CANARY_COLUMNS, QUARANTINE_COLUMNS, SAMPLE_COLUMNS, SHARD_COLUMNS, Ledger
from tasks.store.manifest import StoreError
from tasks.store.shards import ShardInfo

URL_ENV = "EAGLE3_LEDGER_URL"

SCHEMA = """
CREATE TABLE IF NOT EXISTS shards(
    name TEXT PRIMARY KEY, sha256 TEXT NOT NULL, bytes BIGINT NOT NULL,
    num_samples BIGINT NOT NULL, num_tokens BIGINT NOT NULL, created DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS samples(
    sample_id TEXT PRIMARY KEY, source TEXT NOT NULL, source_row BIGINT NOT NULL,
    shard TEXT NOT NULL REFERENCES shards(name), position BIGINT NOT NULL,
    token_offset BIGINT NOT NULL, num_tokens BIGINT NOT NULL,
    num_loss_tokens BIGINT NOT NULL, checksum TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS quarantine(
    source TEXT NOT NULL, source_row BIGINT NOT NULL, sample_id TEXT NOT NULL DEFAULT '',
    reason TEXT NOT NULL, attempts BIGINT NOT NULL, at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY(source, source_row, sample_id));
CREATE TABLE IF NOT EXISTS crashes(
    sample_id TEXT PRIMARY KEY, count BIGINT NOT NULL, at DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS retired(sample_id TEXT PRIMARY KEY);
CREATE INDEX IF NOT EXISTS samples_by_shard ON samples(shard, position);
CREATE TABLE IF NOT EXISTS stream_parts(
    seq BIGINT PRIMARY KEY, epoch BIGINT NOT NULL, into_store TEXT NOT NULL, rows TEXT NOT NULL,
    need BIGINT NOT NULL, tokens BIGINT NOT NULL, taken BIGINT NOT NULL, of BIGINT NOT NULL,
    state TEXT NOT NULL, node TEXT, lease BIGINT, leased_until DOUBLE PRECISION,
    failures BIGINT NOT NULL DEFAULT 0, error TEXT, done_at DOUBLE PRECISION);
CREATE INDEX IF NOT EXISTS stream_parts_open ON stream_parts(seq) WHERE state <> 'done';
CREATE SEQUENCE IF NOT EXISTS stream_part_leases;
CREATE TABLE IF NOT EXISTS canaries(
    shard TEXT NOT NULL REFERENCES shards(name), sample_id TEXT PRIMARY KEY REFERENCES samples(sample_id),
    positions BIGINT NOT NULL, worst_deviation DOUBLE PRECISION NOT NULL, worst_ratio DOUBLE PRECISION NOT NULL,
    profile TEXT NOT NULL, profile_outlier TEXT NOT NULL, at DOUBLE PRECISION NOT NULL);
"""

# The quarantine of a store made when a row gave one sample (its key the row):
# kept, each record under its sample (or the row's, '').
QUARANTINE_BY_SAMPLE = """
ALTER TABLE quarantine DROP CONSTRAINT quarantine_pkey;
UPDATE quarantine SET sample_id = '' WHERE sample_id IS NULL;
ALTER TABLE quarantine ALTER COLUMN sample_id SET DEFAULT '', ALTER COLUMN sample_id SET NOT NULL;
ALTER TABLE quarantine ADD PRIMARY KEY (source, source_row, sample_id)
"""
INSERT_SHARD = "INSERT INTO shards VALUES (%s,%s,%s,%s,%s,%s)"
INSERT_SAMPLE = ("INSERT INTO samples VALUES (%(sample_id)s,%(source)s,%(source_row)s,%(shard)s,%(position)s,"
                 "%(token_offset)s,%(num_tokens)s,%(num_loss_tokens)s,%(checksum)s)")
INSERT_CANARY = ("INSERT INTO canaries VALUES (%(shard)s,%(sample_id)s,%(positions)s,%(worst_deviation)s,"
                 "%(worst_ratio)s,%(profile)s,%(profile_outlier)s,%(at)s)")


def public_url(url: str) -> str:
    """The URL without its password, as libpq key=value pairs: what may be
    written into the store or a log."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        parts = conninfo_to_dict(url)
    except Exception as e:  # noqa: BLE001 - psycopg's message may quote the URL; do not echo it
        raise StoreError(f"the ledger URL is not a valid PostgreSQL URL ({type(e).__name__}); expected "
                         f"postgresql://user@host:port/dbname") from None
    parts.pop("password", None)
    return make_conninfo(**parts)


def has_password(url: str) -> bool:
    """Whether the URL carries a password, in any form libpq reads (a URI's
    user:pass@ or ?password=, a conninfo's password=...)."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        return "password" in conninfo_to_dict(url)
    except Exception:  # noqa: BLE001 - not one libpq reads: judged by its text
        return "password" in url or re.search(r"://[^/@:]*:[^@/]*@", url) is not None


def describe(url: str) -> str:
    """host:port/dbname (user): names the server in messages, never the password."""
    from psycopg.conninfo import conninfo_to_dict

    p = conninfo_to_dict(url)
    return f"{p.get('host', 'localhost')}:{p.get('port', 5432)}/{p.get('dbname', '?')} (user {p.get('user', '?')})"


def same_server(a: str, b: str) -> bool:
    """Both URLs name the same host, port, database and user (passwords aside)."""
    from psycopg.conninfo import conninfo_to_dict

    keys = ("host", "port", "dbname", "user")
    pa, pb = conninfo_to_dict(a), conninfo_to_dict(b)
    return all(str(pa.get(k) or "") == str(pb.get(k) or "") for k in keys)


def url_from_env(url: str, setting: str) -> str:
    """`url` as given, or for "env" the one in $EAGLE3_LEDGER_URL (with its
    password), which must then be set; `setting` names it in the error."""
    if url != "env":
        return url
    if not os.environ.get(URL_ENV):
        raise StoreError(f"{setting} is 'env' but ${URL_ENV} is not set: set it to "
                         f"postgresql://user:password@host:port/dbname")
    return os.environ[URL_ENV]


def resolve_url(recorded: str) -> str:
    """The URL to connect with: EAGLE3_LEDGER_URL when set (it may carry the
    password), else the recorded one (libpq then reads PGPASSWORD or
    ~/.pgpass). The environment must name the recorded server and database:
    a store's index must never be read from, or written to, another one."""
    env = os.environ.get(URL_ENV)
    if not env:
        return recorded
    if not same_server(env, recorded):
        raise StoreError(f"${URL_ENV} names {describe(env)}, but this store's ledger is at {describe(recorded)}: "
                         f"unset ${URL_ENV} or point it at that server")
    return env


class PostgresLedger(Ledger):
    """One short connection per call (as `SqliteLedger`): a psycopg
    connection is never shared between threads, and a process that forks or
    dies holds nothing open. Connecting to a local server costs a few ms,
    small next to writing a shard."""

    def __init__(self, store: Path, url: str, schema: str, create: bool = True):
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", schema):
            raise StoreError(f"ledger schema {schema!r} in {store}/ledger.json is not a plain lower-case "
                             f"identifier; fix ledger.json")
        self.store, self.url, self.schema = Path(store), url, schema
        self.where = f"PostgreSQL {describe(url)}, schema {schema}"
        from psycopg import sql

        with self._connect(search_path=False) as db:
            # Made already (the canaries table is created last): skip the DDL, since
            # CREATE INDEX IF NOT EXISTS takes a lock that waits for, and
            # holds up, commits in flight.
            if db.execute("SELECT to_regclass(%s) IS NOT NULL", (f"{schema}.canaries",)).fetchone()[0]:
                self._quarantine_by_sample(db)
                return
            if not create:  # an existing store: an empty index made now would say "nothing stored"
                raise StoreError(f"the index of {store} ({self.where}) is gone: its schema was dropped, or the URL "
                                 f"names another database than the one the store was made on; point "
                                 f"${URL_ENV} at that database (the store's files are kept)")
            # Two processes creating the same schema at once would race on
            # the catalogue; a transaction-scoped advisory lock serialises them.
            db.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (schema,))
            db.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
            db.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(schema)))
            for statement in filter(str.strip, SCHEMA.split(";")):
                db.execute(statement)

    def _quarantine_by_sample(self, db) -> None:
        """A store's quarantine keyed by its row (made when a row gave one
        sample) keyed by sample, once, under the schema's lock."""
        keyed = ("SELECT COALESCE(array_length(indkey::int[], 1), 0) FROM pg_index "
                 "WHERE indrelid = to_regclass(%s) AND indisprimary")
        where = f"{self.schema}.quarantine"
        if db.execute(keyed, (where,)).fetchone()[0] != 2:
            return
        from psycopg import sql

        db.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (self.schema,))
        if db.execute(keyed, (where,)).fetchone()[0] == 2:  # not done meanwhile by another process
            db.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(self.schema)))
            for statement in filter(str.strip, QUARANTINE_BY_SAMPLE.split(";")):
                db.execute(statement)

    def _connect(self, search_path: bool = True):
        """A connection used as a context manager: one transaction, committed
        on success, rolled back on an error, then closed."""
        import psycopg

        options = f"-c search_path={self.schema}" if search_path else ""
        try:
            return psycopg.connect(self.url, connect_timeout=30, options=options,
                                   application_name="eagle3-ledger")
        except psycopg.OperationalError as e:
            raise StoreError(f"cannot reach the ledger of {self.store} at {describe(self.url)}: "
                             f"{str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}. "
                             f"Start the server or fix the URL (${URL_ENV}, or {self.store}/ledger.json; "
                             f"the password comes from ${URL_ENV}, PGPASSWORD or ~/.pgpass)") from None

    def drop(self) -> None:
        with self._connect(search_path=False) as db:
            from psycopg import sql

            db.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema)))

    def transaction(self):
        """A connection in this store's schema, used as a context manager:
        one transaction, committed on success, rolled back on an error. For
        the tables beside the index (the stream capture's part queue,
        tasks/stream/parts.py), whose statements are their module's."""
        return self._connect()

    def query(self, query: str, args=()) -> list[tuple]:
        """The rows of one read-only statement in this store's schema."""
        return self._rows(query, args)

    def _rows(self, query: str, args=()) -> list[tuple]:
        with self._connect() as db:
            return db.execute(query, args).fetchall()

    def _frame(self, query: str, columns: list[str]) -> pd.DataFrame:
        return pd.DataFrame(self._rows(query), columns=columns)

    def stored_ids(self) -> set[str]:
        return {r[0] for r in self._rows("SELECT sample_id FROM samples")}

    def commit_shard(self, shard: ShardInfo, rows: list[dict], canaries: list[dict] = ()) -> None:
        import psycopg

        try:
            with self._connect() as db, db.cursor() as cur:
                cur.execute(INSERT_SHARD, (shard.name, shard.sha256, shard.bytes, shard.num_samples,
                                           shard.num_tokens, time.time()))
                cur.executemany(INSERT_SAMPLE, rows)
                # Its own record, and its row's (a row that gave none before).
                cur.executemany("DELETE FROM quarantine WHERE source=%s AND source_row=%s AND sample_id IN (%s, '')",
                                [(r["source"], r["source_row"], r["sample_id"]) for r in rows])
                cur.executemany(INSERT_CANARY, [{"at": time.time(), **c} for c in canaries])
        except psycopg.errors.UniqueViolation as e:
            # Plain INSERTs: what is committed stays as committed, and the
            # whole transaction (shard row included) is rolled back.
            detail = (e.diag.message_detail or str(e)).strip()
            raise StoreError(f"cannot commit shard {shard.name} to {self.where}: {detail} (already committed; "
                             f"a committed shard or sample is never replaced; is another run writing "
                             f"this store?)") from None

    def replace_shard(self, old: str, new: ShardInfo | None, rows: list[dict]) -> None:
        with self._connect() as db, db.cursor() as cur:
            kept = [r["sample_id"] for r in rows] if new is not None else []
            cur.execute("SELECT * FROM canaries WHERE shard=%s AND sample_id = ANY(%s)", (old, kept))
            moved = [dict(zip(CANARY_COLUMNS, c)) | {"shard": new.name} for c in cur.fetchall()]
            cur.execute("DELETE FROM canaries WHERE shard=%s", (old,))
            cur.execute("DELETE FROM samples WHERE shard=%s", (old,))
            cur.execute("DELETE FROM shards WHERE name=%s", (old,))
            if cur.rowcount != 1:
                raise StoreError(f"shard {old} is not committed in {self.where}")
            if new is not None:
                cur.execute(INSERT_SHARD, (new.name, new.sha256, new.bytes, new.num_samples, new.num_tokens,
                                           time.time()))
                cur.executemany(INSERT_SAMPLE, rows)
                cur.executemany(INSERT_CANARY, moved)

    def retire_shard(self, name: str) -> None:
        with self._connect() as db, db.cursor() as cur:
            cur.execute("INSERT INTO retired SELECT sample_id FROM samples WHERE shard=%s ON CONFLICT DO NOTHING",
                        (name,))
            cur.execute("DELETE FROM canaries WHERE shard=%s", (name,))
            cur.execute("DELETE FROM samples WHERE shard=%s", (name,))
            cur.execute("DELETE FROM shards WHERE name=%s", (name,))
            if cur.rowcount != 1:
                raise StoreError(f"shard {name} is not committed in {self.where}")

    def retired_ids(self) -> set[str]:
        return {r[0] for r in self._rows("SELECT sample_id FROM retired")}

    def captured_among(self, sample_ids: Sequence[str]) -> set[str]:
        ids = list(sample_ids)
        return {r[0] for r in self._rows("SELECT sample_id FROM samples WHERE sample_id = ANY(%s) UNION "
                                         "SELECT sample_id FROM retired WHERE sample_id = ANY(%s)", (ids, ids))}

    def forget_retired(self) -> None:
        with self._connect() as db:
            db.execute("DELETE FROM retired")

    def quarantine(self, rows: list[dict]) -> None:
        # As SQLite's INSERT OR REPLACE: a sample's (or a row's) latest failure wins.
        with self._connect() as db, db.cursor() as cur:
            cur.executemany(
                "INSERT INTO quarantine VALUES (%(source)s,%(source_row)s,%(sample_id)s,%(reason)s,%(attempts)s,"
                "%(at)s) ON CONFLICT (source, source_row, sample_id) DO UPDATE SET "
                "reason=EXCLUDED.reason, attempts=EXCLUDED.attempts, at=EXCLUDED.at",
                [{"attempts": 0, "at": time.time(), **r, "sample_id": r.get("sample_id") or ""} for r in rows])

    def record_crash(self, sample_ids: list[str]) -> dict[str, int]:
        with self._connect() as db, db.cursor() as cur:
            cur.executemany("INSERT INTO crashes VALUES (%s, 1, %s) ON CONFLICT (sample_id) DO UPDATE SET "
                            "count = crashes.count + 1, at = EXCLUDED.at", [(i, time.time()) for i in sample_ids])
            cur.execute("SELECT sample_id, count FROM crashes WHERE sample_id = ANY(%s)", (list(sample_ids),))
            return dict(cur.fetchall())

    def crash_counts(self) -> dict[str, int]:
        return dict(self._rows("SELECT sample_id, count FROM crashes"))

    def summary(self) -> dict:
        # One snapshot: the three counts come from the same transaction.
        with self._connect() as db:
            db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            samples, tokens, loss = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(num_tokens),0)::bigint, COALESCE(SUM(num_loss_tokens),0)::bigint "
                "FROM samples").fetchone()
            shards, nbytes, newest = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(bytes),0)::bigint, MAX(created) FROM shards").fetchone()
            quarantined = db.execute("SELECT COUNT(*) FROM quarantine").fetchone()[0]
        return {"samples": samples, "tokens": tokens, "loss_tokens": loss, "shards": shards,
                "bytes": nbytes, "quarantined": quarantined, "newest_shard": newest}

    def shards(self) -> pd.DataFrame:
        return self._frame("SELECT * FROM shards", SHARD_COLUMNS)

    def samples(self) -> pd.DataFrame:
        return self._frame("SELECT * FROM samples ORDER BY shard COLLATE \"C\", position", SAMPLE_COLUMNS)

    def quarantined(self) -> pd.DataFrame:
        return self._frame("SELECT source, source_row, NULLIF(sample_id, '') AS sample_id, reason, attempts, at "
                           "FROM quarantine", QUARANTINE_COLUMNS)

    def canaries(self, latest: int | None = None) -> pd.DataFrame:
        if latest is None:
            return self._frame("SELECT * FROM canaries ORDER BY at, sample_id", CANARY_COLUMNS)
        return self._frame(f"SELECT * FROM (SELECT * FROM canaries ORDER BY at DESC, sample_id DESC "
                           f"LIMIT {int(latest)}) AS c ORDER BY at, sample_id", CANARY_COLUMNS)

    def sample_index(self) -> list[tuple]:
        return self._rows("SELECT sample_id, shard, token_offset, num_tokens, num_loss_tokens, source_row, "
                          "checksum FROM samples ORDER BY shard COLLATE \"C\", position")

    def shard_index(self, sample_id: str) -> list[tuple]:
        return self._rows("SELECT sample_id, shard, token_offset, num_tokens, num_loss_tokens, source_row, checksum "
                          "FROM samples WHERE shard = (SELECT shard FROM samples WHERE sample_id = %s) "
                          "ORDER BY position", (sample_id,))
