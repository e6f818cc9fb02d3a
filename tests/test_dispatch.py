"""The share-out of a many-node extraction (tasks/capture/nodes.py) and the
store pieces it relies on: node-named shards, the parent's lock."""
from __future__ import annotations

import threading

import pytest

from tasks.capture.nodes import Dispatcher, Group, make_groups
from tasks.store.lock import LockHeld, check_held_by, hold_lock
from tasks.store.manifest import StoreError
from tasks.store.shards import shard_name, write_shard


def groups(n: int) -> list[Group]:
    return [Group(i, (2 * i, 2 * i + 1), 2, 10) for i in range(n)]


def test_groups_cover_the_plan_in_order():
    class S:
        def __init__(self, row, n):
            self.source_row, self.num_tokens = row, n

    made = make_groups([S(r, r + 1) for r in range(5)], 2)
    assert [g.rows for g in made] == [(0, 1), (2, 3), (4,)]
    assert [(g.index, g.samples, g.tokens) for g in made] == [(0, 2, 3), (1, 2, 7), (2, 1, 5)]


def test_a_failed_group_goes_to_another_node_and_a_failing_node_is_drained():
    d = Dispatcher(groups(3), ["a", "b"], max_node_failures=2)
    g0, g1 = d.take("a"), d.take("b")
    d.finished("b", g1, "Crashed")            # back to the front of the line
    d.finished("a", g0, None)
    assert d.take("a") == g1                  # the failed group first
    g2 = d.take("b")
    d.finished("b", g2, "Crashed")
    assert d.drained == {"b": "2 groups failed in a row there, the last: Crashed"}
    assert d.take("b") is None                # a drained node gets nothing more
    d.finished("a", g1, None)
    assert d.take("a") == g2
    d.finished("a", g2, None)
    assert d.take("a") is None and d.left == []
    assert sorted(g.index for g in d.done["a"]) == [0, 1, 2] and d.done["b"] == []


def test_a_node_waits_while_a_group_may_still_come_back():
    d = Dispatcher(groups(1), ["a", "b"], max_node_failures=1)
    g = d.take("a")
    got = []
    waiter = threading.Thread(target=lambda: got.append(d.take("b")))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # nothing to take, but a's group may fail
    d.finished("a", g, "Failed")
    waiter.join(5)
    assert got == [g]
    d.finished("b", g, None)
    assert d.take("a") is None and d.take("b") is None


def test_groups_left_when_every_node_is_drained():
    d = Dispatcher(groups(2), ["a"], max_node_failures=1)
    d.finished("a", d.take("a"), "Crashed")
    assert d.take("a") is None
    assert [g.index for g in d.left] == [0, 1]


def test_bad_node_lists_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        Dispatcher(groups(1), [], 1)
    with pytest.raises(ValueError, match="distinct"):
        Dispatcher(groups(1), ["a", "a"], 1)


def test_two_nodes_never_write_one_shard_path_and_the_index_takes_one(tmp_path):
    import torch

    from tasks.store.ledger import SqliteLedger

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
