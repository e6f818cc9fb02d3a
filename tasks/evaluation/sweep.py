"""Throughput against per-user speed at several numbers of concurrent
streams, the trade speculative decoding is judged by: it pays at one
stream and can cost total throughput at many (a drafter at 2.85x per user
with one stream, 1.16x at 64, 0.74x total at 128 in speculators' tutorial).

A point is valid by construction: each point starts with a warm-up round
that is not measured; the launcher starts every server with the prefix
cache off (`--disable-radix-cache`), so a prompt sent twice is computed
twice; and a speculative point sends rounds until it has measured at least
`min_verify_steps` verify steps.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass
from itertools import cycle, islice
from typing import Sequence

from tasks.evaluation.generate import GenerationRun, generate_all

logger = logging.getLogger("eagle3.serving")

MAX_ROUNDS = 32  # a speculative point that still lacks its verify steps after this many rounds is an error


@dataclass(frozen=True)
class SweepPoint:
    concurrency: int
    requests: int  # measured, warm-up excluded
    completion_tokens: int
    wall_s: float
    verify_steps: int  # 0 on a plain server
    per_user_tokens_per_s: float  # mean over requests of its tokens / its latency
    total_tokens_per_s: float  # all tokens / wall time

    def to_dict(self) -> dict:
        return asdict(self)


def point_of(concurrency: int, runs: Sequence[GenerationRun]) -> SweepPoint:
    tokens = sum(r.completion_tokens for r in runs)
    wall = sum(r.wall_s for r in runs)
    speeds = [len(ids) / latency for r in runs for ids, latency in zip(r.output_ids, r.latencies_s) if latency > 0]
    return SweepPoint(
        concurrency=concurrency, requests=sum(len(r.output_ids) for r in runs), completion_tokens=tokens,
        wall_s=wall, verify_steps=sum(int(m.get("spec_verify_ct", 0)) for r in runs for m in r.meta_infos),
        per_user_tokens_per_s=sum(speeds) / len(speeds) if speeds else 0.0,
        total_tokens_per_s=tokens / wall if wall > 0 else 0.0)


def sweep(url: str, prompts: Sequence[Sequence[int]], concurrencies: Sequence[int], *, max_new_tokens: int,
          speculative: bool, min_verify_steps: int, timeout_s: float, tag: str,
          api_key: str | None = None) -> list[SweepPoint]:
    """One point per concurrency: `concurrency` streams kept busy through
    rounds of 2 x concurrency requests (prompts cycled), greedy, EOS ignored."""
    points = []
    for c in concurrencies:
        round_prompts = list(islice(cycle(prompts), 2 * c))

        def one_round(name: str) -> GenerationRun:
            return asyncio.run(generate_all(url, round_prompts, max_new_tokens=max_new_tokens, ignore_eos=True,
                                            concurrency=c, timeout_s=timeout_s, tag=f"{tag}-{name}", api_key=api_key))

        one_round(f"c{c}-warmup")
        runs = [one_round(f"c{c}-0")]
        while speculative and point_of(c, runs).verify_steps < min_verify_steps:
            if len(runs) == MAX_ROUNDS:
                raise RuntimeError(f"{tag}: {MAX_ROUNDS} rounds at concurrency {c} measured only "
                                   f"{point_of(c, runs).verify_steps} verify steps (< {min_verify_steps}); "
                                   f"is the server speculative?")
            runs.append(one_round(f"c{c}-{len(runs)}"))
        point = point_of(c, runs)
        logger.info("%s, %d streams: %d requests, %.1f tokens/s per user, %.1f tokens/s in all%s", tag, c,
                    point.requests, point.per_user_tokens_per_s, point.total_tokens_per_s,
                    f", {point.verify_steps} verify steps" if speculative else "")
        points.append(point)
    return points
