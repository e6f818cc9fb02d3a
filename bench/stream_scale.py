"""Stream mode at Kimi-K2.5's size, planned and leased for real, in one run.
No model, no server, no GPU; a private PostgreSQL server for the leases.

    .venv/bin/python bench/stream_scale.py                    # 600k samples, H 7168, 16 ranks on 2 nodes
    .venv/bin/python bench/stream_scale.py --samples 100000 --nodes 8

The plan: --samples samples whose lengths are drawn from the demo
conversations' (data/demo_conversations.jsonl, tokenised by SmolLM2's
tokenizer when it is cached, else by words x 1.3), scaled to the Kimi-K2.5
workload's mean (88M tokens over 37k samples: 2,378 a sample), cut at
max_length 8192; 70% of a sample's tokens are its answer. planned through
tasks.stream.plan.plan_order (what plan_stream does once the dataset is
tokenised) with configs/kimi-k2.5.yaml's training (tokens_per_batch 8192,
3 epochs, 5% held out, eval_max_samples 256, 64 served prompts) on 16
ranks (2 nodes x 8) and a 370 GB budget, in bf16 and in FP8. Printed: plan
time, parts, the held-out bytes the budget holds against what capturing the
whole held-out split took (the old way, outside the budget), the minimum.

The leases: --nodes node loops (threads, a connection each per call, as
flows/stream_node.py) poll tasks.stream.parts.PartQueue.lease for
--seconds while the spool is full (its epoch stores hold more than the
room, PostgreSQL-indexed as on many nodes). Polls answered per second: the
queue as it is (a full spool answered without the lease lock), against the
same polls each taking the lock first and counting the spool under it (the
way before). Then the per-step lookup a trainer rank pays: the shard rows
of a step's samples (16 ranks x 8192 tokens) in a spool store's index.
Ratios are the result: machines differ.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tasks.store.ledger.open import open_store  # noqa: E402
from tasks.store.shards import BF16, FP8, FORMAT, ShardInfo, bytes_per_token  # noqa: E402
from tasks.stream.parts import NEXT, Part, PartQueue, capture_parts  # noqa: E402
from tasks.stream.plan import plan_order  # noqa: E402
from tasks.stream.spool import SpoolBudget, epoch_store  # noqa: E402
from tasks.train.config import TrainConfig  # noqa: E402
from tests.pg_server import start as start_postgres  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KIMI_MEAN = 88e6 / 37e3  # tokens a sample in the workload that started the project
HIDDEN, AUX = 7168, 3
BUDGET = 370 * 10**9
MANIFEST = {"format": FORMAT, "target": {"name": "bench"}, "tokenizer": {"sha256": "t"},
            "aux_layers": {"sglang_ids": [1, 2, 3]}, "hidden_size": HIDDEN, "dtype": BF16, "max_length": 8192,
            "max_length_policy": "truncate", "target_path": "bench", "sources": ["bench.jsonl"]}


def demo_lengths() -> np.ndarray:
    """The demo conversations' lengths in tokens (words x 1.3 without a cached tokenizer)."""
    rows = [json.loads(line) for line in (REPO / "data" / "demo_conversations.jsonl").read_text().splitlines()]
    words = [sum(len(m["content"].split()) for m in r["messages"]) for r in rows]
    return np.asarray(words, dtype=np.float64) * 1.3


def drawn(samples: int, seed: int = 0) -> dict[str, list]:
    """Planned samples' columns: lengths drawn like the demo's, at Kimi's mean."""
    g = np.random.default_rng(seed)
    base = demo_lengths()
    lengths = np.clip(np.round(g.choice(base, samples) * KIMI_MEAN / base.mean()), 16, 8192).astype(np.int64)
    return {"sample_id": [f"{g.integers(2**63):016x}{k:016x}" for k in range(samples)],
            "source_row": list(range(samples)), "num_tokens": lengths.tolist(),
            "num_loss_tokens": (lengths * 7 // 10).tolist()}


def kimi_train(spool_bytes: int | None) -> TrainConfig:
    return TrainConfig(out_dir="/tmp/bench", draft_vocab_size=32000, ttt_steps=7, epochs=3, tokens_per_batch=8192,
                       devices=8, nnodes=2, rdzv_endpoint="head:29500", heldout_fraction=0.05,
                       eval_max_samples=256, stream=True, spool_bytes=spool_bytes)


def plan_figures(columns: dict, dtype: str) -> dict:
    per_token = bytes_per_token(HIDDEN, AUX, dtype)
    started = time.perf_counter()
    plan = plan_order(columns, [], per_token, 64, kimi_train(BUDGET), served_prompts=64)
    seconds = time.perf_counter() - started
    root = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    parts = capture_parts(plan, 64, root, BUDGET)
    whole = plan_order(columns, [], per_token, 64, kimi_train(None))  # every held-out sample, as before
    return {"plan_s": seconds, "parts": len(parts), "epochs": len(plan.epochs), "per_token": per_token,
            "heldout": len(plan.heldout), "heldout_bytes": plan.heldout_bytes, "all_heldout": len(whole.heldout),
            "all_heldout_bytes": whole.shard_bytes(whole.heldout, 64), "minimum": plan.minimum,
            "part_bytes": max(p.need for p in parts), "tokens": sum(columns["num_tokens"])}


def full_spool(root: Path, url: str) -> tuple[PartQueue, SpoolBudget]:
    """A store with its part queue, and two spool stores holding more than the room, all in PostgreSQL."""
    ledger = open_store(root, MANIFEST, url)
    for e in (0, 1):
        spool = open_store(epoch_store(root, e), MANIFEST, url)
        for k in range(20):
            name = f"shard-{e}-{k:04d}"
            spool.commit_shard(ShardInfo(name, "0" * 64, 10**9, 1, 1000), [
                {"sample_id": f"{e}-{k}", "source": "bench.jsonl", "source_row": k, "shard": name, "position": 0,
                 "token_offset": 0, "num_tokens": 1000, "num_loss_tokens": 700, "checksum": "0" * 32}])
    queue = PartQueue(ledger)
    queue.plan([Part(k, 0, "spool/epoch-0000", (k,), 10**9, 1000, k + 1, 1000) for k in range(1000)])
    return queue, SpoolBudget(root, 30 * 10**9)  # 40 GB held: full


def locked_lease(queue: PartQueue, node: str, budget: SpoolBudget):
    """The way before: every poll takes the lease lock, then counts the spool under it."""
    with queue.ledger.transaction() as db:
        queue._serialise(db)
        row = db.execute(f"SELECT {NEXT} LIMIT 1").fetchone()
        if row is not None and row[4] and not budget.admits(row[4], queue._in_flight(db)):
            return "full"
        return row


def polls_per_s(poll, nodes: int, seconds: float) -> float:
    counts, stop = [0] * nodes, time.perf_counter() + seconds

    def loop(k: int) -> None:
        while time.perf_counter() < stop:
            assert poll(f"node-{k}") == "full"
            counts[k] += 1

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=600_000)
    ap.add_argument("--nodes", type=int, default=16, help="capture node loops polling the lease queue")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    columns = drawn(args.samples)
    print(f"{args.samples:,} samples, {sum(columns['num_tokens']) / 1e9:.2f}B tokens (mean "
          f"{np.mean(columns['num_tokens']):,.0f}); 16 ranks on 2 nodes, budget {BUDGET / 1e9:.0f} GB")
    for dtype in (BF16, FP8):
        f = plan_figures(columns, dtype)
        print(f"[{dtype}] {f['per_token']:,} bytes a token: planned {f['epochs']} epochs in {f['plan_s']:.1f} s, "
              f"{f['parts']:,} parts (largest {f['part_bytes'] / 1e9:.2f} GB); trainer minimum "
              f"{f['minimum'] / 1e9:.2f} GB")
        print(f"[{dtype}] held out: {f['heldout']} samples captured, {f['heldout_bytes'] / 1e9:.2f} GB "
              f"({100 * f['heldout_bytes'] / BUDGET:.2f}% of the budget, inside it); the whole split "
              f"({f['all_heldout']:,} samples) took {f['all_heldout_bytes'] / 1e12:.2f} TB, "
              f"{f['all_heldout_bytes'] / BUDGET:.1f}x the budget, outside it: "
              f"{f['all_heldout_bytes'] / max(1, f['heldout_bytes']):,.0f}x less now")
    pg = start_postgres()
    os.environ["EAGLE3_LEDGER_URL"] = pg.url  # as on every node: the stores record the URL without its password
    try:
        with tempfile.TemporaryDirectory() as tmp:
            queue, budget = full_spool(Path(tmp) / "store", pg.url)
            now = polls_per_s(lambda node: queue.lease(node, budget), args.nodes, args.seconds)
            before = polls_per_s(lambda node: locked_lease(queue, node, budget), args.nodes, args.seconds)
            print(f"{args.nodes} node loops polling a full spool: {now:,.0f} polls/s answered without the lock, "
                  f"{before:,.0f}/s each taking it (before): {now / before:.1f}x")
            spool = open_store(epoch_store(Path(tmp) / "step", 0), MANIFEST, pg.url)
            per_shard, step = 64, 16 * 8192 // int(KIMI_MEAN) + 1
            for first in range(0, 20_000, per_shard):
                name = f"shard-{first:08d}"
                spool.commit_shard(ShardInfo(name, "0" * 64, 1, per_shard, 1), [
                    {"sample_id": f"{k:032x}", "source": "bench.jsonl", "source_row": k, "shard": name,
                     "position": k - first, "token_offset": 0, "num_tokens": 1, "num_loss_tokens": 1,
                     "checksum": "0" * 32} for k in range(first, first + per_shard)])
            ids = [f"{k:032x}" for k in range(10_000, 10_000 + step)]
            started = time.perf_counter()
            shards = {}
            for sid in ids:
                if sid not in shards:
                    rows = spool.shard_index(sid)
                    shards.update((r[0], r[1]) for r in rows)
            print(f"a step's {step} samples (16 ranks x 8192 tokens) looked up in a spool store of 20,000: "
                  f"{(time.perf_counter() - started) * 1e3:.1f} ms ({len(set(shards.values()))} shard lookups)")
    finally:
        pg.stop()


if __name__ == "__main__":
    main()
