"""The target's token embedding and output head, read from its safetensors
checkpoint by tensor name (tasks/target/architectures.py) without loading
the rest of the model: the drafter copies them, the capture canary scores
stored states with the head."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from tasks.target.architectures import architecture_of, read_config


def _read(target_path: Path, keep_head: bool) -> dict[str, torch.Tensor]:
    config = read_config(target_path)
    arch = architecture_of(config)
    wanted = {arch.embed_weight: "embed", arch.head_weight: "head"}
    if keep_head:
        wanted.pop(arch.embed_weight)  # read only when the head is tied to it
    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(target_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in wanted:
                    found[wanted[key]] = f.get_tensor(key)
    if keep_head:
        return found if "head" in found else _read_tied(target_path, arch, config)
    if "embed" not in found:
        raise FileNotFoundError(f"no {arch.embed_weight} in {target_path}/*.safetensors (architecture {arch.name})")
    if "head" not in found:
        found["head"] = _read_tied(target_path, arch, config, found["embed"])["head"]
    return found


def _read_tied(target_path, arch, config, embed: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    if not arch.sizes(config).get("tie_word_embeddings", False):
        raise FileNotFoundError(f"{target_path} has no {arch.head_weight} and does not tie its embeddings")
    if embed is None:
        embed = _read(target_path, keep_head=False)["embed"]
    return {"embed": embed, "head": embed}


def load_target_embeddings(target_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) in fp32; a tied target has no
    head tensor, and its head is the embedding."""
    found = _read(Path(target_path), keep_head=False)
    return found["embed"].float(), found["head"].float()


def load_target_head(target_path: Path) -> torch.Tensor:
    """lm_head [V, H] in the checkpoint's own dtype (2.3 GB at Kimi-K2.5's
    163,840 x 7,168 in bf16: kept as stored, never widened whole). A head
    stored quantised is refused: its scales are not read here."""
    head = _read(Path(target_path), keep_head=True)["head"]
    if head.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{target_path}: the lm_head is stored as {head.dtype}; only bf16, fp16 or fp32 heads "
                        f"can be read without their quantisation scales")
    return head
