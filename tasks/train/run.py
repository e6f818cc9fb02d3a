"""A training run as prepared (tasks/train/prepare.py): the store and its
split, the target, the drafter on the rank's device, and its Family (a row
of tasks/train/families.py): what the run asks of the drafter's family,
the training forward, the held-out metrics, the export and how SGLang
serves it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Protocol

import numpy as np
import torch

from tasks.store.reader import StoreReader
from tasks.target.layers import AuxLayers
from tasks.train.config import TrainConfig
from tasks.train.data import collate
from tasks.train.vocab import DraftVocab, GreedyCache

def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of a precision setting on a device; None: plain fp32."""
    if precision == "fp32" or (precision == "auto" and device.type == "cpu"):
        return None
    return torch.bfloat16


def in_precision(model: torch.nn.Module, cfg: TrainConfig, device: torch.device,
                 frozen: tuple[str, ...] = ("embed_tokens",)) -> torch.nn.Module:
    """`model` with its `frozen` target matrices in the autocast dtype: the
    target-vocabulary matrices (4.7 GB each in fp32 for a 160k x 7168
    target) only feed bf16 matmuls under autocast, and a bf16 checkpoint's
    values are bf16 anyway."""
    low = autocast_dtype(cfg.precision, device)
    if low is not None:
        for name in frozen:
            getattr(model, name).to(low)
    return model


class StepCounts(Protocol):
    """What the loop reads of a family's training forward (EAGLE-3's
    StepOutput, DFlash's DFlashOutput): the loss, and per step (or block
    slot) the positions scored and hit."""
    loss: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor


@dataclass(frozen=True)
class Family:
    """What the shared training run, and what reads its exports, ask of a
    drafter family."""
    name: str
    label: str  # as a card or a log names it
    drafter_config: Callable  # (cfg, target config, aux layers) -> the drafter's sizes, refused where unservable
    layout: Callable  # (cfg) -> its attention layout, as a refusal names it
    prepare: Callable  # (family, cfg, reader, target, sizes, split, device, rank, world, vocab) -> Run
    module: Callable  # (run) -> the training forward as a module DDP or FSDP wraps
    forward: Callable  # (run, module, batch, epoch, index) -> loss and per-step counts
    evaluate: Callable  # (run) -> held-out metrics, in the keys every family reports
    describe: Callable  # (run) -> one line for the run's log
    export: Callable  # (run, drafter dir, extra) -> the drafter as SGLang loads it
    served_spec: Callable  # (server section, drafter dir, drafts, **launch options) -> how SGLang serves it
    drafts: Callable  # (cfg) -> the tokens a verify step drafts
    served_metric: Callable  # (cfg) -> training's held-out figure beside SGLang's
    is_export: Callable  # (an exported config.json) -> whether it is this family's drafter
    exported_drafts: Callable  # (config.json, drafts asked for or None) -> the tokens a verify step drafts
    read_back: Callable  # (drafter dir, out dir, target) -> (the export's tensors, the checkpoint's)
    serve_flags: Callable  # (drafts) -> SGLang's flags that serve it, for its card

    @property
    def record(self) -> str:
        """The key of its training record in an exported config.json."""
        return f"{self.name}_training"

    @classmethod
    def of(cls, name: str, label: str, module: ModuleType) -> "Family":
        """The family whose training.py is `module`."""
        return cls(name, label, *(getattr(module, f) for f in list(cls.__dataclass_fields__)[2:]))


def positions_read(positions: tuple[int, ...], manifest: dict) -> tuple[int, ...] | None:
    """The store's layer positions a drafter reads; None where it reads every
    layer of the store, in its order."""
    return None if positions == tuple(range(len(manifest["aux_layers"]["sglang_layer_output_ids"]))) else positions


@dataclass
class Run:
    """What the loop needs, prepared once."""
    cfg: TrainConfig
    family: Family
    reader: StoreReader
    train_idx: np.ndarray
    held_idx: np.ndarray
    layers: AuxLayers | None  # what an EAGLE-3 drafter reads, a subset of the store's
    target: Path
    model: torch.nn.Module
    head_rows: torch.Tensor | None  # EAGLE-3: the target head's rows of the draft vocabulary
    full_head: torch.Tensor
    device: torch.device
    rank: int = 0
    world: int = 1
    vocab: DraftVocab | None = None  # EAGLE-3's; a DFlash drafter drafts from the whole vocabulary
    aux_positions: tuple[int, ...] | None = None  # of the layers read, in the store's layer axis; None: all of them
    setup: object = None  # the family's own (DFlash: its target layers and mask token)
    greedy: GreedyCache | None = None  # EAGLE-3 on one CPU process (remembers_greedy)

    def collate(self, indices: list[int]) -> dict:
        batch = collate(self.reader, indices, self.aux_positions)
        if self.greedy is not None:
            batch["samples"] = torch.tensor(indices, dtype=torch.long)
            top = self.greedy.lookup(indices, batch["input_ids"].shape[1])
            if top is not None:
                batch["target_top"] = top
        return batch

    def remember(self, batch: dict, out) -> None:
        """An EAGLE-3 batch's greedy tokens, for its samples' next epochs."""
        if self.greedy is not None and "target_top" not in batch:
            self.greedy.remember(batch["samples"], out.target_top, batch["lengths"])

    def autocast(self):
        dtype = autocast_dtype(self.cfg.precision, self.device)
        return torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)

    def on_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def module(self) -> torch.nn.Module:
        """The drafter's training forward as a module (what DDP or FSDP wraps)."""
        return self.family.module(self)

    def forward(self, module: torch.nn.Module, batch: dict, epoch: int, index: int):
        """Batch `index` of `epoch`'s order through `module` (self.module(),
        wrapped): its loss and per-step (EAGLE-3) or per-slot (DFlash) counts."""
        return self.family.forward(self, module, batch, epoch, index)
