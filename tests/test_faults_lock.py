"""Two runs on one store or out_dir, with real second processes: a live
holder is named and refused, a SIGKILLed one is taken over, a record left by
another host is never broken silently, and a committed shard is never
replaced, neither in the file nor in the ledger."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tasks.store.ledger.open import open_ledger, open_store
from tasks.store.lock import LockHeld, hold_lock, lock_path, read_holder
from tasks.store.manifest import StoreError
from tasks.store.shards import ShardExists, remove_uncommitted, shard_path, write_shard
from tasks.store.verification import verify_store
from tests.test_store import MANIFEST, item

ROOT = Path(__file__).resolve().parent.parent

HOLDER = """
import sys, time
from pathlib import Path
from tasks.store.lock import hold_lock
with hold_lock(Path(sys.argv[1]), "test holder"):
    print("held", flush=True)
    time.sleep(600)
"""


def start_holder(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def holder(tmp_path):
    procs = []

    def start(directory):
        procs.append(start_holder(directory))
        return procs[-1]

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_live_holder_is_named_and_a_second_run_refused(tmp_path, holder):
    store = tmp_path / "store"
    proc = holder(store)
    with pytest.raises(LockHeld) as e:
        with hold_lock(store, "second run"):
            pass
    message = str(e.value)
    assert f"pid {proc.pid}" in message and socket.gethostname() in message and "started 20" in message
    assert "test holder" in message
    # The refused run changed nothing: the holder's record is intact.
    assert read_holder(store)["pid"] == proc.pid


def test_the_extract_train_and_pipeline_flows_refuse_a_held_directory(tmp_path, holder):
    from flows.extract import extract_hidden_states
    from flows.train import train_drafter
    from prefect.logging import disable_run_logger
    from tasks.capture.config import CaptureConfig
    from tasks.store.config import StoreConfig
    from tasks.train.config import TrainConfig

    store, out_dir = tmp_path / "store", tmp_path / "train"
    proc = holder(store)
    with pytest.raises(LockHeld, match=f"pid {proc.pid}"), disable_run_logger():
        extract_hidden_states.fn(capture=CaptureConfig(dataset=str(tmp_path / "none.jsonl")),
                                 store=StoreConfig(path=str(store)), verify=False)
    assert not (store / "ledger.sqlite").exists()  # refused before touching the store
    proc = holder(out_dir)
    with pytest.raises(LockHeld, match=f"pid {proc.pid}"), disable_run_logger():
        train_drafter.fn(store=str(store), train=TrainConfig(out_dir=str(out_dir)))
    # The pipeline holds both for its whole run: refused on either.
    from flows.pipeline import eagle3_pipeline

    proc = holder(tmp_path / "run" / "train")
    with pytest.raises(LockHeld, match=f"pid {proc.pid}"), disable_run_logger():
        eagle3_pipeline.fn(store=StoreConfig(path=str(tmp_path / "run" / "store")),
                           train=TrainConfig(out_dir=str(tmp_path / "run" / "train")))
    assert read_holder(tmp_path / "run" / "store") is None  # released on the way out


def test_a_second_extraction_on_a_dump_dir_in_use_is_refused_before_it_resets_it(tmp_path, holder):
    """A node's second child (its live first one taken for dead by the
    heartbeat automation), or another store's run attached to the same
    server, would reset the dump dir under the running one."""
    from flows.extract import extract_hidden_states
    from prefect.logging import disable_run_logger
    from tasks.capture.config import CaptureConfig
    from tasks.store.config import StoreConfig

    dumps = tmp_path / "dumps"
    dumps.mkdir(mode=0o700)
    in_flight = dumps / "e3-running-1234@0.safetensors"  # the running extraction's dump, not yet read
    in_flight.write_bytes(b"x")
    proc = holder(dumps)
    with pytest.raises(LockHeld, match=f"{dumps} is in use by another run: .*pid {proc.pid}"), disable_run_logger():
        extract_hidden_states.fn(capture=CaptureConfig(dataset=str(tmp_path / "none.jsonl"), dump_dir=str(dumps)),
                                 store=StoreConfig(path=str(tmp_path / "store")), verify=False)
    assert in_flight.exists() and read_holder(tmp_path / "store") is None
    # A node's child says its node is busy, which the parent does not count
    # as the node failing (tests/test_dispatch.py): no healthy node drained.
    from tasks.capture.nodes import NODE_BUSY, NodeBusy

    with hold_lock(tmp_path / "store", "the parent", run="parent-1"), disable_run_logger(), \
            pytest.raises(NodeBusy, match=f"^{NODE_BUSY}: {dumps} is in use by another run: .*pid {proc.pid}"):
        extract_hidden_states.fn(capture=CaptureConfig(dataset=str(tmp_path / "none.jsonl"), dump_dir=str(dumps)),
                                 store=StoreConfig(path=str(tmp_path / "store")), verify=False, parent_run="parent-1",
                                 node="node-a")
    assert in_flight.exists()


def test_a_sigkilled_holder_is_taken_over(tmp_path, holder, caplog):
    store = tmp_path / "store"
    proc = holder(store)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert read_holder(store)["pid"] == proc.pid  # the dead holder's record is still there
    with caplog.at_level("WARNING", logger="eagle3.lock"), hold_lock(store, "after the kill") as record:
        assert record["pid"] == os.getpid() and read_holder(store)["pid"] == os.getpid()
    assert f"pid {proc.pid}" in caplog.text and "gone" in caplog.text
    assert lock_path(store).read_text() == ""  # released cleanly
    caplog.clear()
    with caplog.at_level("WARNING", logger="eagle3.lock"), hold_lock(store, "next run"):
        pass
    assert not caplog.text  # a clean release is not a stale lock


def test_a_record_from_another_host_is_not_broken_silently(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    lock_path(store).write_text(json.dumps({"pid": 4242, "host": "gpu-node-7", "started": 1.7e9, "purpose": "x"}))
    with pytest.raises(LockHeld, match="pid 4242 on host gpu-node-7.*never released.*delete"):
        with hold_lock(store, "here"):
            pass
    assert read_holder(store)["host"] == "gpu-node-7"
    with hold_lock(store, "here", break_foreign=True) as record:
        assert record["host"] == socket.gethostname()


def test_reentrant_along_a_call_chain_but_not_for_another_thread(tmp_path):
    store = tmp_path / "store"
    errors = []
    with hold_lock(store, "pipeline"):
        with hold_lock(store, "extract subflow") as record:
            assert record["purpose"] == "pipeline"

        def other_run():
            try:
                with hold_lock(store, "another run in this process"):
                    pass
            except LockHeld as e:
                errors.append(str(e))

        t = threading.Thread(target=other_run)
        t.start()
        t.join()
    assert errors and f"pid {os.getpid()}" in errors[0] and "pipeline" in errors[0]
    with hold_lock(store, "after"):
        pass


WRITER = """
import sys
from pathlib import Path
from tests.test_store import item
from tasks.store.shards import ShardExists, write_shard
batch = [item(0, 5), item(1, 3)]
batch[0]["aux_hidden_states"] = batch[0]["aux_hidden_states"] + 1  # same samples, other numbers
try:
    write_shard(Path(sys.argv[1]), batch, source="data.jsonl")
except ShardExists as e:
    print("refused:", e)
"""


def test_a_committed_shard_is_never_replaced(tmp_path, ledger_url):
    store = tmp_path / "store"
    ledger = open_store(store, MANIFEST, ledger_url)
    shard, rows = write_shard(store, [item(0, 5), item(1, 3)], source="data.jsonl")
    ledger.commit_shard(shard, rows)
    before = shard_path(store, shard.name).read_bytes()
    # A second process writing the same samples with other content.
    out = subprocess.run([sys.executable, "-c", WRITER, str(store)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert "refused:" in out.stdout and "never replaced" in out.stdout, out
    assert shard_path(store, shard.name).read_bytes() == before
    assert not [p for p in (store / "shards").iterdir() if p.name.startswith(".")]  # temp cleaned
    # The same content again is not a conflict: the committed file is kept.
    data = [item(0, 5), item(1, 3)]
    again, _ = write_shard(store, data, source="data.jsonl")
    assert again.name == shard.name and again.sha256 == shard.sha256  # describes the file kept
    assert shard_path(store, shard.name).read_bytes() == before
    # The ledger refuses a second commit under the same name, and keeps the first.
    changed = [{**r, "checksum": "0" * 64} for r in rows]
    with pytest.raises(StoreError, match="already committed.*never replaced"):
        ledger.commit_shard(shard, changed)
    assert open_ledger(store).samples().checksum.tolist() == [r["checksum"] for r in rows]
    assert verify_store(store, recheck_source=False, write_report=False).ok


def test_an_uncommitted_leftover_is_replaced_only_after_the_ledger_check(tmp_path, ledger_url):
    store = tmp_path / "store"
    ledger = open_store(store, MANIFEST, ledger_url)
    batch = [item(0, 5)]
    write_shard(store, batch, source="data.jsonl")  # a killed run: written, never committed
    changed = [{**batch[0], "final_hidden_state": batch[0]["final_hidden_state"] * 2}]
    with pytest.raises(ShardExists) as e:
        write_shard(store, changed, source="data.jsonl")
    # What extraction does on a rerun: the ledger does not name it, so it goes.
    assert not ledger.has_shard(e.value.name)
    remove_uncommitted(store, e.value.name)
    ledger.commit_shard(*write_shard(store, changed, source="data.jsonl"))
    assert ledger.has_shard(e.value.name)
    assert verify_store(store, recheck_source=False, write_report=False).ok
