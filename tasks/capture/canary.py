"""The capture canary: stored states checked against the server's own
log-probabilities of the very request they were captured from.

For a seeded share of the requests, the capture request also asks SGLang
for the log-probability of every prompt token (`return_logprob`,
`logprob_start_len` 0: computed in the same prefill that is captured). The
final state at position p, through the target's head, gives the
log-probability of token p+1; it must equal what the server reported, within
a bound derived from the dtypes. Checked at a few random positions per
sample, and at every chunk boundary of a chunked prefill. A capture mixed up
with another request's, shifted by a token, with a chunk from elsewhere, with
its tensors swapped, or from a server serving other weights than the
checkpoint's cannot pass.

What it cannot see: the aux layers never reach the head. For them, each
canary's profile (per layer, the median log-RMS of its token rows, and the
median cosine between neighbouring layers' rows at the same token) is
compared with the profiles of the run's earlier canaries (the index keeps
them): a shifted or swapped layer stands out. An outlier is recorded and
logged, not quarantined (a sample unlike the rest can be one too).

The bound (per checked position, logits z = W x over the vocabulary, the
target token t, log p_t = z_t - logsumexp(z)):
  - the server rounds each logit to its compute dtype: at most u_c |z_k|
    (worst case, one rounding), and so do we with a bf16 head (Head.rounding);
  - the stored state differs from the server's x by independent roundings,
    |dx_j| <= a |x_j| + b (a, b from the storage dtype: tasks/store/fp8.py for
    FP8, none for bf16 kept from a bf16 server); each is uniform, so
    dz_k = sum_j dx_j W_kj has sigma_k^2 <= sum_j (a^2 x_j^2 + b^2) W_kj^2 / 3
    (the worst case, a |W_k|.|x|, is sqrt(H) times looser: useless for FP8);
  - fp32 accumulation, both sides: sigma <= sqrt(H) 2^-24 |W_k|_2 |x|_2.
logsumexp moves by a p-weighted mean of the dz_k, whose sigma is at most
max_k sigma_k. The bound is the rounding term plus SIGMAS of each sigma: a
false alarm at one position is a 6-sigma event.
"""
from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import torch

from tasks.capture.config import CaptureConfig
from tasks.capture.dump import Capture, CaptureError
from tasks.failures import Permanent
from tasks.store.fp8 import E4M3_MAX, dequantize, quantize
from tasks.store.shards import BF16, FP8

# Vocabulary rows widened to fp32 at a time: 8192 x 7168 x 4 B = 235 MB.
HEAD_CHUNK_ROWS = 8192
# log_softmax and logsumexp in fp32 on both sides, and the JSON's decimal
# floats: far below every other term, covered here.
SLACK = 1e-4
SIGMAS = 6.0
# Unit roundoff of each dtype a logit or a state can be held in.
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
FP8_RELATIVE = 2.0 ** -4 + 2.0 ** -8  # e4m3's 3 mantissa bits, then the bf16 it is read back as
FP8_SUBNORMAL = 2.0 ** -10  # times the row's scale, max|x| / 448
# Profiles: an outlier is this many robust deviations from the run's median
# (and at least the floor: near-identical canaries have no spread to speak of).
PROFILE_SIGMAS = 8.0
PROFILE_FLOOR = 0.15
PROFILE_MIN_HISTORY = 8
PROFILE_HISTORY = 256  # the latest canaries of the run's index a profile is judged against


class CanaryMismatch(CaptureError):
    """A capture's final state does not reproduce the server's logprobs for
    its request: not the states of that request, not at those positions, or
    not of the checkpoint's weights. Retried under a fresh rid like any bad
    capture, then quarantined with the numbers."""


class CanaryBatchRejected(RuntimeError):
    """A canary of the batch disagreed on every try: the batch is not stored
    (its other captures are no more trustworthy), and is retried."""


class CanaryDisagrees(Permanent, RuntimeError):
    """So many canaries failed that the captures cannot be trusted: stop."""


def is_canary(sample_id: str, fraction: float, seed: int = 0) -> bool:
    """A seeded, stable draw per sample: the same samples on every rerun and
    every node, whatever the batching."""
    return _draw(sample_id, seed) < fraction


def _draw(sample_id: str, seed: int) -> float:
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def pick_canaries(sample_ids: Sequence[str], fraction: float, seed: int = 0) -> set[str]:
    """The batch's canaries: its share of the draw, and never none (the
    sample with the smallest draw), unless the fraction is 0."""
    if fraction <= 0 or not sample_ids:
        return set()
    chosen = {i for i in sample_ids if is_canary(i, fraction, seed)}
    return chosen or {min(sample_ids, key=lambda i: _draw(i, seed))}


def canary_positions(sample_id: str, num_tokens: int, chunk_starts: Sequence[int], count: int,
                     seed: int = 0) -> list[int]:
    """Positions p whose state predicts token p+1: `count` drawn per sample,
    plus both sides of every chunk boundary (a chunk from another request
    starts there)."""
    last = num_tokens - 2
    if last < 0:
        return []
    g = torch.Generator().manual_seed(int(_draw(sample_id, seed + 1) * 2 ** 62))
    drawn = torch.randperm(last + 1, generator=g)[:count].tolist()
    edges = [p for s in chunk_starts if s > 0 for p in (s - 1, s)]
    return sorted({int(p) for p in drawn + edges if 0 <= p <= last})


def server_logprobs(meta: dict, input_ids: Sequence[int], *, vocab_size: int | None = None) -> list[float | None]:
    """meta_info's input_token_logprobs as one value per prompt token (the
    first has none), checked against the ids sent. SGLang 0.5.23 reports
    every id >= vocab_size - 1 as 0 (logprob_result_processor.py, for image
    tokens' hashes), the vocabulary's last real token too; its value is
    still that token's. Given `vocab_size`, that report is taken for it."""
    entries = meta.get("input_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(input_ids):
        got = "none" if not isinstance(entries, list) else f"{len(entries)}"
        raise CaptureError(f"rid {meta.get('id')}: the server returned {got} input-token logprobs for "
                           f"{len(input_ids)} prompt tokens (asked with logprob_start_len 0)")
    out = []
    for p, (entry, sent) in enumerate(zip(entries, input_ids)):
        value, token = entry[0], entry[1]
        if token != sent and not (token == 0 and vocab_size is not None and sent == vocab_size - 1):
            raise CaptureError(f"rid {meta.get('id')}: logprob entry {p} is for token {token}, {sent} was sent")
        out.append(None if value is None else float(value))
    return out


class CanaryCannotCheck(Permanent, ValueError):
    """A target whose served logits the canary's head does not compute."""


# SGLang's LogitsProcessor caps the logits of any target whose config sets
# this (cap * tanh(z / cap)); it also scales them for model classes that pass
# it a logit_scale, which none of tasks/target/architectures.py's do.
SOFTCAP = "final_logit_softcapping"


def refuse_unchecked_logits(config: dict, canary_fraction: float) -> None:
    """Refuse, before anything runs, a target whose every canary would fail
    because SGLang transforms its logits and the canary's head does not."""
    for section in (config, config.get("text_config") or {}):
        cap = section.get(SOFTCAP)
        if canary_fraction and cap is not None and cap > 0:
            raise CanaryCannotCheck(
                f"the target's config sets {SOFTCAP} {cap}: SGLang caps its logits (cap * tanh(z / cap)) and the "
                f"capture canary's head does not, so every canary would fail: set capture.canary_fraction 0 to "
                f"capture this target without the check")


@dataclass(frozen=True)
class Head:
    """The target's output head, read once per process (tasks/target/embeddings.py)."""

    weight: torch.Tensor  # [V, H], the checkpoint's dtype
    row_norms: torch.Tensor  # [V] fp32: |W_k|_2, for the bound

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Head":
        norms = torch.cat([w.float().norm(dim=1) for w in weight.split(HEAD_CHUNK_ROWS)])
        return cls(weight, norms)

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def rounding(self) -> float:
        """Unit roundoff of our own logits: a bf16 head is multiplied in bf16
        (fp32 accumulation, the result rounded to bf16): widening a 2.3 GB
        head to fp32 for every check would cost more than the product."""
        return UNIT_ROUNDOFF[torch.bfloat16] if self.weight.dtype == torch.bfloat16 else 0.0

    def score(self, states: torch.Tensor, targets: torch.Tensor, spread: torch.Tensor):
        """For states [P, H] (values a bf16 holds exactly, as every stored
        state does), target ids [P] and per-element error variances `spread`
        [P, H]: (log p of each target, its logit z_t, max_k |z_k|, sigma_t,
        max_k sigma_k) with sigma_k^2 = spread . W_k^2, in fp32, a
        vocabulary chunk at a time."""
        p = states.shape[0]
        dtype = torch.bfloat16 if self.weight.dtype == torch.bfloat16 else torch.float32
        x, var_of = states.to(dtype), spread.to(dtype) if bool(spread.any()) else None
        lse = torch.full((p,), -math.inf)
        zmax, smax, z_t, s_t = torch.zeros(p), torch.zeros(p), torch.empty(p), torch.zeros(p)
        for lo in range(0, self.weight.shape[0], HEAD_CHUNK_ROWS):
            w = self.weight[lo: lo + HEAD_CHUNK_ROWS].to(dtype)
            z = (x @ w.T).float()
            var = (var_of @ w.square().T).float() if var_of is not None else None
            lse = torch.logaddexp(lse, torch.logsumexp(z, dim=1))
            zmax = torch.maximum(zmax, z.abs().amax(dim=1))
            if var is not None:
                smax = torch.maximum(smax, var.amax(dim=1).sqrt())
            inside = (targets >= lo) & (targets < lo + z.shape[1])
            if inside.any():
                rows = inside.nonzero().squeeze(1)
                z_t[rows] = z[rows, targets[rows] - lo]
                if var is not None:
                    s_t[rows] = var[rows, targets[rows] - lo].sqrt()
        return z_t - lse, z_t, zmax, s_t, smax


@lru_cache(maxsize=2)
def load_head(target_path: str) -> Head:
    from tasks.target.embeddings import load_target_head

    return Head.of(load_target_head(Path(target_path)))


def storage_error(states: torch.Tensor, storage_dtype: str, compute_dtype: torch.dtype) -> tuple[float, torch.Tensor]:
    """(a, b per row): the stored state's rounding against the server's,
    |dx_j| <= a |x_j| + b."""
    if storage_dtype == FP8:
        return FP8_RELATIVE, states.abs().amax(dim=1) / E4M3_MAX * FP8_SUBNORMAL
    a = 0.0 if compute_dtype == torch.bfloat16 else UNIT_ROUNDOFF[torch.bfloat16]
    return a, torch.zeros(states.shape[0])


@dataclass
class CanaryResult:
    """One canary sample's check: positions, the server's and our numbers,
    the bound, and its aux profile."""

    sample_id: str
    positions: list[int]
    server: list[float]
    ours: list[float]
    tolerance: list[float]
    profile: list[float]
    profile_outlier: str = ""

    @property
    def deviations(self) -> list[float]:
        return [abs(a - b) for a, b in zip(self.server, self.ours)]

    @property
    def worst(self) -> float:
        return max(self.deviations, default=0.0)

    @property
    def worst_ratio(self) -> float:
        """Worst deviation as a fraction of its bound: above 1 fails."""
        return max((d / t for d, t in zip(self.deviations, self.tolerance)), default=0.0)

    @property
    def ok(self) -> bool:
        return all(d <= t for d, t in zip(self.deviations, self.tolerance))

    def explain(self) -> str:
        bad = [(p, s, o, t) for p, s, o, t in zip(self.positions, self.server, self.ours, self.tolerance)
               if abs(s - o) > t]
        shown = "; ".join(f"position {p}: server {s:.4f}, stored state {o:.4f} (|diff| {abs(s - o):.4f} > "
                          f"bound {t:.4f})" for p, s, o, t in bad[:3])
        return (f"the stored final state disagrees with the server's own logprobs at {len(bad)} of "
                f"{len(self.positions)} checked positions: {shown}")

    def record(self, shard: str) -> dict:
        """The index's row (tasks/store/ledger/index.py, canaries)."""
        return {"shard": shard, "sample_id": self.sample_id, "positions": len(self.positions),
                "worst_deviation": self.worst, "worst_ratio": self.worst_ratio,
                "profile": ",".join(f"{v:.5g}" for v in self.profile), "profile_outlier": self.profile_outlier}


def profile(capture: Capture) -> list[float]:
    """Per aux layer then the final state: the median over tokens of log RMS;
    then the median cosine of neighbouring layers (aux_0..aux_k, final) at the
    same token. Medians: attention-sink tokens carry norms orders above the rest."""
    layers = list(capture.aux_hidden_states.unbind(1)) + [capture.final_hidden_state]
    rms = [torch.log(x.float().pow(2).mean(dim=1).sqrt().clamp_min(1e-30)).median().item() for x in layers]
    cos = [torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=1).median().item()
           for a, b in zip(layers, layers[1:])]
    return rms + cos


def profile_outlier(values: Sequence[float], history: Sequence[Sequence[float]]) -> str:
    """'' when `values` sits with the run's earlier profiles, else what stands out."""
    history = [h for h in history if len(h) == len(values)]
    if len(history) < PROFILE_MIN_HISTORY:
        return ""
    past = torch.tensor(history, dtype=torch.float64)
    median = past.median(dim=0).values
    spread = 1.4826 * (past - median).abs().median(dim=0).values
    limit = torch.clamp(PROFILE_SIGMAS * spread, min=PROFILE_FLOOR)
    off = ((torch.tensor(values, dtype=torch.float64) - median).abs() > limit).nonzero().flatten().tolist()
    states = [f"aux state {i}" for i in range((len(values) + 1) // 2 - 1)] + ["the final state"]
    names = [f"log-RMS of {s}" for s in states] + [f"cosine of {a} and {b}" for a, b in zip(states, states[1:])]
    return "; ".join(f"{names[i]} {values[i]:.3f}, run median {median[i]:.3f} (limit +-{limit[i]:.3f})"
                     for i in off)


def checker(head: Head, **settings) -> Callable[[Capture, dict], CanaryResult]:
    """The canary check of one capture from the server's answer to its
    request (meta_info, asked with return_logprob): check_capture with
    `settings` (sample_id, positions, storage_dtype, history)."""
    def check(capture: Capture, meta: dict) -> CanaryResult:
        logprobs = server_logprobs(meta, capture.input_ids.tolist(), vocab_size=head.vocab_size)
        return check_capture(capture, logprobs, head, **settings)
    return check


def check_capture(capture: Capture, logprobs: Sequence[float | None], head: Head, *, sample_id: str,
                  positions: int = 8, storage_dtype: str = BF16, seed: int = 0,
                  history: Sequence[Sequence[float]] = ()) -> CanaryResult:
    """Score `capture`'s final state at its canary positions against the
    server's `logprobs` (one per prompt token, server_logprobs), on the
    values as the store will hold them. Raises CanaryMismatch when any
    position is outside its bound."""
    n = capture.num_tokens
    x = capture.final_hidden_state
    if x.shape[1] != head.hidden_size:
        raise CanaryMismatch(f"rid {capture.rid}: the final state is {x.shape[1]} wide, the target's head "
                             f"{head.hidden_size}: the server does not serve this checkpoint")
    vocab = int(head.weight.shape[0])
    if n and int(capture.input_ids.max()) >= vocab:
        raise CanaryMismatch(f"rid {capture.rid}: token id {int(capture.input_ids.max())} is outside the target "
                             f"head's {vocab} rows: the server does not serve this checkpoint")
    where = canary_positions(sample_id, n, capture.chunk_starts, positions, seed)
    p = torch.tensor(where, dtype=torch.long)
    states = stored_values(x[p], storage_dtype)
    targets = capture.input_ids[p + 1]
    a, b = storage_error(states, storage_dtype, x.dtype)
    ours, z_t, zmax, s_t, smax = head.score(states, targets, (a ** 2 * states.square() + b.square()[:, None]) / 3)
    tol = bound(states, targets, z_t, zmax, s_t, smax, head, compute_dtype=x.dtype)
    result = CanaryResult(sample_id, where, [float(logprobs[i + 1]) for i in where], ours.tolist(), tol.tolist(),
                          profile(capture))
    if not result.ok:
        raise CanaryMismatch(f"rid {capture.rid}: {result.explain()}")
    result.profile_outlier = profile_outlier(result.profile, history)
    return result


def stored_values(rows: torch.Tensor, storage_dtype: str) -> torch.Tensor:
    """The rows as a reader of the store gets them back, in fp32."""
    if storage_dtype == FP8:
        return dequantize(*quantize(rows)).float()
    return rows.to(torch.bfloat16).float()


def bound(states: torch.Tensor, targets: torch.Tensor, z_t: torch.Tensor, zmax: torch.Tensor, s_t: torch.Tensor,
          smax: torch.Tensor, head: Head, *, compute_dtype: torch.dtype) -> torch.Tensor:
    """Per position, the |log p| difference the dtypes allow (the module's
    docstring derives it)."""
    u_c = UNIT_ROUNDOFF[compute_dtype]
    accumulation = 2 * math.sqrt(head.hidden_size) * 2.0 ** -24 * states.norm(dim=1)
    w = head.row_norms[targets] + head.row_norms.max()
    return (u_c + head.rounding) * (z_t.abs() + zmax) + SIGMAS * (s_t + smax + accumulation * w) + SLACK


@dataclass
class CanaryTally:
    """The run's canaries, across batches and threads: stops the run when
    more than `max_ratio` of those checked failed, once `min_failed` have
    (a single glitch, retried, is not a verdict on the run). Its limits are
    the capture section's (of_capture); the defaults, its defaults."""

    max_ratio: float = CaptureConfig.model_fields["canary_max_failed_ratio"].default
    min_failed: int = CaptureConfig.model_fields["canary_min_failed"].default
    checked: int = 0
    failed: int = 0
    worst_ratio: float = 0.0
    outliers: int = 0
    last: str = ""
    _mutex: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def of_capture(cls, capture: CaptureConfig) -> CanaryTally:
        return cls(max_ratio=capture.canary_max_failed_ratio, min_failed=capture.canary_min_failed)

    def passed(self, result: CanaryResult) -> None:
        with self._mutex:
            self.checked += 1
            self.worst_ratio = max(self.worst_ratio, result.worst_ratio)
            self.outliers += bool(result.profile_outlier)

    def mismatched(self, reason: str) -> None:
        with self._mutex:
            self.checked += 1
            self.failed += 1
            self.last = reason

    def check(self) -> None:
        with self._mutex:
            if self.failed >= self.min_failed and self.failed / self.checked > self.max_ratio:
                raise CanaryDisagrees(
                    f"captures disagree with the server's own logprobs: {self.failed} of {self.checked} canary "
                    f"checks failed (> {self.max_ratio:.0%} allowed). Last: {self.last}. The server may serve other "
                    f"weights than the checkpoint named (server.model), or the capture hook is mixing requests "
                    f"up. Batches with a failed canary were not stored, their canaries are quarantined; what "
                    f"was stored before is kept (its canaries passed)")

    def summary(self) -> dict:
        with self._mutex:
            return {"checked": self.checked, "failed": self.failed, "worst_ratio": self.worst_ratio,
                    "profile_outliers": self.outliers}

    def describe(self) -> str:
        s = self.summary()
        return (f"{s['checked']} samples checked against the server's logprobs, {s['failed']} disagreed; worst "
                f"deviation {s['worst_ratio']:.2f} of its bound; {s['profile_outliers']} aux profile outliers")
