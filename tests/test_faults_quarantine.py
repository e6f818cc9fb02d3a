"""Mass quarantine: when every capture fails, the run stops with a reason
instead of ending Completed with nothing stored. The fault is real: an HTTP
server that answers /generate like SGLang but whose capture hook writes no
dump, so every capture comes back missing. The same server writing dumps
runs a batch end to end over a killed run's uncommitted shard."""
import functools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from tasks.capture import extraction
from tasks.capture.dump import write_chunk
from tasks.capture.config import CaptureConfig
from tasks.capture.bookkeeping import FailureGuard, TooManyFailures
from tasks.capture.extraction import Endpoint, extract_batch
from tasks.data.dataset import Sample, sample_id
from tasks.store.ledger.open import open_ledger, open_store
from tasks.store.handle import Store
from tasks.store.shards import shard_path, write_shard
from tasks.store.verification import verify_store
from tests.test_store import MANIFEST

H = 16

# The injected fault is the dump that never comes: how long a capture waits
# for it (10 s by default) changes nothing but the tests' time.
NO_DUMP_WAIT_S = 0.5


class NoDumpServer(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def on_generate(self, body):
        pass  # the hook writes nothing

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.on_generate(body)
        out = json.dumps({"meta_info": {"id": body["rid"], "prompt_tokens": len(body["input_ids"]),
                                        "cached_tokens": 0}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def no_dump_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), NoDumpServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def samples(n, start=0):
    out = []
    for k in range(start, start + n):
        ids, mask = np.arange(4, dtype=np.int32) + k, np.ones(4, np.uint8)
        out.append(Sample(sample_id(ids, mask), k, ids, mask))
    return out


def test_a_run_whose_every_capture_fails_stops_with_the_reason(tmp_path, no_dump_server):
    store, dump_dir = tmp_path / "store", tmp_path / "dumps"
    dump_dir.mkdir()
    # SQLite only: its ledger calls (quarantine, summary, quarantined) run
    # on both backends in test_ledger.py.
    open_store(store, MANIFEST)
    guard = FailureGuard(max_ratio=0.05, max_consecutive=6)
    first = samples(4)
    endpoint = Endpoint(no_dump_server, dump_dir, [1, 3, 4], dump_wait_s=NO_DUMP_WAIT_S)
    result = extract_batch(endpoint, Store.open(store), "data.jsonl", first, CaptureConfig(sample_attempts=2),
                           guard=guard)
    assert result.samples == 0 and len(result.quarantined) == 4  # under the streak limit: goes on
    with pytest.raises(TooManyFailures, match=r"6 captures in a row failed.*no capture in"):
        extract_batch(endpoint, Store.open(store), "data.jsonl", samples(4, start=4), CaptureConfig(sample_attempts=2),
                      guard=guard)
    # Every failed sample is quarantined with its reason, nothing was stored.
    ledger = open_ledger(store)
    assert ledger.summary()["samples"] == 0 and ledger.summary()["quarantined"] == 8
    assert ledger.quarantined().reason.str.contains("no capture").all()
    # A later batch of the same run does not even start.
    with pytest.raises(TooManyFailures):
        extract_batch(endpoint, Store.open(store), "data.jsonl", samples(2, start=20), guard=guard)
    assert open_ledger(store).summary()["quarantined"] == 8


def test_a_small_run_is_judged_by_its_ratio_at_the_end(tmp_path, no_dump_server, ledger_url):
    store, dump_dir = tmp_path / "store", tmp_path / "dumps"
    dump_dir.mkdir()
    open_store(store, MANIFEST, ledger_url)
    guard = FailureGuard(max_ratio=0.05, max_consecutive=20)
    endpoint = Endpoint(no_dump_server, dump_dir, [1, 3, 4], dump_wait_s=NO_DUMP_WAIT_S)
    extract_batch(endpoint, Store.open(store), "data.jsonl", samples(3), CaptureConfig(sample_attempts=1), guard=guard)
    with pytest.raises(TooManyFailures, match=r"3 of 3 samples tried failed their capture \(100% > 5% allowed\)"):
        guard.finish()


def test_the_guard_lets_a_few_failures_through():
    guard = FailureGuard(max_ratio=0.1, max_consecutive=3, min_samples=20)
    guard.record([True] * 9 + [False, False] + [True] * 7)  # 11% of 18: not judged before 20 tries
    with pytest.raises(TooManyFailures, match="3 of 20 samples"):
        guard.record([True, False])
    guard = FailureGuard(max_ratio=0.1, max_consecutive=3, min_samples=20)
    guard.record([True] * 18 + [False, False])  # 10%, 2 in a row: fine
    guard.finish()
    with pytest.raises(TooManyFailures, match="3 captures in a row"):
        guard.record([False])


@pytest.mark.server
def test_the_flow_fails_when_every_capture_fails(capture_server, prefect_api, tmp_path, monkeypatch):
    """On the real server, every capture but the warm-up probes reads back
    as missing: the flow run fails naming the cause, after one try per batch,
    and stores nothing."""
    from flows.extract import extract_hidden_states
    from tasks.capture import client as capture_client
    from tasks.capture.dump import CaptureMissing
    from tasks.capture.dump import read_capture as real_read_capture
    from tests.conftest import attach, demo_rows, write_jsonl

    def nothing_dumped(dump_dir, rid, sent_ids, **kw):
        if "probe" in rid:
            return real_read_capture(dump_dir, rid, sent_ids, **kw)
        raise CaptureMissing(f"rid {rid}: no capture (injected)")

    monkeypatch.setattr(capture_client, "read_capture", nothing_dumped)
    monkeypatch.setattr(extraction, "Endpoint", functools.partial(extraction.Endpoint, dump_wait_s=NO_DUMP_WAIT_S))
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(12))
    state = extract_hidden_states(**attach(capture_server, store=tmp_path / "store", dataset=str(dataset),
                                           batch_size=4, sample_attempts=1, max_consecutive_failures=6,
                                           batch_retry_delay_s=0), return_state=True)
    assert state.is_failed() and "captures in a row failed" in state.message
    ledger = open_ledger(tmp_path / "store")
    assert ledger.summary()["samples"] == 0 and ledger.summary()["quarantined"] >= 6


class DumpingServer(NoDumpServer):
    """Answers like SGLang and writes the rid's dump as the capture hook
    does (random states): extraction end to end, without a model."""

    dump_dir = None

    def on_generate(self, body):
        n = len(body["input_ids"])
        write_chunk(self.dump_dir, body["rid"], 0, torch.tensor(body["input_ids"]), torch.randn(n, 3, H),
                    torch.randn(n, H), [1, 3, 4], "post-norm")



def test_a_killed_runs_uncommitted_shard_is_replaced_and_committed(tmp_path, caplog, ledger_url):
    store, dump_dir = tmp_path / "store", tmp_path / "dumps"
    dump_dir.mkdir()
    open_store(store, {**MANIFEST, "hidden_size": H}, ledger_url)
    batch = samples(3)
    # The run before was killed after writing this batch's shard, before committing it.
    leftover, _ = write_shard(store, [{"sample_id": s.sample_id, "source_row": s.source_row, "input_ids": s.input_ids,
                                       "loss_mask": s.loss_mask, "aux_hidden_states": torch.zeros(4, 3, H),
                                       "final_hidden_state": torch.zeros(4, H)} for s in batch], source="data.jsonl")
    DumpingServer.dump_dir = dump_dir
    server = ThreadingHTTPServer(("127.0.0.1", 0), DumpingServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with caplog.at_level("WARNING", logger="eagle3.extract"):
            result = extract_batch(Endpoint(f"http://127.0.0.1:{server.server_address[1]}", dump_dir, [1, 3, 4]),
                                   Store.open(store), "data.jsonl", batch, guard=FailureGuard())
    finally:
        server.shutdown()
    assert result.samples == 3 and result.shard == leftover.name
    assert "left uncommitted by an interrupted run" in caplog.text
    ledger = open_ledger(store)
    assert ledger.has_shard(leftover.name) and ledger.summary()["samples"] == 3
    assert ledger.shards().sha256.iloc[0] != leftover.sha256  # the new capture, not the zeros
    assert verify_store(store, recheck_source=False, write_report=False).ok
    assert shard_path(store, leftover.name).exists() and not list(dump_dir.iterdir())
