"""How a trained drafter is served and checked: the serve section of a run's
config (tasks/config.py)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from tasks.config import Section


class ServeConfig(Section):
    """The serving check: the drafter served in SGLang beside the plain target, on held-out prompts; the
    servers it launches take the server section's settings (the target, its parallelism, its flags) in the
    dtype given here."""

    num_prompts: int = Field(8, ge=1, description="held-out prompts to generate for")
    max_new_tokens: int = Field(48, ge=1, description="greedy tokens per prompt")
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = Field(None, description=(
        "compute dtype of both servers (default float32, which makes greedy comparable; bf16 for a target "
        "SGLang runs in bf16 only)"))
    baseline: Literal["launch", "attached"] = Field("launch", description=(
        "where the plain greedy outputs come from: 'launch' a plain server of the target (default), or the "
        "'attached' server (server.url, with server.api_key): a running server of the same target, whose "
        "dtype the speculative server then takes, so the target is not launched twice. Its tokens/s are "
        "that server's as it runs (a capture server's include the hook)"))
    num_steps: Optional[int] = Field(None, ge=1, description=(
        "--speculative-num-steps (default: the serve_steps the drafter was trained for)"))
    num_draft_tokens: Optional[int] = Field(None, ge=2, description=(
        "--speculative-num-draft-tokens (default: num_steps + 1, a top-1 chain)"))

    @model_validator(mode="after")
    def _chain_fits(self):
        if self.num_steps is not None and self.num_draft_tokens is not None \
                and self.num_draft_tokens > self.num_steps + 1:
            raise ValueError(f"num_draft_tokens {self.num_draft_tokens} > num_steps + 1 = {self.num_steps + 1}: "
                             "a top-1 chain of num_steps drafts verifies num_steps + 1 tokens")
        return self
