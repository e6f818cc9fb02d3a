"""seal(store) exports the index beside the shards; checked with pyarrow and
sqlite3 directly (not tasks.store), on both ledger backends."""
import hashlib
import json
import sqlite3

import pyarrow.parquet as pq
import pytest

from tasks.store.ledger.index import SAMPLE_COLUMNS, SHARD_COLUMNS
from tasks.store.ledger.open import open_store
from tasks.store.lock import LockHeld, hold_lock
from tasks.store.seal import seal
from tasks.store.shards import write_shard
from test_store import MANIFEST, item


@pytest.fixture
def filled(tmp_path, ledger_url):
    store = tmp_path / "s"
    ledger = open_store(store, MANIFEST, ledger_url)
    ledger.commit_shard(*write_shard(store, [item(0, 5), item(1, 3)], source="d"))
    ledger.commit_shard(*write_shard(store, [item(2, 7)], source="d"))
    ledger.quarantine([{"source": "d", "source_row": 7, "reason": "no capture", "attempts": 3}])
    return store, ledger


def test_seal_exports_the_index_as_parquet_and_sqlite(filled, index_db):
    store, ledger = filled
    record = seal(store)
    out = store / "index"
    with index_db(store) as db:  # the live index, through its own driver
        samples = db.execute(f"SELECT {','.join(SAMPLE_COLUMNS)} FROM samples ORDER BY sample_id").fetchall()
        shards = db.execute(f"SELECT {','.join(SHARD_COLUMNS)} FROM shards ORDER BY name").fetchall()
    by_id = lambda rows: sorted(rows)  # noqa: E731
    table = pq.read_table(out / "samples.parquet")
    assert table.column_names == SAMPLE_COLUMNS
    assert by_id([tuple(r.values()) for r in table.to_pylist()]) == by_id(samples)
    assert sorted(tuple(r.values()) for r in pq.read_table(out / "shards.parquet").to_pylist()) == sorted(shards)
    q = pq.read_table(out / "quarantine.parquet").to_pylist()
    assert [(r["source_row"], r["reason"], r["attempts"], r["sample_id"]) for r in q] == [(7, "no capture", 3, None)]
    lite = sqlite3.connect(out / "ledger.sqlite")
    assert sorted(lite.execute(f"SELECT {','.join(SAMPLE_COLUMNS)} FROM samples").fetchall()) == sorted(samples)
    assert sorted(lite.execute(f"SELECT {','.join(SHARD_COLUMNS)} FROM shards").fetchall()) == sorted(shards)
    # The ledger's schema keys a row's own record by '' (parquet: null).
    assert lite.execute("SELECT source_row, sample_id FROM quarantine").fetchall() == [(7, "")]
    lite.close()
    sealed = json.loads((out / "sealed.json").read_text())
    assert sealed == json.loads(json.dumps(record))
    assert sealed["summary"]["samples"] == 3 and sealed["summary"]["quarantined"] == 1
    for name, sha in sealed["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == sha
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


def test_sealing_again_follows_the_ledger(filled):
    store, ledger = filled
    seal(store)
    ledger.commit_shard(*write_shard(store, [item(3, 2)], source="d"))
    seal(store)
    assert pq.read_table(store / "index" / "samples.parquet").num_rows == 4
    lite = sqlite3.connect(store / "index" / "ledger.sqlite")
    assert lite.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 4
    lite.close()


def test_a_store_held_by_a_run_is_not_sealed(filled):
    """A run holding the store may commit between the tables' reads: no
    snapshot then, and nothing written."""
    store, _ = filled
    with hold_lock(store, "a run"):
        import threading

        errors = []
        t = threading.Thread(target=lambda: errors.append(_try_seal(store)))
        t.start()
        t.join()
    assert isinstance(errors[0], LockHeld) and not (store / "index").exists()


def _try_seal(store):
    try:
        seal(store)
    except Exception as e:  # noqa: BLE001 - returned to the test
        return e
