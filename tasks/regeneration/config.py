"""Whether and how a dataset's answers are rewritten by the target first:
the regenerate section of a run's config (tasks/config.py)."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from tasks.config import Section
from tasks.store.config import no_password


class RegenerateConfig(Section):
    """Replace the answers with the target's own before capture: drafters learn best from the target's
    outputs. Resumable: a rerun answers only the conversations not yet answered under the same settings."""

    enabled: bool = Field(False, description=(
        "pipeline: regenerate the answers before capture, on a plain SGLang server of the target (launched, or "
        "server.url attached)"))
    turns: Literal["all", "last"] = Field("all", description=(
        "all: every assistant turn, turn k answered with the target's own earlier answers in its context; "
        "last: only the last user turn (earlier assistant turns kept as the dataset has them)"))
    max_new_tokens: int = Field(256, ge=1, description="longest answer of a turn, in tokens (after any reasoning)")
    temperature: float = Field(0.0, ge=0, description="sampling temperature (0: greedy, as served by default)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling threshold (with temperature > 0)")
    repetition_penalty: float = Field(1.0, gt=0, description="SGLang's repetition penalty (1: none)")
    seed: int = Field(0, ge=0, description=(
        "sampling seed: each request's is derived from it, the conversation and the turn. SGLang 0.5.23 applies "
        "a request's seed only on a server started with --enable-deterministic-inference (server.extra_args); "
        "otherwise sampled answers differ from run to run"))
    thinking: Optional[bool] = Field(None, description=(
        "reasoning targets: turn reasoning on or off through the chat template's switch (none: the template's "
        "default)"))
    thinking_switch: Optional[str] = Field(None, description=(
        "the chat-template kwarg that turns reasoning on or off (none: the one SGLang's own template detection "
        "finds, as its chat endpoint does: Qwen3's enable_thinking, Kimi-K2.5's thinking). A template that does "
        "not read it is refused at the plan"))
    reasoning_end: str = Field("</think>", description=(
        "the text that ends a reasoning part (the target's reasoning parser's end marker)"))
    chat_template_kwargs: dict[str, Union[bool, int, float, str]] = Field(default_factory=dict, description=(
        "further chat-template arguments the target is served with (gpt-oss's reasoning_effort)"))
    template_date: Optional[str] = Field(None, description=(
        "YYYY-MM-DD: the date a template that reads today's date renders (gpt-oss's strftime_now), the same in "
        "every request of the answers (none: the day regenerate.out was first answered into, kept in its "
        "provenance)"))
    max_reasoning_tokens: Optional[int] = Field(None, ge=1, description=(
        "a reasoning part's own budget: cut there and closed with reasoning_end, the answer then gets "
        "max_new_tokens of its own (none: the reasoning counts against max_new_tokens)"))
    on_truncated: Literal["keep", "drop", "quarantine"] = Field("keep", description=(
        "an answer SGLang stopped at max_new_tokens: keep it, marked (its tokens are still the target's own; "
        "dropping them biases the data against long answers; the conversation ends at it, never the history of "
        "a later turn), drop it (not stored, not asked again), or quarantine it (not stored, counted as a "
        "failure, asked again by a rerun)"))
    keep_reasoning: bool = Field(True, description=(
        "keep the reasoning in the training rows (a drafter for a reasoning target drafts it too), or drop it "
        "(the rows hold the answers only)"))
    # At most 32,766: a batch asks the answers index about its rows in one SQLite statement.
    batch_size: int = Field(64, ge=1, le=32_766, description="conversations per batch task and per answer shard")
    concurrency: int = Field(16, ge=1, description=(
        "conversations in flight per data-parallel rank of the server (server.dp_size), across batches: the "
        "next starts as soon as one ends (tasks/regeneration/pool.py)"))
    attempts: int = Field(3, ge=1, description="tries per conversation before it is quarantined with its error")
    batch_retries: int = Field(5, ge=0, description=(
        "retries of a batch task that failed as a whole (the server went down), with growing delays; a "
        "conversation that crashes the server takes three (in flight, with its fellow suspects, alone)"))
    request_timeout_s: float = Field(3600.0, gt=0, description="one request's limit (a long answer on a slow server)")
    max_quarantine_ratio: float = Field(0.05, ge=0, le=1, description=(
        "stop the run when more than this share of the conversations tried fail (judged once 100 were tried)"))
    out: Optional[str] = Field(None, description=(
        "where the answer shards and their index go (default: <store>/regenerated; flows.regenerate requires it)"))
    index_url: Optional[str] = Field(None, description=(
        "where new answers keep their index: none = SQLite beside them (one machine); a postgresql:// URL, or "
        "'env' for $EAGLE3_LEDGER_URL, = PostgreSQL (answered from many nodes). Its password never travels as a "
        "parameter: give it in $EAGLE3_LEDGER_URL, PGPASSWORD or ~/.pgpass"))

    @field_validator("index_url")
    @classmethod
    def _no_password(cls, url: str | None) -> str | None:
        return no_password(url, "regenerate.index_url")

    @model_validator(mode="after")
    def _consistent(self):
        if self.max_reasoning_tokens is not None and self.thinking is False:
            raise ValueError("regenerate.max_reasoning_tokens is a budget for reasoning, which regenerate.thinking: "
                             "false turns off: unset one of them")
        if self.max_reasoning_tokens is not None and not self.reasoning_end:
            raise ValueError("regenerate.max_reasoning_tokens closes a reasoning part with regenerate.reasoning_end: "
                             "give the target's end marker")
        return self

    def sampling(self) -> dict:
        """SGLang sampling parameters (seeds are per request: answers.py)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "repetition_penalty": self.repetition_penalty}

    def identity(self) -> dict:
        """The settings that decide an answer: a conversation answered under
        other ones is answered again."""
        return self.model_dump(include={"turns", "max_new_tokens", "temperature", "top_p", "repetition_penalty",
                                        "seed", "thinking", "thinking_switch", "reasoning_end", "max_reasoning_tokens",
                                        "keep_reasoning", "on_truncated", "chat_template_kwargs", "template_date"})
