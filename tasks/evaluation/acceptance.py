"""Acceptance, from SGLang's own per-request counts, under both of the
aggregations drafters are compared by.

- pooled: Σ completion tokens / Σ verify steps over the whole set, as vLLM
  and SGLang's server report it (long requests weigh more);
- mean of means: the mean over requests of each one's completion tokens /
  verify steps, as SpecForge's benchmark reports it.
The two can order two drafters differently (vllm #42508), so both are named.

Per position, from `spec_correct_drafts_histogram` (index k: verify steps
that accepted exactly k drafts): the share of verify steps whose k-th draft
was accepted, i.e. that accepted at least k.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence


# SGLang's per-request counts everything here is computed from, as kept
# beside each report (requests.jsonl) so its figures can be recomputed.
RAW_COUNTS = ("completion_tokens", "spec_verify_ct", "spec_correct_drafts_histogram")


def raw_counts(meta_info: dict) -> dict:
    """One request's RAW_COUNTS from its meta_info."""
    return {k: meta_info.get(k) for k in RAW_COUNTS}


@dataclass(frozen=True)
class Acceptance:
    requests: int
    completion_tokens: int
    verify_steps: int
    pooled: float  # Σ completion tokens / Σ verify steps
    mean_of_means: float  # mean over requests of completion tokens / verify steps
    accept_rate: float  # drafts accepted / drafts proposed (num_drafts a step)
    histogram: list[int]  # summed over requests, num_drafts + 1 bins; bin k: verify steps that accepted k drafts
    per_position: list[float]  # num_drafts entries; entry k-1: share of verify steps that accepted their k-th draft
    # The pooled figure's standard error, requests as clusters (pooled_standard_error).
    pooled_se: float = 0.0
    # Each request's (completion tokens, verify steps), in request order: two
    # measurements on the same prompts compare request by request (paired_difference).
    per_request: list[tuple[int, int]] = ()

    def to_dict(self) -> dict:
        return asdict(self)


def acceptance(meta_infos: Sequence[dict], num_drafts: int) -> Acceptance:
    """Acceptance over requests answered by a speculative server drafting
    `num_drafts` tokens a step (its num_steps, top-1). A request
    without verify steps (answered by prefill alone) has no ratio; one that
    lacks SGLang's counts is an error, not a zero: it would drag both means
    down unseen."""
    if not meta_infos:
        raise ValueError("no requests to measure acceptance on")
    if num_drafts < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
    ratios, completion, steps, histogram = [], 0, 0, [0] * (num_drafts + 1)
    for i, meta in enumerate(meta_infos):
        if "spec_verify_ct" not in meta or "completion_tokens" not in meta:
            raise ValueError(f"request {i}: meta_info has no spec_verify_ct/completion_tokens (keys "
                             f"{sorted(meta)}): the server is not speculative, or SGLang changed its fields")
        n, v = int(meta["completion_tokens"]), int(meta["spec_verify_ct"])
        completion, steps = completion + n, steps + v
        if v:
            ratios.append(n / v)
        hist = meta.get("spec_correct_drafts_histogram") or []
        if v and sum(hist) != v:
            raise ValueError(f"request {i}: its acceptance histogram counts {sum(hist)} verify steps, "
                             f"meta_info says {v}")
        if len(hist) > num_drafts + 1:
            raise ValueError(f"request {i}: its acceptance histogram has {len(hist)} bins, more than "
                             f"{num_drafts} drafts a step can fill")
        for k, count in enumerate(hist):
            histogram[k] += int(count)
    if not steps:
        raise ValueError(f"none of {len(meta_infos)} requests went through a verify step: nothing was drafted")
    total = sum(histogram)
    accepted = sum(k * n for k, n in enumerate(histogram))
    counts = [(int(m["completion_tokens"]), int(m["spec_verify_ct"])) for m in meta_infos]
    return Acceptance(requests=len(meta_infos), completion_tokens=completion, verify_steps=steps,
                      pooled=completion / steps, mean_of_means=sum(ratios) / len(ratios),
                      accept_rate=accepted / (total * num_drafts) if total else 0.0,
                      histogram=histogram, per_position=per_position(histogram),
                      pooled_se=pooled_standard_error(counts), per_request=counts)


def _influence(counts: Sequence[tuple[int, int]]) -> list[float]:
    """Each request's share of the pooled ratio's error: (n_i - r v_i) / V
    for r = N / V, the linearisation of a ratio of sums (the delta method)."""
    tokens, steps = sum(n for n, _ in counts), sum(v for _, v in counts)
    r = tokens / steps
    return [(n - r * v) / steps for n, v in counts]


def pooled_standard_error(counts: Sequence[tuple[int, int]]) -> float:
    """The standard error of Σ n / Σ v over requests (n completion tokens, v
    verify steps each), requests as clusters: the verify steps of one request
    are not independent draws (a text the drafter reads well stays so), so
    the spread between requests is what measures it. 0 for one request."""
    m = len(counts)
    if m < 2:
        return 0.0
    return (m / (m - 1) * sum(e * e for e in _influence(counts))) ** 0.5


def paired_difference(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """(pooled a - pooled b, its standard error) for two measurements on the
    same prompts in the same order: request by request, so what the prompts
    share (a hard prompt is hard for both) cancels."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired measurements need the same requests: {len(a)} against {len(b)}")
    pooled = lambda c: sum(n for n, _ in c) / sum(v for _, v in c)  # noqa: E731
    d = [x - y for x, y in zip(_influence(a), _influence(b))]
    m = len(d)
    se = (m / (m - 1) * sum(e * e for e in d)) ** 0.5 if m > 1 else 0.0
    return pooled(a) - pooled(b), se


def per_position(histogram: Sequence[int]) -> list[float]:
    """From a histogram of verify steps by drafts accepted (bin k: exactly
    k), the share of steps that accepted their k-th draft, k = 1..K."""
    total = sum(histogram)
    return [sum(histogram[k:]) / total if total else 0.0 for k in range(1, len(histogram))]
