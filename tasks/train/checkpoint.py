"""The training checkpoint, `checkpoint.pt` in out_dir: what it holds, how
it is written (atomically, by rank 0, whole tensors under every sharding,
never from non-finite weights or optimizer state) and read (plain tensors
and values only, refused when written under other settings), and where a
resume starts from it.

It holds the run's identity (the store and the settings that are not
resumable ones), the drafter's trainable weights, the optimizer state, the draft
vocabulary (d2t and the target's vocabulary size), the position (epoch, and
batches of that epoch's order done: the order is a function of the seed,
the epoch and the split alone, so the position means the same on any device
count), a fingerprint of the split, the step count, the held-out history,
and the device count it was written on (for the log only)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from tasks.durable import replace_durably
from tasks.train import distributed
from tasks.train.config import BEFORE_THE_SETTING, CheckpointMismatch, TrainConfig, TrainingError
from tasks.train.data import describe_split_change

logger = logging.getLogger("eagle3.training")

CHECKPOINT = "checkpoint.pt"


def load_checkpoint(path: Path) -> dict:
    # weights_only: a checkpoint is tensors and plain values, and loading one
    # must never run code (the file may come from another machine).
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:
        # torch wraps the one useful line in paragraphs of general advice.
        paragraphs = [p.strip() for p in str(e).split("\n\n") if p.strip()]
        why = " ".join(p for p in paragraphs if not p.startswith(("Weights only load failed", "Check the doc",
                                                                  "Please file an issue"))) or str(e)
        raise CheckpointMismatch(f"checkpoint {path} cannot be loaded as plain tensors and values ({why[:300]}); it "
                            f"is not one this trainer wrote, or it is damaged: delete it to start over") from e


def read_checkpoint(path: Path, cfg: TrainConfig, store: str | Path, world: int) -> dict | None:
    """The checkpoint to resume, or None to start afresh; refused if it was
    written under other settings (naming them) or, on several nodes, if
    some ranks see it and others do not."""
    if world > 1:
        # Every rank reads the checkpoint rank 0 writes: on several nodes,
        # only one shared out_dir makes them all resume from the same one.
        seen = float(path.exists())
        seen_and_unseen = distributed.on_any_rank(torch.tensor([seen, 1 - seen], device=distributed.device()), world)
        if bool(seen_and_unseen.all()):
            raise TrainingError(f"{path} is there for some ranks and not for others: on several nodes out_dir must "
                                f"be one directory every node shares (the same path on a shared filesystem, as for "
                                f"the store)")
    if not path.exists():
        return None
    ckpt = load_checkpoint(path)
    ckpt["identity"], changed = identity_changes(ckpt["identity"], cfg, store)
    if changed:
        changed = {f"train.{k}" if k != "store" else k: v for k, v in changed.items()}
        raise CheckpointMismatch(f"{path} belongs to a run with other settings {changed} (old, new): use another "
                                 f"out_dir, or delete the checkpoint to start over")
    return ckpt


def identity_changes(saved: dict, cfg: TrainConfig, store: str | Path) -> tuple[dict, dict]:
    """A checkpoint's identity, completed, and what `cfg` changes of it
    ({setting: (old, new)}). A checkpoint from before a setting existed ran
    with its default then (BEFORE_THE_SETTING where today's differs); a
    setting another drafter family's alone reads is not compared."""
    saved = {**TrainConfig(method=cfg.method).identity(store), **BEFORE_THE_SETTING, **saved}
    return saved, {k: (saved.get(k), v) for k, v in cfg.identity(store).items() if saved.get(k) != v}


def resume_position(ckpt: dict, fingerprint: dict, cfg: TrainConfig, store: str | Path,
                    path: Path) -> tuple[int, int]:
    """(epoch, batches of its order done) to resume a checkpoint from, with
    `fingerprint` the current split's. A split changed since the checkpoint
    is refused, or with on_store_change "replan" the epoch starts again."""
    epoch = ckpt["epoch"]
    if ckpt["fingerprint"] == fingerprint:
        return epoch, ckpt["batches_done"]
    change = describe_split_change(ckpt["fingerprint"], fingerprint)
    if epoch >= cfg.epochs:
        if cfg.on_store_change != "replan":
            raise CheckpointMismatch(f"store {store} changed since {path} was written ({change}), and that run has "
                                f"finished on the old split: train the store as it is now in a new out_dir")
        logger.warning("store %s changed since %s was written (%s), and that run has finished: nothing is left "
                       "to re-plan", store, path, change)
        return epoch, 0
    if cfg.on_store_change != "replan":
        raise CheckpointMismatch(
            f"store {store} changed since {path} was written ({change}): the checkpoint's position (epoch "
            f"{epoch + 1}, {ckpt['batches_done']} batches done) is in batches cut from the old split, so going on "
            f"would skip or repeat samples. Train the store as it is now in a new out_dir, or set "
            f"train.on_store_change=replan to go on with this run from the start of epoch {epoch + 1}, its batches cut "
            f"from the current split (the samples it trained on this epoch are trained again)")
    logger.warning("store %s changed since %s was written (%s): on_store_change=replan, so epoch %d starts again "
                   "over the current split (%d batches of the old split's order were done); the draft vocabulary "
                   "stays the one counted at the start, and the history's earlier held-out rows are over the old "
                   "held-out split", store, path, change, epoch + 1, ckpt["batches_done"])
    return epoch, 0


def nonfinite_tensors(tensors: dict) -> list[str]:
    """Names of the tensors (nested dicts and lists walked, e.g. an optimizer
    state) holding a NaN or an infinity; of a sharded tensor, this rank's
    shard."""
    bad: list[str] = []

    def walk(prefix: str, v) -> None:
        if isinstance(v, DTensor):
            walk(prefix, v.to_local())
        elif isinstance(v, torch.Tensor):
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                bad.append(prefix)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, (list, tuple)):
            for k, x in enumerate(v):
                walk(f"{prefix}.{k}" if prefix else str(k), x)

    walk("", tensors)
    return bad


@dataclass
class CheckpointWriter:
    """Writes a run's checkpoints; every rank calls it (the gathers of
    sharded tensors and the finiteness verdict are collectives), rank 0
    writes."""
    path: Path
    identity: dict
    fingerprint: dict
    model: torch.nn.Module  # the family's drafter (its trainable_state is checkpointed)
    optimizer: torch.optim.Optimizer
    rank: int
    world: int

    def require_finite(self, what: str, step: int) -> None:
        """Refuse to write `what` from non-finite weights or Adam state.
        Every rank checks its own (under DDP equal to rank 0's, under FSDP its
        shards), and the verdict is all-reduced, so all raise together rather
        than leave the others waiting in a collective."""
        bad = nonfinite_tensors({"model": self.model.trainable_state(),
                                 "optimizer": self.optimizer.state_dict()["state"]})
        anywhere = distributed.on_any_rank(torch.tensor([float(bool(bad))], device=distributed.device()), self.world)
        if anywhere.item() and not bad:
            bad = ["another rank's shard"]
        if bad:
            raise TrainingError(f"refusing to write {what} at step {step}: non-finite values in "
                                f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; {self.path} "
                                f"(the last good checkpoint) is kept")

    def save(self, epoch: int, batches_done: int, step: int, history: list[dict]) -> None:
        self.require_finite(f"checkpoint {self.path}", step)
        keep = self.rank == 0
        weights = distributed.whole(self.model.trainable_state(), keep)
        optimizer = distributed.whole(self.optimizer.state_dict(), keep)
        if keep:
            state = {"identity": self.identity, "model": weights, "optimizer": optimizer, "epoch": epoch,
                     "batches_done": batches_done, "fingerprint": self.fingerprint, "world": self.world,
                     "step": step, "history": history, "vocab_size": self.model.cfg.vocab_size,
                     # An EAGLE-3 drafter's draft vocabulary; a DFlash one has none.
                     "d2t": self.model.d2t.cpu() if hasattr(self.model, "d2t") else None}
            replace_durably(self.path, lambda tmp: torch.save(state, tmp))
