"""Publishing a drafter folder to a model hub as it is: huggingface_hub's
upload of the folder, dry run by default (what would be sent, and what
stops it).

A folder is refused while its card still holds a FILL_IN (a licence or a
base model only the user can give), lacks its metadata block, or any text
file in it names an absolute path (a path of the machine that trained it,
meaningless to its readers). The files sent are the folder's own plain
files; a hidden file (a temp file, an editor's) or a sub-folder is left out
and listed as such. The token is huggingface_hub's own (HF_TOKEN or `hf auth
login`), never a parameter: Prefect would store it with the run.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from tasks.train.model_card import CARD
from tasks.train.record import FILL_IN, card_metadata, is_hub_id

# Files read for paths and placeholders: everything a hub renders or a loader parses.
TEXT_SUFFIXES = {".json", ".md", ".txt", ".yaml", ".yml", ".jinja", ".py"}
# An absolute path: a slash not inside a word, a URL or a relative path,
# followed by at least two name parts (`/home/x`, not the `/` of "tokens/s").
ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])/(?:[\w.+-]+/)+[\w.+-]+")
REQUIRED_METADATA = ("base_model", "license", "library_name", "tags", "pipeline_tag")


class PublishRefused(ValueError):
    """The folder is not ready to publish; the message lists why."""


@dataclass
class PublishPlan:
    folder: Path
    repo_id: str
    files: list[tuple[str, int]]  # (name, bytes), in name order
    left_out: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"{self.repo_id} <- {self.folder}: {len(self.files)} files, "
                 f"{sum(b for _, b in self.files):,} bytes"]
        lines += [f"  {name} ({size:,} bytes)" for name, size in self.files]
        lines += [f"  left out: {name}" for name in self.left_out]
        lines += [f"  refused: {p}" for p in self.problems]
        return "\n".join(lines)


def _text_problems(path: Path) -> list[str]:
    problems = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        for found in ABSOLUTE_PATH.findall(line):
            problems.append(f"{path.name} line {number} names the absolute path {found}: a path of this machine "
                            f"means nothing to the folder's readers")
        if FILL_IN in line:
            problems.append(f"{path.name} line {number} still says {FILL_IN}: {line.strip()[:120]}")
    return problems


def _card_problems(folder: Path) -> list[str]:
    card = folder / CARD
    if not card.is_file():
        return [f"no {CARD}: export the drafter with train_drafter, which writes its card"]
    meta = card_metadata(card)  # {} for a block that does not parse: it lacks them all
    missing = [k for k in REQUIRED_METADATA if not meta.get(k)]
    return [f"{CARD}'s metadata block lacks {', '.join(missing)}"] if missing else []


def plan(folder: str | Path, repo_id: str) -> PublishPlan:
    """What publishing `folder` as `repo_id` sends, and what stops it."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise PublishRefused(f"{folder} has no config.json: give an exported drafter folder (train_drafter's "
                             f"drafter/)")
    entries = sorted(folder.iterdir())
    files = [p for p in entries if p.is_file() and not p.is_symlink() and not p.name.startswith(".")]
    result = PublishPlan(folder, repo_id, [(p.name, p.stat().st_size) for p in files],
                         [p.name + ("/" if p.is_dir() else "") for p in entries if p not in files])
    if not is_hub_id(repo_id):
        result.problems.append(f"repo id {repo_id!r} is not <user-or-org>/<name>")
    try:
        json.loads((folder / "config.json").read_text())
    except ValueError as e:
        result.problems.append(f"config.json does not parse: {e}")
    if not any(p.suffix == ".safetensors" for p in files):
        result.problems.append("no .safetensors weights in the folder")
    result.problems += _card_problems(folder)
    for p in files:
        if p.suffix in TEXT_SUFFIXES:
            result.problems += _text_problems(p)
    return result


def publish(folder: str | Path, repo_id: str, upload: bool = False, private: bool = True) -> PublishPlan:
    """Dry run (upload False): the plan. Upload: refused while the plan has
    problems; otherwise the repository is created if needed and the plan's
    files sent in one commit."""
    made = plan(folder, repo_id)
    if not upload:
        return made
    if made.problems:
        raise PublishRefused(f"{folder} is not published:\n" + "\n".join(f"- {p}" for p in made.problems))
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(folder_path=str(made.folder), repo_id=repo_id, repo_type="model",
                      allow_patterns=[name for name, _ in made.files],
                      commit_message=f"drafter from eagle3-hidden-states ({made.folder.name})")
    return made
