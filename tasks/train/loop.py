"""The training loop over a verified store: prepare once (split, draft
vocabulary, drafter; tasks/train/prepare.py), train with the forward of
the drafter's family (EAGLE-3's TTT, DFlash's random blocks:
tasks/train/families.py), evaluate on held-out samples per epoch
(tasks/train/heldout.py), checkpoint atomically with the data position
(tasks/train/checkpoint.py), export at the end.

Each epoch's batch order is a function of the seed, the epoch and the
training split alone, never of the device count; the checkpoint records how
many of its batches are done and a fingerprint of the split, so a resumed
run, on as many devices as before or not, trains exactly the batches left,
and a store changed since is refused (or re-planned on request). Under
torchrun (tasks/train/launch.py) each optimizer step takes the next
`accumulate` batches of the order on every rank (tasks/train/data.py
assign_batches), under DDP or FSDP2 (tasks/train/distributed.py).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from tasks.train import distributed
from tasks.train.checkpoint import CHECKPOINT, CheckpointWriter, read_checkpoint, resume_position
from tasks.train.config import CheckpointMismatch, DrafterRefused, TrainConfig, TrainingError, TrainResult
from tasks.train.data import assign_batches, heldout_prompts, plan_batches, prefetch, split_fingerprint
from tasks.train.heldout import describe, evaluate
from tasks.train.layers.rope import rope_parameters
from tasks.train.eagle3.speculators import FOLDER as SPECULATORS_FOLDER, export_beside, refusal
from tasks.train.export import copy_drafter
from tasks.train.record import export_record
from tasks.train.model_card import card_or_warning
from tasks.train.metrics import write_metrics
from tasks.train.prepare import prepare
from tasks.train.run import Run, StepCounts, autocast_dtype
from tasks.server.config import ServerConfig
from tasks.train.served import (check_serving_fits, choose_served, describe_choice, describe_served, gpus_here,
                                measure_served, serve_now, served_dir)
from tasks.stream.reader import Spool
from tasks.train.vocab import DraftVocab

logger = logging.getLogger("eagle3.training")

RESULT = "result.json"


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine to 10%, over `total` (the run's batches:
    `step` is the batches done before this step, so the schedule is the same
    on any number of devices): a function of the position alone, so a resume
    needs no scheduler state."""
    warm = max(1, int(cfg.warmup_fraction * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Stepper:
    """One optimizer step at a time, over the batches this rank takes for it
    (`accumulate`, each with its loss weight): their forward and backward,
    the gradients reduced across the ranks in the last backward, clipped, and
    the step taken, or skipped where a loss or the gradient norm is not
    finite. Keeps the run's counts: tokens trained, seconds spent waiting for
    data and computing, steps skipped."""

    def __init__(self, run: Run, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 trainable: list[torch.nn.Parameter], checkpoint_path: Path):
        self.run, self.module, self.optimizer, self.trainable = run, module, optimizer, trainable
        self.checkpoint_path = checkpoint_path
        self.tokens, self.wait_s, self.compute_s = 0, 0.0, 0.0
        self.skipped = self.in_a_row = 0
        self.loaded: Iterator[dict] = iter(())
        self.idle_since = self.epoch_started = time.time()
        self.epoch_tokens = self.epoch_steps = 0

    def start_epoch(self, plan: list[list[int]], mine: list[tuple[int, list[tuple[int, float]]]]) -> None:
        """Start reading this rank's batches of the epoch, in the order it trains them."""
        self.loaded = prefetch(lambda b: self.run.collate(plan[b]), [b for _, bs in mine for b, _ in bs])
        self.idle_since = self.epoch_started = time.time()
        self.epoch_tokens = self.epoch_steps = 0

    def step(self, batches: list[tuple[int, float]], lr: float, epoch: int, number: int
             ) -> tuple[list[StepCounts], torch.Tensor]:
        """Step `number` of the run (from 1) in `epoch` (from 0): each batch's
        output, and the gradient norm before clipping."""
        run, cfg = self.run, self.run.cfg
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        outs = []
        for i, (index, weight) in enumerate(batches):
            batch = next(self.loaded)
            t0 = time.time()
            self.wait_s += t0 - self.idle_since
            batch = run.on_device(batch)
            with distributed.gradient_sync(self.module, last=i == len(batches) - 1):
                with run.autocast():
                    out = run.forward(self.module, batch, epoch, index)
                # weight: world/m on the slots with a batch of their own, 0
                # on a slot repeating one (assign_batches), so that the mean
                # over the ranks of the sum over each rank's batches is the
                # mean over the step's batches.
                (out.loss * weight).backward()
            outs.append(out)
            n_tok = int(batch["lengths"].sum()) if weight else 0
            self.tokens += n_tok
            self.epoch_tokens += n_tok
            self.idle_since = time.time()
            self.compute_s += self.idle_since - t0
        t0 = time.time()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, cfg.max_grad_norm)
        if isinstance(grad_norm, DTensor):  # over FSDP's shards: the same on every rank
            grad_norm = grad_norm.full_tensor()
        self._step_unless_nonfinite(outs, grad_norm, epoch, number)
        self.epoch_steps += 1
        self.idle_since = time.time()
        self.compute_s += self.idle_since - t0
        return outs, grad_norm

    def _step_unless_nonfinite(self, outs: list[StepCounts], grad_norm: torch.Tensor, epoch: int,
                               number: int) -> None:
        cfg = self.run.cfg
        # Under DDP and FSDP the gradient norm agrees across ranks but the
        # losses do not: the flags are taken from every rank, so all make the
        # same decision and the weights stay identical.
        losses = torch.stack([o.loss.detach().float() for o in outs])
        flags = torch.stack([~torch.isfinite(losses).all(), ~torch.isfinite(grad_norm.detach().float())]).float()
        bad_loss, bad_grad = (bool(f) for f in distributed.on_any_rank(flags, self.run.world).tolist())
        if not (bad_loss or bad_grad):
            self.optimizer.step()
            self.in_a_row = 0
            return
        # Skipped: the gradients are dropped and the weights (and Adam's
        # moments) are left as they were; the batches are spent.
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped += 1
        self.in_a_row += 1
        what = "loss and gradient norm" if bad_loss and bad_grad else "loss" if bad_loss else "gradient norm"
        if self.run.rank == 0:
            logger.warning("epoch %d/%d step %d: non-finite %s (loss %s, gradient norm %s): step skipped (%d in a "
                           "row, %d in all; the run stops at %d in a row)", epoch + 1, cfg.epochs, number, what,
                           ", ".join(f"{x:.3g}" for x in losses.tolist()), f"{grad_norm.item():.3g}",
                           self.in_a_row, self.skipped, cfg.max_nonfinite_steps)
        if self.in_a_row >= cfg.max_nonfinite_steps:
            raise TrainingError(
                f"training stopped at epoch {epoch + 1}, step {number}: {self.in_a_row} optimizer steps in a row "
                f"had a non-finite {what} (max_nonfinite_steps {cfg.max_nonfinite_steps}); nothing was exported, "
                f"and {self.checkpoint_path} (the last good checkpoint, written before these steps) is kept. A "
                f"resume replays the same batches: lower lr or max_grad_norm, or check the store")

    def log_progress(self, epoch: int, step: int, total_steps: int, outs: list[StepCounts]) -> None:
        cfg, took = self.run.cfg, time.time() - self.epoch_started
        acc0 = float(outs[0].correct[0]) / max(1, int(outs[0].counted[0]))
        logger.info("epoch %d/%d step %d/%d: loss %.3f, acc0 %.2f, lr %.2e, %.0f tok/s, ETA %.0f s", epoch + 1,
                    cfg.epochs, step, total_steps, outs[0].loss.item(), acc0, self.optimizer.param_groups[0]["lr"],
                    self.epoch_tokens / max(1e-9, took), (total_steps - step) * took / self.epoch_steps)


def train(cfg: TrainConfig, store: str | Path, *, server: ServerConfig | None = None,
          on_eval: Callable[[dict], None] | None = None,
          on_step: Callable[[dict], None] | None = None) -> TrainResult:
    """Train (or resume) a drafter on `store`, a verified store; returns its
    exported directory and metrics. Checkpoints hold the weights, the
    optimizer, the draft vocabulary, the data position (epoch, batches of its
    order done) and the split's fingerprint; the batch order is a function of
    the seed, the epoch and the split, so a resumed run, on any number of
    devices, trains exactly what is left.

    on_step, on every rank after each optimizer step (and its checkpoint, if
    one was due), once per batch the rank trained in the step (`accumulate`
    of them): epoch, step, rank, world, the batch (its index in the epoch's
    order), sample ids and loss weight (0: a repeat in a slot left without a
    batch at an epoch's end), its loss and the step's gradient norm (before
    clipping), so a caller can account for every batch the run consumed.

    `server`: the run's server section, which the drafter is served with
    (train.serve_every launches it; its tensor parallelism must split the
    drafter's heads)."""
    started = time.time()
    check_serving_fits(cfg, server, gpus_here())
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / CHECKPOINT
    rank, world = distributed.process_group()
    ckpt = read_checkpoint(ckpt_path, cfg, store, world)
    vocab = DraftVocab.from_d2t(ckpt["d2t"], ckpt["vocab_size"]) if ckpt and ckpt.get("d2t") is not None else None
    run = prepare(cfg, store, vocab, rank, world, server)
    if "speculators" in cfg.export_formats:  # refused before training, not after
        why = refusal(rope_parameters(run.model.target_config), len(run.layers.sglang_ids))
        if why:
            raise DrafterRefused(f"train.export_formats speculators: {why}; leave export_formats [sglang]")
    model = run.model
    if ckpt is not None:
        try:
            model.load_state_dict(ckpt["model"], strict=False)
        except RuntimeError as e:  # same settings, other shapes: derived otherwise when it was written
            raise CheckpointMismatch(f"{ckpt_path} holds a drafter of other shapes than these settings make for "
                                     f"this target (its sizes were derived otherwise when it was written: "
                                     f"{str(e).splitlines()[-1].strip()}): use another out_dir, or delete the "
                                     f"checkpoint to start over") from None
    # After the checkpoint's weights are in: FSDP2 shards what each rank holds.
    module = distributed.parallel(run.module(), cfg.sharding, run.device, world)
    # The frozen embedding has no optimizer state (nor, under FSDP, shards).
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    fingerprint = split_fingerprint(run.reader, run.train_idx, run.held_idx)
    plans = [plan_batches(run.reader.num_tokens, run.train_idx, cfg.tokens_per_batch, cfg.seed, e)
             for e in range(cfg.epochs)]
    epoch, done, step, history, resumed = 0, 0, 0, [], None
    if ckpt is not None:
        epoch, done = resume_position(ckpt, fingerprint, cfg, store, ckpt_path)
        opt.load_state_dict(distributed.sharded_like(ckpt["optimizer"], trainable))
        step, history = ckpt["step"], ckpt["history"]
        resumed = {"epoch": epoch, "batches_done": done, "step": step}
        logger.info("resuming from %s: epoch %d, %d of its %d batches done, step %d; written on %d device(s), "
                    "resumed on %d", ckpt_path, epoch + 1, done, len(plans[epoch]) if epoch < cfg.epochs else 0,
                    step, ckpt["world"], world)
    # Every batch of every epoch is trained (the last step of an epoch may
    # have fewer batches than devices); the learning rate follows batches.
    per_step = world * cfg.accumulate
    batches_before = np.cumsum([0] + [len(p) for p in plans])  # in the epochs before each
    total = int(batches_before[-1])
    total_steps = step + sum(-(-(len(p) - (done if e == epoch else 0)) // per_step)
                             for e, p in enumerate(plans) if e >= epoch)
    _log_start(run, plans, per_step)
    writer = CheckpointWriter(ckpt_path, cfg.identity(store), fingerprint, model, opt, rank, world)
    steps = Stepper(run, module, opt, trainable, ckpt_path)
    spool = Spool(run, store)
    if not history:
        _evaluate(run, module, history, 0, 0, on_eval, store, server)
    while epoch < cfg.epochs:
        plan = plans[epoch]
        mine = assign_batches(len(plan), done, rank, world, cfg.accumulate)
        spool.start_epoch(epoch, plan[:done])
        steps.start_epoch(plan, mine)
        for first, batches in mine:
            lr = lr_at(int(batches_before[epoch]) + first, total, cfg)
            outs, grad_norm = steps.step(batches, lr, epoch, step + 1)
            step += 1
            spool.stepped(epoch, step, total_steps, plan[first:first + per_step])
            done = min(len(plan), first + per_step)
            if step % cfg.log_every == 0 and rank == 0:
                steps.log_progress(epoch, step, total_steps, outs)
            if step % cfg.checkpoint_every == 0 and steps.in_a_row == 0:
                # Not inside a run of skipped steps: should it end the run,
                # the checkpoint on disk is the one before it, and a resume
                # (say at a lower lr) replays its batches.
                writer.save(epoch, done, step, history)
                spool.checkpointed(epoch, done)
            if on_step:
                for (b, weight), out in zip(batches, outs):
                    on_step({"epoch": epoch, "step": step, "rank": rank, "world": world, "batch": b,
                             "sample_ids": [run.reader.sample_ids[i] for i in plan[b]], "weight": weight,
                             "loss": out.loss.item(), "grad_norm": grad_norm.item()})
        epoch, done = epoch + 1, 0
        _evaluate(run, module, history, epoch, step, on_eval, store, server)
        writer.save(epoch, 0, step, history)
        spool.checkpointed(epoch, 0)
    spool.finish(cfg.epochs)
    drafter_dir = out_dir / "drafter"
    writer.require_finite(f"the export {drafter_dir}", step)
    choice = choose_served(history, cfg.keep_best_margin) if cfg.keep_best_served else None
    exported_epoch = choice["epoch"] if choice and choice["epoch"] != history[-1]["epoch"] else None
    with distributed.whole_weights(module):
        if rank == 0:
            if choice:
                logger.info("keep_best_served: %s", describe_choice(choice))
            if exported_epoch is None:
                _export(run, drafter_dir, store, step, history[-1])
            else:
                copy_drafter(served_dir(out_dir, exported_epoch) / "drafter", drafter_dir)
            write_metrics(out_dir, history)
            beside = out_dir / SPECULATORS_FOLDER
            if "speculators" in cfg.export_formats:  # the config refused it for any drafter but EAGLE-3's GQA one
                card_or_warning(export_beside(drafter_dir, run.target, cfg.serve_steps))
                logger.info("speculators format: %s", beside)
            elif beside.exists():  # an earlier run's, of other weights: never beside these
                shutil.rmtree(beside)
                logger.info("removed %s, an earlier export of other weights (export_formats [sglang])", beside)
    if world > 1:
        torch.distributed.barrier()
    result = TrainResult(drafter_dir=str(drafter_dir), history=history, steps=step,
                         train_samples=len(run.train_idx), heldout_samples=len(run.held_idx),
                         draft_vocab_size=run.vocab.size if run.vocab else run.model.cfg.vocab_size,
                         target=str(run.target), resumed_from=resumed,
                         seconds=time.time() - started, data_wait_s=steps.wait_s, compute_s=steps.compute_s,
                         tokens=steps.tokens, nonfinite_steps=steps.skipped, exported_epoch=exported_epoch,
                         served_choice=choice)
    if rank == 0:
        (out_dir / RESULT).write_text(json.dumps(dataclasses.asdict(result), indent=1) + "\n")
    return result


def _log_start(run: Run, plans: list[list[list[int]]], per_step: int) -> None:
    cfg = run.cfg
    drafter = run.family.describe(run)
    logger.info("training on %d samples (%s tokens), held out %d; %d epochs of %s batches, %d per step, %s, "
                "device %s x %d (%s), %s", len(run.train_idx), f"{int(run.reader.num_tokens[run.train_idx].sum()):,}",
                len(run.held_idx), cfg.epochs,
                "/".join(str(len(p)) for p in plans) if len({len(p) for p in plans}) > 1 else len(plans[0]),
                per_step, drafter, run.device, run.world, cfg.sharding if run.world > 1 else "one process",
                "bf16 autocast" if autocast_dtype(cfg.precision, run.device) else "fp32")


def _export(run: Run, drafter_dir: Path, store: str | Path, step: int, heldout: dict) -> None:
    """The drafter's weights as they are now, exported with how they were
    trained and their held-out metrics."""
    extra = export_record(run.target, Path(store), run.reader.manifest, step,
                          {k: v for k, v in heldout.items() if k not in ("epoch", "served")}, run.cfg.identity(store))
    run.family.export(run, drafter_dir, extra)
    card_or_warning(drafter_dir)


def _evaluate(run: Run, module: torch.nn.Module, history: list[dict], epoch: int, step: int,
              on_eval: Callable[[dict], None] | None, store: str | Path, server: ServerConfig | None) -> None:
    """Rank 0 evaluates the drafter after `epoch` epochs (0: untrained) into
    `history`, and serves it in SGLang when serve_every says so
    (tasks/train/served.py); under FSDP every rank takes part in gathering
    its weights."""
    cfg = run.cfg
    with distributed.whole_weights(module):
        if run.rank == 0:
            entry = {"epoch": epoch, "step": step, **evaluate(run)}
            if epoch == 0:
                logger.info("untrained drafter, held out: %s", describe(entry))
            else:
                logger.info("epoch %d/%d held out: %s", epoch, cfg.epochs, describe(entry))
            if serve_now(cfg, epoch):
                drafter_dir = served_dir(cfg.out_dir, epoch) / "drafter"
                _export(run, drafter_dir, store, step, entry)
                prompts = heldout_prompts(Path(store), cfg.heldout_fraction, cfg.serve_prompts)
                entry["served"] = measure_served(drafter_dir, run.target, prompts, cfg, server)
                # Beside training's simulation of the same drafts: a chain of serve_steps, or the whole block.
                logger.info(describe_served(entry, run.family.served_metric(cfg)))
            history.append(entry)
            if on_eval:
                on_eval(entry)
