"""A DFlash drafter in the training run (train.method dflash): what it is
built from (the store's target layers it reads, the target's embedding,
head and mask token), its training forward as a module DDP can wrap, its
held-out metrics, its export, and how SGLang serves it. The loop, the data
order, checkpoints, resume and sharding are the run's (tasks/train/loop.py).

The anchors of a batch are drawn from a generator seeded by (seed, epoch,
batch): a resumed run draws the blocks the uninterrupted one would have,
and every held-out evaluation scores the same blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tasks.server.config import ServerConfig
from tasks.server.launch import SpeculativeSpec
from tasks.store.reader import StoreReader
from tasks.target.architectures import load_tokenizer
from tasks.target.embeddings import load_target_embeddings
from tasks.train.config import TrainConfig, TrainingError
from tasks.train.data import plan_batches, prefetch
from tasks.train.dflash.model import DFlashConfig, DFlashDrafter, DFlashOutput, build_dflash, dflash_forward
from tasks.train.checkpoint import CHECKPOINT, load_checkpoint
from tasks.train.dflash.export import export_dflash, is_dflash, load_dflash
from tasks.train.dflash.target import check_target_layer_ids, layer_positions, mask_token_for
from tasks.train.layers.sizes import target_sizes
from tasks.train.metrics import acceptance_length
from tasks.train.run import Family, Run, in_precision, positions_read

# The epoch number of held-out anchors: no training epoch has it.
HELDOUT = -1


@dataclass(frozen=True)
class DFlashSetup:
    """What the drafter is fixed to on the target's side, and exported with."""
    target_layer_ids: tuple[int, ...]  # SGLang's "output of layer i", ascending
    mask_token: str
    mask_token_id: int


def drafter_config(cfg: TrainConfig, target_config: dict, num_aux: int) -> DFlashConfig:
    return DFlashConfig.from_target(target_config, cfg.draft_layers, num_aux, cfg.head_dim)


def layout(cfg: TrainConfig) -> str:
    """Its attention layout, as a refusal names it: GQA layers."""
    return "gqa"


def prepare(family: Family, cfg: TrainConfig, reader: StoreReader, target: Path, sizes: dict,
            split: tuple[np.ndarray, np.ndarray], device: torch.device, rank: int, world: int,
            vocab=None) -> Run:
    """The drafter on the target layers it reads, on the rank's device; it
    holds the target's head (its own lm_head, frozen): no second copy."""
    model, setup, positions = build(cfg, reader, target)
    model = in_precision(model.to(device), cfg, device, frozen=("embed_tokens", "lm_head"))
    return Run(cfg, family, reader, *split, None, target, model, None, model.lm_head.weight.detach(), device, rank,
               world, None, positions_read(positions, reader.manifest), setup)


def build(cfg: TrainConfig, reader: StoreReader, target: Path
          ) -> tuple[DFlashDrafter, DFlashSetup, tuple[int, ...]]:
    """The fresh drafter (on the CPU), its setup, and where its target layers
    sit in the store's layer axis. train.aux_layer_ids picks the target
    layers among the store's (default: all of them); refused, naming them,
    where the store lacks one, before the target's embedding and head are
    read."""
    manifest = reader.manifest
    config = target_sizes(target)
    wanted = cfg.aux_layer_ids if cfg.aux_layer_ids is not None else manifest["aux_layers"]["sglang_layer_output_ids"]
    try:
        ids = check_target_layer_ids(wanted, config["num_hidden_layers"])
        positions = layer_positions(manifest, ids)
    except ValueError as e:
        raise TrainingError(f"train.aux_layer_ids {list(wanted)} (a DFlash drafter's target layers): {e}") from None
    try:
        mask_token, mask_id = mask_token_for(load_tokenizer(target), config["vocab_size"])
    except ValueError as e:
        raise TrainingError(f"target {target}: {e}") from None
    model = build_dflash(config, load_target_embeddings(target), num_layers=cfg.draft_layers, num_context=len(ids),
                         seed=cfg.seed, head_dim=cfg.head_dim)
    return model, DFlashSetup(ids, mask_token, mask_id), positions


def anchor_generator(seed: int, epoch: int, batch: int) -> torch.Generator:
    state = np.random.SeedSequence([seed, epoch + 1, batch]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


class DFlashStep(torch.nn.Module):
    """`dflash_forward` as a module's forward, so DDP (which syncs gradients
    only for calls through its own forward) can wrap it."""

    def __init__(self, drafter: DFlashDrafter, cfg: TrainConfig, setup: DFlashSetup):
        super().__init__()
        self.drafter = drafter
        self.cfg, self.setup = cfg, setup

    def forward(self, batch: dict, generator: torch.Generator) -> DFlashOutput:
        cfg = self.cfg
        return dflash_forward(self.drafter, batch, block_size=cfg.block_size, mask_token_id=self.setup.mask_token_id,
                              max_anchors=cfg.max_anchors, gamma=cfg.loss_gamma, labels=cfg.labels,
                              generator=generator)


def module(run: Run) -> torch.nn.Module:
    return DFlashStep(run.model, run.cfg, run.setup)


def forward(run: Run, module: torch.nn.Module, batch: dict, epoch: int, index: int):
    return module(batch, anchor_generator(run.cfg.seed, epoch, index))


def describe(run: Run) -> str:
    cfg = run.cfg
    return (f"DFlash: {cfg.draft_layers} layer(s) reading target layers {list(run.setup.target_layer_ids)}, "
            f"blocks of {cfg.block_size}")


@torch.no_grad()
def evaluate(run: Run) -> dict:
    """Held-out loss, per-slot accuracy and the accept lengths they imply,
    over up to eval_max_samples: `tau` (the product of the slots'
    accuracies) and `tau_exact` (sum over slots k of the share of blocks
    whose drafts 1..k all hit), in the keys EAGLE-3's metrics use (a
    slot is a TTT step's counterpart; the accept length is tau + 1)."""
    cfg, model = run.cfg, run.model
    step = DFlashStep(model, cfg, run.setup)
    model.eval()
    slots = cfg.block_size - 1
    correct, counted = torch.zeros(slots, dtype=torch.long), torch.zeros(slots, dtype=torch.long)
    chained, chain_counted = torch.zeros(slots, dtype=torch.long), torch.zeros(slots, dtype=torch.long)
    loss, weight = 0.0, 0
    batches = plan_batches(run.reader.num_tokens, run.held_idx[:cfg.eval_max_samples], cfg.tokens_per_batch, None)
    for i, batch in enumerate(prefetch(run.collate, batches)):
        with run.autocast():
            out = step(run.on_device(batch), anchor_generator(cfg.seed, HELDOUT, i))
        correct += out.correct.cpu()
        counted += out.counted.cpu()
        chained += out.chained.cpu()
        chain_counted += out.chain_counted.cpu()
        loss += float(out.loss) * int(out.counted[0])
        weight += int(out.counted[0])
    model.train()
    acc = (correct / counted.clamp(min=1)).tolist()
    chain = (chained / chain_counted.clamp(min=1)).tolist()
    s = min(cfg.serve_steps, slots)
    return {
        "loss": loss / max(1, weight),
        "acc": acc,
        "tau": acceptance_length(acc),
        f"tau@{cfg.serve_steps}": acceptance_length(acc[:s]),
        "tau_exact": sum(chain),
        f"tau_exact@{cfg.serve_steps}": sum(chain[:s]),
        "chain": chain,
        "chain_counted": chain_counted.tolist(),
        "heldout_tokens": int(counted[0]),
        "unproposable": 0.0,  # a DFlash drafter drafts from the whole vocabulary
    }


def export(run: Run, drafter_dir: Path, extra: dict) -> Path:
    """The drafter as it is now, as SGLang's DFlashDraftModel loads it."""
    return export_dflash(run.model, run.setup.target_layer_ids, drafter_dir, target_config=target_sizes(run.target),
                         block_size=run.cfg.block_size, mask_token_id=run.setup.mask_token_id,
                         mask_token=run.setup.mask_token, extra=extra)


def served_spec(launch: ServerConfig, drafter_dir: Path, drafts: int, **options) -> SpeculativeSpec:
    """Served with the block size it was trained with (its config.json)."""
    return SpeculativeSpec.dflash(launch, drafter_dir, **options)


def drafts(cfg: TrainConfig) -> int:
    """The tokens a verify step drafts: its block, less the bonus token."""
    return cfg.block_size - 1


def served_metric(cfg: TrainConfig) -> str:
    """Training's simulation of what SGLang serves: the whole block's exact tau."""
    return "tau_exact"


def is_export(config: dict) -> bool:
    return is_dflash(config)


def exported_drafts(config: dict, asked: int | None) -> int:
    """Its block, less the bonus token, whatever was asked."""
    return config["dflash_config"]["block_size"] - 1


def read_back(drafter_dir: Path, out_dir: Path, target: Path) -> tuple[dict, dict]:
    """The checkpoint holds a DFlash drafter's trained tensors under the export's names."""
    return load_dflash(drafter_dir, target).trained_tensors(), load_checkpoint(Path(out_dir) / CHECKPOINT)["model"]


def serve_flags(drafts: int) -> str:
    return "--speculative-algorithm DFLASH"
