"""What the target is asked, turn by turn, and the training row its answers
make.

A drafter is scored on guessing the target's own next token; it learns that
best from text the target wrote. With turns "all", a conversation is
replayed as a deployment serves it: the system and user turns kept, each
user turn that was answered (or ends the conversation) answered by the
target, with its own earlier answers in the context, rendered by the chat
template from their text as a serving stack renders a history. With
"last", only the last user turn is answered and the earlier assistant turns
stay as the dataset has them (and out of the loss: the target never said
them).

The training row is the last turn's context and answer, token for token as
the target produced the answer (decoding and re-tokenising need not give
back the same ids); the earlier answers, as the template rendered them, are
loss tokens too with turns "all".
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from tasks.data.dataset import render_template, to_messages, tokenize_conversation


@dataclass(frozen=True)
class Conversation:
    """A dataset row to answer: `row_id` names it and the settings it is
    answered under (answer_store.py keys everything by it)."""
    row_id: str
    source_row: int
    messages: tuple
    extra: tuple = ()  # the row's own "id", kept with its answer


def row_id(messages: list[dict], settings: dict) -> str:
    """The content address of a row's answers: its conversation, the target
    and the settings it is answered under."""
    h = hashlib.sha256(json.dumps([messages, settings], sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()[:32]


def answer_points(messages: list[dict], turns: str) -> list[int]:
    """Indices of the user turns the target answers: with "all" each one an
    assistant turn follows or that ends the conversation; with "last" the
    last user turn. ValueError when there is none."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError("no user turn to answer")
    if turns == "last":
        return [users[-1]]
    return [i for i in users if i + 1 == len(messages) or messages[i + 1]["role"] == "assistant"]


def prompt_messages(row: dict) -> list[dict]:
    """The conversation up to and including its last user turn (what a
    prompt set serves, and what turns "last" answers)."""
    messages = to_messages(row)
    return messages[:answer_points(messages, "last")[0] + 1]


def template_kwargs(thinking: bool | None) -> dict:
    return {} if thinking is None else {"enable_thinking": thinking}


def render_prompt(tokenizer, messages: list[dict], thinking: bool | None) -> list[int]:
    """The ids the target is sent for the next answer: the chat template
    with its generation prompt."""
    return render_template(tokenizer, messages, add_generation_prompt=True, **template_kwargs(thinking))


def context_mask(tokenizer, messages: list[dict], prompt: list[int], thinking: bool | None,
                 answers_are_targets: bool) -> list[int]:
    """The loss mask over `prompt` (messages rendered with the generation
    prompt): the earlier assistant answers when they are the target's own,
    nothing else."""
    if not answers_are_targets or not any(m["role"] == "assistant" for m in messages):
        return [0] * len(prompt)
    ids, mask = tokenize_conversation(tokenizer, messages, **template_kwargs(thinking))
    if prompt[:len(ids)] != ids:
        raise ValueError("the chat template renders a history differently with its generation prompt; the "
                         "earlier answers' loss tokens cannot be placed")
    return mask + [0] * (len(prompt) - len(ids))


def split_reasoning(output: list[int], marker: list[int]) -> tuple[list[int], list[int]] | None:
    """(reasoning up to and including `marker`, the answer after it), or
    None when the output has no marker."""
    n = len(marker)
    if not n:
        return None
    for i in range(len(output) - n + 1):
        if output[i:i + n] == marker:
            return output[:i + n], output[i + n:]
    return None
