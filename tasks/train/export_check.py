"""An export read back and compared with what was trained (the last
checkpoint's fp32 weights): a tensor dropped or renamed on the way would
otherwise surface only as a drafter SGLang accepts at ~0. Either family:
an EAGLE-3 drafter through tasks/train/eagle3/export.py's reader, a DFlash one
through tasks/train/dflash/export.py's."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tasks.train.families import exported_family

# A bf16 export of fp32 weights differs by ~4e-3 relative at most.
TOLERANCE = 1e-2


def exported_and_trained(drafter_dir: Path, out_dir: Path, target: Path
                         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the export's tensors as its reader loads them, the checkpoint's), by
    the export's names."""
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    return exported_family(config, drafter_dir).read_back(Path(drafter_dir), Path(out_dir), Path(target))


def compare_export(drafter_dir: Path, out_dir: Path, target: Path) -> dict:
    """The worst relative difference between the export and the checkpoint,
    tensor by tensor; raises naming a tensor the export lacks, a non-finite
    value on either side, or a difference past TOLERANCE."""
    loaded, trained = exported_and_trained(Path(drafter_dir), Path(out_dir), Path(target))
    worst = 0.0
    for name, tensor in trained.items():
        if name not in loaded:
            raise RuntimeError(f"exported drafter {drafter_dir} lacks {name}")
        # NaN-safe: max(worst, nan) keeps worst, so a NaN difference would pass.
        for what, t in (("exported", loaded[name]), ("trained (checkpoint)", tensor)):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise RuntimeError(f"{what} drafter tensor {name} holds NaN or infinite values ({drafter_dir})")
        diff = (loaded[name].float() - tensor.float()).abs().max().item()
        scale = tensor.float().abs().max().item() or 1.0
        if not math.isfinite(diff / scale):
            raise RuntimeError(f"exported drafter {drafter_dir}: {name} differs by a non-finite amount")
        worst = max(worst, diff / scale)
    if not worst <= TOLERANCE:
        raise RuntimeError(f"exported drafter {drafter_dir} differs from the trained one (relative {worst:.2e})")
    return {"tensors": len(loaded), "worst_relative_diff": worst, "dtype": str(torch.bfloat16)}
