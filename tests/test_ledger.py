"""The ledger's contract on both backends (SQLite, and PostgreSQL on the
session's private server): one transaction per commit, conflicts are errors,
many threads and processes commit each shard exactly once; a Postgres store
keeps no password and works for the reader and verification."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import psycopg
import pytest

from tasks.store.ledger.open import open_ledger, open_store
from tasks.store.manifest import StoreError
from tasks.store.reader import StoreReader
from tasks.store.shards import write_shard
from tasks.store.verification import verify_store
from test_store import MANIFEST, item

ROOT = Path(__file__).resolve().parent.parent


def test_interface_round_trip(tmp_path, ledger_url, index_db):
    store = tmp_path / "s"
    ledger = open_store(store, MANIFEST, ledger_url)
    assert ledger.summary() == {"samples": 0, "tokens": 0, "loss_tokens": 0, "shards": 0, "bytes": 0,
                                "quarantined": 0, "newest_shard": None}
    ledger.quarantine([{"source": "d", "source_row": 1, "reason": "first"},
                       {"source": "d", "source_row": 9, "reason": "other"}])
    ledger.quarantine([{"source": "d", "source_row": 1, "reason": "second", "attempts": 3}])  # latest wins
    q = ledger.quarantined().set_index("source_row")
    assert q.loc[1, "reason"] == "second" and q.loc[1, "attempts"] == 3 and len(q) == 2
    a, rows_a = write_shard(store, [item(0, 5), item(1, 3)], source="d")
    b, rows_b = write_shard(store, [item(2, 4)], source="d")
    ledger.commit_shard(b, rows_b)
    canaries = [canary_row(a.name, "s000", 0.1), canary_row(a.name, "s001", 0.7)]
    ledger.commit_shard(a, rows_a, canaries)  # the commit clears its rows' quarantine
    assert set(ledger.quarantined().source_row) == {9}
    s = ledger.summary()
    assert (s["samples"], s["tokens"], s["shards"], s["bytes"]) == (3, 12, 2, a.bytes + b.bytes)
    assert s["loss_tokens"] == sum(r["num_loss_tokens"] for r in rows_a + rows_b)
    assert ledger.stored_ids() == {"s000", "s001", "s002"}
    expect = sorted(rows_a + rows_b, key=lambda r: (r["shard"], r["position"]))
    assert ledger.sample_index() == [(r["sample_id"], r["shard"], r["token_offset"], r["num_tokens"],
                                      r["num_loss_tokens"], r["source_row"], r["checksum"]) for r in expect]
    assert ledger.samples().to_dict("records") == expect
    # One shard's rows by any of its samples (a stream reader's lookup), nothing for one not stored.
    assert ledger.shard_index("s001") == ledger.shard_index("s000") == [
        row for row in ledger.sample_index() if row[1] == a.name]
    assert [row[0] for row in ledger.shard_index("s000")] == ["s000", "s001"]  # in position order
    assert ledger.shard_index("s999") == []
    assert ledger.has_shard(a.name) and not ledger.has_shard("shard-none")
    assert ledger.canaries().drop(columns="at").to_dict("records") == canaries
    assert ledger.canaries(latest=1).drop(columns="at").to_dict("records") == canaries[1:]  # the newest only (ties: by sample id)
    # Pruning s000 away: s001's canary follows it to the new shard, s000's goes.
    kept, rows_kept = write_shard(store, [item(1, 3)], source="d")
    ledger.replace_shard(a.name, kept, rows_kept)
    assert ledger.canaries().drop(columns="at").to_dict("records") == [canary_row(kept.name, "s001", 0.7)]
    ledger.replace_shard(kept.name, None, [])
    assert ledger.stored_ids() == {"s002"} and not ledger.has_shard(kept.name) and ledger.canaries().empty
    with pytest.raises(StoreError, match="not committed"):
        ledger.replace_shard(a.name, None, [])
    # What the database itself holds, read with its own driver.
    with index_db(store) as db:
        assert db.execute("SELECT sample_id, shard FROM samples").fetchall() == [("s002", b.name)]


def canary_row(shard, sample_id, ratio):
    return {"shard": shard, "sample_id": sample_id, "positions": 8, "worst_deviation": ratio / 10,
            "worst_ratio": ratio, "profile": "1.5,2.5", "profile_outlier": ""}


def test_crash_counts_add_up_across_opens(tmp_path, ledger_url, index_db):
    store = tmp_path / "s"
    ledger = open_store(store, MANIFEST, ledger_url)
    assert ledger.crash_counts() == {}
    assert ledger.record_crash(["a", "b"]) == {"a": 1, "b": 1}
    assert open_ledger(store).record_crash(["b"]) == {"b": 2}  # a rerun's ledger sees the first run's crashes
    assert open_ledger(store).crash_counts() == {"a": 1, "b": 2}
    with index_db(store) as db:
        assert sorted(db.execute("SELECT sample_id, count FROM crashes").fetchall()) == [("a", 1), ("b", 2)]


def test_a_duplicate_sample_in_a_second_commit_is_refused_and_nothing_of_it_lands(tmp_path, ledger_url, index_db):
    store = tmp_path / "s"
    ledger = open_store(store, MANIFEST, ledger_url)
    ledger.commit_shard(*write_shard(store, [item(0, 5), item(1, 3)], source="d"))
    ledger.quarantine([{"source": "d", "source_row": 2, "reason": "earlier failure"}])
    before = (ledger.summary(), ledger.samples(), ledger.shards())
    # s002 is new, s001 is already committed (in another shard).
    shard, rows = write_shard(store, [item(2, 4), item(1, 3)], source="d")
    with pytest.raises(StoreError, match=r"cannot commit shard .*s001.*never replaced"):
        ledger.commit_shard(shard, rows)
    assert ledger.summary() == before[0]
    assert ledger.samples().equals(before[1]) and ledger.shards().equals(before[2])
    assert not ledger.has_shard(shard.name) and "s002" not in ledger.stored_ids()
    assert list(ledger.quarantined().reason) == ["earlier failure"]  # its DELETE rolled back too
    with index_db(store) as db:
        assert db.execute("SELECT COUNT(*) FROM shards WHERE name=?", (shard.name,)).fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM samples WHERE sample_id='s002'").fetchone()[0] == 0


BATCHES = [[item(k, 2 + k % 5) for k in range(4 * b, 4 * b + 4)] for b in range(6)]

COMMITTER = """
import sys, time
from pathlib import Path
sys.path.insert(0, "tests")
from test_store import item
from tasks.store.ledger.open import open_ledger
from tasks.store.manifest import StoreError
from tasks.store.shards import write_shard
store, go = Path(sys.argv[1]), Path(sys.argv[2])
batches = [[item(k, 2 + k % 5) for k in range(4 * b, 4 * b + 4)] for b in range(6)]
print("ready", flush=True)
while not go.exists():
    time.sleep(0.005)
ok = refused = 0
for batch in reversed(batches):
    try:
        open_ledger(store).commit_shard(*write_shard(store, batch, source="d", workers=1))
        ok += 1
    except StoreError as e:
        assert "never replaced" in str(e), e
        refused += 1
print("result", ok, refused, flush=True)
"""


def test_concurrent_commits_from_threads_and_a_second_process_land_exactly_once(tmp_path, ledger_url, index_db):
    """Four threads and another process each commit all six batches (in
    different orders): each shard and sample lands once, every other try
    is refused as a conflict, and the store verifies."""
    store = tmp_path / "s"
    open_store(store, MANIFEST, ledger_url)
    go = tmp_path / "go"
    other = subprocess.Popen([sys.executable, "-c", COMMITTER, str(store), str(go)], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert other.stdout.readline().strip() == "ready"
    results, errors = [], []
    start = threading.Barrier(4)

    def commit_all(t):
        ledger = open_ledger(store)  # one Ledger shared would be fine too; each call connects anew
        start.wait()
        ok = refused = 0
        for b in range(6):
            batch = BATCHES[(b + t) % 6]
            try:
                ledger.commit_shard(*write_shard(store, batch, source="d", workers=1))
                ok += 1
            except StoreError as e:
                refused += 1
                if "never replaced" not in str(e):
                    errors.append(e)
        results.append((ok, refused))

    threads = [threading.Thread(target=commit_all, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    go.touch()
    for t in threads:
        t.join()
    out, err = other.communicate(timeout=300)
    assert other.returncode == 0, err
    ok, refused = map(int, out.split("result", 1)[1].split())
    results.append((ok, refused))
    assert not errors, errors
    assert sum(r[0] for r in results) == 6 and sum(r[1] for r in results) == 5 * 6 - 6
    with index_db(store) as db:
        n, distinct = db.execute("SELECT COUNT(*), COUNT(DISTINCT sample_id) FROM samples").fetchone()
        assert n == distinct == 24
        assert db.execute("SELECT COUNT(*) FROM shards").fetchone()[0] == 6
    assert verify_store(store, recheck_source=False, write_report=False).ok


def test_a_postgres_store_keeps_no_password_and_reads_and_verifies(tmp_path, postgres_url, monkeypatch):
    from pg_server import PASSWORD

    monkeypatch.setenv("EAGLE3_LEDGER_URL", postgres_url)
    store = tmp_path / "s"
    ledger = open_store(store, MANIFEST, "env")
    items = [item(0, 5), item(1, 3), item(2, 6)]
    ledger.commit_shard(*write_shard(store, items, source="d"))
    assert not (store / "ledger.sqlite").exists()
    for p in store.rglob("*"):
        if p.is_file():
            assert PASSWORD.encode() not in p.read_bytes(), p
    reader = StoreReader(store)
    assert [reader[i]["input_ids"].tolist() for i in range(3)] == [it["input_ids"].tolist() for it in items]
    assert verify_store(store, recheck_source=False, write_report=False).ok
    # Without the password (no env var, no PGPASSWORD) the error names the
    # server, never the password.
    monkeypatch.delenv("EAGLE3_LEDGER_URL")
    monkeypatch.delenv("PGPASSWORD", raising=False)
    with pytest.raises(StoreError, match=r"cannot reach the ledger .* at 127\.0\.0\.1:\d+/eagle3") as e:
        open_ledger(store).summary()
    assert PASSWORD not in str(e.value)


def test_two_stores_share_a_database_but_not_tables(tmp_path, postgres_url, monkeypatch):
    monkeypatch.setenv("EAGLE3_LEDGER_URL", postgres_url)
    one, two = open_store(tmp_path / "a", MANIFEST, postgres_url), open_store(tmp_path / "b", MANIFEST, postgres_url)
    one.commit_shard(*write_shard(tmp_path / "a", [item(0, 5)], source="d"))
    two.commit_shard(*write_shard(tmp_path / "b", [item(0, 5)], source="d"))  # same sample id, another store
    assert one.schema != two.schema and one.stored_ids() == two.stored_ids() == {"s000"}


def test_a_dropped_index_is_refused_not_made_again_empty(tmp_path, postgres_url, monkeypatch):
    """A store whose schema was dropped (a spool's epoch store, trained and
    removed) reads as gone, never as an empty store: a capture would take
    that for nothing stored, a trainer wait on it for good."""
    monkeypatch.setenv("EAGLE3_LEDGER_URL", postgres_url)
    ledger = open_store(tmp_path / "pg", MANIFEST, postgres_url)
    ledger.commit_shard(*write_shard(tmp_path / "pg", [item(0, 5)], source="d"))
    ledger.drop()
    with pytest.raises(StoreError, match=rf"the index of {tmp_path / 'pg'} \(PostgreSQL .*, schema "
                                         rf"{ledger.schema}\) is gone"):
        open_ledger(tmp_path / "pg")
    with psycopg.connect(postgres_url) as db:
        assert db.execute("SELECT to_regclass(%s)", (f"{ledger.schema}.samples",)).fetchone()[0] is None


def test_a_ledger_does_not_move_between_backends_or_servers(tmp_path, postgres_url, monkeypatch):
    monkeypatch.setenv("EAGLE3_LEDGER_URL", postgres_url)
    open_store(tmp_path / "lite", MANIFEST)
    with pytest.raises(StoreError, match="already keeps its ledger in SQLite"):
        open_store(tmp_path / "lite", MANIFEST, postgres_url)
    open_store(tmp_path / "pg", MANIFEST, postgres_url)
    other = postgres_url.replace("/eagle3", "/postgres")
    with pytest.raises(StoreError, match=r"keeps its ledger at .*/eagle3"):
        open_store(tmp_path / "pg", MANIFEST, other)
    monkeypatch.setenv("EAGLE3_LEDGER_URL", other)
    with pytest.raises(StoreError, match=r"EAGLE3_LEDGER_URL names .*/postgres.*ledger is at .*/eagle3"):
        open_ledger(tmp_path / "pg")


def test_many_first_opens_of_a_postgres_ledger_at_once_make_one_schema(tmp_path, postgres_url):
    """Runs starting together on a new store all create its tables: the
    advisory lock serialises them, none fails on the catalogue."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks.store.ledger.postgres import PostgresLedger

    with ThreadPoolExecutor(8) as pool:
        ledgers = list(pool.map(lambda _: PostgresLedger(tmp_path, postgres_url, "eagle3_race"), range(8)))
    assert all(ledger.summary()["samples"] == 0 for ledger in ledgers)


def test_an_unreachable_server_is_named_without_its_password(tmp_path):
    from pg_server import free_port

    port = free_port()  # nothing listens there
    with pytest.raises(StoreError, match=rf"cannot reach the ledger .* at 127\.0\.0\.1:{port}/db \(user u\)") as e:
        open_store(tmp_path / "s", MANIFEST, f"postgresql://u:hunter2@127.0.0.1:{port}/db")
    assert "hunter2" not in str(e.value)
    assert not (tmp_path / "s" / "ledger.json").exists()  # nothing recorded: a rerun may name another server


def test_runs_creating_a_postgres_store_at_once_all_use_one_schema(tmp_path, postgres_url, monkeypatch):
    """ledger.json is linked into place, never renamed over: the first run's
    schema is the store's, and every other run opens that one."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks.store.ledger.open import choose_postgres

    monkeypatch.setenv("EAGLE3_LEDGER_URL", postgres_url)
    store = tmp_path / "s"
    store.mkdir()
    def create_and_open(_):
        choose_postgres(store, postgres_url, existed=False)
        return open_ledger(store).schema  # what this run goes on writing

    with ThreadPoolExecutor(6) as pool:
        schemas = set(pool.map(create_and_open, range(6)))
    assert schemas == {open_ledger(store).schema} and sorted(p.name for p in store.iterdir()) == ["ledger.json"]


def test_each_sample_of_a_row_keeps_its_own_quarantine_record(tmp_path, ledger_url, index_db):
    """A conversation gives several samples (one per group of its turns):
    each failure is recorded under its sample, and a sibling's commit
    clears neither (a record keyed by the row was replaced by the next
    failure and cleared by any commit of the row: a sample neither stored nor
    quarantined); a commit clears its own record and its row's. A store
    whose quarantine was keyed by row is re-keyed when opened, its records
    kept."""
    store = tmp_path / "s"
    ledger = open_store(store, MANIFEST, ledger_url)
    ledger.quarantine([{"source": "d", "source_row": 7, "sample_id": "s101", "reason": "too long"},
                       {"source": "d", "source_row": 7, "sample_id": "s102", "reason": "crashed"},
                       {"source": "d", "source_row": 8, "reason": "not a conversation"}])

    def commit(sample_id: str, row: int) -> None:
        ledger.commit_shard(*write_shard(store, [{**item(0, 5), "sample_id": sample_id, "source_row": row}],
                                         source="d"))

    def records(ledger=ledger) -> set:
        q = ledger.quarantined()
        return {(r, s if isinstance(s, str) else None) for r, s in q[["source_row", "sample_id"]].itertuples(index=False)}

    commit("s100", 7)  # a sibling
    assert records() == {(7, "s101"), (7, "s102"), (8, None)}
    commit("s102", 7)
    assert records() == {(7, "s101"), (8, None)}
    commit("s103", 8)  # the row gives a sample now (the dataset was mended): its own record goes
    assert records() == {(7, "s101")}

    old = tmp_path / "old"
    open_store(old, MANIFEST, ledger_url)
    with index_db(old) as db:
        db.execute("DROP TABLE quarantine")
        db.execute("CREATE TABLE quarantine(source TEXT NOT NULL, source_row BIGINT NOT NULL, sample_id TEXT, "
                   "reason TEXT NOT NULL, attempts BIGINT NOT NULL, at DOUBLE PRECISION NOT NULL, "
                   "PRIMARY KEY(source, source_row))")
        db.execute("INSERT INTO quarantine VALUES ('d', 1, NULL, 'bad row', 0, 0), ('d', 2, 's002', 'failed', 3, 0)")
    ledger = open_ledger(old)
    assert records(ledger) == {(1, None), (2, "s002")}
    ledger.quarantine([{"source": "d", "source_row": 2, "sample_id": "s003", "reason": "its sibling failed"}])
    assert len(ledger.quarantined()) == 3
