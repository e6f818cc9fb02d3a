"""Asking the target: each conversation's turns in order, conversations
side by side, each request under a rid of its own (the conversation's id,
turn, part and attempt), so a server log line names what it served.

One conversation becomes one answers row (answer_store.FORMAT):

    row_id, source_row, [id]    the conversation (and the dataset's own id)
    messages                    the conversation as answered: the target's
                                answers in place of the dataset's
    input_ids, loss_mask        the last turn's context and answer, token
                                for token (turns.py)
    answer_tokens, turns        tokens the target generated, turns answered
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
from dataclasses import dataclass
from typing import Sequence

import httpx

from tasks.regeneration.config import RegenerateConfig
from tasks.regeneration.turns import (
    Conversation, answer_points, context_mask, render_prompt, split_reasoning,
)
from tasks.sglang_api import client_options


class NoAnswer(ValueError):
    """A conversation the target cannot answer under the settings (no token,
    or its reasoning never ended when only the answer is kept)."""


@dataclass(frozen=True)
class Asker:
    """What every request needs: the server, the tokenizer, the settings."""
    url: str
    tokenizer: object
    cfg: RegenerateConfig
    api_key: str | None = None
    rid_prefix: str = "regen-"
    transport: httpx.AsyncBaseTransport | None = None

    @functools.cached_property
    def marker(self) -> list[int]:
        # Asked on every turn: encoded once.
        return list(self.tokenizer.encode(self.cfg.reasoning_end, add_special_tokens=False))


def request_seed(seed: int, key: str) -> int:
    """A sampled answer's seed: the run's and the request's key (the
    conversation, turn and part; not the run's rid prefix nor the attempt),
    so a rerun draws the same answer wherever and whenever it is asked."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:4], "little") >> 1


async def _generate(client: httpx.AsyncClient, asker: Asker, ids: list[int], max_new_tokens: int, key: str,
                    attempt: int, stop: str | None = None) -> list[int]:
    params = {**asker.cfg.sampling(), "max_new_tokens": max_new_tokens}
    if asker.cfg.temperature > 0:
        params["sampling_seed"] = request_seed(asker.cfg.seed, key)
    if stop:
        params["stop"] = [stop]
    rid = f"{asker.rid_prefix}{key}-{attempt}"
    r = await client.post(f"{asker.url}/generate", json={"input_ids": ids, "sampling_params": params, "rid": rid})
    r.raise_for_status()
    return list(r.json()["output_ids"])


async def _answer_turn(client, asker: Asker, prompt: list[int], key: str,
                       attempt: int) -> tuple[list[int], list[int]]:
    """(every token generated, the answer after any reasoning): with a
    reasoning budget, the reasoning first (cut there and closed with the
    end marker), then the answer on its own budget."""
    cfg = asker.cfg
    if cfg.max_reasoning_tokens is None:
        out = await _generate(client, asker, prompt, cfg.max_new_tokens, key, attempt)
    else:
        thought = await _generate(client, asker, prompt, cfg.max_reasoning_tokens, f"{key}-r", attempt,
                                  stop=cfg.reasoning_end)
        split = split_reasoning(thought, asker.marker)
        reasoning = split[0] if split else thought + asker.marker  # cut at its budget (or its stop): closed here
        out = reasoning + await _generate(client, asker, prompt + reasoning, cfg.max_new_tokens, f"{key}-a", attempt)
    split = split_reasoning(out, asker.marker)
    if split is None and cfg.thinking and not cfg.keep_reasoning:
        raise NoAnswer(f"the reasoning did not end ({cfg.reasoning_end!r}) within {cfg.max_new_tokens} tokens, so "
                       f"there is no answer to keep without it: raise regenerate.max_new_tokens, or set "
                       f"max_reasoning_tokens")
    return out, split[1] if split else out


async def answer(client: httpx.AsyncClient, asker: Asker, conv: Conversation, attempt: int = 1) -> dict:
    """The conversation answered turn by turn: its answers row."""
    cfg, tok = asker.cfg, asker.tokenizer
    original = [dict(m) for m in conv.messages]
    points = answer_points(original, cfg.turns)
    if cfg.turns == "all":  # the dataset's answers go; the target's take their places
        history = [m for m in original if m["role"] != "assistant"]
        points = [sum(1 for m in original[:p + 1] if m["role"] != "assistant") - 1 for p in points]
    else:
        history = original
    answers, generated, prompt, kept = {}, 0, [], []
    for turn, point in enumerate(points):
        context = _replayed(history[:point + 1], answers)
        prompt = render_prompt(tok, context, cfg.thinking)
        out, answer_ids = await _answer_turn(client, asker, prompt, f"{conv.row_id}-{turn}", attempt)
        kept = out if cfg.keep_reasoning else answer_ids
        if not kept:
            raise NoAnswer(f"the target answered turn {turn} with no token")
        generated += len(out)
        # A later turn sees the answer as a serving stack's history holds it:
        # without its reasoning (a reasoning parser returns that apart).
        answers[point] = {"role": "assistant", "content": tok.decode(answer_ids, skip_special_tokens=True).strip()}
    # An answer without its reasoning follows the context a request without
    # thinking gets (the template's empty reasoning part, if it has one).
    row_thinking = False if cfg.thinking and not cfg.keep_reasoning else cfg.thinking
    if row_thinking != cfg.thinking:
        prompt = render_prompt(tok, context, row_thinking)
    mask = context_mask(tok, context, prompt, row_thinking, answers_are_targets=cfg.turns == "all")
    return {"row_id": conv.row_id, "source_row": conv.source_row, **dict(conv.extra),
            "messages": _replayed(history[:points[-1] + 1], answers), "input_ids": prompt + kept,
            "loss_mask": mask + [1] * len(kept), "answer_tokens": generated, "turns": len(points)}


def _replayed(history: list[dict], answers: dict[int, dict]) -> list[dict]:
    """`history` with the target's answer after each turn it answered."""
    out = []
    for i, m in enumerate(history):
        out += [m, answers[i]] if i in answers else [m]
    return out


async def answer_all(asker: Asker, conversations: Sequence[Conversation], attempt: int = 1,
                     concurrency: int | None = None) -> list[dict | Exception]:
    """Each conversation's answers row, or the exception that stopped it,
    in order; `concurrency` conversations at once."""
    limit = asyncio.Semaphore(concurrency or asker.cfg.concurrency)
    options = client_options(asker.api_key, asker.transport)
    async with httpx.AsyncClient(timeout=asker.cfg.request_timeout_s, **options) as client:
        async def one(conv):
            async with limit:
                try:
                    return await answer(client, asker, conv, attempt)
                except Exception as e:  # noqa: BLE001 - the batch decides: retried, quarantined, or the server's
                    return e
        return await asyncio.gather(*(one(c) for c in conversations))
