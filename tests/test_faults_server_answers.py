"""What the client does with a server that answers wrongly or not at all,
each from a real HTTP server on loopback: a 200 that is not SGLang's JSON, a
request that hangs past the timeout, and a port another process holds."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from tasks.capture.config import CaptureConfig
from tasks.capture.bookkeeping import FailureGuard, TooManyFailures
from tasks.capture.extraction import Endpoint, extract_batch
from tasks.data.dataset import Sample
from tasks.server.config import ServerConfig
from tasks.server.launch import CaptureSpec, launch_server
from tasks.sglang_api import ServerError
from tasks.store.handle import Store
from tasks.store.ledger.open import open_ledger, open_store
from tests.test_faults_store import MANIFEST


class Answers(BaseHTTPRequestHandler):
    generate = b"<html>gateway</html>"
    delay_s = 0.0

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.delay_s)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.generate)))
        self.end_headers()
        self.wfile.write(self.generate)

    def log_message(self, *args):
        pass


def serve(handler) -> tuple[str, ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def samples(n: int) -> list[Sample]:
    return [Sample(f"s{k}", k, np.arange(4, dtype=np.int32) + k, np.ones(4, np.uint8)) for k in range(n)]


def test_a_200_that_is_not_sglangs_json_is_a_failed_capture_never_a_stored_one(tmp_path):
    url, server = serve(Answers)
    store = tmp_path / "store"
    open_store(store, MANIFEST)
    try:
        with pytest.raises(TooManyFailures):
            extract_batch(Endpoint(url, tmp_path / "dumps", (1, 3, 4)), Store.open(store), "d.jsonl", samples(6),
                          CaptureConfig(sample_attempts=2), guard=FailureGuard(max_consecutive=6))
    finally:
        server.shutdown()
    ledger = open_ledger(store)
    assert ledger.summary()["samples"] == 0
    reasons = ledger.quarantined().reason.tolist()
    assert len(reasons) == 6 and all("without SGLang's JSON" in r and "gateway" in r for r in reasons), reasons


def test_a_request_that_hangs_past_the_timeout_fails_its_sample_and_not_the_server(tmp_path):
    class Hangs(Answers):
        delay_s = 30.0

    url, server = serve(Hangs)
    store = tmp_path / "store"
    open_store(store, MANIFEST)
    t0 = time.monotonic()
    try:
        result = extract_batch(Endpoint(url, tmp_path / "dumps", (1, 3, 4)), Store.open(store), "d.jsonl",
                               samples(2), CaptureConfig(sample_attempts=1, request_timeout_s=1.0))
    finally:
        server.shutdown()
    assert time.monotonic() - t0 < 20  # the timeout, not the hang, decided
    assert result.samples == 0 and sorted(result.quarantined) == ["s0", "s1"]
    assert all("ReadTimeout" in r for r in open_ledger(store).quarantined().reason)
    assert open_ledger(store).crash_counts() == {}  # /health answered: the server was up, no crash counted


def test_a_port_another_process_holds_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cfg = CaptureSpec(ServerConfig(model=str(tmp_path)), dump_dir=tmp_path / "d", port=port)
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is taken by another process"):
            launch_server(cfg, tmp_path / "server.log")
        assert time.monotonic() - t0 < 5 and not (tmp_path / "server.log").exists()  # no server was started


def test_a_request_the_server_refuses_is_quarantined_at_once_with_its_answer(tmp_path):
    seen = []

    class Refuses(Answers):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body["input_ids"])
            long = len(body["input_ids"]) > 4
            answer = (b'{"error": "input is longer than the model\'s context length (4)"}' if long else
                      json.dumps({"meta_info": {"id": body["rid"], "prompt_tokens": len(body["input_ids"]),
                                                "cached_tokens": 0}}).encode())
            self.send_response(400 if long else 200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    url, server = serve(Refuses)
    store = tmp_path / "store"
    open_store(store, MANIFEST)
    batch = samples(2) + [Sample("long", 9, np.arange(9, dtype=np.int32), np.ones(9, np.uint8))]
    try:
        result = extract_batch(Endpoint(url, tmp_path / "dumps", (1, 3, 4), dump_wait_s=0.2), Store.open(store),
                               "d.jsonl", batch, CaptureConfig(sample_attempts=3))
    finally:
        server.shutdown()
    assert "long" in result.quarantined
    assert sum(len(ids) == 9 for ids in seen) == 1  # asked once, not three times
    row = open_ledger(store).quarantined().set_index("sample_id").loc["long"]
    assert "HTTP 400" in row.reason and "context length" in row.reason and row.attempts == 1
