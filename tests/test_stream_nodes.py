"""Stream mode across hosts and nodes, each fault injected for real:
trainer processes of the same pid on other hosts each say what they wait
for; capture nodes lease parts from a PostgreSQL part queue that fences off
a killed run's loop, times leases by the database's clock and answers a
poll of a full spool without its lock; and a run across hosts on a SQLite
index is refused before it starts."""
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tasks.stream.state import trainer_waiting

REPO = Path(__file__).resolve().parent.parent


def test_trainer_processes_of_the_same_pid_on_other_hosts_each_say_what_they_wait_for(tmp_path):
    """Ranks on different hosts (or in containers) share pid numbers: two
    trainer processes, each the first process of a pid namespace of its
    own (pid 1 both), wait for different samples at once; the capture sees
    both, not one file the other overwrote."""
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from tasks.stream.state import mark_waiting
        assert os.getpid() == 1
        mark_waiting({str(tmp_path)!r}, sys.argv[1])
        open(sys.argv[2], "w").close()
        time.sleep(60)
    """)
    procs = [subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", script, what,
                               str(tmp_path / f"ready-{k}")]) for k, what in enumerate(("sample a", "sample b"))]
    try:
        while not all((tmp_path / f"ready-{k}").exists() for k in range(2)):
            assert all(p.poll() is None for p in procs)
            time.sleep(0.05)
        assert sorted(w["waiting_for"] for w in trainer_waiting(tmp_path)) == ["sample a", "sample b"]
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture
def part_queue(tmp_path, postgres_url, monkeypatch):
    """A stream capture's part queue in a fresh store's PostgreSQL index:
    three parts planned, none into the spool."""
    from tasks.store.ledger.open import open_store
    from tasks.stream.parts import Part, PartQueue
    from test_store import MANIFEST

    monkeypatch.setenv("EAGLE3_LEDGER_URL", postgres_url)
    queue = PartQueue(open_store(tmp_path / "store", MANIFEST, postgres_url))
    parts = [Part(k, 0, "", (k,), 0, 10, k + 1, 3) for k in range(3)]
    queue.plan(parts)
    return queue, parts


def test_a_node_loop_of_a_killed_run_cannot_mark_a_part_of_the_rerun_done(part_queue, tmp_path):
    """The head was SIGKILLed while node-a captured part 0; the rerun plans
    the parts again (the same numbers) and node-b leases part 0. node-a's
    loop, still running, finishes after that: its done and its renewal are
    refused (they matched the part's number alone, marking done a part
    nobody captured under the new plan), and the part stays node-b's."""
    from tasks.stream.spool import SpoolBudget

    queue, parts = part_queue
    budget = SpoolBudget(tmp_path, None)
    old = queue.lease("node-a", budget)
    queue.plan(parts)  # the rerun
    new = queue.lease("node-b", budget)
    assert (old.seq, new.seq) == (0, 0) and new.lease != old.lease
    assert not queue.done(old) and not queue.renew(old)
    queue.release(old, "late failure")  # nor can it put the part back in line
    state = queue.parts().set_index("seq")
    assert (state.state[0], state.node[0], state.failures[0]) == ("leased", "node-b", 0)
    assert queue.done(new) and queue.parts().set_index("seq").state[0] == "done"


def test_a_node_whose_clock_runs_ahead_takes_no_live_lease(part_queue, tmp_path, monkeypatch):
    """node-b's clock is 35 s ahead of node-a's (more than a lease's 30 s):
    node-a's live lease of part 0 is not taken (leases are timed by the
    database's clock, not each node's); node-b takes the next part. Once
    node-a's lease has run out (its node stopped renewing), node-b takes
    part 0 under a new lease and node-a learns at its next renewal."""
    import time as clock

    from tasks.stream.spool import SpoolBudget

    queue, _ = part_queue
    budget = SpoolBudget(tmp_path, None)
    a = queue.lease("node-a", budget)
    real = clock.time
    monkeypatch.setattr(clock, "time", lambda: real() + 35.0)  # this process is node-b now
    b = queue.lease("node-b", budget)
    assert (a.seq, b.seq) == (0, 1)
    with queue.ledger.transaction() as db:  # node-a stopped renewing: its lease ran out
        db.execute("UPDATE stream_parts SET leased_until = leased_until - 31 WHERE seq = 0")
    taken = queue.lease("node-b", budget)
    assert taken.seq == 0 and taken.lease > a.lease and not queue.renew(a) and queue.renew(taken)


def test_nodes_polling_a_full_spool_do_not_queue_behind_the_lease_lock(tmp_path, postgres_url, monkeypatch):
    """The spool is full (part 0 in flight fills the room); while another
    connection holds the queue's lease lock (a node mid-lease, or 15 others
    polling), a waiting node's poll is answered "full" at once instead of
    queueing for the lock: 16 waiting nodes no longer serialise on it. Once
    part 0 is done, the next poll leases part 1."""
    import threading

    from tasks.store.ledger.open import open_store
    from tasks.stream.parts import Part, PartQueue
    from tasks.stream.spool import SpoolBudget
    from test_store import MANIFEST

    monkeypatch.setenv("EAGLE3_LEDGER_URL", postgres_url)
    queue = PartQueue(open_store(tmp_path / "store", MANIFEST, postgres_url))
    queue.plan([Part(k, 0, "spool/epoch-0000", (k,), 60, 10, k + 1, 2) for k in range(2)])
    budget = SpoolBudget(tmp_path / "store", 100)
    first = queue.lease("node-a", budget)
    answers = []
    with queue.ledger.transaction() as holder:
        holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"{queue.ledger.schema}.stream_parts",))
        poll = threading.Thread(target=lambda: answers.append(queue.lease("node-b", budget)), daemon=True)
        poll.start()
        poll.join(timeout=10)
        answered_while_locked = list(answers)
    poll.join(timeout=30)
    assert answered_while_locked == ["full"]
    assert queue.done(first) and queue.lease("node-b", budget).seq == 1


def test_a_stream_run_across_hosts_on_a_sqlite_index_is_refused_before_it_starts(tmp_path, monkeypatch):
    """Trainer ranks on two nodes read the spool stores' indexes that the
    capture writes on another host: SQLite on shared storage is refused,
    naming store.ledger_url, before anything is planned or launched (it
    used to keep the spool's index in SQLite, written by one host, read by
    others); capture nodes likewise; one host is fine."""
    from flows.stream import capture_and_train
    from tasks.capture.config import CaptureConfig
    from tasks.server.config import ServerConfig
    from tasks.store.config import StoreConfig
    from tasks.stream.plan import UnsharedIndex, require_shared_index
    from tasks.train.config import TrainConfig

    two = TrainConfig(out_dir=str(tmp_path / "run"), nnodes=2, rdzv_endpoint="127.0.0.1:29500", spool_bytes=10**9)
    with pytest.raises(UnsharedIndex, match=r"trainer ranks on 2 nodes \(train.nnodes\)\): set store.ledger_url"):
        capture_and_train(ServerConfig(model="tiny"), CaptureConfig(dataset=str(tmp_path / "none.jsonl")),
                          StoreConfig(path=str(tmp_path / "store")), two)
    assert not (tmp_path / "store").exists()  # nothing planned, nothing written
    with pytest.raises(UnsharedIndex, match=r"capture nodes \(node-a\)"):
        require_shared_index(two.model_copy(update={"nnodes": 1}), None, ("node-a",))
    require_shared_index(two, "postgresql://eagle3@db/eagle3")
    require_shared_index(two.model_copy(update={"nnodes": 1}), None)
