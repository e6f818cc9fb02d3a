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
from pathlib import Path

from tasks.data.chat import ChatRender, prompt_ids, reads_date, resolve, today
from tasks.data.dataset import to_messages


@dataclass(frozen=True)
class Conversation:
    """A dataset row to answer: `row_id` names it and the settings it is
    answered under (answer_store.py keys everything by it)."""
    row_id: str
    source_row: int
    messages: tuple
    extra: tuple = ()  # the row's own "id", kept with its answer
    tools: tuple = ()  # its function definitions, rendered into every prompt


def row_id(messages: list[dict], settings: dict, tools=None) -> str:
    """The content address of a row's answers: its conversation (and the
    tools it declares), the target and the settings it is answered under."""
    given = [messages, settings] + ([list(tools)] if tools else [])
    h = hashlib.sha256(json.dumps(given, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()[:32]


def calls_tools(message: dict) -> bool:
    """An assistant turn that calls tools. It stays as the dataset has it
    with turns "all": the tool results after it answer those calls, and no
    tool runs here to answer the target's own."""
    return message["role"] == "assistant" and bool(message.get("tool_calls"))


def answer_points(messages: list[dict], turns: str) -> list[int]:
    """Indices of the turns the target answers, a user's or a tool's result:
    with "all" each one a plain assistant turn follows (not one that calls
    tools) or that ends the conversation; with "last" the last one.
    ValueError when there is none."""
    if not any(m["role"] == "user" for m in messages):
        raise ValueError("no user turn to answer")
    asks = [i for i, m in enumerate(messages) if m["role"] in ("user", "tool")]
    if turns == "last":
        return [asks[-1]]
    points = [i for i in asks if i + 1 == len(messages) or
              (messages[i + 1]["role"] == "assistant" and not calls_tools(messages[i + 1]))]
    if not points:
        raise ValueError("no user turn is followed by an answer or ends the conversation, so none is answered "
                         "with turns 'all' (use turns 'last')")
    return points


def prompt_messages(row: dict) -> list[dict]:
    """The conversation up to and including its last user turn (what a
    prompt set serves, and what turns "last" answers)."""
    messages = to_messages(row)
    return messages[:answer_points(messages, "last")[0] + 1]


def check_template(tokenizer, cfg) -> ChatRender:
    """How this run drives the target's chat template (tasks/data/chat.py,
    as capture does): the switch that turns reasoning on or off, found as
    SGLang's chat endpoint finds it; ChatRefused naming the setting to
    change, before any request is sent. Rows without their reasoning
    (keep_reasoning false) are rendered with it switched off, so they need
    a switch too."""
    date = cfg.template_date or today()
    if not cfg.keep_reasoning and cfg.thinking is None:
        resolve(tokenizer, thinking=False, switch=cfg.thinking_switch, date=date,
                what="regenerate (keep_reasoning false renders rows with reasoning off)")
    # The target's stop tokens are its own output here: none to find.
    return resolve(tokenizer, thinking=cfg.thinking, switch=cfg.thinking_switch, kwargs=dict(cfg.chat_template_kwargs),
                   end=cfg.reasoning_end, date=date, stop=(), what="regenerate")


def pin_date(cfg, tokenizer, out: Path):
    """`cfg` with its template_date set where the target's template reads
    today's date: the one the answers in `out` were made with, else today's
    (then kept in their provenance), so every request of them renders one
    date, whatever day a resume or a node asks it on."""
    if cfg.template_date is not None or not reads_date(tokenizer.chat_template):
        return cfg
    kept = Path(out) / "provenance.json"
    made = json.loads(kept.read_text()).get("settings", {}).get("template_date") if kept.is_file() else None
    return cfg.model_copy(update={"template_date": made or today()})


def render_prompt(tokenizer, messages: list[dict], kwargs: dict, tools=None) -> list[int]:
    """The ids the target is sent for the next answer: the chat template
    (its `kwargs`: a reasoning switch) with its generation prompt, and the
    row's `tools` as a request declares them."""
    return prompt_ids(tokenizer, messages, kwargs, tools)


def after_closed_reasoning(prompt: list[int], answer: list[int], marker: list[int]) -> list[int]:
    """`answer` (what the target wrote after its reasoning's end marker)
    where it follows `prompt`, a render with reasoning off that already
    closes an empty reasoning part: the tokens the render put after its
    marker (Qwen3's "\n\n") are the ones the target wrote first, and are
    not written twice."""
    # Only the generation prompt's own closed part: the last few tokens.
    for i in range(len(prompt) - len(marker), max(len(prompt) - len(marker) - 8, 0) - 1, -1):
        if marker and prompt[i:i + len(marker)] == marker:
            tail = prompt[i + len(marker):]
            return answer[len(tail):] if tail and answer[:len(tail)] == tail else answer
    return answer


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
