"""The client side without a server: an httpx transport plays SGLang, and
its "hook" hands dumps to the real background writer, so a dump can land
after the response, as it does in the server now."""
import json
import threading

import httpx
import numpy as np
import pytest
import torch

from tasks.capture.client import capture_many
from tasks.capture.dump import CaptureMissing
from tasks.capture.config import CaptureConfig
from tasks.capture.extraction import Endpoint, extract_batch
from tasks.capture.writer import DumpWriter
from tasks.data.dataset import Sample
from tasks.store.ledger.open import open_store
from tasks.store.reader import StoreReader
from tasks.store import fp8
from tasks.store.handle import Store
from tasks.store.shards import BF16, FORMAT, FP8
from tasks.store.verification import verify_store

H = 8
LAYERS = (1, 3, 4)


def states_for(ids):
    """Deterministic states from the ids, so a reader can tell samples apart."""
    t = torch.tensor(ids, dtype=torch.float32)
    final = t[:, None] + torch.arange(H) / 100
    return (torch.stack([final + 1000 * k for k in range(1, 4)], dim=1).to(torch.bfloat16),
            final.to(torch.bfloat16))


class FakeServer:
    """Answers /generate like SGLang with max_new_tokens 0 and queues the dump
    on a DumpWriter; `hold` keeps the writer from writing until released."""

    def __init__(self, dump_dir, write=None):
        self.hold = threading.Event()
        self.hold.set()
        self.writer = DumpWriter(dump_dir, **({"write": write} if write else {}))
        real = self.writer._write
        self.writer._write = lambda *a: (self.hold.wait(30), real(*a))[1]
        self.transport = httpx.MockTransport(self.handle)

    def handle(self, request):
        body = json.loads(request.content)
        ids, rid = body["input_ids"], body["rid"]
        aux, final = states_for(ids)
        self.writer.submit(rid, 0, torch.tensor(ids), aux, final, LAYERS, "post-norm")
        return httpx.Response(200, json={"meta_info": {"id": rid, "prompt_tokens": len(ids), "cached_tokens": 0}})


def test_the_client_waits_for_a_dump_written_after_the_response(tmp_path):
    server = FakeServer(tmp_path)
    server.hold.clear()
    threading.Timer(0.4, server.hold.set).start()  # the writer lags the responses by 0.4 s
    id_lists = [[k, k + 1, k + 2] for k in range(10)]
    out = capture_many("http://fake", tmp_path, id_lists, lambda i, c: c.final_hidden_state.clone(),
                       transport=server.transport, read_workers=3, dump_wait_s=10)
    for ids, got in zip(id_lists, out):
        assert not isinstance(got, Exception), got
        assert torch.equal(got, states_for(ids)[1])
    server.writer.close(timeout=10)
    assert list(tmp_path.iterdir()) == []


def test_a_dump_that_never_comes_fails_after_the_bounded_wait(tmp_path):
    def failing(dump_dir, rid, *args):
        raise OSError("injected")

    server = FakeServer(tmp_path, write=failing)
    (out,) = capture_many("http://fake", tmp_path, [[1, 2, 3]], lambda i, c: c, transport=server.transport,
                          dump_wait_s=0.3)
    assert isinstance(out, CaptureMissing) and "waited 0 s for the hook's writer" in str(out)
    server.writer.close(timeout=10)


@pytest.mark.parametrize("storage", [BF16, FP8])
def test_extract_batch_stores_the_batch_in_order_through_many_workers(tmp_path, storage):
    store = tmp_path / "store"
    open_store(store, {"format": FORMAT, "target": {"name": "m"}, "tokenizer": {"sha256": "t"},
                       "aux_layers": {"sglang_layer_output_ids": list(LAYERS)}, "hidden_size": H, "dtype": storage,
                       "max_length": 64, "max_length_policy": "truncate"})
    samples = []
    for k in range(24):
        ids = np.arange(100 * k, 100 * k + 3 + k % 7, dtype=np.int32)
        samples.append(Sample(sample_id=f"s{k:02d}", source_row=k, input_ids=ids,
                              loss_mask=np.ones(len(ids), dtype=np.uint8)))
    server = FakeServer(tmp_path / "dumps")
    result = extract_batch(Endpoint("http://fake", tmp_path / "dumps", LAYERS, transport=server.transport),
                           Store.open(store), "data.jsonl", samples, CaptureConfig(concurrency=6), store_workers=4)
    server.writer.close(timeout=10)
    assert result.samples == 24 and not result.quarantined
    reader = StoreReader(store)
    assert reader.sample_ids == [s.sample_id for s in samples]  # shard order = batch order
    for i, s in enumerate(samples):
        aux, final = states_for(s.input_ids.tolist())
        if storage == FP8:  # the format itself is checked by hand in test_store.py
            aux, final = (fp8.dequantize(*fp8.quantize(t)) for t in (aux, final))
        assert torch.equal(reader[i]["aux_hidden_states"], aux) and torch.equal(reader[i]["final_hidden_state"], final)
    assert verify_store(store, recheck_source=False, write_report=False).ok


class TimingOutServer(FakeServer):
    """The server runs the request and its hook queues the dump, but the
    client's timeout fires first: the dump lands for a request that failed."""

    def handle(self, request):
        super().handle(request)
        raise httpx.ReadTimeout("timed out", request=request)


def test_no_dump_of_a_failed_request_stays_in_the_dump_dir(tmp_path):
    """A timeout, a transport error or a dump landing after its request
    failed used to stay in the (RAM-backed) dump dir until the next run's
    reset: only a bad capture was discarded. Every failure path discards
    now, and a dump the writer lands later is swept by the run's next batch."""
    from tasks.capture.bookkeeping import FailureGuard
    from tasks.capture.extraction import ServerUnavailable

    store, dumps = tmp_path / "store", tmp_path / "dumps"
    open_store(store, {"format": FORMAT, "target": {"name": "m"}, "tokenizer": {"sha256": "t"},
                       "aux_layers": {"sglang_layer_output_ids": list(LAYERS)}, "hidden_size": H, "dtype": BF16,
                       "max_length": 64, "max_length_policy": "truncate"})

    def samples(start):
        out = []
        for k in range(start, start + 4):
            ids = np.arange(10 * k, 10 * k + 5, dtype=np.int32)
            out.append(Sample(sample_id=f"s{k:02d}", source_row=k, input_ids=ids, loss_mask=np.ones(5, np.uint8)))
        return out

    guard = FailureGuard(max_ratio=1.0, max_consecutive=100)
    late = TimingOutServer(dumps)
    late.hold.clear()  # the writer lags: dumps land after the batch has given up on them
    # No /health behind the fake either: the batch takes the server for down.
    with pytest.raises(ServerUnavailable, match="stopped answering mid-batch"):
        extract_batch(Endpoint("http://fake", dumps, LAYERS, transport=late.transport), Store.open(store),
                      "d.jsonl", samples(0), CaptureConfig(sample_attempts=2), guard=guard)
    assert len(guard.failed_rids) == 4
    late.hold.set()
    late.writer.close(timeout=10)
    assert len(list(dumps.glob("*.safetensors"))) == 4  # landed after their requests failed
    server = FakeServer(dumps)
    result = extract_batch(Endpoint("http://fake", dumps, LAYERS, transport=server.transport), Store.open(store),
                           "d.jsonl", samples(4), CaptureConfig(), guard=guard)
    server.writer.close(timeout=10)
    assert result.samples == 4 and list(dumps.iterdir()) == []  # the next batch swept them

    # Written before the timeout fired: discarded by the attempt itself.
    from tasks.capture.dump import write_chunk

    def written_then_timed_out(request):
        body = json.loads(request.content)
        aux, final = states_for(body["input_ids"])
        write_chunk(tmp_path, body["rid"], 0, torch.tensor(body["input_ids"]), aux, final, LAYERS, "post-norm")
        raise httpx.ReadTimeout("timed out", request=request)

    (out,) = capture_many("http://fake", tmp_path, [[1, 2, 3]], lambda i, c: c,
                          transport=httpx.MockTransport(written_then_timed_out))
    assert isinstance(out, httpx.ReadTimeout) and not list(tmp_path.glob("*.safetensors"))
