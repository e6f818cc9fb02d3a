"""Datasets: rows in, token ids and loss masks out.

Accepted files: JSONL, JSON (a list of rows) or Parquet, or a directory of
the target's regenerated answers (tasks/regeneration/answer_store.py).
Accepted rows:
- OpenAI `messages`: [{"role": "system"|"user"|"assistant", "content": ...}]
- ShareGPT `conversations`: [{"from": "system"|"human"|"gpt", "value": ...}]
- plain `text` (every token is a loss token)
- pre-tokenised `input_ids`, with an optional `loss_mask` of 0/1
  (absent or null: every token; anything else must be one 0/1 per id)

Conversations go through the target tokenizer's own chat template as the
target generates them (tasks/data/chat.py): the loss mask covers what the
target emits in each assistant turn (reasoning, answer, tool calls, its
stop token), and a row whose turns its renders cannot keep together gives
several samples. A row that cannot be used is returned as a
`Rejected` with its reason, never dropped silently and never fatal to the
rest of the file.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Iterator

import numpy as np

from tasks.data.chat import REASONING_FIELDS, ChatRender, Renderer, renderer, resolve, split_inline, template_text
from tasks.failures import Permanent
from tasks.paths import DATA_DIR

DEMO_DATASET = DATA_DIR / "demo_conversations.jsonl"
# A tool's result ("tool"; Llama 3.1's "ipython") and "developer" (gpt-oss's
# and OpenAI's system role) are kept where the chat template renders them in
# the row (check_rendered).
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool", "ipython": "tool",
         "developer": "developer"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "ipython": "tool", "observation": "tool", "developer": "developer"}
MAX_LENGTH_POLICIES = ("truncate", "skip")


@dataclass
class Sample:
    sample_id: str
    source_row: int
    input_ids: np.ndarray  # int32; arrays, not lists: a big dataset is held in memory
    loss_mask: np.ndarray  # uint8

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class Rejected:
    source_row: int
    reason: str
    sample_id: str | None = None  # one of a row's samples left out (its others kept); None: the row


def sample_id(input_ids, loss_mask) -> str:
    """Content address of a sample: the same tokens and mask give the same id
    wherever and whenever they appear, so the ledger never depends on row
    order or batching."""
    h = hashlib.sha256()
    h.update(np.asarray(input_ids, dtype="<i4").tobytes())
    h.update(np.asarray(loss_mask, dtype="u1").tobytes())
    return h.hexdigest()[:32]


# A row larger than this is refused, not read: one runaway line (a file
# without newlines, a pasted binary) must not take the machine's memory.
MAX_ROW_BYTES = 64 << 20
_CHUNK = 1 << 20


def read_rows(path: Path, *, max_row_bytes: int = MAX_ROW_BYTES,
              rows: Collection[int] | None = None) -> Iterator[tuple[int, dict | Rejected]]:
    """(row index, row) pairs, streamed; a line that cannot be a row (not
    UTF-8, not JSON, nested too deeply, over `max_row_bytes`) is yielded as
    Rejected with the reason and reading goes on. With `rows`, only those
    rows, and reading stops after the last: a JSONL line not asked for is
    counted, not decoded (a stream run captures a large dataset a few
    dozen rows at a time, and each part reads it)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if rows is not None and not isinstance(rows, (set, frozenset, range)):
        rows = frozenset(rows)  # looked up once a line
    if path.is_dir():  # the target's answers (tasks/regeneration), under their source rows
        from tasks.regeneration.answer_store import AnswerStore

        yield from AnswerStore(path).read(rows)
        return
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        def parquet_rows():
            i = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    yield i, row
                    i += 1
        found = parquet_rows()
    elif suffix == ".json":
        found = _json_array_rows(path, max_row_bytes)
    elif suffix in (".jsonl", ".ndjson"):
        found = _jsonl_rows(path, max_row_bytes, rows)
    else:
        raise ValueError(f"{path}: unknown dataset format {suffix!r}; use .jsonl, .json or .parquet")
    if rows is None:
        yield from found
        return
    last = max(rows, default=-1)
    for i, row in found:
        if i > last:
            return
        if i in rows:
            yield i, row


def _parse(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return f"bad JSON {where}: {e.msg} at column {e.colno}"
    except RecursionError:
        return f"JSON nested too deeply {where}"


def _jsonl_rows(path: Path, max_row_bytes: int,
                rows: Collection[int] | None = None) -> Iterator[tuple[int, dict | Rejected]]:
    with open(path, "rb") as f:
        i = 0
        while True:
            raw = f.readline(max_row_bytes + 1)
            if not raw:
                return
            where = f"on line {i + 1}"
            if len(raw) > max_row_bytes and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # skip the rest of the line, unread
                    raw = f.readline(_CHUNK)
                yield i, Rejected(i, f"line {i + 1} is longer than {max_row_bytes:,} bytes; not read")
            elif rows is not None and i not in rows:
                pass  # counted, not decoded
            else:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield i, Rejected(i, f"not UTF-8 {where}: byte 0x{raw[e.start]:02x} at column {e.start + 1}")
                else:
                    if not text.strip():
                        yield i, Rejected(i, "empty line")
                    else:
                        row = _parse(text, where)
                        yield i, Rejected(i, row) if isinstance(row, str) else row
            i += 1


def _json_array_rows(path: Path, max_row_bytes: int) -> Iterator[tuple[int, dict | Rejected]]:
    """The elements of a top-level JSON array, one at a time. A fault in the
    array itself (not UTF-8, malformed) stops reading with a ValueError: past
    it there is no telling where the next row starts."""
    import codecs

    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf, pos, read, eof, i = "", 0, 0, False, 0

    def more() -> bool:
        nonlocal buf, pos, read, eof
        if eof:
            return False
        chunk = f.read(_CHUNK)
        eof = not chunk
        try:
            text = utf8.decode(chunk, final=eof)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 at byte offset {read + e.start}; fix the file, or convert it "
                             f"to JSONL, where a bad line loses only that line") from None
        read += len(chunk)
        buf = buf[pos:] + text
        pos = 0
        return True

    def skip_ws() -> str:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or not more():
                return buf[pos] if pos < len(buf) else ""

    with open(path, "rb") as f:
        if skip_ws() != "[":
            raise ValueError(f"{path}: a .json dataset must be a list of rows")
        pos += 1
        if skip_ws() == "]":
            return
        while True:
            skip_ws()
            while True:
                try:
                    row, end = decoder.raw_decode(buf, pos)
                    if end < len(buf) or eof:
                        break
                    # A value ending exactly at the buffer's end may go on
                    # in the next chunk (a number, a literal): read on.
                    if not more():
                        break
                    continue
                except RecursionError:
                    raise ValueError(f"{path}: row {i} is nested too deeply") from None
                except json.JSONDecodeError as e:
                    if len(buf) - pos > max_row_bytes:
                        raise ValueError(f"{path}: row {i} is longer than {max_row_bytes:,} bytes") from None
                    if not more():
                        raise ValueError(f"{path}: bad JSON in row {i}: {e.msg}") from None
            if end - pos > max_row_bytes // 4 and len(buf[pos:end].encode()) > max_row_bytes:
                raise ValueError(f"{path}: row {i} is longer than {max_row_bytes:,} bytes")
            pos = end
            yield i, row
            i += 1
            sep = skip_ws()
            pos += 1
            if sep == "]":
                return
            if sep != ",":
                raise ValueError(f"{path}: expected ',' or ']' after row {i - 1}, found {sep or 'the end'!r}")


def to_messages(row: dict, *, tool_calls: bool = False, markers: tuple[str, str] = ("<think>", "</think>")) -> list[dict]:
    """OpenAI-style messages of a conversation row; ValueError says why not.
    An assistant turn's reasoning, from its `reasoning_content`,
    `reasoning` or `thinking` field or inline in its content between the
    target's `markers`, is kept as its `reasoning_content` (tasks/data/chat.py
    hands it to the template). An assistant turn's `tool_calls` are kept
    when `tool_calls` (the chat template renders them), their arguments
    parsed as SGLang's chat endpoint parses them before it renders; else the
    row is refused: dropping them would train on a conversation that never
    happened."""
    if "messages" in row:
        raw = row["messages"]
        key_role, key_text, roles = "role", "content", ROLES
    elif "conversations" in row:
        raw = row["conversations"]
        key_role, key_text, roles = "from", "value", SHAREGPT_ROLES
    else:
        raise ValueError("row has none of: messages, conversations, text, input_ids")
    if not isinstance(raw, list) or not raw:
        raise ValueError("empty conversation")
    messages = []
    for k, turn in enumerate(raw):
        if not isinstance(turn, dict) or key_role not in turn:
            raise ValueError(f"turn {k} ({turn!r:.80}) lacks '{key_role}'")
        role = roles.get(turn[key_role])
        if role is None:
            raise ValueError(f"turn {k}: unknown role {turn[key_role]!r} (known: {sorted(roles)})")
        calls = turn.get("tool_calls")
        reasoning = _reasoning_field(turn, k) if role == "assistant" else None
        text = turn.get(key_text)
        if text is None and (calls or reasoning) and role == "assistant":
            text = ""
        if key_text not in turn and not text == "":
            raise ValueError(f"turn {k} ({role}) lacks '{key_text}'")
        if not isinstance(text, str):
            raise ValueError(f"turn {k} ({role}): '{key_text}' is not a string")
        if role == "assistant":
            inline, answer = split_inline(text, *markers)
            if inline is not None:
                if reasoning is not None:
                    raise ValueError(f"assistant turn {k} has reasoning twice: in a field and inline "
                                     f"({markers[1]!r} in its content); keep one")
                reasoning, text = inline, answer
        message = {"role": role, "content": text}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            if not tool_calls:
                raise ValueError(f"{role} turn {k} has tool_calls, which this tokenizer's chat template does "
                                 f"not render; use a template that renders tool calls, or drop the row")
            message["tool_calls"] = [_parsed_call(call, k) for call in calls]
        for key in ("tool_call_id", "name") if role == "tool" else ():  # which call a result answers
            if key in turn:
                message[key] = turn[key]
        messages.append(message)
    return messages


def _reasoning_field(turn: dict, k: int) -> str | None:
    """An assistant turn's reasoning from the one field that holds it."""
    given = {f: turn[f] for f in REASONING_FIELDS if turn.get(f) not in (None, "")}
    if len(set(map(str, given.values()))) > 1:
        raise ValueError(f"assistant turn {k} has different reasoning in {' and '.join(given)}; keep one")
    for name, value in given.items():
        if not isinstance(value, str):
            raise ValueError(f"assistant turn {k}: '{name}' is not a string")
        return value
    return None


def _parsed_call(call, turn: int) -> dict:
    """A tool call with its arguments a JSON object, as SGLang's chat
    endpoint hands them to the template (serving_chat.py
    normalize_assistant_tool_call_arguments): templates render a dict
    (GLM-4.5's iterates its items), and a string would render quoted twice."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"assistant turn {turn} has a tool call without a function name: {call!r:.80}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ValueError(f"assistant turn {turn}'s call of {function['name']} has arguments that are not JSON "
                             f"(SGLang refuses them too): {function.get('arguments')!r:.80}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"assistant turn {turn}'s call of {function['name']} has arguments that are not a JSON "
                         f"object (SGLang refuses them too)")
    return {**call, "function": {**function, "arguments": arguments}}


def check_rendered(render: Renderer, messages: list[dict], tools=None) -> None:
    """ValueError for a row a part of which the chat template leaves out of
    its render: a tool result, a developer turn, or one tool call (Qwen3's
    drops developer turns, gpt-oss's renders a developer turn only first and
    an assistant turn's first call only, DeepSeek-V3's drops calls beside
    text). The row would train on a conversation that never happened. Each
    part is looked for by rendering the row without it: a render that is
    the same has left it out. Rows without such parts are not rendered here."""
    parts = [(k, None) for k, m in enumerate(messages) if m["role"] in ("tool", "developer") and m["content"].strip()]
    parts += [(k, j) for k, m in enumerate(messages) for j in range(len(m.get("tool_calls") or ()))]
    if not parts:
        return

    def text(row: list[dict]) -> str:
        return render.text(row, generation_prompt=False, thinking=render.chat.thinking, tools=tools)

    try:
        whole = text(messages)
    except Exception as e:  # a template can raise anything on odd input: name the turn
        raise ValueError(render.failure(messages, e, tools)) from None
    for k, j in parts:
        m = messages[k]
        if j is None:
            without, what = messages[:k] + messages[k + 1:], f"{m['role']} turn"
        else:
            calls = m["tool_calls"][:j] + m["tool_calls"][j + 1:]
            turn = {key: v for key, v in m.items() if key != "tool_calls"} | ({"tool_calls": calls} if calls else {})
            without, what = messages[:k] + [turn] + messages[k + 1:], f"call of {m['tool_calls'][j]['function']['name']}"
        try:
            left_out = text(without) == whole
        except Exception:  # noqa: BLE001 -- a template that cannot do without it renders it
            left_out = False
        if left_out:
            raise ValueError(f"turn {k}'s {what} is not in the chat template's render of this row (the template "
                             f"leaves it out here); use a template that renders it, or drop the row")


def row_tools(row: dict) -> list[dict] | None:
    """A row's function definitions (`tools`, as a chat request carries
    them), which the template renders into every prompt: each as SGLang's
    chat endpoint hands it over (its Tool model, dumped: a template that
    writes them as JSON writes its defaults too)."""
    tools = row.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be a list of tool definitions (objects), as a chat request's")
    from pydantic import ValidationError
    from sglang.srt.entrypoints.openai.protocol import Tool

    try:
        return [Tool.model_validate(t).model_dump() for t in tools] or None
    except ValidationError as e:
        raise ValueError(f"tools: not a tool definition SGLang takes: {str(e).splitlines()[0]}") from None


def tokenize_row(tokenizer, row: dict, tool_calls: bool | None = None,
                 chat: ChatRender | None = None) -> list[tuple[list[int], list[int]]]:
    """A row's samples: (token ids, loss mask) each. A conversation gives
    one per group of assistant turns its renders keep together
    (tasks/data/chat.py); `tool_calls`: renders_tool_calls(tokenizer),
    found once; `chat`: how the template renders it (default: its own
    defaults)."""
    if not isinstance(row, dict):
        raise ValueError(f"row is a {type(row).__name__}, not an object")
    if "input_ids" in row:
        ids = row["input_ids"]
        # bool is an int in Python: true/false are not token ids (nor mask values).
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < len(tokenizer) for i in ids):
            raise ValueError(f"input_ids must be a list of integer token ids in [0, {len(tokenizer)})")
        mask = row.get("loss_mask")
        if mask is None:  # absent: every token is a loss token
            mask = [1] * len(ids)
        if not isinstance(mask, list):
            raise ValueError(f"loss_mask must be a list of 0/1, one per input id, not {mask!r:.40}")
        if len(mask) != len(ids):
            raise ValueError(f"loss_mask has {len(mask)} values for {len(ids)} input ids")
        if not all(type(m) is int and m in (0, 1) for m in mask):
            raise ValueError("loss_mask values must be the integers 0 or 1")
        if chat is not None and chat.turns == "last" and "row_id" in row:
            # A regenerated answers row (answers.py), its last turn alone: the
            # loss's last run, none of its earlier_samples.
            end = max(k for k, m in enumerate(mask) if m) + 1
            start = next(k for k in range(end - 1, -1, -1) if not mask[k]) + 1 if 0 in mask[:end] else 0
            return [(list(ids), [0] * start + [1] * (end - start) + [0] * (len(mask) - end))]
        # A regenerated answers row's turns its last sample does not hold (answers.py).
        earlier = [s for e in row.get("earlier_samples") or () for s in tokenize_row(tokenizer, e, tool_calls, chat)]
        return earlier + [(list(ids), list(mask))]
    if "text" in row and "messages" not in row and "conversations" not in row:
        if not isinstance(row["text"], str):
            raise ValueError("text is not a string")
        ids = list(tokenizer(row["text"])["input_ids"])
        return [(ids, [1] * len(ids))]
    render = renderer(tokenizer, chat or resolve(tokenizer))
    messages = to_messages(row, tool_calls=renders_tool_calls(tokenizer) if tool_calls is None else tool_calls,
                           markers=(render.chat.start, render.chat.end))
    tools = row_tools(row)
    check_rendered(render, messages, tools)
    return [(ids, mask) for ids, mask, _ in render.samples(messages, tools)]


def renders_tool_calls(tokenizer) -> bool:
    """Whether the chat template looks at an assistant turn's tool_calls."""
    return "tool_calls" in template_text(tokenizer.chat_template)


class NoUsableRows(Permanent, ValueError):
    """A dataset with no row a drafter can train on."""


def require_usable(path: Path, samples: list, rejected: list[Rejected]) -> None:
    """Refuse a dataset none of whose rows is usable, before anything runs:
    it would otherwise make a run that stores nothing and passes."""
    if samples:
        return
    why = (f"all {len(rejected)} rows rejected, e.g. row {rejected[0].source_row}: {rejected[0].reason}"
           if rejected else "it holds no rows")
    raise NoUsableRows(f"dataset {path} has no usable row ({why}): give a JSONL, JSON or Parquet file of "
                       f"messages, conversations, text or input_ids rows (capture.dataset)")


def prepare_samples(path: Path, tokenizer, *, max_length: int, policy: str = "truncate",
                    rows: Collection[int] | None = None,
                    chat: ChatRender | None = None) -> tuple[list[Sample], list[Rejected]]:
    """Every usable row's samples, every other row as Rejected (with why).
    With `rows`, only those row indices (a node's share of a fanned-out run:
    the rest is not tokenised). `chat`: how conversations are rendered (the
    store's, tasks/data/chat.py; default: the template's own defaults)."""
    if policy not in MAX_LENGTH_POLICIES:
        raise ValueError(f"max-length policy must be one of {MAX_LENGTH_POLICIES}, got {policy!r}")
    samples, rejected, tool_calls = [], [], renders_tool_calls(tokenizer)
    chat = chat or resolve(tokenizer)  # once: it reads the template and the checkpoint's files
    for i, row in read_rows(path, rows=rows):
        if isinstance(row, Rejected):
            rejected.append(row)
            continue
        try:
            pieces = tokenize_row(tokenizer, row, tool_calls, chat)
        except Exception as e:  # a template can raise anything on odd input
            rejected.append(Rejected(i, str(e) or type(e).__name__))
            continue
        kept, left = 0, []
        for ids, mask in pieces:
            if not ids:
                left.append((None, "no tokens"))
                continue
            whole = sample_id(ids, mask)
            if len(ids) > max_length:
                if policy == "skip":
                    left.append((whole, f"{len(ids)} tokens > max_length {max_length} (policy: skip)"))
                    continue
                ids, mask = ids[:max_length], mask[:max_length]
            if not any(mask):
                left.append((whole, "no loss tokens (no assistant turn within max_length)"))
                continue
            samples.append(Sample(sample_id(ids, mask), i, np.asarray(ids, np.int32), np.asarray(mask, np.uint8)))
            kept += 1
        if len(pieces) == 1 and left:
            rejected.append(Rejected(i, left[0][1]))
        else:  # a row's sample left out is said, even beside its kept ones, each under its own id
            rejected += [Rejected(i, f"one of its {len(pieces)} samples left out: {why}", sid) for sid, why in left]
    return samples, rejected
