"""What a stream trainer pays to find a sample the capture has just
committed, in a store of N samples, in one run. No server, no shard files.

    .venv/bin/python bench/stream_lookup.py                  # 600k samples, shards of 32 (a Kimi-size dataset)
    .venv/bin/python bench/stream_lookup.py --samples 100000 --url postgresql://...  # a PostgreSQL index

The ledger is filled with N samples' rows (committed shard by shard, as a
capture commits them). Then, per lookup of a sample stored last, the two
ways: (a) re-read the whole sample index, as a reader made for a finished
store does (what the stream reader did on each miss, every 0.5 s while it
waited); (b) `Ledger.shard_index`: the rows of the shard holding the sample,
by two indexed lookups. Prints both per lookup and their ratio; at N the
difference is what a waiting trainer loses per sample.

Then what rank 0 pays after each step to find the spool's shards that step
finished: (c) the epoch's whole sample table grouped by shard (what
StreamReader.consumed did), against (d) `shard_index` once per shard the
step's samples lie in (a step of --step-samples consecutive samples).
Ratios are the result: machines differ.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tasks.store.ledger.open import open_store  # noqa: E402
from tasks.store.shards import FORMAT, ShardInfo  # noqa: E402

MANIFEST = {"format": FORMAT, "target": {"name": "bench"}, "tokenizer": {"sha256": "t"},
            "aux_layers": {"sglang_ids": [1, 2, 3]}, "hidden_size": 7168, "dtype": "bfloat16", "max_length": 4096,
            "max_length_policy": "truncate", "target_path": "bench", "sources": ["bench.jsonl"]}


def fill(ledger, samples: int, per_shard: int) -> list[str]:
    ids = []
    for first in range(0, samples, per_shard):
        name = f"shard-{first // per_shard:08d}"
        rows = [{"sample_id": f"{k:064x}", "source": "bench.jsonl", "source_row": k, "shard": name,
                 "position": k - first, "token_offset": (k - first) * 2000, "num_tokens": 2000,
                 "num_loss_tokens": 1000, "checksum": f"{k:032x}"} for k in range(first, min(first + per_shard, samples))]
        ledger.commit_shard(ShardInfo(name, "0" * 64, 2000 * len(rows) * 57344, len(rows), 2000 * len(rows)), rows)
        ids += [r["sample_id"] for r in rows]
    return ids


def per_call(fn, repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=600_000)
    ap.add_argument("--per-shard", type=int, default=32)
    ap.add_argument("--step-samples", type=int, default=256, help="samples a step trains (all ranks)")
    ap.add_argument("--url", default=None, help="a PostgreSQL URL (default: SQLite in a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ledger = open_store(Path(tmp) / "store", MANIFEST, args.url)
        started = time.perf_counter()
        ids = fill(ledger, args.samples, args.per_shard)
        print(f"{args.samples:,} samples in shards of {args.per_shard} committed in "
              f"{time.perf_counter() - started:.0f} s ({'PostgreSQL' if args.url else 'SQLite'})")
        newest = ids[-1]
        whole = per_call(lambda: [r for r in ledger.sample_index() if r[0] == newest], 3)
        shard = per_call(lambda: ledger.shard_index(newest), 200)
        assert ledger.shard_index(newest)[-1][0] == newest
        print(f"(a) the whole index per lookup: {whole * 1e3:,.1f} ms")
        print(f"(b) shard_index per lookup:     {shard * 1e3:,.3f} ms (the {args.per_shard} rows of its shard)")
        print(f"(a)/(b): {whole / shard:,.0f}x")
        step = ids[len(ids) // 2:len(ids) // 2 + args.step_samples]
        grouped = per_call(lambda: dict(iter(ledger.samples().groupby("shard").sample_id)), 3)

        def by_shard():
            seen: set[str] = set()
            for sid in step:
                if sid not in seen:
                    seen.update(r[0] for r in ledger.shard_index(sid))

        looked = per_call(by_shard, 20)
        print(f"(c) the whole table per step:   {grouped * 1e3:,.1f} ms")
        print(f"(d) shard_index per step shard: {looked * 1e3:,.2f} ms ({-(-args.step_samples // args.per_shard)} "
              f"shards of a {args.step_samples}-sample step)")
        print(f"(c)/(d): {grouped / looked:,.0f}x")


if __name__ == "__main__":
    main()
