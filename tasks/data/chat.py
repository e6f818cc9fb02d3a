"""A conversation rendered for training as the target generates it: the
one render capture and regeneration share.

Each trained assistant turn is the generation prompt the server builds for
it (the turns before it as the chat template renders a history, the
reasoning switch as set) followed by exactly what the target emits there:
its reasoning, the reasoning's end marker, the answer, its tool calls and
the stop token it ends on, and nothing after that under the loss. The
template's own renders give all of it: a turn rendered last, cut at the
target's first stop token (Qwen3's `\\n` after `<|im_end|>` is the next
turn's, never generated), or given the stop token the template puts before
the next turn (GLM-4.5 ends a turn on `<|user|>` or `<|observation|>`).
Where the template renders no reasoning for the last turn (Kimi-K2.5 and
DeepSeek-V3.1 drop it), the reasoning goes where the generation prompt opens
it, before the end marker the template closes it with.

Reasoning comes in the row's `reasoning_content`, `reasoning` or `thinking`
field, or inline in the content between the target's markers; it reaches
the template in every one of those fields the template reads. A trained
turn whose reasoning does not fit the switch follows a named policy
(`missing_reasoning`, `unwanted_reasoning`), never silently.

`turns` chooses the samples of a row: "auto" trains every assistant turn,
in one sample where the row's renders are prefix-stable (an earlier turn
rendered in the history exactly as the target emitted it), else in as few
samples as they allow; "each" gives every assistant turn a sample of its
own (what speculators and SpecForge's multi-turn expansion do); "last"
trains the last assistant turn only.
"""
from __future__ import annotations

import datetime
import functools
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tasks.failures import Permanent

REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
TURNS = ("auto", "each", "last")
MISSING_REASONING = ("off", "empty", "refuse")
UNWANTED_REASONING = ("refuse", "drop")
# A user turn only the dry renders see, never sent.
PROBE = {"role": "user", "content": "Next question?"}


class ChatRefused(Permanent, ValueError):
    """The chat settings cannot render this target's conversations."""


def today() -> str:
    return datetime.date.today().isoformat()


@dataclass(frozen=True)
class ChatRender:
    """How a target's chat template renders training rows, resolved once
    (`resolve`) and recorded in the store's manifest (`record`)."""
    switch: str | None = None  # the template kwarg that turns reasoning on or off
    thinking: bool | None = None  # reasoning on or off; None: the template has none
    always: bool = False  # the template always reasons (gpt-oss): no switch
    kwargs: tuple = ()  # further template arguments, (name, value) pairs
    date: str | None = None  # what strftime_now returns, for a template that reads the date
    start: str = "<think>"
    end: str = "</think>"
    stop: tuple = ()  # the texts of the tokens the target stops on
    turns: str = "auto"
    missing_reasoning: str = "off"
    unwanted_reasoning: str = "refuse"

    def record(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()} | {
            "kwargs": [list(kv) for kv in self.kwargs]}

    @classmethod
    def from_record(cls, record: dict) -> "ChatRender":
        return cls(**{**record, "kwargs": tuple(tuple(kv) for kv in record.get("kwargs", ())),
                      "stop": tuple(record.get("stop", ()))})

    def describe(self) -> str:
        """One line for a run's log."""
        reasoning = ("no reasoning (the template has none)" if self.thinking is None else
                     "reasoning always on" if self.always else
                     f"reasoning {'on' if self.thinking else 'off'} ({self.switch})")
        extra = ", ".join(f"{k}={v}" for k, v in self.kwargs)
        return (f"{reasoning}, turns {self.turns}, missing reasoning: {self.missing_reasoning}, unwanted reasoning: "
                f"{self.unwanted_reasoning}" + (f", date {self.date}" if self.date else "") +
                (f", {extra}" if extra else ""))

    def template_kwargs(self, thinking: bool | None) -> dict:
        """What the template is rendered with, `thinking` for the switch."""
        out = dict(self.kwargs)
        if self.switch is not None and thinking is not None:
            out[self.switch] = thinking
        if self.date is not None:
            pinned = datetime.date.fromisoformat(self.date)
            out["strftime_now"] = pinned.strftime
        return out


def store_chat(manifest: dict) -> ChatRender | None:
    """How a store's conversations were rendered (its manifest's `chat`;
    None for a store built before it was recorded: the template's
    defaults)."""
    return ChatRender.from_record(manifest["chat"]) if manifest.get("chat") else None


def template_text(template: str | dict | None) -> str:
    """A tokenizer's chat template as text (a tokenizer may carry several, by name)."""
    return "\n".join(template.values()) if isinstance(template, dict) else template or ""


def reads_date(template: str | dict | None) -> bool:
    return "strftime_now" in template_text(template)


def reasoning_fields(template: str | dict | None) -> tuple[str, ...]:
    """The message fields the template reads reasoning from."""
    return tuple(f for f in REASONING_FIELDS if re.search(rf"\b{f}\b", template_text(template)))


def stop_texts(tokenizer, model_path: Path | None = None) -> tuple[str, ...]:
    """The texts of the tokens the target stops on: its tokenizer's end of
    sequence and generation_config.json's eos_token_id (a list for most
    chat models: Qwen3's <|im_end|> and <|endoftext|>, GLM-4.5's <|user|>
    and <|observation|>, gpt-oss's <|return|> and <|call|>), which SGLang
    stops on too. `model_path`: the checkpoint (default: the folder the
    tokenizer was loaded from)."""

    ids = [tokenizer.eos_token_id]
    folder = Path(model_path if model_path is not None else getattr(tokenizer, "name_or_path", "") or ".")
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [eos]
    texts = [tokenizer.convert_ids_to_tokens(int(i)) for i in ids if i is not None]
    return tuple(dict.fromkeys(t for t in texts if t))


def resolve(tokenizer, *, thinking: bool | None = None, switch: str | None = None, kwargs: dict | None = None,
            date: str | None = None, start: str = "<think>", end: str = "</think>", stop: tuple | None = None,
            turns: str = "auto", missing_reasoning: str = "off", unwanted_reasoning: str = "refuse",
            what: str = "capture") -> ChatRender:
    """The ChatRender for this tokenizer's template and these settings
    (`what` names their section in a refusal), found as SGLang's chat
    endpoint finds the switch (its template detection) and checked by a dry
    render; ChatRefused names the setting to change."""
    template = template_text(tokenizer.chat_template)
    for value, allowed, name in ((turns, TURNS, "turns"), (missing_reasoning, MISSING_REASONING, "missing_reasoning"),
                                 (unwanted_reasoning, UNWANTED_REASONING, "unwanted_reasoning")):
        if value not in allowed:
            raise ChatRefused(f"{what}.{name} must be one of {', '.join(allowed)}, not {value!r}")
    always, default, found = _detected(template)
    switch = switch or found
    if always and thinking is False:
        raise ChatRefused(f"{what}.thinking is false but the target's chat template always reasons (no switch, as "
                          f"gpt-oss's): leave {what}.thinking unset")
    if thinking is not None and switch is None and not always:
        raise ChatRefused(f"{what}.thinking is {str(thinking).lower()} but SGLang finds no reasoning switch in the "
                          f"target's chat template: set {what}.thinking_switch to the template's kwarg, or leave "
                          f"{what}.thinking unset")
    if switch is not None and thinking is not None:
        on, off = (_dry_prompt(tokenizer, {switch: v, **(kwargs or {})}) for v in (True, False))
        if on == off:
            raise ChatRefused(f"the target's chat template renders the same prompt with {switch}=true and false: it "
                              f"does not read {switch!r}. Set {what}.thinking_switch to the kwarg it reads, or leave "
                              f"{what}.thinking unset")
    if always:
        resolved = True
    elif thinking is not None:
        resolved = thinking
    else:
        resolved = default if switch is not None else None
    if reads_date(template) and date is None:
        raise ChatRefused(f"the target's chat template reads today's date (strftime_now): give {what}.template_date "
                          f"so a row renders the same on every day")
    if date is not None:
        datetime.date.fromisoformat(date)  # ValueError names a malformed one
    return ChatRender(switch=switch, thinking=resolved, always=always, kwargs=tuple(sorted((kwargs or {}).items())),
                      date=date if reads_date(template) else None, start=start, end=end,
                      stop=tuple(stop_texts(tokenizer) if stop is None else stop),
                      turns=turns, missing_reasoning=missing_reasoning, unwanted_reasoning=unwanted_reasoning)


def _detected(template: str) -> tuple[bool, bool | None, str | None]:
    """(always reasons, reasoning on by default, the switch's kwarg), as
    SGLang's template detection finds them (serving_chat.py
    _get_reasoning_toggle_param)."""
    from sglang.srt.parser.template_detection import detect_reasoning_pattern

    force, config = detect_reasoning_pattern(template)
    if config is None:
        return bool(force), True if force else None, None
    if config.always_on:
        return True, True, None
    return False, config.default_enabled if config.default_enabled is not None else True, config.toggle_param


def _dry_prompt(tokenizer, kwargs: dict) -> str:
    return tokenizer.apply_chat_template([PROBE], tokenize=False, add_generation_prompt=True, **kwargs)


def split_inline(content: str, start: str, end: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a content holding its reasoning inline, split
    at the first end marker (a start marker before it dropped), or (None,
    content)."""
    if not end or end not in content:
        return None, content
    reasoning, answer = content.split(end, 1)
    if start and start in reasoning:
        reasoning = reasoning.split(start, 1)[1]
    return reasoning.strip("\n"), answer.lstrip("\n")


@dataclass
class Turn:
    """An assistant turn rendered: the generation prompt's ids and the ids
    the target emits after it (with the texts they came from)."""
    index: int
    prompt: list[int]
    emitted: list[int]
    prompt_text: str = field(repr=False, default="")
    emitted_text: str = field(repr=False, default="")


class Renderer:
    """A tokenizer's chat template driven by a ChatRender. A row's `tools`
    (its function definitions) go to every render, as SGLang's chat
    endpoint passes a request's."""

    def __init__(self, tokenizer, chat: ChatRender):
        self.tok, self.chat = tokenizer, chat

    # -- renders --------------------------------------------------------------------------------------------

    def text(self, messages: list[dict], *, generation_prompt: bool, thinking: bool | None, tools=None,
             emitting: bool = False) -> str:
        """The template's text for `messages` (`thinking` for its switch).
        `emitting`: the last message is the turn whose emission is read, its
        reasoning in every field the template reads; the others as SGLang
        hands a history over (reasoning_content alone)."""
        return render_text(self.tok, messages, generation_prompt, self.chat.template_kwargs(thinking), tools=tools,
                           emitting=emitting)

    def encode(self, text: str) -> list[int]:
        return encode(self.tok, text)

    # -- one turn -------------------------------------------------------------------------------------------

    def turn_thinking(self, message: dict, k: int) -> tuple[bool | None, dict]:
        """The switch a trained turn is rendered with, and the turn as
        rendered (an empty reasoning part where the target must reason);
        ValueError under a refusing policy."""
        chat, reasoned = self.chat, bool(message.get("reasoning_content"))
        if reasoned and not chat.thinking:
            raise ValueError(f"assistant turn {k} has reasoning but "
                             f"{'the chat template has no reasoning' if chat.thinking is None else 'thinking is off'}"
                             f": set capture.thinking true to train on it as the target reasons, or "
                             f"capture.unwanted_reasoning drop to train on the answer alone")
        if not reasoned and chat.thinking:
            if chat.missing_reasoning == "refuse":
                raise ValueError(f"assistant turn {k} has no reasoning but thinking is on, where the target "
                                 f"reasons before it answers: set capture.missing_reasoning off (the turn as the "
                                 f"target answers with thinking off) or empty (an empty reasoning part)")
            if chat.missing_reasoning == "off" and chat.switch is not None:
                return False, message
            # empty, or a target that cannot answer without reasoning (gpt-oss): an empty part.
            return chat.thinking, {**message, "reasoning_content": ""}
        return chat.thinking, message

    def turn(self, messages: list[dict], k: int, tools=None) -> Turn:
        """Assistant turn `k` of `messages`: its generation prompt and what
        the target emits after it, up to and including its stop token."""
        thinking, message = self.turn_thinking(messages[k], k)
        history, reasoning = messages[:k], message.get("reasoning_content") or ""
        pieces = [reasoning, message.get("content") or ""] + [
            json.dumps(c["function"], ensure_ascii=False) for c in message.get("tool_calls") or ()]
        inside = [s for s in self.chat.stop for piece in pieces if s in piece]
        if inside:
            raise ValueError(f"assistant turn {k} holds the text of the target's stop token {inside[0]!r}, which "
                             f"would end it there: drop the row")

        def render(context, m, gp):
            return self.text(context + ([m] if m else []), generation_prompt=gp, thinking=thinking, tools=tools,
                             emitting=m is not None)

        prompt = render(history, None, True)
        whole = render(history, message, False)
        if self.chat.always and not reasoning and whole == render(history, _bare(message), False):
            raise ValueError(f"assistant turn {k} has no reasoning, the target always reasons first, and its chat "
                             f"template renders no empty reasoning part for it (gpt-oss's, before a tool call): give "
                             f"the turn its reasoning, or drop the row")
        # Read after its own history, or else after a one-question history
        # (gpt-oss drops a tool call's analysis once a final answer follows
        # it), where the turn renders as it does here; a render that is the
        # same without the reasoning has left it out.
        for context in (history, [PROBE]):
            shown = prompt if context is history else render(context, None, True)
            alone = whole if context is history else render(context, message, False)
            emitted = alone[len(shown):] if alone.startswith(shown) else None
            rendered = not reasoning or alone != render(context, _bare(message), False)
            if emitted is not None and rendered and (context is history or emitted in whole):
                break
        else:  # the template leaves this turn's reasoning out (Kimi-K2.5's last turn, DeepSeek-V3.1)
            emitted = reasoning + self._answer_part(history, _bare(message), prompt, thinking, k, tools)
        emitted = self._ended(emitted, messages, k, thinking, tools)
        return Turn(k, self.encode(prompt), self.encode(emitted), prompt, emitted)

    def _answer_part(self, history: list[dict], bare: dict, prompt: str, thinking: bool | None, k: int,
                     tools=None) -> str:
        """What the template renders of a turn from its reasoning's end marker
        on, where the generation prompt opens the reasoning: the target
        writes its reasoning, then that. Read where the turn follows its own
        history, or else (Kimi-K2.5 renders a history otherwise once a plain
        answer ends it) after a one-question history."""
        start, end = self.chat.start, self.chat.end
        if not prompt.endswith(start):
            raise ValueError(f"assistant turn {k}: the chat template renders it otherwise than after its generation "
                             f"prompt, and the prompt opens no reasoning part ({start!r}) to place it after")
        for context in (history, [PROBE]):
            opened = self.text(context, generation_prompt=True, thinking=thinking, tools=tools)[:-len(start)]
            whole = self.text(context + [bare], generation_prompt=False, thinking=thinking, tools=tools)
            rest = whole[len(opened):] if whole.startswith(opened) else ""
            cut = rest.find(end)
            if cut >= 0 and rest[:cut] in ("", start):
                return rest[cut:]
        raise ValueError(f"assistant turn {k}: the chat template renders it otherwise than after its generation "
                         f"prompt ({start!r}...{end!r} not where the prompt leaves off)")

    def _ended(self, emitted: str, messages: list[dict], k: int, thinking: bool | None, tools=None) -> str:
        """`emitted` cut after the first stop token the target would end on,
        or given the one the template puts before the next turn (read on the
        conversation without its reasoning, which a later turn's history may
        render otherwise)."""
        stops = self.chat.stop
        found = [(emitted.find(s), s) for s in stops if s in emitted]
        if found:
            at, s = min(found)
            return emitted[:at + len(s)]
        plain = [_bare(m) for m in messages[:k + 1]]
        alone = self.text(plain, generation_prompt=False, thinking=thinking, tools=tools)
        for following in messages[k + 1:k + 2] + [PROBE]:
            later = self.text(plain + [_bare(following)], generation_prompt=False, thinking=thinking, tools=tools)
            after = later[len(alone):] if later.startswith(alone) else ""
            for s in stops:
                if after.startswith(s):
                    return emitted + s
        raise ValueError(f"assistant turn {k}: the chat template puts none of the target's stop tokens "
                         f"({', '.join(stops) or 'none known'}) after it; give the checkpoint's "
                         f"generation_config.json eos_token_id")

    # -- a row ----------------------------------------------------------------------------------------------

    def samples(self, messages: list[dict], tools=None) -> list[tuple[list[int], list[int], int]]:
        """(ids, loss mask, last trained turn) of each sample the row gives."""
        trained = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if not trained:
            raise ValueError("no assistant turn to train on")
        if not self.chat.thinking and self.chat.unwanted_reasoning == "drop":
            messages = [_bare(m) for m in messages]  # the whole row's, as the policy says
        if self.chat.turns == "last":
            trained = trained[-1:]
        turns = [self._checked_turn(messages, k, tools) for k in trained]
        return [(ids, mask, trained[last]) for ids, mask, last in
                group([(t.prompt, t.emitted) for t in turns], merge=self.chat.turns == "auto")]

    def _checked_turn(self, messages: list[dict], k: int, tools=None) -> Turn:
        try:
            return self.turn(messages, k, tools)
        except ValueError:
            raise
        except Exception as e:  # a template can raise anything on odd input: say which turn it fails on
            raise ValueError(self.failure(messages, e, tools)) from None

    def failure(self, messages: list[dict], error: Exception, tools=None) -> str:
        """One line naming the first turn the template fails to render, and
        the field it fails on."""
        for n in range(1, len(messages) + 1):
            try:
                self.text(messages[:n], generation_prompt=False, thinking=self.chat.thinking, tools=tools)
            except Exception as e:  # noqa: BLE001 -- the first failing prefix names the turn
                m = messages[n - 1]
                what = "tool_calls" if m.get("tool_calls") else "content"
                return (f"the chat template fails on turn {n - 1} ({m['role']}, its {what}): "
                        f"{type(e).__name__}: {str(e)[:200]}")
        return f"the chat template fails on this row: {type(error).__name__}: {str(error)[:200]}"


def render_text(tokenizer, messages: list[dict], generation_prompt: bool, kwargs: dict, tools=None,
                emitting: bool = False) -> str:
    """The template's text for `messages`. A history is handed over as
    SGLang's chat endpoint hands it (its message model keeps
    `reasoning_content` alone, and drops what is None); with `emitting`,
    the last message's reasoning is given in every field the template reads
    too (gpt-oss's reads `thinking`), to read how it renders the turn the
    target emits."""
    fields = reasoning_fields(tokenizer.chat_template)
    given = [_bare(m) | ({"reasoning_content": m["reasoning_content"]} if m.get("reasoning_content") is not None
                         else {}) for m in messages]
    if emitting and given and given[-1].get("reasoning_content") is not None:
        given[-1] = given[-1] | {f: given[-1]["reasoning_content"] for f in fields}
    return tokenizer.apply_chat_template(given, tokenize=False, add_generation_prompt=generation_prompt,
                                         **({"tools": tools} if tools else {}), **kwargs)


def encode(tokenizer, text: str) -> list[int]:
    # As apply_chat_template(tokenize=True) and SGLang's chat endpoint
    # encode a render: its special tokens are in the text.
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer, messages: list[dict], kwargs: dict, tools=None) -> list[int]:
    """The ids the target is sent for the next answer after `messages`."""
    return encode(tokenizer, render_text(tokenizer, messages, True, kwargs, tools=tools))


def group(turns: list[tuple[list[int], list[int]]], merge: bool) -> list[tuple[list[int], list[int], int]]:
    """Samples of a row's trained turns, each (generation prompt, what the
    target emitted), in order: (ids, mask, index of its last turn). With
    `merge`, an earlier turn the later sample holds exactly (its prompt and
    emission a prefix of it) is a loss span of that sample, not a sample
    of its own; the latest turn not yet held starts the next sample."""
    out, pending = [], list(range(len(turns)))
    while pending:
        last = pending.pop()
        prompt, emitted = turns[last]
        ids, mask = prompt + emitted, [0] * len(prompt) + [1] * len(emitted)
        for j in list(pending) if merge else ():
            piece = turns[j][0] + turns[j][1]
            if ids[:len(piece)] == piece:
                mask[len(turns[j][0]):len(piece)] = [1] * len(turns[j][1])
                pending.remove(j)
        out.append((ids, mask, last))
    return out[::-1]


def _bare(message: dict) -> dict:
    return {k: v for k, v in message.items() if k != "reasoning_content"}


@functools.lru_cache(maxsize=8)
def _renderer(tokenizer, chat: ChatRender) -> Renderer:
    return Renderer(tokenizer, chat)


def renderer(tokenizer, chat: ChatRender) -> Renderer:
    """One Renderer per tokenizer and settings (a dataset's rows share it)."""
    try:
        return _renderer(tokenizer, chat)
    except TypeError:  # an unhashable tokenizer
        return Renderer(tokenizer, chat)
