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
from tasks.capture.extraction import extract_batch
from tasks.capture.writer import DumpWriter
from tasks.data.dataset import Sample
from tasks.store.ledger import open_store
from tasks.store.reader import StoreReader
from tasks.store import fp8
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
                       "aux_layers": {"ids": list(LAYERS)}, "hidden_size": H, "dtype": storage,
                       "max_length": 64, "max_length_policy": "truncate"})
    samples = []
    for k in range(24):
        ids = np.arange(100 * k, 100 * k + 3 + k % 7, dtype=np.int32)
        samples.append(Sample(sample_id=f"s{k:02d}", source_row=k, input_ids=ids,
                              loss_mask=np.ones(len(ids), dtype=np.uint8)))
    server = FakeServer(tmp_path / "dumps")
    result = extract_batch("http://fake", tmp_path / "dumps", store, "data.jsonl", samples, aux_layer_ids=LAYERS,
                           concurrency=6, store_workers=4, transport=server.transport)
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
