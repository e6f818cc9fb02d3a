"""The real SGLang server on the tiny model, checked against HF transformers."""
import asyncio
import random

import httpx
import pytest
import torch

from tasks.capture.client import capture_many, capture_one, probe_capture
from tasks.server.cpu.shim import gpu_present, resolve_dtype
from tasks.sglang_api import auth_headers
from tasks.target.reference import load_reference_model, reference_states
from tests.conftest import CHUNKED_PREFILL
from tests.reference_comparison import compare_with_reference

pytestmark = pytest.mark.server

# 600 tokens > CHUNKED_PREFILL: that prompt is prefilled in three forwards.
LENGTHS = [1, 7, 64, 255, 600]


def prompts(lengths, seed=0, vocab=2000):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def server_dtype() -> str:
    # The tiny checkpoint is bf16; on a CPU without fast bf16 the server computes in fp32.
    dtype = resolve_dtype("auto", cpu=not gpu_present())
    return "bfloat16" if dtype == "auto" else dtype


@pytest.fixture(scope="module")
def reference(tiny_model):
    """HF transformers in the dtype the server computes in."""
    return load_reference_model(str(tiny_model), getattr(torch, server_dtype()))


def access(server) -> dict:
    """The session server's own API key and rid prefix, as the pipeline sends them."""
    return {"api_key": server.api_key, "rid_prefix": server.rid_prefix}


def test_probe_round_trips(capture_server, tiny_layers):
    summary = probe_capture(capture_server.url, capture_server.spec.dump_dir, aux_layer_ids=tiny_layers.sglang_ids,
                            **access(capture_server))
    assert summary == {"tokens": 16, "aux_layer_ids": [1, 3, 4], "hidden_size": 128, "dtype": server_dtype()}


def test_captures_equal_an_independent_hf_forward(capture_server, tiny_layers, reference):
    server = capture_server
    id_lists = prompts(LENGTHS)
    chunks = {}

    def check(i, capture):
        chunks[i] = len(capture.files)
        ref_aux, ref_final = reference_states(reference, id_lists[i], tiny_layers)
        assert capture.input_ids.tolist() == id_lists[i]
        assert capture.aux_layer_ids == tiny_layers.sglang_ids
        return compare_with_reference(capture, ref_aux, ref_final)

    results = capture_many(server.url, server.spec.dump_dir, id_lists, check, concurrency=1, **access(server))
    for n, result in zip(LENGTHS, results):
        assert not isinstance(result, Exception), f"{n} tokens: {result!r}"
        assert result["min_cosine_aux"] >= 0.999 and result["min_cosine_final"] >= 0.999, (n, result)
    # The long prompt really was split, and reassembled in order.
    assert chunks[LENGTHS.index(600)] == -(-600 // CHUNKED_PREFILL)
    assert all(chunks[i] == 1 for i, n in enumerate(LENGTHS) if n <= CHUNKED_PREFILL)


def test_concurrent_requests_give_the_same_data_per_rid_as_serial(capture_server):
    server = capture_server
    id_lists = prompts([5 + 37 * i % 300 for i in range(16)], seed=1)

    def keep(i, capture):
        return capture.input_ids.clone(), capture.aux_hidden_states.clone(), capture.final_hidden_state.clone()

    serial = capture_many(server.url, server.spec.dump_dir, id_lists, keep, concurrency=1, **access(server))
    concurrent = capture_many(server.url, server.spec.dump_dir, id_lists, keep, concurrency=16, **access(server))
    for i, (s, c) in enumerate(zip(serial, concurrent)):
        assert not isinstance(s, Exception) and not isinstance(c, Exception), (i, s, c)
        assert torch.equal(s[0], c[0]) and s[0].tolist() == id_lists[i]
        # Batched kernels may round differently from single-request ones.
        for a, b in zip(s[1:], c[1:]):
            cos = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
            assert cos.min() >= 0.999, (i, cos.min())
    assert list(server.spec.dump_dir.iterdir()) == []


def test_unsafe_rids_write_nothing_anywhere(capture_server, tmp_path):
    server = capture_server
    dump_dir = server.spec.dump_dir
    outside = dump_dir.parent
    before_outside = set(outside.iterdir())
    prefix = server.rid_prefix  # unsafe rids that do carry the server's prefix
    with httpx.Client(timeout=60, headers=auth_headers(server.api_key)) as client:
        for rid in [f"{prefix}../../escape", f"{prefix}a/../../b", prefix + "x" * 200, f".{prefix}hidden"]:
            r = client.post(f"{server.url}/generate", json={
                "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0}, "rid": rid})
            assert r.status_code in (200, 400), r.text
    assert list(dump_dir.iterdir()) == []
    assert set(outside.iterdir()) == before_outside
    # ...and the server still captures afterwards.
    probe_capture(server.url, dump_dir, **access(server))


def test_requests_the_pipeline_did_not_issue_are_not_captured(capture_server):
    server = capture_server
    with httpx.Client(timeout=60, headers=auth_headers(server.api_key)) as client:
        for _ in range(3):
            assert client.get(f"{server.url}/health_generate").status_code == 200
        r = client.post(f"{server.url}/generate", json={
            "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0}, "rid": "someone-else-1"})
        assert r.status_code == 200
    assert list(server.spec.dump_dir.iterdir()) == []


def test_a_prompt_from_the_prefix_cache_would_be_refused(capture_server):
    """cached_tokens must be 0 for every capture: the server runs without
    the radix cache, so sending the same prompt twice recomputes it."""
    server = capture_server
    ids = prompts([40], seed=3)[0]

    async def twice():
        async with httpx.AsyncClient(timeout=60, headers=auth_headers(server.api_key)) as client:
            return [await capture_one(client, server.url, server.spec.dump_dir, ids, rid_prefix=server.rid_prefix)
                    for _ in range(2)]

    first, second = asyncio.run(twice())
    assert first.rid != second.rid
    assert torch.equal(first.final_hidden_state, second.final_hidden_state)
    for cap in (first, second):
        for f in cap.files:
            f.unlink()
