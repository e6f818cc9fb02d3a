"""Where an answers directory keeps its index: SQLite in the directory (one
machine, the default) or PostgreSQL (answers written from many nodes at
once; SQLite must not sit on NFS), as a capture store's ledger chooses
(tasks/store/ledger/open.py).

    <out>/index.sqlite   the SQLite index, or
    <out>/index.json     {"backend": "postgres", "url": the URL without its
                         password, "schema": the answers' own schema}

The password never reaches the directory: it comes from $EAGLE3_LEDGER_URL,
PGPASSWORD or ~/.pgpass (tasks/store/ledger/postgres.py). Both backends
take the same statements (answer_store.py's), written with `?` marks.
"""
from __future__ import annotations

import json
import re
import secrets
import sqlite3
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Iterator

from tasks.store.ledger.postgres import URL_ENV, describe, public_url, resolve_url, same_server, url_from_env
from tasks.store.manifest import StoreError, write_json_once

SQLITE = "index.sqlite"
RECORD = "index.json"


class Index:
    """One backend: short connections, one per call (safe from the threads
    Prefect runs batch tasks in, and from a process that forks or dies)."""

    @contextmanager
    def transaction(self) -> Iterator:
        """A cursor: its statements committed together on success."""
        raise NotImplementedError

    def rows(self, sql: str, args=()) -> list[tuple]:
        with self.transaction() as db:
            db.execute(sql, args)
            return db.fetchall()

    def is_duplicate(self, error: Exception) -> bool:
        """`error` is a unique key taken by another writer's commit."""
        raise NotImplementedError

    def hold_sweeps(self, db) -> None:
        """At the start of a commit's transaction: a sweep of unindexed
        files (answer_store.py remove_unindexed) waits for this commit to
        end, or this commit sees the sweep."""
        raise NotImplementedError


class SqliteIndex(Index):
    def __init__(self, root: Path):
        self.path = Path(root) / SQLITE

    @contextmanager
    def transaction(self):
        with closing(sqlite3.connect(self.path, timeout=120)) as db, db:
            yield db.cursor()

    def is_duplicate(self, error: Exception) -> bool:
        return isinstance(error, sqlite3.IntegrityError)

    def hold_sweeps(self, db) -> None:
        # The write lock at once (sqlite3 would begin only at the first write).
        db.execute("BEGIN IMMEDIATE")


class PostgresIndex(Index):
    def __init__(self, root: Path, url: str, schema: str):
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", schema):
            raise StoreError(f"answers index schema {schema!r} in {root}/{RECORD} is not a plain lower-case "
                             f"identifier; fix {RECORD}")
        self.root, self.url, self.schema = Path(root), url, schema
        self.where = f"PostgreSQL {describe(url)}, schema {schema}"

    def _connect(self, search_path: bool = True):
        import psycopg

        try:
            return psycopg.connect(self.url, connect_timeout=30, application_name="eagle3-answers",
                                   options=f"-c search_path={self.schema}" if search_path else "")
        except psycopg.OperationalError as e:
            raise StoreError(f"cannot reach the answers index of {self.root} at {describe(self.url)}: "
                             f"{str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}. Start "
                             f"the server or fix the URL (${URL_ENV}, or {self.root}/{RECORD}; the password comes "
                             f"from ${URL_ENV}, PGPASSWORD or ~/.pgpass)") from None

    @contextmanager
    def transaction(self):
        with self._connect() as db, db.cursor() as cur:
            yield _Marks(cur)

    def create(self, ddl: str) -> None:
        """The schema and its tables, made once."""
        from psycopg import sql

        with self._connect(search_path=False) as db:
            # Two processes creating it at once would race on the catalogue.
            db.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (self.schema,))
            db.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema)))
            db.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(self.schema)))
            for statement in filter(str.strip, ddl.split(";")):
                db.execute(statement)

    def exists(self, table: str = "shards") -> bool:
        with self._connect(search_path=False) as db:
            return db.execute("SELECT to_regclass(%s) IS NOT NULL", (f"{self.schema}.{table}",)).fetchone()[0]

    def is_duplicate(self, error: Exception) -> bool:
        import psycopg

        return isinstance(error, psycopg.errors.UniqueViolation)

    def hold_sweeps(self, db) -> None:
        # Commits share it; a sweep's INSERT (ROW EXCLUSIVE) waits for them all.
        db.execute("LOCK TABLE sweeps IN SHARE MODE")


class _Marks:
    """A psycopg cursor that takes sqlite3's `?` marks."""

    def __init__(self, cur):
        self.cur = cur

    def execute(self, sql: str, args=()):
        return self.cur.execute(sql.replace("?", "%s"), args)

    def executemany(self, sql: str, args):
        return self.cur.executemany(sql.replace("?", "%s"), list(args))

    def fetchall(self) -> list[tuple]:
        return self.cur.fetchall()


def has_index(root: Path) -> bool:
    return (Path(root) / SQLITE).is_file() or (Path(root) / RECORD).is_file()


def open_index(root: Path, ddl: str, index_url: str | None = None, *, new: bool) -> Index:
    """The index of answers directory `root`, its tables (`ddl`) made if
    `new` may make them. index_url, for a new directory: None = SQLite, a
    postgresql:// URL or "env" (the one in $EAGLE3_LEDGER_URL) = PostgreSQL;
    for an existing one, it must name the server it records."""
    root = Path(root)
    record_path = root / RECORD
    if index_url is not None:
        index_url = url_from_env(index_url, "regenerate.index_url")
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        if index_url and not same_server(record["url"], index_url):
            raise StoreError(f"the answers in {root} keep their index at {describe(record['url'])}, not "
                             f"{describe(index_url)}: use that server, or another regenerate.out")
        index = PostgresIndex(root, resolve_url(record["url"]), record["schema"])
        if not index.exists():
            raise StoreError(f"the answers index of {root} ({index.where}) is gone: its schema was dropped, or the "
                             f"URL names another database; point ${URL_ENV} at the one it was made on")
        if not index.exists("sweeps"):  # made before sweeps fenced commits (the DDL is IF NOT EXISTS)
            index.create(ddl)
        return index
    if (root / SQLITE).is_file() or (new and index_url is None):
        if index_url is not None:
            raise StoreError(f"the answers in {root} keep their index in SQLite ({root}/{SQLITE}); an index does "
                             f"not move: give another regenerate.out for a PostgreSQL one")
        index = SqliteIndex(root)
        with closing(sqlite3.connect(index.path, timeout=120)) as db, db:
            db.executescript(ddl)
        return index
    if not new:
        raise FileNotFoundError(f"{root} holds no regenerated answers (no {SQLITE} or {RECORD})")
    # Made before the record: a wrong URL or a server that is down leaves no
    # index.json to undo. Of two runs creating it at once, the first's wins.
    index = PostgresIndex(root, index_url, f"eagle3_answers_{secrets.token_hex(6)}")
    index.create(ddl)
    if not write_json_once(record_path, {"backend": "postgres", "url": public_url(index_url), "schema": index.schema}):
        return open_index(root, ddl, index_url, new=False)
    return index
