"""Regeneration's scheduling, in one run on one real server: the same
conversations, each answer's length drawn long-tailed (a seeded lognormal
cap per conversation, as reasoning answers are), answered

  batches: as the stage did before its pool: two batch tasks at a time,
           each with its own `width / 2` requests in flight, a batch over
           only when its longest answer is;
  pool:    through the stage's AnswerPool of `width`, batches of the same
           size handed to it by as many workers as keep it full,

at each width, alternating, best of `--rounds`. Prints the mean number of
requests in flight (counted at the transport: the same count for both),
wall time, generated tokens/s and pool / batches.

    python bench/regeneration.py [--model smollm2-135m-instruct] [--rows 64] [--widths 4,8,16,32]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tasks.data.dataset import DEMO_DATASET, read_rows, to_messages
from tasks.regeneration.answers import Asker
from tasks.regeneration.config import RegenerateConfig
from tasks.regeneration.pool import AnswerPool
from tasks.regeneration.stage import answer_server, batch_workers
from tasks.regeneration.turns import Conversation, prompt_messages
from tasks.server.config import ServerConfig
from tasks.server.launch import launch_server
from tasks.target.architectures import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (the tiny models) is not installed
from tests.tiny_models import TINY, resolve_model_or_tiny  # noqa: E402


RID_PREFIX = "bench-"


class LongTail(httpx.AsyncBaseTransport):
    """Forwards to the server, capping each answer at its conversation's
    drawn length, and integrates the requests open over time."""

    def __init__(self, caps: dict[str, int]):
        # One connection pool per event loop (the batch schedule's pools each run their own).
        self.caps, self.reals, self.lock = caps, {}, threading.Lock()
        self.open, self.area, self.since, self.t0 = 0, 0.0, time.perf_counter(), time.perf_counter()
        self.tokens = 0

    def _step(self, k: int) -> None:
        with self.lock:
            now = time.perf_counter()
            self.area += self.open * (now - self.since)
            self.since, self.open = now, self.open + k

    async def handle_async_request(self, request):
        body = json.loads(request.content)
        conversation = body["rid"][len(RID_PREFIX):].split("-")[0]  # <prefix><row_id>-<turn>-<attempt>-<nonce>
        body["sampling_params"]["max_new_tokens"] = self.caps[conversation]
        forwarded = httpx.Request(request.method, request.url, headers={
            k: v for k, v in request.headers.items() if k.lower() != "content-length"}, json=body)
        self._step(+1)
        try:
            real = self.reals.setdefault(id(asyncio.get_running_loop()), httpx.AsyncHTTPTransport())
            response = await real.handle_async_request(forwarded)
            answered = len(json.loads(await response.aread()).get("output_ids", ()))
            with self.lock:
                self.tokens += answered
            return response
        finally:
            self._step(-1)

    def mean_open(self) -> float:
        now = time.perf_counter()
        return (self.area + self.open * (now - self.since)) / max(now - self.t0, 1e-9)


def by_batches(server, asker, batches, width, transport) -> None:
    def one(batch):
        with AnswerPool(max(width // 2, 1), api_key=server.api_key, transport=transport) as own:
            return own.answer_many(asker, batch)

    with ThreadPoolExecutor(2) as workers:
        outs = [o for done in workers.map(one, batches) for o in done]
    _check(outs)


def by_pool(server, asker, batches, width, transport) -> None:
    with AnswerPool(width, api_key=server.api_key, transport=transport) as pool, \
            ThreadPoolExecutor(batch_workers(width, len(batches[0]))) as workers:
        outs = [o for done in workers.map(lambda b: pool.answer_many(asker, b), batches) for o in done]
    _check(outs)


def _check(outs) -> None:
    failed = [o for o in outs if isinstance(o, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)} conversations failed: {failed[0]!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=TINY, help="a checkpoint, smollm2-135m-instruct or a tiny model's name")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--widths", default="4,8,16,32")
    ap.add_argument("--median-tokens", type=int, default=24, help="the answers' median length")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    model = resolve_model_or_tiny(args.model)
    tokenizer = load_tokenizer(model)
    rng = random.Random(0)
    rows = [row for _, row in read_rows(DEMO_DATASET)][:args.rows]
    conversations = [Conversation(f"c{k}", k, tuple(prompt_messages(row))) for k, row in enumerate(rows)
                     if to_messages(row)]
    # Lognormal with sigma 1: the longest answers ~10x the median, as reasoning's are.
    caps = {c.row_id: max(1, min(args.max_tokens, round(args.median_tokens * rng.lognormvariate(0, 1.0))))
            for c in conversations}
    batches = [conversations[i:i + args.batch_size] for i in range(0, len(conversations), args.batch_size)]
    cfg = RegenerateConfig(turns="last", max_new_tokens=args.max_tokens)
    widths = [int(w) for w in args.widths.split(",")]
    print(f"{len(conversations)} conversations in batches of {args.batch_size}, answers capped at a lognormal "
          f"length (median {args.median_tokens}, max {max(caps.values())}, {sum(caps.values()):,} tokens at most), "
          f"{model.name}, greedy, best of {args.rounds}")
    with tempfile.TemporaryDirectory(prefix="e3-regen-bench-") as tmp:
        spec = answer_server(ServerConfig(model=str(model)), model)
        with launch_server(spec, Path(tmp) / "server.log") as server:
            asker = Asker(server.url, tokenizer, cfg, api_key=server.api_key, rid_prefix=RID_PREFIX)
            by_pool(server, asker, [conversations[:4]], 4, LongTail({c.row_id: 8 for c in conversations}))  # warm
            print(f"{'width':>5} {'schedule':>8} {'in flight':>9} {'wall s':>7} {'tok/s':>7}")
            for width in widths:
                best = {}
                for _ in range(args.rounds):
                    for name, run in (("batches", by_batches), ("pool", by_pool)):
                        transport = LongTail(caps)
                        t0 = time.perf_counter()
                        run(server, asker, batches, width, transport)
                        wall = time.perf_counter() - t0
                        if name not in best or wall < best[name][1]:
                            best[name] = (transport.mean_open(), wall, transport.tokens)
                for name, (flight, wall, tokens) in best.items():
                    print(f"{width:>5} {name:>8} {flight:>9.1f} {wall:>7.1f} {tokens / wall:>7.1f}")
                print(f"{width:>5} {'pool / batches: wall':>18} {best['pool'][1] / best['batches'][1]:.3f}, "
                      f"in flight {best['pool'][0] / best['batches'][0]:.2f}x")


if __name__ == "__main__":
    main()
