"""Generation on a running SGLang server, as the evaluation measures it:
every prompt's output ids and meta_info (SGLang's own counts), its latency,
the run's wall time; and the dtype the servers compare in.

float32 by default: in bf16, two plain servers can already disagree at
near-tied logits, which would read as speculation changing greedy output.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

from tasks.sglang_api import ServerError, client_options, server_says
from tasks.target.architectures import architecture_at

logger = logging.getLogger("eagle3.serving")


@dataclass
class GenerationRun:
    """One server's outputs for the prompts, in prompt order."""
    output_ids: list[list[int]]
    meta_infos: list[dict]
    wall_s: float
    latencies_s: list[float] = field(default_factory=list)  # per request, from sending to its answer

    @property
    def completion_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_ids)


def serving_dtype(model: str, wanted: str | None, baseline_url: str | None, api_key: str | None) -> str:
    """The dtype the evaluation's servers compute in: `wanted`, else float32 or
    the one dtype SGLang runs the target in; against a running baseline,
    that server's own (a different `wanted` is refused: outputs of two
    dtypes differ at near-tied logits, which would read as speculation
    changing them)."""
    if baseline_url is None:
        if wanted is not None:
            return wanted
        only = architecture_at(Path(model)).only_dtype
        if only:
            logger.info("%s runs in %s only in SGLang: the greedy outputs may differ at near-tied logits", model, only)
        return only or "float32"
    theirs = server_says(baseline_url, "/server_info", "dtype", "the server's dtype", api_key=api_key)
    if wanted is not None and wanted != theirs:
        shown = "the checkpoint's dtype (--dtype auto)" if theirs == "auto" else theirs
        raise ValueError(f"evaluate.dtype is {wanted}, but the baseline server at {baseline_url} computes in {shown}: "
                         f"set evaluate.dtype to {theirs} (or leave it unset), or use evaluate.baseline: launch")
    return theirs


async def generate_all(url: str, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, ignore_eos: bool,
                       concurrency: int, timeout_s: float, tag: str, api_key: str | None = None,
                       temperature: float = 0.0) -> GenerationRun:
    """Generation for every prompt, greedy by default, at most `concurrency`
    in flight, each request carrying the server's `api_key`. Sampled
    requests are seeded by their index, so two servers draw alike."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    limit = asyncio.Semaphore(concurrency)
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": ignore_eos}

    async def one(client: httpx.AsyncClient, i: int, ids: Sequence[int]) -> tuple[list[int], dict, float]:
        rid = f"serve-{tag}-{i}-{uuid.uuid4().hex[:8]}"
        async with limit:
            sent = time.monotonic()
            response = await client.post(f"{url}/generate", json={
                "input_ids": [int(t) for t in ids],
                "sampling_params": {**sampling, "sampling_seed": i} if temperature > 0 else sampling,
                "rid": rid,
            })
            latency = time.monotonic() - sent
        if response.status_code != 200:
            raise ServerError(f"prompt {i} (rid {rid}): HTTP {response.status_code}: {response.text[:300]}")
        body = response.json()
        if "output_ids" not in body:
            raise ServerError(f"prompt {i} (rid {rid}): the response has no output_ids: {str(body)[:300]}")
        return list(body["output_ids"]), body.get("meta_info", {}), latency

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=timeout_s, **client_options(api_key)) as client:
        results = await asyncio.gather(*(one(client, i, ids) for i, ids in enumerate(prompts)))
    wall_s = time.monotonic() - started
    return GenerationRun([r[0] for r in results], [r[1] for r in results], wall_s, [r[2] for r in results])
