"""How a dataset is captured: the capture section of a run's config
(tasks/config.py)."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field

from tasks.config import AuxLayerIds, Section
from tasks.data.dataset import DEMO_DATASET


class CaptureConfig(Section):
    """What is captured and how: the dataset, the length policy, the batches, retries and quarantine."""

    dataset: str = Field(str(DEMO_DATASET), description=(
        "JSONL/JSON/Parquet: messages, conversations, text or input_ids rows (best: answered by the target "
        "itself)"))
    thinking: Optional[bool] = Field(None, description=(
        "reasoning targets: render conversations with reasoning on or off through the chat template's switch, as "
        "the target is served (none: the template's default, as SGLang serves it: Qwen3, GLM-4.5, Kimi-K2.5 on, "
        "DeepSeek-V3.1 off; gpt-oss always reasons)"))
    thinking_switch: Optional[str] = Field(None, description=(
        "the chat-template kwarg that turns reasoning on or off (none: the one SGLang's template detection finds)"))
    chat_template_kwargs: dict[str, Union[bool, int, float, str]] = Field(default_factory=dict, description=(
        "further chat-template arguments the target is served with (gpt-oss's reasoning_effort)"))
    template_date: Optional[str] = Field(None, description=(
        "YYYY-MM-DD: the date a template that reads today's date renders (gpt-oss's strftime_now), so a row "
        "renders the same on every day (none: the day the store was created, kept in its manifest)"))
    turns: Literal["auto", "each", "last"] = Field("auto", description=(
        "the assistant turns a conversation trains on: auto, every turn, in one sample where the template renders "
        "the earlier turns as the target wrote them, else in as few as it allows; each, every turn a sample of its "
        "own with its history; last, only the last turn"))
    missing_reasoning: Literal["off", "empty", "refuse"] = Field("off", description=(
        "a trained turn without reasoning while thinking is on: off, the turn as the target answers with thinking "
        "switched off (a template without a switch: its render without reasoning); empty, thinking on with an "
        "empty reasoning part under the loss; refuse the row"))
    unwanted_reasoning: Literal["refuse", "drop"] = Field("refuse", description=(
        "a trained turn with reasoning while thinking is off (or the template has none): refuse the row, or drop "
        "the reasoning and train on the answer as the target writes it without"))
    reasoning_start: str = Field("<think>", description="the text that opens a reasoning part (inline reasoning)")
    reasoning_end: str = Field("</think>", description=(
        "the text that ends a reasoning part (the target's reasoning parser's end marker)"))
    max_length: int = Field(2048, ge=1, description="longest sample in tokens")
    max_length_policy: Literal["truncate", "skip"] = Field("truncate", description="what to do with a longer sample")
    aux_layer_ids: AuxLayerIds = Field(None, description=(
        "SGLang 'output of layer i' ids of the aux layers to store: three or more, ascending, up to n-2 "
        "(default SGLang's three: [1, n//2-1, n-4]). A store with more serves drafters on any of its layers "
        "(train.aux_layer_ids); an attached server or a node's must capture these"))
    batch_size: int = Field(32, ge=1, description="samples per batch task and per shard")
    concurrency: int = Field(8, ge=1, description="requests in flight per batch")
    dump_dir: Optional[str] = Field(None, description=(
        "where the server writes captures (default: one dir per store under /dev/shm); with an attached "
        "server, the dump dir it was started with"))
    sample_attempts: int = Field(3, ge=1, description="tries per sample (each under a fresh rid) before it is "
                                                      "quarantined")
    request_timeout_s: float = Field(600.0, gt=0, description=(
        "a capture request not answered within this many seconds fails its attempt"))
    batch_retries: int = Field(3, ge=0, description="retries of a failed batch task (server or network faults)")
    batch_retry_delay_s: float = Field(5.0, ge=0, description="first retry delay in seconds; doubles each retry, "
                                                              "with jitter")
    max_quarantine_ratio: float = Field(0.05, ge=0, le=1, description=(
        "stop the run when more than this share of the samples tried fail their capture"))
    max_consecutive_failures: int = Field(20, ge=1, description="stop the run after this many failed captures in a "
                                                                "row")
    quarantine_min_tried: int = Field(100, ge=1, description=(
        "samples tried before max_quarantine_ratio is judged during the run (it is judged over every sample at "
        "the end)"))
    canary_fraction: float = Field(0.01, ge=0, le=1, description=(
        "share of requests (seeded, at least one per batch; 0: none) whose stored final state is checked "
        "against the server's own logprobs of the same request"))
    canary_positions: int = Field(8, ge=1, description=(
        "random positions checked per canary sample (chunk boundaries are always checked too)"))
    canary_max_failed_ratio: float = Field(0.02, ge=0, le=1, description=(
        "stop the run when more than this share of the canary samples disagree with the server"))
    canary_min_failed: int = Field(3, ge=1, description=(
        "failed canaries before canary_max_failed_ratio is judged (a single glitch, retried, is no verdict)"))
