"""The share-out of a many-node extraction (tasks/capture/nodes.py) and the
store pieces it relies on: node-named shards, the parent's lock."""
from __future__ import annotations

import threading

import pytest

import logging

from tasks.capture.nodes import Dispatcher, feed_node
from tasks.store.lock import LockHeld, check_held_by, hold_lock
from tasks.store.manifest import StoreError
from tasks.store.shards import shard_name, write_shard


class S:
    """A planned sample: its row and size."""

    def __init__(self, row: int, tokens: int = 10):
        self.source_row, self.num_tokens = row, tokens


def plan(n: int) -> list[S]:
    return [S(r) for r in range(n)]


def test_a_rows_samples_go_to_one_share():
    """A conversation that gives several samples (one per group of turns:
    tasks/data/chat.py) is one row: a share that would end inside it takes
    the rest of it, so no two children plan and capture the same row."""
    samples = [S(r) for r in range(40) for _ in range(1 + r % 3)]
    d = Dispatcher(samples, ["a", "b"], 2, min_share=8, batch_size=4)
    shares = []
    while (share := d.take("a")) is not None:
        shares.append(share)
        d.finished("a", share, None)
    rows = [r for sh in shares for r in sh.rows]
    assert rows == list(range(40)) and sum(sh.samples for sh in shares) == len(samples)
    assert any(sh.samples % 4 for sh in shares)  # a share grew past its whole batches to end on a row


def test_shares_are_half_of_what_is_left_per_node_in_whole_batches_down_to_the_minimum():
    d = Dispatcher(plan(100), ["a", "b"], 2, min_share=8, batch_size=4)
    sizes = []
    while (share := d.take("a")) is not None:
        sizes.append(share.samples)
        d.finished("a", share, None)
    assert sizes == [28, 20, 16, 12, 8, 8, 8]  # 100/4 -> 25 -> 28 (whole batches), 72/4 -> 18 -> 20, ...
    rows = [r for sh in d.done["a"] for r in sh.rows]
    assert rows == list(range(100))  # every row once, in plan order
    assert [sh.index for sh in d.done["a"]] == list(range(7))
    assert d.done["a"][0].tokens == 280


def test_a_failed_share_goes_to_another_node_and_a_failing_node_is_drained():
    d = Dispatcher(plan(6), ["a", "b"], max_node_failures=2, min_share=2)
    s0, s1 = d.take("a"), d.take("b")
    d.finished("b", s1, "Crashed")            # back to the front of the line
    d.finished("a", s0, None)
    assert d.take("a") == s1                  # the failed share first
    s2 = d.take("b")
    d.finished("b", s2, "Crashed")
    assert d.drained == {"b": "2 shares failed in a row there, the last: Crashed"}
    assert d.take("b") is None                # a drained node gets nothing more
    d.finished("a", s1, None)
    assert d.take("a") == s2
    d.finished("a", s2, None)
    assert d.take("a") is None and d.left == 0
    assert sorted(r for sh in d.done["a"] for r in sh.rows) == list(range(6)) and d.done["b"] == []


def test_a_node_waits_while_a_share_may_still_come_back():
    d = Dispatcher(plan(2), ["a", "b"], max_node_failures=1, min_share=2)
    share = d.take("a")
    got = []
    waiter = threading.Thread(target=lambda: got.append(d.take("b")))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # nothing to take, but a's share may fail
    d.finished("a", share, "Failed")
    waiter.join(5)
    assert got == [share]
    d.finished("b", got[0], None)
    assert d.take("a") is None and d.take("b") is None


def test_a_failed_share_never_goes_back_to_the_node_that_failed_it_while_another_can_take_it():
    """A node whose worker is gone fails each share after start_timeout_s:
    its share must move at once, whatever max_node_failures is (it used to
    go straight back to the same node, costing max_node_failures timeouts)."""
    d = Dispatcher(plan(8), ["a", "b"], max_node_failures=5, min_share=2)
    s0, s1 = d.take("a"), d.take("b")
    d.finished("a", s0, "cancelled: no worker started it")
    s2 = d.take("a")
    assert s2 not in (s0, s1) and s2 is not None  # a gets new work, not its failed share
    d.finished("b", s1, None)
    assert d.take("b") == s0  # the first node free that did not fail it
    d.finished("a", s2, "cancelled")
    d.finished("b", s0, None)
    assert d.take("b") == s2 and d.take("a") not in (s0, s2)


def test_a_share_every_healthy_node_failed_is_tried_again():
    d = Dispatcher(plan(2), ["a"], max_node_failures=3, min_share=2)
    s0 = d.take("a")
    d.finished("a", s0, "Failed")
    assert d.take("a") == s0  # nobody else can take it


def test_a_share_is_handed_back_whatever_watching_its_child_raises():
    """The parent used to hang for good when a Prefect API call raised while
    a child ran: the share stayed counted in flight and the other nodes
    waited for it. Now it goes back; the other node runs it; both end."""
    d = Dispatcher(plan(12), ["a", "b"], max_node_failures=2, min_share=2)
    ran: dict[str, list] = {"a": [], "b": []}

    def runner(node):
        def run_share(share, n):
            if node == "a" and n == 1:
                raise ConnectionError("Prefect API unreachable")
            ran[node].append(share.index)
            return None, f"{node}-{share.index}"
        return run_share

    reports = {}
    threads = [threading.Thread(target=lambda q=q: reports.setdefault(q, feed_node(q, d, runner(q),
                                                                                   logging.getLogger("t"))))
               for q in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    done = sorted(r for q in "ab" for sh in d.done[q] for r in sh.rows)
    assert done == list(range(12)) and d.left == 0 and not d.drained
    assert sorted(ran["a"] + ran["b"]) == sorted({sh.index for q in "ab" for sh in d.done[q]})
    assert reports["a"]["samples"] + reports["b"]["samples"] == 12


def test_a_progress_update_that_raises_stops_no_node(caplog):
    """The progress update reads the index and calls the Prefect API after
    every share; when it raised, the node's thread ended there: its report
    was lost and the node took no more shares."""
    d = Dispatcher(plan(8), ["a"], max_node_failures=2, min_share=2)

    def on_progress():
        raise ConnectionError("Prefect API unreachable")

    with caplog.at_level(logging.WARNING):
        report = feed_node("a", d, lambda share, n: (None, f"a-{share.index}"), logging.getLogger("t"), on_progress)
    assert report["samples"] == 8 and d.left == 0
    assert sorted(r for sh in d.done["a"] for r in sh.rows) == list(range(8))
    assert "could not update the progress after share 0 (ConnectionError: Prefect API unreachable)" in caplog.text


def test_a_busy_node_is_neither_drained_nor_kept_from_the_share_it_was_refused():
    """A node whose earlier child still runs (marked Crashed by the
    heartbeat automation while alive) refuses the next child with NODE_BUSY:
    the share goes back uncounted and the node, once free, works on. Counted
    as failures, two refusals drained a healthy node."""
    from tasks.capture.nodes import NODE_BUSY

    d = Dispatcher(plan(6), ["a"], max_node_failures=1, min_share=2, busy_limit_s=60)
    refusals = []

    def run_share(share, n):
        if n <= 2:
            refusals.append(share.index)
            return f"a-{n} ended Failed: NodeBusy: {NODE_BUSY}: the dump dir is in use", f"a-{n}"
        return None, f"a-{n}"

    report = feed_node("a", d, run_share, logging.getLogger("t"), busy_wait_s=0)
    assert report["drained"] is None and not d.drained and d.left == 0
    assert sorted(r for sh in d.done["a"] for r in sh.rows) == list(range(6))
    assert refusals == [0, 0] and d.done["a"][0].index == 0


def test_a_node_busy_for_too_long_is_drained_saying_so():
    from tasks.capture.nodes import NODE_BUSY

    d = Dispatcher(plan(4), ["a", "b"], max_node_failures=5, min_share=2, busy_limit_s=0)
    share = d.take("a")
    d.finished("a", share, f"NodeBusy: {NODE_BUSY}", busy=True)
    assert d.drained["a"].startswith("busy with an earlier child run for 0 s") and NODE_BUSY in d.drained["a"]
    assert d.take("b") == share  # the share itself never failed: the other node runs it


def test_the_prefect_api_is_retried_patiently_then_given_up(monkeypatch):
    import httpx

    from flows import node_runs
    from flows.node_runs import patiently

    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise httpx.ConnectError("refused")
        return "run"

    monkeypatch.setattr(node_runs.time, "sleep", lambda s: None)
    assert patiently(flaky, what="watch x") == "run" and len(calls) == 3
    with pytest.raises(RuntimeError, match="could not watch x: the Prefect API failed"):
        patiently(lambda: (_ for _ in ()).throw(httpx.ConnectError("down")), what="watch x", patience_s=5)


def test_samples_left_when_every_node_is_drained():
    d = Dispatcher(plan(5), ["a"], max_node_failures=1, min_share=2)
    d.finished("a", d.take("a"), "Crashed")
    assert d.take("a") is None
    assert d.left == 5


def test_bad_node_lists_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        Dispatcher(plan(1), [], 1, min_share=1)
    with pytest.raises(ValueError, match="distinct"):
        Dispatcher(plan(1), ["a", "a"], 1, min_share=1)


def test_two_nodes_never_write_one_shard_path_and_the_index_takes_one(tmp_path):
    import torch

    from tasks.store.ledger.sqlite import SqliteLedger

    items = [{"sample_id": "s0", "source_row": 0, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1],
              "aux_hidden_states": torch.randn(3, 3, 8), "final_hidden_state": torch.randn(3, 8)}]
    (tmp_path / "shards").mkdir()
    a, rows_a = write_shard(tmp_path, items, source="d", writer="node-a")
    b, rows_b = write_shard(tmp_path, items, source="d", writer="node-b")
    assert a.name != b.name and a.name.endswith("-node-a") and b.name.endswith("-node-b")
    assert shard_name(["s0"]) == a.name.removesuffix("-node-a")  # one machine: names as before
    ledger = SqliteLedger(tmp_path)
    ledger.commit_shard(a, rows_a)
    with pytest.raises(StoreError, match="s0"):
        ledger.commit_shard(b, rows_b)
    assert list(ledger.shards().name) == [a.name]
    with pytest.raises(ValueError, match="writer name"):
        shard_name(["s0"], "Node A")


def test_a_child_writes_only_under_its_parents_lock(tmp_path):
    with hold_lock(tmp_path, "parent", run="run-1"):
        assert check_held_by(tmp_path, "run-1")["run"] == "run-1"
        with pytest.raises(LockHeld, match="not held by run run-2"):
            check_held_by(tmp_path, "run-2")
    with pytest.raises(LockHeld, match="parent run has ended"):
        check_held_by(tmp_path, "run-1")  # released: a late child stops


def test_a_child_stops_once_its_parents_process_is_killed(tmp_path):
    # A parent holding the store, SIGKILLed: its record stays (the kernel
    # drops only the flock), and a child checking before its next batch
    # learns the parent is gone instead of writing on for nobody.
    import signal
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", "import sys, time; from tasks.store.lock import hold_lock\n"
                               f"with hold_lock({str(tmp_path)!r}, 'parent', run='run-1'):\n"
                               "    print('held', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "held"
        assert check_held_by(tmp_path, "run-1")["pid"] == parent.pid
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    with pytest.raises(LockHeld, match=rf"its process \(pid {parent.pid}\) is gone: the parent run died"):
        check_held_by(tmp_path, "run-1")


def test_node_queues_that_cannot_name_shards_are_refused_before_anything_runs(tmp_path):
    from flows.extract_nodes import extract_across_nodes

    with pytest.raises(ValueError, match=r"node queue names \['Node_A'\]"):
        extract_across_nodes.fn(queues=["node-b", "Node_A"], store=str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


@pytest.fixture
def small_volume(tmp_path):
    """A 1 MiB tmpfs: a store that cannot hold the plan."""
    import subprocess

    where = tmp_path / "small"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], check=True)
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_a_plan_larger_than_the_stores_volume_is_refused_before_any_child(tmp_path, small_volume, tiny_model,
                                                                          prefect_api):
    """Each child checks only its share; 160 samples at H 128 need ~40 MiB, the
    volume has 1: the parent refuses the whole plan before it starts one."""
    from flows.extract_nodes import extract_across_nodes
    from tasks.capture.config import CaptureConfig
    from tasks.capture.planning import InsufficientSpace
    from tasks.store.config import StoreConfig
    from tests.conftest import demo_rows, write_jsonl

    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(160))
    where = small_volume / "store"
    with pytest.raises(InsufficientSpace, match=rf"the store needs .* GiB for [\d,]+ tokens but {where}"
                                                r" has 0\.00 GiB free"):
        extract_across_nodes(queues=["node-a"], model=str(tiny_model), capture=CaptureConfig(dataset=str(dataset)),
                             store=StoreConfig(path=str(small_volume / "store")), deployment="no/such-deployment")
