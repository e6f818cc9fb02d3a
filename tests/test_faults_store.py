"""Faults on the store side of a batch, injected for real: a writer
SIGKILLed after its shard is linked into place but before the ledger commit,
one SIGKILLed halfway through writing its shard, and a disk that fills up
mid-shard. Each time: nothing committed is lost or altered, no leftover is
taken for data, and the batch stores cleanly once the fault is gone. The
states come from an httpx transport that plays SGLang with the real dump
writer (tests/test_capture_client.py)."""
from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks.capture.config import CaptureConfig
from tasks.capture.extraction import Endpoint, extract_batch, reset_dump_dir
from tasks.data.dataset import Sample
from tasks.store import shards
from tasks.store.handle import Store
from tasks.store.ledger.open import open_ledger, open_store
from tasks.store.reader import StoreReader
from tasks.store.shards import FORMAT, remove_leaked_temps
from tasks.store.verification import verify_store
from tests.test_capture_client import H, LAYERS, FakeServer, states_for

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = {"format": FORMAT, "target": {"name": "m"}, "tokenizer": {"sha256": "t"},
            "aux_layers": {"sglang_layer_output_ids": list(LAYERS)}, "hidden_size": H, "dtype": "bfloat16",
            "max_length": 64, "max_length_policy": "truncate"}


def batch(first: int, n: int = 6) -> list[Sample]:
    out = []
    for k in range(first, first + n):
        ids = np.arange(100 * k, 100 * k + 3 + k % 5, dtype=np.int32)
        out.append(Sample(sample_id=f"s{k:03d}", source_row=k, input_ids=ids, loss_mask=np.ones(len(ids), np.uint8)))
    return out


def run_batch(tmp_path, store, samples):
    server = FakeServer(tmp_path / "dumps")
    try:
        return extract_batch(Endpoint("http://fake", tmp_path / "dumps", LAYERS, transport=server.transport),
                             Store.open(store), "data.jsonl", samples, CaptureConfig(concurrency=3), store_workers=2)
    finally:
        server.writer.close(timeout=10)


def store_with_one_batch(tmp_path) -> tuple[Path, dict]:
    store = tmp_path / "store"
    open_store(store, MANIFEST)
    run_batch(tmp_path, store, batch(0))
    return store, {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (store / "shards").iterdir()}


def killed_writer(store: Path, samples: list[Sample], *, when: str) -> None:
    """Write `samples` as a shard in another process that SIGKILLs itself
    `when` = "after-link" (the shard in place, not committed) or
    "mid-write" (after the first piece of the file)."""
    code = f"""
import os, signal, numpy as np, torch
from pathlib import Path
from tasks.store import shards
from tests.test_capture_client import states_for
items = []
for sid, row, ids in {[(s.sample_id, s.source_row, s.input_ids.tolist()) for s in samples]!r}:
    aux, final = states_for(ids)
    items.append(dict(sample_id=sid, source_row=row, input_ids=np.array(ids, np.int32),
                      loss_mask=np.ones(len(ids), np.uint8), aux_hidden_states=aux, final_hidden_state=final))
if {when!r} == "mid-write":
    real = shards._pwrite
    shards._pwrite = lambda fd, data, at: (real(fd, data, at), os.kill(os.getpid(), signal.SIGKILL))
shards.write_shard(Path({str(store)!r}), items, source="data.jsonl", workers=1)
os.kill(os.getpid(), signal.SIGKILL)  # linked into place; the ledger commit never happens
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120)
    assert run.returncode == -signal.SIGKILL


def assert_intact(store: Path, before: dict, samples_now: int):
    for name, sha in before.items():
        assert hashlib.sha256((store / "shards" / name).read_bytes()).hexdigest() == sha, name
    assert open_ledger(store).summary()["samples"] == samples_now
    assert verify_store(store, recheck_source=False, write_report=False).ok
    reader = StoreReader(store)
    for i, sid in enumerate(reader.sample_ids):  # what is stored is what the "server" produced for it
        ids = reader[i]["input_ids"].tolist()
        aux, final = states_for(ids)
        assert (reader[i]["aux_hidden_states"] == aux).all() and (reader[i]["final_hidden_state"] == final).all()


def test_a_kill_between_the_shard_link_and_the_ledger_commit(tmp_path):
    store, before = store_with_one_batch(tmp_path)
    second = batch(10)
    killed_writer(store, second, when="after-link")
    leftover = set(os.listdir(store / "shards")) - set(before)
    assert len(leftover) == 1  # the shard is in place, uncommitted
    assert open_ledger(store).summary()["samples"] == 6  # and not stored
    result = run_batch(tmp_path, store, second)  # the rerun replaces the leftover, then commits
    assert result.samples == 6
    assert_intact(store, before, 12)


def test_a_kill_while_writing_a_shard_leaves_a_temp_the_next_run_removes(tmp_path):
    store, before = store_with_one_batch(tmp_path)
    killed_writer(store, batch(10), when="mid-write")
    temps = [n for n in os.listdir(store / "shards") if n.startswith(".")]
    assert len(temps) == 1 and set(os.listdir(store / "shards")) - set(before) == set(temps)
    assert remove_leaked_temps(store) == temps and sorted(os.listdir(store / "shards")) == sorted(before)
    run_batch(tmp_path, store, batch(10))
    assert_intact(store, before, 12)


def test_a_full_disk_mid_shard_fails_the_batch_and_loses_nothing(tmp_path, monkeypatch):
    store, before = store_with_one_batch(tmp_path)
    real, calls = shards._pwrite, []

    def fills_up(fd, data, at):
        calls.append(len(data))
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, at)

    monkeypatch.setattr(shards, "_pwrite", fills_up)
    with pytest.raises(OSError) as raised:
        run_batch(tmp_path, store, batch(10))
    assert raised.value.errno == errno.ENOSPC
    assert sorted(os.listdir(store / "shards")) == sorted(before)  # no temp, no partial shard
    assert_intact(store, before, 6)
    monkeypatch.setattr(shards, "_pwrite", real)  # space again: the batch stores
    assert run_batch(tmp_path, store, batch(10)).samples == 6
    assert_intact(store, before, 12)


def test_the_dump_dir_reset_removes_a_killed_hooks_temp_files(tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir(mode=0o700)
    leaked = [dumps / ".tmp-e3-abc@0.safetensors.4242", dumps / "e3-abc@0.safetensors"]
    foreign = dumps / "someone-else.safetensors"
    for p in [*leaked, foreign]:
        p.write_bytes(b"x")
    assert reset_dump_dir(dumps) == 2
    assert not any(p.exists() for p in leaked) and foreign.exists()
