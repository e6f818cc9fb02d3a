"""How fast the client side turns dump files into a verified store, against
the disk's own sequential write rate, in one run. No server.

    .venv/bin/python bench/store_ingest.py                       # Kimi-sized: H=7168, ~1.8 GB per variant
    .venv/bin/python bench/store_ingest.py --samples 24 --workers 8

The data: dumps of a Kimi-sized layout (3 aux + final, H=7168, bf16 as the
model computes them; prompt lengths uniform in [--min-len, --max-len]),
written as fast as possible into the dump dir (RAM-backed /dev/shm, as in the
flow) one batch at a time, outside the timed part. Then the client side
consumes them, timed: the real `capture_many` reads each dump back by rid and
checks it (an httpx transport answers for the server, so the server's own
time is not in the figure), packs the batch into one shard with its hashes,
fsyncs it and commits it to the ledger. Variants, on the same data:

  (a) 1 worker: per-sample xxh3_128, the shard written in place, the file's
      sha256 hashed alongside, one reader, one writer;
  (b) N workers: the same with N readers and N shard workers (the flow's
      default: one per core, at most 8);
  (c) as (b), FP8 storage (half the bytes).

Prints tokens/s, the store's GB/s and the dumps' GB/s read, the disk's
sequential write rate (dd-like: 1 GiB in 8 MiB blocks, fsync) measured in
the same run, and the ratios: to the disk, and to (a), what the worker pool
and FP8 change. Ratios are the result: machines differ.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import torch

import tasks.capture.client as client
from tasks.capture.dump import write_chunk
from tasks.capture.config import CaptureConfig
from tasks.capture.extraction import Endpoint, extract_batch
from tasks.data.dataset import Sample
from tasks.paths import default_dump_root
from tasks.store.ledger.open import open_ledger, open_store
from tasks.store.handle import Store
from tasks.store.shards import BF16, FORMAT, FP8, default_workers

LAYERS = (1, 30, 56)  # any three: the layout, not the model, is what is measured


def disk_write_rate(where: Path, nbytes: int = 1 << 30, block: int = 8 << 20) -> float:
    """Bytes/s of one sequential write, fsynced: what the disk itself takes."""
    buf = os.urandom(block)
    path = where / ".dd-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        for _ in range(nbytes // block):
            os.write(fd, buf)
        os.fsync(fd)
        return nbytes / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()


class Answers(httpx.AsyncBaseTransport):
    """Answers /generate as SGLang does once the prompt was prefilled; the
    dump is already there (written before the timed part)."""

    async def handle_async_request(self, request):
        body = json.loads(await request.aread())
        meta = {"id": body["rid"], "prompt_tokens": len(body["input_ids"]), "cached_tokens": 0}
        return httpx.Response(200, json={"meta_info": meta})


def produce(dump_dir: Path, batch: list[Sample], pool_aux: torch.Tensor, pool_final: torch.Tensor) -> float:
    """Write the batch's dumps (rid = e3-bench-<index in batch>, as the
    patched new_rid will name them), all at once."""
    def one(i: int):
        s = batch[i]
        n = s.num_tokens
        at = (i * 997) % (pool_aux.shape[0] - n + 1)
        write_chunk(dump_dir, f"e3-bench-{i}", 0, torch.from_numpy(s.input_ids.astype(np.int64)),
                    pool_aux[at:at + n], pool_final[at:at + n], LAYERS, "post-norm")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=default_workers()) as pool:
        list(pool.map(one, range(len(batch))))
    return time.perf_counter() - t0


def manifest(hidden: int, storage: str) -> dict:
    return {"format": FORMAT, "target": {"name": "kimi-layout"}, "tokenizer": {"sha256": "-"},
            "aux_layers": {"sglang_layer_output_ids": list(LAYERS)}, "hidden_size": hidden, "dtype": storage, "max_length": 1 << 20,
            "max_length_policy": "truncate"}


def run_variant(label: str, batches, work: Path, dump_dir: Path, pools, hidden: int, *, workers: int,
                storage: str) -> dict:
    store = work / f"store-{label}"
    open_store(store, manifest(hidden, storage))
    timed = produced = 0.0
    for batch in batches:
        produced += produce(dump_dir, batch, *pools)
        t0 = time.perf_counter()
        result = extract_batch(Endpoint("http://bench", dump_dir, LAYERS, transport=Answers()), Store.open(store),
                               "bench", batch, CaptureConfig(concurrency=8), store_workers=workers)
        assert result.samples == len(batch) and not result.quarantined, result
        timed += time.perf_counter() - t0
    summary = open_ledger(store).summary()
    assert not list(dump_dir.iterdir()), "dumps left behind"
    shutil.rmtree(store)
    return {"seconds": timed, "produce_s": produced, "tokens": summary["tokens"], "store_bytes": summary["bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=6)
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=default_workers())
    ap.add_argument("--work-dir", default=None, help="where the stores go (default: a temp dir on the system disk)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, size=args.samples)
    samples = [Sample(f"s{k:05d}", k, rng.integers(0, 150000, size=int(n)).astype(np.int32),
                      (rng.random(int(n)) < 0.6).astype(np.uint8)) for k, n in enumerate(lengths)]
    batches = [samples[i: i + args.batch_size] for i in range(0, len(samples), args.batch_size)]
    g = torch.Generator().manual_seed(args.seed)
    pools = (torch.randn(args.max_len + 997, 3, args.hidden, generator=g).to(torch.bfloat16),
             torch.randn(args.max_len + 997, args.hidden, generator=g).to(torch.bfloat16))
    # Each batch's dumps are named by their index in it, so the timed part
    # finds the files it asks for; every other step of the client is the real one.
    client.new_rid = lambda tag="", prefix="": f"e3-bench-{tag}"

    work = Path(tempfile.mkdtemp(prefix="e3-ingest-", dir=args.work_dir))
    dump_dir = default_dump_root() / f"bench-{work.name}"
    dump_dir.mkdir(parents=True)
    try:
        disk = disk_write_rate(work)
        variants = [("a", "1 worker", dict(workers=1, storage=BF16)),
                    ("b", f"{args.workers} workers", dict(workers=args.workers, storage=BF16)),
                    ("c", f"{args.workers} workers, FP8", dict(workers=args.workers, storage=FP8))]
        out = {}
        for key, _, kw in variants:
            out[key] = run_variant(key, batches, work, dump_dir, pools, args.hidden, **kw)
        tokens = out["a"]["tokens"]
        dump_per_token = 3 * args.hidden * 2 + args.hidden * 2 + 8
        print(f"{len(samples)} samples, {tokens:,} tokens, H={args.hidden}, {os.cpu_count()} cores; "
              f"dumps {tokens * dump_per_token / 1e9:.2f} GB per variant")
        print(f"disk sequential write (fsync): {disk / 1e9:.2f} GB/s")
        print(f"{'variant':40s} {'tok/s':>9s} {'store GB/s':>11s} {'dumps GB/s':>11s} {'vs disk':>8s} {'vs (a)':>7s}")
        for key, label, _ in variants:
            r = out[key]
            rate = r["tokens"] / r["seconds"]
            store_rate = r["store_bytes"] / r["seconds"]
            print(f"({key}) {label:36s} {rate:9,.0f} {store_rate / 1e9:11.2f} "
                  f"{r['tokens'] * dump_per_token / r['seconds'] / 1e9:11.2f} {store_rate / disk:8.2f} "
                  f"{rate / (out['a']['tokens'] / out['a']['seconds']):7.2f}")
        produce_rate = sum(r["tokens"] for r in out.values()) / sum(r["produce_s"] for r in out.values())
        print(f"(dump production, not timed above: {produce_rate:,.0f} tok/s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(dump_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
