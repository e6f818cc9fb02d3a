"""Serve a drafter the way it will be used: EAGLE-3 speculative decoding in
SGLang, checked against plain greedy decoding of the same target.

`serve_check` runs the same prompts greedily on a plain server (launched, or
one already running) and on a speculative server with the drafter, one server
at a time, and reports whether every output is identical (speculative
decoding must not change greedy outputs), SGLang's own acceptance figures,
and the throughput of each.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import httpx

from tasks.serve.config import ServeConfig
from tasks.server.config import ServerConfig
from tasks.server.launch import LaunchSpec, check_serves, launch_server
from tasks.sglang_api import ServerError, client_options, server_says
from tasks.target.architectures import architecture_at

logger = logging.getLogger("eagle3.serving")


@dataclass
class GenerationRun:
    """One server's greedy outputs for the prompts, in prompt order."""
    output_ids: list[list[int]]
    meta_infos: list[dict]
    wall_s: float

    @property
    def completion_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class ServeReport:
    num_prompts: int
    outputs_equal: bool
    differing_prompts: list[int]  # indices of prompts whose outputs differ
    plain_completion_tokens: int
    spec_completion_tokens: int
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float  # speculative over plain tokens/s
    # SGLang's meta_info figures, summed over requests; the accept length is
    # completion tokens per verify step (bonus token included), the accept
    # rate accepted over proposed drafts.
    spec_verify_ct: int
    spec_accept_length: float | None
    spec_accept_rate: float | None
    spec_num_correct_drafts: int | None
    spec_num_proposed_drafts: int | None
    speculative: dict = field(default_factory=dict)  # the settings served
    baseline: str = "launched"  # where the plain outputs came from: "launched", or the running server's URL

    def to_dict(self) -> dict:
        return asdict(self)


def serve_check(
    server: ServerConfig,
    draft_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    serve: ServeConfig,
    *,
    log_dir: str | Path,
    baseline_url: str | None = None,
    baseline_api_key: str | None = None,
    ignore_eos: bool = True,
    concurrency: int = 1,
    eagle_topk: int = 1,
    startup_timeout_s: float = 600.0,
    request_timeout_s: float = 600.0,
) -> ServeReport:
    """Generate greedily for `prompts` (token ids) on a plain server of
    `server.model` (a checkpoint folder), launched with the section's
    settings, or on the running server at `baseline_url` if given (the same
    target: checked), then on an EAGLE-3 speculative server with the drafter
    in `draft_dir`, and compare. `serve` has its num_steps set (the flow
    takes the drafter's own when the run gives none).

    float32 by default (serve.dtype None): in bf16, two plain servers can
    already disagree at near-tied logits, which would hide what speculation
    itself changes. A target SGLang runs in one dtype only (gpt-oss: bf16) is
    run in that one, and its outputs may then differ at such ties. Against a
    running baseline, the speculative server takes that server's dtype.
    `ignore_eos` makes every generation serve.max_new_tokens long, so the
    two servers do the same amount of work. Server logs and the report
    (serve-report.json) go to `log_dir`.
    """
    if serve.num_steps is None:
        raise ValueError("serve.num_steps is not set: give the steps the drafter is served with")
    if not prompts:
        raise ValueError("serve_check needs at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    draft_dir = Path(draft_dir)
    if not (draft_dir / "config.json").is_file():
        raise FileNotFoundError(f"no drafter at {draft_dir}: expected an SGLang EAGLE-3 directory with config.json")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if baseline_url is not None:
        check_serves(baseline_url, Path(server.model), api_key=baseline_api_key)
    dtype = serving_dtype(server.model, serve.dtype, baseline_url, baseline_api_key)
    num_steps, max_new_tokens = serve.num_steps, serve.max_new_tokens
    num_draft_tokens = serve.num_draft_tokens or num_steps + 1
    plain = LaunchSpec(server.model_copy(update={"dtype": dtype}), dump_dir=log_dir / "unused-dumps", capture=False)
    speculative = dict(num_steps=num_steps, eagle_topk=eagle_topk, num_draft_tokens=num_draft_tokens)

    def generate(name: str, url: str, api_key: str | None, log_tail) -> GenerationRun:
        try:
            run = asyncio.run(generate_all(url, prompts, api_key=api_key, max_new_tokens=max_new_tokens,
                                           ignore_eos=ignore_eos, concurrency=concurrency,
                                           timeout_s=request_timeout_s, tag=name))
        except (httpx.HTTPError, ServerError) as e:
            raise ServerError(f"generation on the {name} server failed: {e}\n{log_tail()}") from e
        logger.info("%s: %d tokens in %.1f s (%.1f tokens/s)", name, run.completion_tokens, run.wall_s,
                    run.tokens_per_s)
        return run

    def launched(name: str, spec: LaunchSpec) -> GenerationRun:
        log_path = log_dir / f"{name}-server.log"
        logger.info("starting the %s server on %s (log: %s)", name, server.model, log_path)
        started = time.monotonic()
        with launch_server(spec, log_path, timeout_s=startup_timeout_s) as live:
            logger.info("%s server up after %.0f s; generating %d prompts x %d tokens",
                        name, time.monotonic() - started, len(prompts), max_new_tokens)
            return generate(name, live.url, live.api_key, lambda: f"last lines of {log_path}:\n{live.log_tail()}")

    if baseline_url is None:
        plain_run = launched("plain", plain)
    else:
        logger.info("plain outputs from the running server at %s, in %s (no plain server launched)",
                    baseline_url, dtype)
        plain_run = generate("plain", baseline_url, baseline_api_key, lambda: f"(the server at {baseline_url})")
    spec_run = launched("speculative", replace(
        plain, draft_model_path=str(draft_dir), speculative_num_steps=num_steps, speculative_eagle_topk=eagle_topk,
        speculative_num_draft_tokens=num_draft_tokens))
    report = compare(plain_run, spec_run, speculative, baseline=baseline_url or "launched")
    (log_dir / "serve-report.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    logger.info("outputs equal: %s%s; accept length %s over %d verify steps; speed-up %.2fx",
                report.outputs_equal,
                "" if report.outputs_equal else f" (differ for prompts {report.differing_prompts})",
                "n/a" if report.spec_accept_length is None else f"{report.spec_accept_length:.2f}",
                report.spec_verify_ct, report.speedup)
    return report


def serving_dtype(model: str, wanted: str | None, baseline_url: str | None, api_key: str | None) -> str:
    """The dtype the check's servers compute in: `wanted`, else float32 or
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
        raise ValueError(f"serve.dtype is {wanted}, but the baseline server at {baseline_url} computes in {shown}: "
                         f"set serve.dtype to {theirs} (or leave it unset), or use serve.baseline: launch")
    return theirs


def compare(plain: GenerationRun, spec: GenerationRun, speculative: dict, baseline: str = "launched") -> ServeReport:
    differing = [i for i, (a, b) in enumerate(zip(plain.output_ids, spec.output_ids)) if a != b]
    metas = spec.meta_infos
    verify_ct = sum(int(m.get("spec_verify_ct", 0)) for m in metas)
    with_spec = [m for m in metas if m.get("spec_verify_ct")]
    # Weighted by verify steps, so that the figure is tokens per step over the whole run.
    accept_length = (sum(m["spec_accept_length"] * m["spec_verify_ct"] for m in with_spec) / verify_ct
                     if with_spec and all("spec_accept_length" in m for m in with_spec) else None)
    correct = _sum_if_present(with_spec, "spec_num_correct_drafts")
    proposed = _sum_if_present(with_spec, "spec_num_proposed_drafts")
    if proposed:
        accept_rate = correct / proposed
    elif with_spec and all("spec_accept_rate" in m for m in with_spec):
        accept_rate = sum(m["spec_accept_rate"] * m["spec_verify_ct"] for m in with_spec) / verify_ct
    else:
        accept_rate = None
    return ServeReport(
        num_prompts=len(plain.output_ids),
        outputs_equal=not differing,
        differing_prompts=differing,
        plain_completion_tokens=plain.completion_tokens,
        spec_completion_tokens=spec.completion_tokens,
        plain_tokens_per_s=plain.tokens_per_s,
        spec_tokens_per_s=spec.tokens_per_s,
        speedup=spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0,
        spec_verify_ct=verify_ct,
        spec_accept_length=accept_length,
        spec_accept_rate=accept_rate,
        spec_num_correct_drafts=correct,
        spec_num_proposed_drafts=proposed,
        speculative=dict(speculative),
        baseline=baseline,
    )


def _sum_if_present(metas: list[dict], key: str) -> int | None:
    if not metas or not all(key in m for m in metas):
        return None
    return sum(int(m[key]) for m in metas)


async def generate_all(url: str, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, ignore_eos: bool,
                       concurrency: int, timeout_s: float, tag: str, api_key: str | None = None) -> GenerationRun:
    """Greedy generation for every prompt, at most `concurrency` in flight,
    each request carrying the server's `api_key`."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    limit = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, i: int, ids: Sequence[int]) -> tuple[list[int], dict]:
        rid = f"serve-{tag}-{i}-{uuid.uuid4().hex[:8]}"
        async with limit:
            response = await client.post(f"{url}/generate", json={
                "input_ids": [int(t) for t in ids],
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                    "ignore_eos": ignore_eos},
                "rid": rid,
            })
        if response.status_code != 200:
            raise ServerError(f"prompt {i} (rid {rid}): HTTP {response.status_code}: {response.text[:300]}")
        body = response.json()
        if "output_ids" not in body:
            raise ServerError(f"prompt {i} (rid {rid}): the response has no output_ids: {str(body)[:300]}")
        return list(body["output_ids"]), body.get("meta_info", {})

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=timeout_s, **client_options(api_key)) as client:
        results = await asyncio.gather(*(one(client, i, ids) for i, ids in enumerate(prompts)))
    wall_s = time.monotonic() - started
    return GenerationRun([r[0] for r in results], [r[1] for r in results], wall_s)
