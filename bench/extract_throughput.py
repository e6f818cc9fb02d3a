"""Throughput of the extraction pipeline against its baselines, in one run.

    .venv/bin/python bench/extract_throughput.py --model smollm2-135m-instruct --samples 96
    .venv/bin/python bench/extract_throughput.py --model tiny-llama --samples 300

On the same SGLang build, model and prompts (the bundled demo conversations):
  (a) plain prefill, capture off: a server without capture flags or hook;
  (b) the whole pipeline: capture, dump, read back and check, shard write and
      ledger commit (tasks.extraction.extract_batch, two batches in flight as
      in the flow);
  (c) the old serial design: clear the dump dir, send one request, read
      whatever file appeared, save it as its own file.
Prints tokens/s of each, the ratios b/a and b/c, and stored bytes against the
raw tensor bytes. Ratios, not absolute numbers, are the result: this machine
is shared and noisy, and all three are measured back to back.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from tasks.capture.config import CaptureConfig
from tasks.capture.extraction import Endpoint, extract_batch
from tasks.data.dataset import DEMO_DATASET, prepare_samples
from tasks.paths import default_dump_root
from tasks.server.config import ServerConfig
from tasks.server.launch import CaptureSpec, LaunchSpec, launch_server
from tasks.sglang_api import auth_headers
from tasks.store.handle import Store
from tasks.store.ledger.open import open_ledger, open_store
from tasks.store.manifest import build_manifest
from tasks.store.shards import bytes_per_token
from tasks.target.architectures import architecture_of
from tasks.target.layers import AuxLayers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (the tiny models) is not installed
from tests.tiny_models import resolve_model_or_tiny  # noqa: E402


async def _prefill_all(url: str, id_lists, in_flight: int, api_key: str) -> None:
    limit = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient(timeout=600, headers=auth_headers(api_key)) as client:
        async def one(i, ids):
            async with limit:
                r = await client.post(f"{url}/generate", json={
                    "input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "rid": f"plain-{i}-{time.time_ns()}"})
                r.raise_for_status()
        await asyncio.gather(*(one(i, ids) for i, ids in enumerate(id_lists)))


def plain_prefill(cfg: LaunchSpec, id_lists, in_flight: int, log: Path) -> float:
    with launch_server(cfg, log) as server:
        asyncio.run(_prefill_all(server.url, id_lists[:8], in_flight, server.api_key))  # warm-up
        t0 = time.perf_counter()
        asyncio.run(_prefill_all(server.url, id_lists, in_flight, server.api_key))
        return time.perf_counter() - t0


def pipeline(server, dump_dir, store, source, samples, layers, batch_size, concurrency) -> float:
    batches = [samples[i: i + batch_size] for i in range(0, len(samples), batch_size)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:
        endpoint = Endpoint(server.url, dump_dir, layers.sglang_ids, api_key=server.api_key,
                            rid_prefix=server.rid_prefix)
        opened = Store.open(store)
        for result in pool.map(lambda b: extract_batch(endpoint, opened, source, b,
                                                       CaptureConfig(concurrency=concurrency)), batches):
            assert not result.quarantined, result.quarantined
    return time.perf_counter() - t0


def clear_and_scan(server, dump_dir: Path, out_dir: Path, id_lists) -> float:
    """The design this project replaces: correct only because it is serial."""
    out_dir.mkdir(parents=True, exist_ok=True)
    url = server.url
    t0 = time.perf_counter()
    with httpx.Client(timeout=600, headers=auth_headers(server.api_key)) as client:
        for i, ids in enumerate(id_lists):
            for f in dump_dir.iterdir():
                f.unlink()
            r = client.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                                     "rid": f"{server.rid_prefix}serial-{i}"})
            r.raise_for_status()
            tensors = {}
            for f in sorted(dump_dir.iterdir()):  # "whatever appeared"
                tensors.update({f"{f.name}/{k}": v for k, v in load_file(f).items()})
            save_file(tensors, str(out_dir / f"sample-{i}.safetensors"))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()

    model = resolve_model_or_tiny(args.model)
    config = json.loads((model / "config.json").read_text())
    layers = AuxLayers.for_model(config["num_hidden_layers"])
    tok = AutoTokenizer.from_pretrained(model)
    samples, _ = prepare_samples(DEMO_DATASET, tok, max_length=4096)
    samples = samples[: args.samples]
    id_lists = [s.input_ids.tolist() for s in samples]
    tokens = sum(map(len, id_lists))
    work = Path(tempfile.mkdtemp(prefix="e3-bench-"))
    dump_dir = default_dump_root() / f"bench-{work.name}"
    try:
        base = CaptureSpec(ServerConfig(model=str(model)), dump_dir=dump_dir)
        t_plain = plain_prefill(replace(base, capture=False), id_lists, 2 * args.concurrency, work / "plain.log")

        store = work / "store"
        open_store(store, build_manifest(model, tok, layers, architecture_of(config), max_length=4096,
                                         policy="truncate", sources=[str(DEMO_DATASET)]))
        with launch_server(replace(base, aux_layer_ids=layers.sglang_ids), work / "capture.log") as server:
            # warm-up (not captured: plain rids)
            asyncio.run(_prefill_all(server.url, id_lists[:8], 2 * args.concurrency, server.api_key))
            t_pipe = pipeline(server, dump_dir, store, str(DEMO_DATASET), samples, layers,
                              args.batch_size, args.concurrency)
            t_serial = clear_and_scan(server, dump_dir, work / "serial", id_lists)

        summary = open_ledger(store).summary()
        assert summary["tokens"] == tokens, summary
        raw = tokens * bytes_per_token(config["hidden_size"])  # the tensors alone, no header
        a, b, c = tokens / t_plain, tokens / t_pipe, tokens / t_serial
        print(f"model {model.name}: {len(samples)} samples, {tokens} tokens, hidden {config['hidden_size']}")
        print(f"(a) plain prefill, capture off   {a:9.0f} tok/s")
        print(f"(b) whole pipeline               {b:9.0f} tok/s")
        print(f"(c) serial clear-and-scan        {c:9.0f} tok/s")
        print(f"b/a = {b / a:.3f}   b/c = {b / c:.2f}")
        print(f"stored {summary['bytes']:,} bytes for {raw:,} raw tensor bytes: overhead {100 * (summary['bytes'] / raw - 1):.3f}%")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(dump_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
