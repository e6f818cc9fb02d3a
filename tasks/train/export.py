"""What every family's export shares: the drafter's sizes its config.json
names, the refusal of an export SGLang's class would load only in part,
and an earlier export put in place (a served epoch's). Each family writes
its own layout: tasks/train/eagle3/export.py, tasks/train/dflash/export.py."""
from __future__ import annotations

import shutil
from pathlib import Path

from tasks.durable import replace_dir_durably

# A drafter's sizes in its config.json (its own: tasks/train/layers/sizes.py).
SIZE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
             "rms_norm_eps", "vocab_size")


class UnservedTensor(ValueError):
    """An export SGLang would load only in part."""


def refuse_unserved(names, want: set[str], served_as: str, where: str) -> None:
    """Refuse tensor `names` that SGLang's class `served_as`, whose
    parameters take `want`, would not load whole: a tensor it maps to no
    parameter (skipped without an error) or a parameter no tensor fills."""
    names = set(names)
    wrong = []
    if names - want:
        wrong.append(f"it skips {', '.join(sorted(names - want))} (no parameter of its model takes it)")
    if want - names:
        wrong.append(f"nothing fills {', '.join(sorted(want - names))}")
    if wrong:
        raise UnservedTensor(
            f"SGLang's {served_as} would serve this drafter only in part: {'; '.join(wrong)}. The drafter has "
            f"tensors its served class lacks, or lacks some it has: change the drafter, or teach {where} what "
            f"SGLang now loads")


def copy_drafter(exported: Path, out_dir: Path) -> Path:
    """A drafter exported earlier (a served epoch's) put in place at
    `out_dir`, atomically as export_drafter puts one."""
    def fill(tmp: Path) -> None:
        for f in Path(exported).iterdir():
            shutil.copy2(f, tmp / f.name)

    return replace_dir_durably(out_dir, fill)
