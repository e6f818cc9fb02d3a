"""Datasets: rows in, token ids and loss masks out.

Accepted files: JSONL, JSON (a list of rows) or Parquet. Accepted rows:
- OpenAI `messages`: [{"role": "system"|"user"|"assistant", "content": ...}]
- ShareGPT `conversations`: [{"from": "system"|"human"|"gpt", "value": ...}]
- plain `text` (every token is a loss token)
- pre-tokenised `input_ids`, with an optional `loss_mask` of 0/1

Conversations go through the target tokenizer's own chat template; the loss
mask covers assistant tokens only. A row that cannot be used is returned as a
`Rejected` with its reason, never dropped silently and never fatal to the
rest of the file.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from tasks.paths import DATA_DIR

DEMO_DATASET = DATA_DIR / "demo_conversations.jsonl"
ROLES = {"system", "user", "assistant"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
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


def sample_id(input_ids, loss_mask) -> str:
    """Content address of a sample: the same tokens and mask give the same id
    wherever and whenever they appear, so the ledger never depends on row
    order or batching."""
    h = hashlib.sha256()
    h.update(np.asarray(input_ids, dtype="<i4").tobytes())
    h.update(np.asarray(loss_mask, dtype="u1").tobytes())
    return h.hexdigest()[:32]


def read_rows(path: Path) -> Iterator[tuple[int, dict | Rejected]]:
    """(row index, row) pairs; a line that is not a JSON object is yielded as
    Rejected and reading goes on."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pandas as pd

        for i, row in enumerate(pd.read_parquet(path).to_dict("records")):
            yield i, {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in row.items()}
    elif suffix == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json dataset must be a list of rows")
        yield from enumerate(rows)
    elif suffix in (".jsonl", ".ndjson"):
        with open(path) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    yield i, Rejected(i, "empty line")
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    yield i, Rejected(i, f"bad JSON on line {i + 1}: {e.msg} at column {e.colno}")
    else:
        raise ValueError(f"{path}: unknown dataset format {suffix!r}; use .jsonl, .json or .parquet")


def to_messages(row: dict) -> list[dict]:
    """OpenAI-style messages of a conversation row; ValueError says why not."""
    if "messages" in row:
        raw = row["messages"]
        key_role, key_text, roles = "role", "content", {r: r for r in ROLES}
    elif "conversations" in row:
        raw = row["conversations"]
        key_role, key_text, roles = "from", "value", SHAREGPT_ROLES
    else:
        raise ValueError("row has none of: messages, conversations, text, input_ids")
    if not isinstance(raw, list) or not raw:
        raise ValueError("empty conversation")
    messages = []
    for turn in raw:
        if not isinstance(turn, dict) or key_role not in turn or key_text not in turn:
            raise ValueError(f"turn {turn!r:.80} lacks '{key_role}' or '{key_text}'")
        role = roles.get(turn[key_role])
        if role is None:
            raise ValueError(f"unknown role {turn[key_role]!r} (known: {sorted(roles)})")
        if not isinstance(turn[key_text], str):
            raise ValueError(f"{role} turn content is not a string")
        messages.append({"role": role, "content": turn[key_text]})
    return messages


def _render(tokenizer, messages, **kw) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])


def tokenize_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids through the target's chat template, and the assistant mask.

    Uses the template's own `{% generation %}` markers where it has them;
    otherwise each assistant turn's span is the difference between the
    conversation rendered up to its generation prompt and up to its end.
    """
    template = tokenizer.chat_template or ""
    if "{% generation %}" in template or "{%- generation %}" in template:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
    ids = _render(tokenizer, messages)
    mask = [0] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:k], add_generation_prompt=True) if k else []
        end = _render(tokenizer, messages[: k + 1])
        if ids[: len(start)] != start or ids[: len(end)] != end:
            raise ValueError("the chat template does not render conversations prefix-stably; "
                             "add {% generation %} markers to it to define the loss mask")
        mask[len(start): len(end)] = [1] * (len(end) - len(start))
    return ids, mask


def tokenize_row(tokenizer, row: dict) -> tuple[list[int], list[int]]:
    if not isinstance(row, dict):
        raise ValueError(f"row is a {type(row).__name__}, not an object")
    if "input_ids" in row:
        ids = row["input_ids"]
        mask = row.get("loss_mask") or [1] * len(ids)
        if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < len(tokenizer) for i in ids):
            raise ValueError(f"input_ids must be a list of token ids in [0, {len(tokenizer)})")
        if len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
            raise ValueError("loss_mask must be 0/1 values, one per input id")
        return list(ids), [int(m) for m in mask]
    if "text" in row and "messages" not in row and "conversations" not in row:
        if not isinstance(row["text"], str):
            raise ValueError("text is not a string")
        ids = list(tokenizer(row["text"])["input_ids"])
        return ids, [1] * len(ids)
    return tokenize_conversation(tokenizer, to_messages(row))


def prepare_samples(path: Path, tokenizer, *, max_length: int, policy: str = "truncate") -> tuple[list[Sample], list[Rejected]]:
    """Every usable row as a Sample, every other row as Rejected (with why)."""
    if policy not in MAX_LENGTH_POLICIES:
        raise ValueError(f"max-length policy must be one of {MAX_LENGTH_POLICIES}, got {policy!r}")
    samples, rejected = [], []
    for i, row in read_rows(path):
        if isinstance(row, Rejected):
            rejected.append(row)
            continue
        try:
            ids, mask = tokenize_row(tokenizer, row)
        except Exception as e:  # a template can raise anything on odd input
            rejected.append(Rejected(i, str(e) or type(e).__name__))
            continue
        if not ids:
            rejected.append(Rejected(i, "no tokens"))
            continue
        if len(ids) > max_length:
            if policy == "skip":
                rejected.append(Rejected(i, f"{len(ids)} tokens > max_length {max_length} (policy: skip)"))
                continue
            ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            rejected.append(Rejected(i, "no loss tokens (no assistant turn within max_length)"))
            continue
        samples.append(Sample(sample_id(ids, mask), i, np.asarray(ids, np.int32), np.asarray(mask, np.uint8)))
    return samples, rejected

