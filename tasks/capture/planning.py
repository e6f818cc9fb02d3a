"""The extraction's plan: which of the dataset's samples are still to
capture (the ledger says which are stored), and whether their states fit
where they must go, before any request is sent."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tasks.capture.config import CaptureConfig
from tasks.data.chat import ChatRender, reads_date, resolve, stop_texts, today
from tasks.data.dataset import Rejected, Sample, prepare_samples, require_usable
from tasks.failures import Permanent
from tasks.store.ledger.index import Ledger
from tasks.store.manifest import manifest_path, read_manifest
from tasks.store.shards import BF16, bytes_per_token


class InsufficientSpace(Permanent, RuntimeError):
    """The plan's states do not fit where they must go (a retry finds the same space)."""


@dataclass
class Plan:
    source: str
    todo: list[Sample]
    already_stored: int
    rejected: list[Rejected]
    total_samples: int

    @property
    def todo_tokens(self) -> int:
        return sum(s.num_tokens for s in self.todo)

    def batches(self, batch_size: int) -> list[list[Sample]]:
        return [self.todo[i: i + batch_size] for i in range(0, len(self.todo), batch_size)]


def capture_chat(capture: CaptureConfig, tokenizer, model_path: Path, store: Path | None = None) -> ChatRender:
    """How the capture renders conversations (tasks/data/chat.py): its
    settings, the target's stop tokens, and for a template that reads
    today's date the date it renders: capture.template_date, else the one
    the store at `store` was created with, else today's (then kept in the
    new store's manifest). ChatRefused names the setting to change."""
    date = capture.template_date
    if date is None and reads_date(tokenizer.chat_template):
        kept = None
        if store is not None and manifest_path(store).exists():
            kept = (read_manifest(store).get("chat") or {}).get("date")
        date = kept or today()
    return resolve(tokenizer, thinking=capture.thinking, switch=capture.thinking_switch,
                   kwargs=dict(capture.chat_template_kwargs), date=date, start=capture.reasoning_start,
                   end=capture.reasoning_end, stop=stop_texts(tokenizer, model_path), turns=capture.turns,
                   missing_reasoning=capture.missing_reasoning, unwanted_reasoning=capture.unwanted_reasoning)


def plan_extraction(capture: CaptureConfig, tokenizer, ledger: Ledger, rows: Sequence[int] | None = None,
                    chat: ChatRender | None = None) -> Plan:
    """Tokenise the capture's dataset (or only its `rows`, captured in the
    order given: a stream run's training order) as `chat` renders it (the
    store's) and keep only what the ledger does not hold yet. Rows that
    cannot be used go to the quarantine table with their reason."""
    source = str(Path(capture.dataset).resolve())
    samples, rejected = prepare_samples(Path(capture.dataset), tokenizer, max_length=capture.max_length,
                                        policy=capture.max_length_policy,
                                        rows=None if rows is None else frozenset(rows), chat=chat)
    if rows is None:
        require_usable(Path(capture.dataset), samples, rejected)
    stored = ledger.captured_ids()
    todo, seen = [], set()
    for s in samples:
        if s.sample_id not in stored and s.sample_id not in seen:  # duplicates are stored once
            seen.add(s.sample_id)
            todo.append(s)
    if rows is not None:
        position = {row: k for k, row in enumerate(rows)}
        todo.sort(key=lambda s: position[s.source_row])
    if rejected:
        ledger.quarantine([{"source": source, "source_row": r.source_row, "sample_id": r.sample_id,
                            "reason": r.reason} for r in rejected])
    return Plan(source, todo, len(samples) - len(todo), rejected, len(samples) + len(rejected))


def storage_preflight(plan: Plan, store: Path, dump_dir: Path | None, *, hidden_size: int, in_flight_tokens: int,
                      dtype: str = BF16) -> dict:
    """Bytes the plan will need where the store and the dump dir live; raise
    InsufficientSpace (needed, free, where) before any work if they cannot fit.
    No dump dir: the store alone (a many-node parent, for the whole plan;
    each node checks its own dump dir)."""
    per_token = bytes_per_token(hidden_size, dtype=dtype)
    need_store = plan.todo_tokens * per_token
    # A dump holds the model dtype (at most fp32) plus int64 ids, only while in flight.
    need_dump = in_flight_tokens * ((3 + 1) * hidden_size * 4 + 8)
    out = {"tokens": plan.todo_tokens, "bytes_per_token": per_token, "store_bytes": need_store, "dump_bytes": need_dump}
    places = [("store", store, need_store)] + ([("dump dir", dump_dir, need_dump)] if dump_dir is not None else [])
    for what, path, need in places:
        path = _existing_parent(Path(path))
        free = shutil.disk_usage(path).free
        out[f"{what.replace(' ', '_')}_free"] = free
        if need > free:
            raise InsufficientSpace(
                f"the {what} needs {_gib(need)} for {plan.todo_tokens:,} tokens but {path} has "
                f"{_gib(free)} free; free space there or choose another location")
    return out


def _existing_parent(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
