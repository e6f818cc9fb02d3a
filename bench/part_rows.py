"""What one part of a stream capture pays to read its rows from a large
JSONL dataset, in one run. No server, no tokenizer.

    .venv/bin/python bench/part_rows.py                       # 200k rows of ~2 KB, parts of 64 rows
    .venv/bin/python bench/part_rows.py --rows 600000 --part 256

A stream run captures in parts (two batches each with a spool), and every
part's extraction plans only its rows (`prepare_samples(..., rows=)`), so a
dataset of N rows is read once per part: N / part reads an epoch. Two ways
to read a part's rows: (a) decode and parse every line, keep the part's (what
`prepare_samples` did); (b) `read_rows(..., rows=)`: a line not asked for is
counted, not decoded, and reading stops after the part's last row. Prints
both per part (the part's rows drawn at random, as training order draws
them) and their ratio. Ratios are the result: machines differ.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tasks.data.dataset import read_rows  # noqa: E402


def write_dataset(path: Path, rows: int, row_bytes: int) -> None:
    rng = random.Random(0)
    words = ["the", "capture", "of", "hidden", "states", "for", "a", "drafter", "model", "token"]
    with open(path, "w") as f:
        for i in range(rows):
            text = " ".join(rng.choice(words) for _ in range(row_bytes // 12))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"question {i}: {text}"},
                                             {"role": "assistant", "content": text}]}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--row-bytes", type=int, default=2048)
    ap.add_argument("--part", type=int, default=64, help="rows in a part")
    ap.add_argument("--parts", type=int, default=3, help="parts timed each way")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "data.jsonl"
        write_dataset(path, args.rows, args.row_bytes)
        print(f"{args.rows:,} rows, {path.stat().st_size / 2**20:,.0f} MiB; parts of {args.part} rows")
        rng = random.Random(1)
        parts = [frozenset(rng.sample(range(args.rows), args.part)) for _ in range(args.parts)]
        timings = {}
        for way, read in (("(a) parse every line", lambda p: [r for i, r in read_rows(path) if i in p]),
                          ("(b) read_rows(rows=)", lambda p: list(read_rows(path, rows=p)))):
            t0 = time.perf_counter()
            got = [read(p) for p in parts]
            timings[way] = (time.perf_counter() - t0) / len(parts)
            assert all(len(g) == args.part for g in got)
            print(f"{way}: {timings[way] * 1000:,.0f} ms a part")
        a, b = timings.values()
        print(f"ratio (a)/(b): {a / b:.1f}x; an epoch of {args.rows // args.part:,} parts reads for "
              f"{a * args.rows / args.part / 3600:.1f} h against {b * args.rows / args.part / 3600:.1f} h")


if __name__ == "__main__":
    main()
