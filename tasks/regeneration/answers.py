"""Asking the target: each conversation's turns in order, conversations
side by side, each request under a rid of its own (the conversation's id,
turn, part and attempt), so a server log line names what it served.

One conversation becomes one answers row (answer_store.FORMAT):

    row_id, source_row, [id]    the conversation (and the dataset's own id)
    messages                    the conversation as answered: the target's
                                answers in place of the dataset's, each
                                with its reasoning_content when kept
    input_ids, loss_mask        the last turn's context and answer, token
                                for token, with every earlier answer the
                                context holds as the target wrote it
    earlier_samples             [{input_ids, loss_mask}] for each earlier
                                answer it does not (Qwen3's history drops
                                reasoning): its own context and answer
    answer_tokens, turns        tokens the target generated, turns answered
    cut                         the last answer was stopped at max_new_tokens
                                (regenerate.on_truncated "keep"): no end of
                                turn, and no later turn asked after it
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import secrets
from dataclasses import dataclass, field

import httpx

from tasks.failures import EndsRun, Permanent
from tasks.regeneration.config import RegenerateConfig
from tasks.data.chat import ChatRender, group
from tasks.regeneration.turns import (
    Conversation, after_closed_reasoning, answer_points, calls_tools, check_template, render_prompt, split_reasoning,
)


class NoAnswer(ValueError):
    """A conversation the target cannot answer under the settings (no token,
    or its reasoning never ended when only the answer is kept)."""


class Refused(Permanent, NoAnswer):
    """SGLang refused the request (a 4xx: a prompt longer than the context,
    a parameter it rejects): asking again gets the same answer."""


class Aborted(RuntimeError):
    """SGLang aborted the request (HTTP 200, finish_reason abort), or ended it
    on a NaN: asked again."""


class NotServed(EndsRun, RuntimeError):
    """The server refuses every request (401, 403: a wrong key; 404: no
    /generate there): no conversation can be answered, the run stops."""


class Cut(Permanent, NoAnswer):
    """An answer stopped at max_new_tokens, under on_truncated drop or quarantine:
    not asked again (a sampled retry that happened to end sooner would bias
    the data towards short answers)."""

    def __init__(self, message: str, turn: int):
        super().__init__(message)
        self.turn = turn


@dataclass(frozen=True)
class Asker:
    """What every request needs: the server, the tokenizer, the settings."""
    url: str
    tokenizer: object = field(repr=False)
    cfg: RegenerateConfig
    api_key: str | None = field(default=None, repr=False)
    rid_prefix: str = "regen-"
    transport: httpx.AsyncBaseTransport | None = field(default=None, repr=False)

    @functools.cached_property
    def marker(self) -> list[int]:
        # Asked on every turn: encoded once.
        return list(self.tokenizer.encode(self.cfg.reasoning_end, add_special_tokens=False))

    @functools.cached_property
    def template(self) -> ChatRender:
        return check_template(self.tokenizer, self.cfg)


@dataclass(frozen=True)
class Generated:
    ids: list[int]
    cut: bool  # stopped at its max_new_tokens
    stopped_at: object = None  # what ended it: a stop string, an EOS id


def request_seed(seed: int, key: str) -> int:
    """A sampled answer's seed: the run's and the request's key (the
    conversation, turn and part; not the run's rid prefix nor the attempt),
    so a rerun draws the same answer wherever and whenever it is asked."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:4], "little") >> 1


def sglang_message(r: httpx.Response) -> str:
    """SGLang's own words for a refused request ({"error": {"message"}})."""
    try:
        body = r.json()
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        return str(error or (body.get("detail") if isinstance(body, dict) else None) or r.text[:500])
    except ValueError:
        return r.text[:500]


async def _generate(client: httpx.AsyncClient, asker: Asker, ids: list[int], max_new_tokens: int, key: str,
                    attempt: int, stop: str | None = None) -> Generated:
    params = {**asker.cfg.sampling(), "max_new_tokens": max_new_tokens}
    if asker.cfg.temperature > 0:
        params["sampling_seed"] = request_seed(asker.cfg.seed, key)
    if stop:
        params["stop"] = [stop]
    # A nonce of its own: a retry never meets its earlier try, still
    # registered on the server, as a "duplicate request ID" refusal.
    rid = f"{asker.rid_prefix}{key}-{attempt}-{secrets.token_hex(3)}"
    r = await client.post(f"{asker.url}/generate", json={"input_ids": ids, "sampling_params": params, "rid": rid})
    if r.status_code in (401, 403, 404):
        raise NotServed(f"the SGLang server at {asker.url} answers {r.status_code} to /generate "
                        f"({sglang_message(r)}): check server.url and the API key; the run stops")
    # 408 and 429 are a busy server's: worth asking again, as a 5xx is.
    if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
        raise Refused(f"SGLang refused request {rid} with {r.status_code}: {sglang_message(r)}")
    r.raise_for_status()
    body = r.json()
    finish = (body.get("meta_info") or {}).get("finish_reason") or {}
    # SGLang ends a request whose logits went NaN as a "stop" on its EOS
    # (schedule_batch.py _check_vocab_boundary_finish): not an answer.
    if finish.get("type") == "abort" or finish.get("matched") == "NaN happened":
        raise Aborted(f"SGLang aborted request {rid}: {finish.get('message') or finish}")
    return Generated(list(body["output_ids"]), finish.get("type") == "length", finish.get("matched"))


async def _answer_turn(client, asker: Asker, prompt: list[int], key: str,
                       attempt: int) -> tuple[list[int], list[int], bool]:
    """(every token generated, the answer after any reasoning, whether the
    answer was cut): with a reasoning budget, the reasoning first (cut
    there and closed with the end marker), then the answer on its own
    budget; an output that ended without reasoning is the answer."""
    cfg = asker.cfg
    if cfg.max_reasoning_tokens is None:
        out = await _generate(client, asker, prompt, cfg.max_new_tokens, key, attempt)
    else:
        thought = await _generate(client, asker, prompt, cfg.max_reasoning_tokens, f"{key}-r", attempt,
                                  stop=cfg.reasoning_end)
        split = split_reasoning(thought.ids, asker.marker)
        stopped_at_marker = thought.stopped_at == cfg.reasoning_end
        if split is None and not thought.cut and not stopped_at_marker:
            out = thought  # it ended (end of turn) without reasoning: that was the answer
        else:
            # Closed by the target (its own tokens for the marker), or cut at its budget and closed here.
            reasoning = split[0] if split else thought.ids if stopped_at_marker else thought.ids + asker.marker
            answer = await _generate(client, asker, prompt + reasoning, cfg.max_new_tokens, f"{key}-a", attempt)
            # The split is known: the marker's tokens may be the target's own, not encode(reasoning_end)'s.
            return reasoning + answer.ids, answer.ids, answer.cut
    split = split_reasoning(out.ids, asker.marker)
    if split is None and not cfg.keep_reasoning and cfg.thinking is not False and out.cut:
        raise Cut(f"the output reached max_new_tokens ({cfg.max_new_tokens}) without the reasoning's end "
                  f"({cfg.reasoning_end!r}), so there is no answer to keep without it: raise "
                  f"regenerate.max_new_tokens, or set max_reasoning_tokens", turn=-1)
    return out.ids, split[1] if split else out.ids, out.cut


async def answer(client: httpx.AsyncClient, asker: Asker, conv: Conversation, attempt: int = 1) -> dict:
    """The conversation answered turn by turn: its answers row. A turn cut
    at max_new_tokens ends it (on_truncated keep: the row is marked), or
    raises Cut."""
    cfg, tok, template = asker.cfg, asker.tokenizer, asker.template
    original = [dict(m) for m in conv.messages]
    points = answer_points(original, cfg.turns)
    if cfg.turns == "all":  # the dataset's answers go (its tool calls stay); the target's take their places
        kept = [m["role"] != "assistant" or calls_tools(m) for m in original]
        history = [m for m, keep in zip(original, kept) if keep]
        points = [sum(kept[:p + 1]) - 1 for p in points]
    else:
        history = original
    answers, generated, cut, rows, tools = {}, 0, False, [], list(conv.tools) or None
    row_thinking = False if not cfg.keep_reasoning else cfg.thinking
    for turn, point in enumerate(points):
        context = _replayed(history[:point + 1], answers)
        # Templates render off the pool's event loop: every answer in flight waits while it is busy.
        prompt = await asyncio.to_thread(render_prompt, tok, context, template.template_kwargs(cfg.thinking),
                                        tools)
        out, answer_ids, cut = await _answer_turn(client, asker, prompt, f"{conv.row_id}-{turn}", attempt)
        kept = out if cfg.keep_reasoning else answer_ids
        if not kept:
            raise NoAnswer(f"the target answered turn {turn} with no token")
        generated += len(out)
        answers[point] = _answered(tok, template, out, answer_ids, cfg.keep_reasoning)
        # An answer without its reasoning follows the context a request
        # without thinking gets (the template's empty reasoning part, if it has one).
        if row_thinking != cfg.thinking:
            prompt = await asyncio.to_thread(render_prompt, tok, context, template.template_kwargs(row_thinking),
                                            tools)
            kept = after_closed_reasoning(prompt, kept, asker.marker)
            if not kept:
                raise NoAnswer(f"the target's answer to turn {turn} is only what the template already puts after a "
                               f"closed reasoning part")
        rows.append((prompt, kept))
        if cut:
            if cfg.on_truncated != "keep":
                raise Cut(f"turn {turn}'s answer reached max_new_tokens ({cfg.max_new_tokens}) "
                          f"(regenerate.on_truncated: {cfg.on_truncated})", turn)
            points = points[:turn + 1]  # a cut answer is no later turn's history
            break
    # As capture groups a conversation's turns (tasks/data/chat.py group), on
    # the exact ids: an earlier answer the later context holds as the target
    # wrote it is a loss span there, any other (its reasoning left out of the
    # history) a sample of its own.
    *earlier, (ids, mask, _) = group(rows, merge=cfg.turns == "all")
    return {"row_id": conv.row_id, "source_row": conv.source_row, **dict(conv.extra),
            "messages": _replayed(history[:points[-1] + 1], answers), **({"tools": tools} if tools else {}),
            "input_ids": ids, "loss_mask": mask,
            **({"earlier_samples": [{"input_ids": i, "loss_mask": m} for i, m, _ in earlier]} if earlier else {}),
            "answer_tokens": generated, "turns": len(points), "cut": cut}


def _answered(tok, template: ChatRender, out: list[int], answer_ids: list[int], keep_reasoning: bool) -> dict:
    """The answer as a serving stack's history holds it: its text, and its
    reasoning apart (a reasoning parser returns that apart), when kept."""
    message = {"role": "assistant", "content": tok.decode(answer_ids, skip_special_tokens=True).strip()}
    if keep_reasoning and len(answer_ids) < len(out):
        # As the target wrote it (a template renders it back verbatim): the
        # text before its end marker, after a start marker it wrote itself.
        text = tok.decode(out[:len(out) - len(answer_ids)], skip_special_tokens=False)
        text = text[:text.rfind(template.end)] if template.end in text else text
        message["reasoning_content"] = text.split(template.start, 1)[1] if template.start in text else text
    return message


def _replayed(history: list[dict], answers: dict[int, dict]) -> list[dict]:
    """`history` with the target's answer after each turn it answered."""
    out = []
    for i, m in enumerate(history):
        out += [m, answers[i]] if i in answers else [m]
    return out
