"""Opening a store's ledger in the backend `<store>/ledger.json` records:
SQLite (`<store>/ledger.sqlite`, the default, and what a store without
ledger.json has) or PostgreSQL; and choosing the backend when a store is
created.
"""
from __future__ import annotations

import json
import secrets
from pathlib import Path

from tasks.store.ledger.index import Ledger
from tasks.store.ledger.postgres import PostgresLedger, describe, public_url, resolve_url, same_server, url_from_env
from tasks.store.ledger.sqlite import SqliteLedger
from tasks.store.manifest import StoreError, create_or_check, write_json_once

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
        return PostgresLedger(store, resolve_url(record["url"]), record["schema"], create=False)
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
    if ledger_url is not None:
        # Before the manifest: whoever sees a new store's manifest finds its
        # ledger.json too (a reader of a growing store would otherwise take
        # it for a SQLite one, and wait on an empty index for good).
        store.mkdir(parents=True, exist_ok=True)
        choose_postgres(store, ledger_url, existed)
    create_or_check(store, manifest)
    return open_ledger(store)


def choose_postgres(store: Path, ledger_url: str, existed: bool) -> None:
    """Record that the store's index is in PostgreSQL at ledger_url ("env":
    $EAGLE3_LEDGER_URL), or check that the server it records is that one.
    existed: the store had a manifest before this run; its index, if any,
    stays where it is."""
    ledger_url = url_from_env(ledger_url, "ledger_url")
    recorded = ledger_record(store)
    if recorded["backend"] == "postgres":
        if not same_server(recorded["url"], ledger_url):
            raise StoreError(f"store {store} keeps its ledger at {describe(recorded['url'])}, not "
                             f"{describe(ledger_url)}: use that server, or a new store directory")
        return
    if existed and (store / "ledger.sqlite").exists():
        raise StoreError(f"store {store} already keeps its ledger in SQLite ({store}/ledger.sqlite); a store's "
                         f"index does not move: use a new store directory for a PostgreSQL ledger")
    # The password stays out of the store (see postgres.py); the schema
    # is random so two stores never share tables, wherever they are mounted.
    record = {"backend": "postgres", "url": public_url(ledger_url), "schema": f"eagle3_{secrets.token_hex(6)}"}
    # Reach the server and make the tables before recording the choice: a
    # wrong URL or a server that is down leaves no ledger.json to undo.
    PostgresLedger(store, ledger_url, record["schema"])
    # Of two runs creating the store at once, the other uses the first's schema.
    if not write_json_once(store / LEDGER_JSON, record):
        choose_postgres(store, ledger_url, existed)
