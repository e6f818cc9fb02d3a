"""The regeneration stage's overhead, in one run on one server: the same
prompts answered (greedy, so the same tokens) by the plain server's own
decode, raw /generate requests at the stage's concurrency, and by the stage
(tasks/regeneration: the chat template, batches, shards, the index),
alternating, best of `--rounds` each. Prints answers/s, generated tokens/s
and the stage's share of the plain throughput.

    python bench/regeneration.py [--model smollm2-135m-instruct] [--rows 64] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tasks.data.dataset import DEMO_DATASET, read_rows
from tasks.regeneration.config import RegenerateConfig
from tasks.regeneration.stage import regenerate
from tasks.regeneration.turns import prompt_messages, render_prompt
from tasks.server.config import ServerConfig
from tasks.server.launch import LaunchSpec, launch_server
from tasks.sglang_api import client_options
from tasks.target.architectures import load_tokenizer
from tasks.target.models import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (the tiny models) is not installed
from tests.tiny_models import TINY, ensure_model  # noqa: E402


async def plain_decode(url: str, api_key: str, prompts: list[list[int]], cfg: RegenerateConfig) -> int:
    """Every prompt answered by raw requests, cfg.concurrency at once; tokens generated."""
    limit = asyncio.Semaphore(cfg.concurrency)
    async with httpx.AsyncClient(timeout=3600, **client_options(api_key)) as client:
        async def one(ids):
            async with limit:
                r = await client.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {
                    **cfg.sampling(), "max_new_tokens": cfg.max_new_tokens}})
                return len(r.raise_for_status().json()["output_ids"])
        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint or smollm2-135m-instruct (default: the tiny model)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    model = resolve_model(args.model) if args.model else ensure_model(TINY)
    tokenizer = load_tokenizer(model)
    cfg = RegenerateConfig(turns="last", max_new_tokens=args.max_new_tokens, concurrency=args.concurrency,
                           batch_size=args.concurrency * 4)
    rows = [row for _, row in read_rows(DEMO_DATASET)][:args.rows]
    prompts = [render_prompt(tokenizer, prompt_messages(r), None) for r in rows]
    with tempfile.TemporaryDirectory(prefix="e3-regen-bench-") as tmp:
        source = Path(tmp) / "rows.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with launch_server(LaunchSpec(ServerConfig(model=str(model))), Path(tmp) / "server.log") as server:
            asyncio.run(plain_decode(server.url, server.api_key, prompts[:4], cfg))  # warm
            plain, stage = [], []
            for k in range(args.rounds):
                t0 = time.perf_counter()
                tokens = asyncio.run(plain_decode(server.url, server.api_key, prompts, cfg))
                plain.append((tokens, time.perf_counter() - t0))
                result = regenerate(server.url, source, Path(tmp) / f"answers-{k}", tokenizer, model, cfg,
                                    api_key=server.api_key)
                stage.append((result["answer_tokens"], result["seconds"]))
    (pt, ps), (st, ss) = min(plain, key=lambda r: r[1]), min(stage, key=lambda r: r[1])
    print(f"{len(rows)} prompts, up to {cfg.max_new_tokens} tokens each, {cfg.concurrency} in flight, "
          f"{model.name}, best of {args.rounds}")
    print(f"plain decode: {len(rows) / ps:.2f} answers/s, {pt / ps:.1f} tok/s ({pt} tokens)")
    print(f"stage:        {len(rows) / ss:.2f} answers/s, {st / ss:.1f} tok/s ({st} tokens)")
    print(f"stage / plain throughput: {(st / ss) / (pt / ps):.3f}")


if __name__ == "__main__":
    main()
