"""The training loop over a verified store: prepare once (split, draft
vocabulary, drafter), train with TTT, evaluate on held-out samples per
epoch, checkpoint atomically with the data position, export at the end.

Each epoch's batch order is a function of the seed, the epoch and the
training split alone, never of the device count; the checkpoint records how
many of its batches are done and a fingerprint of the split, so a resumed
run, on as many devices as before or not, trains exactly the batches left,
and a store changed since is refused (or re-planned on request). Under
torchrun (tasks/train/launch.py) each optimizer step takes the next batch of
the order on every rank under DDP (tasks/train/data.py assign_batches).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tasks.durable import replace_durably
from tasks.store.reader import StoreReader
from tasks.store.verification import require_verified
from tasks.target.architectures import architecture_of, read_config
from tasks.target.layers import AuxLayers
from tasks.train.data import (assign_batches, collate, describe_split_change, plan_batches, prefetch, split,
                              split_fingerprint)
from tasks.train.drafter import Eagle3Drafter, build_drafter, load_target_embeddings
from tasks.train.export import export_drafter
from tasks.train.metrics import write_metrics
from tasks.train.ttt import TTT, acceptance_length, exact_acceptance_length, ttt_forward
from tasks.train.vocab import DraftVocab, count_target_tokens

logger = logging.getLogger("eagle3.training")

CHECKPOINT = "checkpoint.pt"
RESULT = "result.json"
PRECISIONS = ("auto", "fp32", "bf16")
STORE_CHANGES = ("refuse", "replan")


@dataclass
class TrainConfig:
    store: str
    out_dir: str
    target: str | None = None  # default: the checkpoint the store was captured from
    draft_vocab_size: int = 8192
    ttt_steps: int = 7
    step_decay: float = 0.8
    epochs: int = 2
    lr: float = 3e-4
    warmup_fraction: float = 0.05
    max_grad_norm: float = 0.5
    tokens_per_batch: int = 4096  # padded tokens per batch: one per device and optimizer step
    heldout_fraction: float = 0.05
    eval_max_samples: int = 256
    serve_steps: int = 3  # tau@serve_steps is what SGLang's --speculative-num-steps serves
    seed: int = 0
    # "auto": bf16 autocast on an accelerator (fp32 master weights, fp32
    # softmax and loss), fp32 on a CPU, where bf16 matmuls are slower.
    precision: str = "auto"
    # Training positions counted to pick the draft vocabulary (a seeded random
    # subset): plenty for a frequency estimate.
    vocab_positions: int = 2_000_000
    # Not part of a run's identity: they may change between a run and its resume.
    checkpoint_every: int = 50
    log_every: int = 10
    devices: int = 1
    # Optimizer steps in a row whose loss or gradient norm is not finite that
    # are skipped (gradients dropped, weights untouched) before the run stops.
    # A safety limit, not a training setting: a run that stopped on it may be
    # resumed with another (a good step is the same under any value).
    max_nonfinite_steps: int = 3
    # A resume whose store split differs from the checkpoint's (samples added,
    # removed or changed since): "refuse", or "replan": start the current
    # epoch again, its batches cut from the split as it is now.
    on_store_change: str = "refuse"

    RESUMABLE = ("checkpoint_every", "log_every", "devices", "max_nonfinite_steps", "on_store_change")

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if self.on_store_change not in STORE_CHANGES:
            raise ValueError(f"on_store_change {self.on_store_change!r}: use one of {', '.join(STORE_CHANGES)}")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps {self.max_nonfinite_steps}: at least 1")

    def identity(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.RESUMABLE}


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of a precision setting on a device; None: plain fp32."""
    if precision == "fp32" or (precision == "auto" and device.type == "cpu"):
        return None
    return torch.bfloat16


def _autocast(run: "_Run"):
    dtype = autocast_dtype(run.cfg.precision, run.device)
    return torch.autocast(run.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


@dataclass
class TrainResult:
    drafter_dir: str
    history: list[dict]  # one row per evaluation (epoch 0 = untrained)
    steps: int
    train_samples: int
    heldout_samples: int
    draft_vocab_size: int
    target: str = ""
    resumed_from: dict | None = None
    seconds: float = 0.0
    data_wait_s: float = 0.0
    compute_s: float = 0.0
    tokens: int = 0
    nonfinite_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient

    @property
    def final(self) -> dict:
        return self.history[-1]


class TrainingError(RuntimeError):
    pass


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


def _save_atomic(obj, path: Path) -> None:
    replace_durably(path, lambda tmp: torch.save(obj, tmp))


def nonfinite_tensors(tensors: dict) -> list[str]:
    """Names of the tensors (nested dicts and lists walked, e.g. an optimizer
    state) holding a NaN or an infinity."""
    bad: list[str] = []

    def walk(prefix: str, v) -> None:
        if isinstance(v, torch.Tensor):
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


def _load_checkpoint(path: Path) -> dict:
    # weights_only: a checkpoint is tensors and plain values, and loading one
    # must never run code (the file may come from another machine).
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:
        # torch wraps the one useful line in paragraphs of general advice.
        paragraphs = [p.strip() for p in str(e).split("\n\n") if p.strip()]
        why = " ".join(p for p in paragraphs if not p.startswith(("Weights only load failed", "Check the doc",
                                                                   "Please file an issue"))) or str(e)
        raise TrainingError(f"checkpoint {path} cannot be loaded as plain tensors and values ({why[:300]}); it "
                            f"is not one this trainer wrote, or it is damaged: delete it to start over") from e


def resume_position(ckpt: dict, cfg: TrainConfig, plans: list[list[list[int]]], fingerprint: dict | None,
                    world: int, path: Path) -> tuple[int, int]:
    """(epoch, batches of its order done) to resume a checkpoint from, on
    `world` devices, with `plans` the epochs' batch orders over the split
    whose fingerprint is given. A split changed since the checkpoint is
    refused, or with on_store_change "replan" the epoch starts again."""
    epoch = ckpt["epoch"]
    if "batches_done" not in ckpt:
        return epoch, _old_position(ckpt, cfg, plans, world, path)
    if ckpt["fingerprint"] == fingerprint:
        return epoch, ckpt["batches_done"]
    change = describe_split_change(ckpt["fingerprint"], fingerprint)
    if epoch >= cfg.epochs:
        if cfg.on_store_change != "replan":
            raise TrainingError(f"store {cfg.store} changed since {path} was written ({change}), and that run has "
                                f"finished on the old split: train the store as it is now in a new out_dir")
        logger.warning("store %s changed since %s was written (%s), and that run has finished: nothing is left "
                       "to re-plan", cfg.store, path, change)
        return epoch, 0
    if cfg.on_store_change != "replan":
        raise TrainingError(
            f"store {cfg.store} changed since {path} was written ({change}): the checkpoint's position (epoch "
            f"{epoch + 1}, {ckpt['batches_done']} batches done) is in batches cut from the old split, so going on "
            f"would skip or repeat samples. Train the store as it is now in a new out_dir, or pass "
            f"on_store_change='replan' to go on with this run from the start of epoch {epoch + 1}, its batches cut "
            f"from the current split (the samples it trained on this epoch are trained again)")
    logger.warning("store %s changed since %s was written (%s): on_store_change=replan, so epoch %d starts again "
                   "over the current split (%d batches of the old split's order were done); the draft vocabulary "
                   "stays the one counted at the start, and the history's earlier held-out rows are over the old "
                   "held-out split", cfg.store, path, change, epoch + 1, ckpt["batches_done"])
    return epoch, 0


def _old_position(ckpt: dict, cfg: TrainConfig, plans: list[list[list[int]]], world: int, path: Path) -> int:
    """A checkpoint from before the position counted the epoch's batches:
    its `batch` counted each rank's, rank r took batches r, r+devices, ... of
    the same order (it never depended on the device count), and each epoch
    was cut at the shortest epoch's batches // devices. So it resumes exactly
    at batch x devices, on the device count it ran with, which it did not
    record; the learning rate it recorded does tell: the old schedule ran
    over epochs x that cut, a length per device count."""
    logger.warning("%s predates the store fingerprint: a store changed since it was written goes unnoticed", path)
    if ckpt["batch"] == 0:  # an epoch's start: the same on any device count
        return 0
    shortest = min(len(p) for p in plans)
    lr = ckpt["optimizer"]["param_groups"][0]["lr"]
    fits = [w for w in range(1, shortest + 1)
            if ckpt["batch"] <= shortest // w and lr_at(ckpt["step"] - 1, cfg.epochs * (shortest // w), cfg) == lr]
    if world not in fits:
        said = (f"its learning rate says devices={' or '.join(map(str, fits))}" if fits else
                "its learning rate fits no device count (has the store changed since?)")
        raise TrainingError(
            f"{path} was written by an earlier version of this trainer, which recorded its position per device "
            f"(epoch {ckpt['epoch'] + 1}, {ckpt['batch']} batches on each) and not the device count; {said}, not "
            f"{world}. Resume it with that many devices (the run then goes on with a position any device count "
            f"can resume), or train in a new out_dir")
    return ckpt["batch"] * world


@dataclass
class _Run:
    """What the loop needs, prepared once."""
    cfg: TrainConfig
    reader: StoreReader
    train_idx: np.ndarray
    held_idx: np.ndarray
    layers: AuxLayers
    target: Path
    model: Eagle3Drafter
    head_rows: torch.Tensor
    full_head: torch.Tensor
    device: torch.device
    rank: int = 0
    world: int = 1
    vocab: DraftVocab | None = None


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def prepare(cfg: TrainConfig, vocab: DraftVocab | None = None, rank: int = 0, world: int = 1) -> _Run:
    """Read the store and the target's embeddings, pick the draft vocabulary
    (unless given: a resumed run's) and build the drafter. Under DDP only rank
    0 counts the vocabulary and broadcasts it, so every rank has the same one
    (counting is the slow part: it reads the target's final states)."""
    store = Path(cfg.store)
    require_verified(store)
    # Verification passed once; each sample is checked again as it is read,
    # so bytes changed since then are never trained on.
    reader = StoreReader(store, verify_checksums=True)
    if len(reader) < 2:
        raise TrainingError(f"store {store} holds {len(reader)} samples: training needs at least 2")
    manifest = reader.manifest
    target = Path(cfg.target or manifest["target_path"])
    if not (target / "config.json").exists():
        raise TrainingError(f"target checkpoint {target} not found: pass `target` (the model the store was "
                            f"captured from, {manifest.get('target')})")
    layers = AuxLayers(tuple(manifest["aux_layers"]["sglang_layer_output_ids"]))
    train_idx, held_idx = split(reader, cfg.heldout_fraction)
    embed, head = load_target_embeddings(target)
    device = _device()
    head = head.to(device)
    if vocab is None:
        vocab = _draft_vocab(cfg, reader, train_idx, head, device, rank, world)
    model = build_drafter(target, vocab, seed=cfg.seed, num_aux=len(layers.sglang_ids),
                          embeddings=(embed, head)).to(device)
    head_rows = head[torch.from_numpy(vocab.target_ids).to(device)]
    low = autocast_dtype(cfg.precision, device)
    if low is not None:
        # The two target-vocabulary matrices (4.7 GB each in fp32 for a 160k x
        # 7168 target) are frozen and only feed bf16 matmuls under autocast;
        # a bf16 checkpoint's values are bf16 anyway.
        model.embed_tokens.to(low)
        head = head.to(low)
    return _Run(cfg, reader, train_idx, held_idx, layers, target, model, head_rows, head, device, rank, world,
                vocab)


def _draft_vocab(cfg: TrainConfig, reader: StoreReader, train_idx: np.ndarray, head: torch.Tensor,
                 device: torch.device, rank: int, world: int) -> DraftVocab:
    size = min(cfg.draft_vocab_size, head.shape[0])
    target_ids = torch.zeros(size, dtype=torch.long, device=device)
    if rank == 0:
        order = np.random.default_rng(cfg.seed).permutation(train_idx)
        counts = count_target_tokens((reader[int(i)] for i in order), head, cfg.vocab_positions,
                                     dtype=autocast_dtype(cfg.precision, device) or torch.float32)
        vocab = DraftVocab.from_counts(counts, size)
        covered = counts[vocab.target_ids].sum() / max(1, counts.sum())
        logger.info("draft vocabulary: %d of %d target ids cover %.1f%% of the target's greedy tokens at %s "
                    "loss-masked training positions (a random subset, seed %d)", vocab.size, vocab.vocab_size,
                    100 * covered, f"{counts.sum():,}", cfg.seed)
        target_ids.copy_(torch.from_numpy(vocab.target_ids))
    if world > 1:
        torch.distributed.broadcast(target_ids, src=0)
    return DraftVocab(target_ids.cpu().numpy(), head.shape[0])


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def evaluate(run: _Run) -> dict:
    """Held-out loss, per-step accuracy and both taus (the product estimate
    and the exact chained one), over up to eval_max_samples."""
    cfg = run.cfg
    model = run.model
    model.eval()
    idx = run.held_idx[:cfg.eval_max_samples]
    correct = torch.zeros(cfg.ttt_steps, dtype=torch.long)
    counted = torch.zeros(cfg.ttt_steps, dtype=torch.long)
    in_loss = torch.zeros(cfg.ttt_steps, dtype=torch.long)
    chained = torch.zeros(cfg.ttt_steps, dtype=torch.long)
    chain_counted = torch.zeros(cfg.ttt_steps, dtype=torch.long)
    losses = torch.zeros(cfg.ttt_steps)
    batches = plan_batches(run.reader.num_tokens, idx, cfg.tokens_per_batch, None)
    for batch in prefetch(lambda b: collate(run.reader, b), batches):
        with _autocast(run):
            out = ttt_forward(model, _to(batch, run.device), run.head_rows, steps=cfg.ttt_steps,
                              decay=cfg.step_decay, full_head=run.full_head)
        correct += out.correct.cpu()
        counted += out.counted.cpu()
        in_loss += out.in_loss.cpu()
        chained += out.chained.cpu()
        chain_counted += out.chain_counted.cpu()
        losses += out.step_losses.cpu() * out.in_loss.cpu()
    model.train()
    acc = (correct / counted.clamp(min=1)).tolist()
    step_loss = (losses / in_loss.clamp(min=1)).tolist()
    chained, chain_counted = chained.tolist(), chain_counted.tolist()
    return {
        "loss": sum(cfg.step_decay ** k * l for k, l in enumerate(step_loss)),
        "acc": acc,
        "tau": acceptance_length(acc),
        f"tau@{cfg.serve_steps}": acceptance_length(acc[:cfg.serve_steps]),
        "tau_exact": exact_acceptance_length(chained, chain_counted),
        f"tau_exact@{cfg.serve_steps}": exact_acceptance_length(chained[:cfg.serve_steps],
                                                                chain_counted[:cfg.serve_steps]),
        "heldout_tokens": int(counted[0]),
        # Scored positions whose target greedy token the draft vocabulary lacks (left out of the loss).
        "unproposable": 1 - int(in_loss[0]) / max(1, int(counted[0])),
    }


def _distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        # The other ranks wait in a collective while rank 0 alone counts the
        # draft vocabulary and evaluates: minutes on a large store, past
        # NCCL's default 10.
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                             timeout=datetime.timedelta(hours=2))
    return (torch.distributed.get_rank(), world) if world > 1 else (0, 1)


def train(cfg: TrainConfig, *, on_eval: Callable[[dict], None] | None = None,
          on_step: Callable[[dict], None] | None = None) -> TrainResult:
    """Train (or resume) a drafter; returns its exported directory and metrics.
    Checkpoints hold the weights, the optimizer, the draft vocabulary, the
    data position (epoch, batches of its order done) and the split's
    fingerprint; the batch order is a function of the seed, the epoch and the
    split, so a resumed run, on any number of devices, trains exactly what
    is left.

    on_step, on every rank after each optimizer step (and its checkpoint, if
    one was due): epoch, step, rank, world, this rank's batch (its index in
    the epoch's order), sample ids and loss weight (0: a repeat on a rank
    left without a batch at an epoch's end), its loss and the step's gradient
    norm (before clipping), so a caller can account for every batch the run
    consumed."""
    started = time.time()
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / CHECKPOINT
    rank, world = _distributed()
    ckpt = _load_checkpoint(ckpt_path) if ckpt_path.exists() else None
    if ckpt is not None:
        # A checkpoint from before a setting existed ran with its default.
        ckpt["identity"] = {**TrainConfig(store="", out_dir="").identity(), **ckpt["identity"]}
    if ckpt is not None and ckpt["identity"] != cfg.identity():
        changed = {k: (ckpt["identity"].get(k), v) for k, v in cfg.identity().items() if ckpt["identity"].get(k) != v}
        raise TrainingError(f"{ckpt_path} belongs to a run with other settings {changed} (old, new): "
                            f"use another out_dir, or delete the checkpoint to start over")
    run = prepare(cfg, DraftVocab.from_d2t(ckpt["d2t"], ckpt["vocab_size"]) if ckpt else None, rank, world)
    model = run.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    history: list[dict] = []
    fingerprint = split_fingerprint(run.reader, run.train_idx, run.held_idx)
    plans = [plan_batches(run.reader.num_tokens, run.train_idx, cfg.tokens_per_batch, cfg.seed, e)
             for e in range(cfg.epochs)]
    epoch, done, step = 0, 0, 0
    resumed = None
    if ckpt is not None:
        epoch, done = resume_position(ckpt, cfg, plans, fingerprint, world, ckpt_path)
        model.load_state_dict(ckpt["model"], strict=False)
        opt.load_state_dict(ckpt["optimizer"])
        step, history = ckpt["step"], ckpt["history"]
        resumed = {"epoch": epoch, "batches_done": done, "step": step}
        logger.info("resuming from %s: epoch %d, %d of its %d batches done, step %d; written on %s device(s), "
                    "resumed on %d", ckpt_path, epoch + 1, done, len(plans[epoch]) if epoch < cfg.epochs else 0,
                    step, ckpt.get("world", "an unrecorded number of"), world)
    ttt = TTT(model)
    ttt = torch.nn.parallel.DistributedDataParallel(ttt, broadcast_buffers=False) if world > 1 else ttt
    # Every batch of every epoch is trained (the last step of an epoch may
    # have fewer batches than devices); the learning rate follows batches.
    batches_before = np.cumsum([0] + [len(p) for p in plans])  # in the epochs before each
    total = int(batches_before[-1])
    total_steps = step + sum(-(-(len(p) - (done if e == epoch else 0)) // world)
                             for e, p in enumerate(plans) if e >= epoch)
    logger.info("training on %d samples (%s tokens), held out %d; %d epochs of %s batches, %d per step, TTT %d "
                "steps, draft vocab %d, device %s x %d, %s", len(run.train_idx),
                f"{int(run.reader.num_tokens[run.train_idx].sum()):,}", len(run.held_idx), cfg.epochs,
                "/".join(str(len(p)) for p in plans) if len({len(p) for p in plans}) > 1 else len(plans[0]),
                world, cfg.ttt_steps, run.vocab.size, run.device, world,
                "bf16 autocast" if autocast_dtype(cfg.precision, run.device) else "fp32")

    def require_finite(what: str) -> None:
        # Every rank checks (its weights equal rank 0's under DDP), so all
        # raise together rather than leave the others waiting in a collective.
        bad = nonfinite_tensors({"model": model.trainable_state(), "optimizer": opt.state_dict()["state"]})
        if bad:
            raise TrainingError(f"refusing to write {what} at step {step}: non-finite values in "
                                f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; {ckpt_path} "
                                f"(the last good checkpoint) is kept")

    def save(epoch_: int, done_: int) -> None:
        require_finite(f"checkpoint {ckpt_path}")
        if rank == 0:
            # batches_done: of the epoch's order, whatever the device count;
            # world: for the log only, a resume may use another.
            _save_atomic({"identity": cfg.identity(), "model": model.trainable_state(),
                          "optimizer": opt.state_dict(), "epoch": epoch_, "batches_done": done_,
                          "fingerprint": fingerprint, "world": world, "step": step, "history": history,
                          "d2t": model.d2t.cpu(), "vocab_size": model.cfg.vocab_size}, ckpt_path)

    if not history and rank == 0:
        history.append({"epoch": 0, "step": 0, **evaluate(run)})
        logger.info("untrained drafter, held out: %s", _describe(history[-1]))
        if on_eval:
            on_eval(history[-1])
    wait_s = compute_s = 0.0
    tokens = 0
    skipped = in_a_row = 0
    while epoch < cfg.epochs:
        plan = plans[epoch]
        mine = assign_batches(len(plan), done, rank, world)
        t_epoch, tok_epoch, steps_epoch = time.time(), 0, 0
        t_wait = time.time()
        for (first, b, weight), batch in zip(mine, prefetch(lambda a: collate(run.reader, plan[a[1]]), mine)):
            t0 = time.time()
            wait_s += t0 - t_wait
            batch = _to(batch, run.device)
            for g in opt.param_groups:
                g["lr"] = lr_at(int(batches_before[epoch]) + first, total, cfg)
            with _autocast(run):
                out = ttt(batch, run.head_rows, cfg.ttt_steps, cfg.step_decay, run.full_head)
            opt.zero_grad(set_to_none=True)
            # weight: world/m on the m ranks with a batch of their own, 0 on
            # a rank repeating one (assign_batches), so that DDP's mean over
            # the ranks is the mean over the step's batches; 1 in the rest.
            (out.loss * weight).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
            # 1 where the loss / the total gradient norm is NaN or infinite.
            # Under DDP the gradients (so the norm) agree across ranks but the
            # losses do not: the flags are all-reduced (max), so every rank
            # makes the same decision and the weights stay identical.
            flags = torch.stack([~torch.isfinite(out.loss.detach().float()),
                                 ~torch.isfinite(grad_norm.detach().float())]).float()
            if world > 1:
                torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            bad_loss, bad_grad = (bool(f) for f in flags.tolist())
            if bad_loss or bad_grad:
                # Skip: the step's gradients are dropped and the weights (and
                # Adam's moments) are left as they were; the batch is spent.
                opt.zero_grad(set_to_none=True)
                skipped += 1
                in_a_row += 1
                what = "loss and gradient norm" if bad_loss and bad_grad else "loss" if bad_loss else "gradient norm"
                if rank == 0:
                    logger.warning("epoch %d/%d step %d: non-finite %s (loss %s, gradient norm %s): step skipped "
                                   "(%d in a row, %d in all; the run stops at %d in a row)", epoch + 1,
                                   cfg.epochs, step + 1, what, f"{out.loss.item():.3g}", f"{grad_norm.item():.3g}",
                                   in_a_row, skipped, cfg.max_nonfinite_steps)
                if in_a_row >= cfg.max_nonfinite_steps:
                    raise TrainingError(
                        f"training stopped at epoch {epoch + 1}, step {step + 1}: {in_a_row} optimizer steps in a "
                        f"row had a non-finite {what} (max_nonfinite_steps {cfg.max_nonfinite_steps}); nothing "
                        f"was exported, and {ckpt_path} (the last good checkpoint, written before these steps) is "
                        f"kept. A resume replays the same batches: lower lr or max_grad_norm, or check the store")
            else:
                opt.step()
                in_a_row = 0
            step += 1
            steps_epoch += 1
            done = min(len(plan), first + world)
            n_tok = int(batch["lengths"].sum()) if weight else 0
            tokens += n_tok
            tok_epoch += n_tok
            t_wait = time.time()
            compute_s += t_wait - t0
            if step % cfg.log_every == 0 and rank == 0:
                rate = tok_epoch / max(1e-9, time.time() - t_epoch)
                left = (total_steps - step) * (time.time() - t_epoch) / steps_epoch
                acc0 = float(out.correct[0]) / max(1, int(out.counted[0]))
                logger.info("epoch %d/%d step %d/%d: loss %.3f, acc0 %.2f, lr %.2e, %.0f tok/s, ETA %.0f s",
                            epoch + 1, cfg.epochs, step, total_steps, out.loss.item(), acc0, opt.param_groups[0]["lr"],
                            rate, left)
            if step % cfg.checkpoint_every == 0 and in_a_row == 0:
                # Not inside a run of skipped steps: should it end the run,
                # the checkpoint on disk is the one before it, and a resume
                # (say at a lower lr) replays its batches.
                save(epoch, done)
            if on_step:
                on_step({"epoch": epoch, "step": step, "rank": rank, "world": world, "batch": b,
                         "sample_ids": [run.reader.sample_ids[i] for i in plan[b]], "weight": weight,
                         "loss": out.loss.item(), "grad_norm": grad_norm.item()})
        epoch, done = epoch + 1, 0
        if rank == 0:
            history.append({"epoch": epoch, "step": step, **evaluate(run)})
            logger.info("epoch %d/%d held out: %s", epoch, cfg.epochs, _describe(history[-1]))
            if on_eval:
                on_eval(history[-1])
        save(epoch, 0)
    drafter_dir = out_dir / "drafter"
    require_finite(f"the export {drafter_dir}")
    if rank == 0:
        export_drafter(model, run.layers, drafter_dir, architecture=architecture_of(read_config(run.target)), extra={
            "store": str(Path(cfg.store).resolve()), "target": str(run.target), "steps": step,
            "heldout": {k: v for k, v in history[-1].items() if k != "epoch"}, "config": cfg.identity()})
        write_metrics(out_dir, history)
    if world > 1:
        torch.distributed.barrier()
    result = TrainResult(drafter_dir=str(drafter_dir), history=history, steps=step,
                         train_samples=len(run.train_idx), heldout_samples=len(run.held_idx),
                         draft_vocab_size=run.vocab.size, target=str(run.target), resumed_from=resumed,
                         seconds=time.time() - started, data_wait_s=wait_s, compute_s=compute_s, tokens=tokens,
                         nonfinite_steps=skipped)
    if rank == 0:
        (out_dir / RESULT).write_text(json.dumps(dataclasses.asdict(result), indent=1) + "\n")
    return result


def _describe(m: dict) -> str:
    acc = ", ".join(f"{a:.2f}" for a in m["acc"])
    tau_s = next(k for k in m if k.startswith("tau@"))
    exact_s = tau_s.replace("tau@", "tau_exact@")
    return (f"loss {m['loss']:.3f}, tau {m['tau']:.2f} (exact {m['tau_exact']:.2f}), {tau_s} {m[tau_s]:.2f} "
            f"(exact {m[exact_s]:.2f}), acc [{acc}], {100 * m['unproposable']:.1f}% of positions unproposable")


def trained_drafter(out_dir: Path, target: Path) -> Eagle3Drafter:
    """The drafter as the last checkpoint holds it (fp32), to check an export against."""
    ckpt = _load_checkpoint(Path(out_dir) / CHECKPOINT)
    model = build_drafter(Path(target), DraftVocab.from_d2t(ckpt["d2t"], ckpt["vocab_size"]))
    model.load_state_dict(ckpt["model"], strict=False)
    return model
