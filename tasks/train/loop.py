"""The training loop over a verified store: prepare once (split, draft
vocabulary, drafter), train with TTT, evaluate on held-out samples per
epoch, checkpoint atomically with the data position, export at the end.

Each epoch's batch order is a function of the seed, the epoch and the
training split alone, never of the device count; the checkpoint records how
many of its batches are done and a fingerprint of the split, so a resumed
run, on as many devices as before or not, trains exactly the batches left,
and a store changed since is refused (or re-planned on request). Under
torchrun (tasks/train/launch.py) each optimizer step takes the next
`accumulate` batches of the order on every rank (tasks/train/data.py
assign_batches), under DDP (every rank holds the whole drafter and its Adam
state) or FSDP2 (`sharding` "fsdp": weights, gradients and Adam state
sharded over the ranks; "hsdp": sharded within a node, replicated across
nodes). A checkpoint holds whole tensors in every mode, so any mode and
device count resumes any other's.
"""
from __future__ import annotations

import contextlib
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
from torch.distributed.tensor import DTensor, distribute_tensor

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
SHARDINGS = ("ddp", "fsdp", "hsdp")


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
    devices: int = 1  # processes (GPUs) per node
    # Batches each device trains per optimizer step (gradient accumulation):
    # a step takes devices x nnodes x accumulate batches of the order.
    accumulate: int = 1
    # "ddp": every rank holds the whole drafter, its gradients and Adam
    # state; "fsdp": all three sharded over every rank; "hsdp": sharded
    # within a node, replicated across nodes (the gradient reduce-scatter
    # stays on the node's fast links). The frozen target embedding is never
    # sharded: it has no gradients or optimizer state to save.
    sharding: str = "ddp"
    # More than one node: torchrun's c10d rendezvous at host:port
    # (tasks/train/launch.py).
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    # Optimizer steps in a row whose loss or gradient norm is not finite that
    # are skipped (gradients dropped, weights untouched) before the run stops.
    # A safety limit, not a training setting: a run that stopped on it may be
    # resumed with another (a good step is the same under any value).
    max_nonfinite_steps: int = 3
    # A resume whose store split differs from the checkpoint's (samples added,
    # removed or changed since): "refuse", or "replan": start the current
    # epoch again, its batches cut from the split as it is now.
    on_store_change: str = "refuse"

    RESUMABLE = ("checkpoint_every", "log_every", "devices", "accumulate", "sharding", "nnodes", "rdzv_endpoint",
                 "max_nonfinite_steps", "on_store_change")

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if self.on_store_change not in STORE_CHANGES:
            raise ValueError(f"on_store_change {self.on_store_change!r}: use one of {', '.join(STORE_CHANGES)}")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps {self.max_nonfinite_steps}: at least 1")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding {self.sharding!r}: use one of {', '.join(SHARDINGS)}")
        if min(self.devices, self.accumulate, self.nnodes) < 1:
            raise ValueError(f"devices {self.devices}, accumulate {self.accumulate}, nnodes {self.nnodes}: each at "
                             f"least 1")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nnodes {self.nnodes} needs rdzv_endpoint host:port: an address of one of the nodes "
                             f"(the same on every node), where torchrun's rendezvous meets")

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


def _parallel(ttt: TTT, cfg: TrainConfig, device: torch.device, world: int) -> torch.nn.Module:
    """The TTT module as the ranks train it: DDP, or FSDP2 over all ranks
    ("fsdp") or a (nodes, ranks per node) mesh ("hsdp": replicated across
    nodes, sharded within one). Under FSDP2 the whole drafter is one group
    (one layer: gathering it whole costs little, and every method the TTT
    forward calls sees whole weights), the frozen target embedding left out
    (replicated, as under DDP: sharding it would gather it every step and
    save nothing at the step's peak). FSDP2 does not broadcast: each rank
    keeps its slice of its own copy, which is rank 0's (the same seeded
    initialisation, the same broadcast vocabulary, the same checkpoint)."""
    if world == 1:
        return ttt
    if cfg.sharding == "ddp":
        return torch.nn.parallel.DistributedDataParallel(ttt, broadcast_buffers=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if cfg.sharding == "hsdp":
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        mesh = init_device_mesh(device.type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    return fully_shard(ttt, mesh=mesh, ignored_params={ttt.drafter.embed_tokens.weight})


def _gradient_sync(ttt: torch.nn.Module, last: bool):
    """Gradients are reduced across the ranks in a step's last backward only:
    the ones before it accumulate locally (accumulate > 1)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(ttt, FSDPModule):
        ttt.set_requires_gradient_sync(last)
    elif isinstance(ttt, torch.nn.parallel.DistributedDataParallel) and not last:
        return ttt.no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _whole_weights(ttt: torch.nn.Module):
    """Under FSDP2 the drafter's weights are shards between steps; rank 0's
    evaluation and export call it outside the wrapped forward, so every rank
    gathers them (a collective) and frees them after."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(ttt, FSDPModule):
        yield
        return
    ttt.unshard()
    try:
        yield
    finally:
        ttt.reshard()


def _whole(state, keep: bool):
    """A state (nested dicts and lists) with every sharded tensor gathered
    whole, onto the CPU where `keep` (rank 0, which writes it) and dropped on
    the others: one tensor at a time, so no device holds more than one whole.
    Every rank must call it, on the same structure (the gathers are
    collectives made in order). A checkpoint is then the same under every
    sharding."""
    if isinstance(state, DTensor):
        whole = state.detach().full_tensor()
        return whole.cpu() if keep else None
    if isinstance(state, dict):
        return {k: _whole(v, keep) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_whole(v, keep) for v in state)
    return state


def _sharded_like(optimizer_state: dict, params: list[torch.nn.Parameter]) -> dict:
    """A checkpoint's (whole) optimizer state cut into this rank's shards of
    `params` (the optimizer's, in its order), where they are sharded."""
    state = {}
    for i, entry in optimizer_state["state"].items():
        p = params[int(i)]
        state[i] = {k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                    if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.shape else v
                    for k, v in entry.items()}
    return {**optimizer_state, "state": state}


def train(cfg: TrainConfig, *, on_eval: Callable[[dict], None] | None = None,
          on_step: Callable[[dict], None] | None = None) -> TrainResult:
    """Train (or resume) a drafter; returns its exported directory and metrics.
    Checkpoints hold the weights, the optimizer, the draft vocabulary, the
    data position (epoch, batches of its order done) and the split's
    fingerprint; the batch order is a function of the seed, the epoch and the
    split, so a resumed run, on any number of devices, trains exactly what
    is left.

    on_step, on every rank after each optimizer step (and its checkpoint, if
    one was due), once per batch the rank trained in the step (`accumulate`
    of them): epoch, step, rank, world, the batch (its index in the epoch's
    order), sample ids and loss weight (0: a repeat in a slot left without a
    batch at an epoch's end), its loss and the step's gradient norm (before
    clipping), so a caller can account for every batch the run consumed."""
    started = time.time()
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / CHECKPOINT
    rank, world = _distributed()
    if world > 1:
        # Every rank reads the checkpoint rank 0 writes: on several nodes,
        # only one shared out_dir makes them all resume from the same one.
        seen = float(ckpt_path.exists())
        seen_by = torch.tensor([seen, -seen], device=_device())
        torch.distributed.all_reduce(seen_by, op=torch.distributed.ReduceOp.MAX)
        if seen_by[0] != -seen_by[1]:
            raise TrainingError(f"{ckpt_path} is there for some ranks and not for others: on several nodes out_dir "
                                f"must be one directory every node shares (the same path on a shared filesystem, "
                                f"as for the store)")
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
    if ckpt is not None:
        model.load_state_dict(ckpt["model"], strict=False)
    # After the checkpoint's weights are in: FSDP2 shards what each rank holds.
    ttt = _parallel(TTT(model), cfg, run.device, world)
    # The frozen embedding has no optimizer state (nor, under FSDP, shards).
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
        opt.load_state_dict(_sharded_like(ckpt["optimizer"], trainable))
        step, history = ckpt["step"], ckpt["history"]
        resumed = {"epoch": epoch, "batches_done": done, "step": step}
        logger.info("resuming from %s: epoch %d, %d of its %d batches done, step %d; written on %s device(s), "
                    "resumed on %d", ckpt_path, epoch + 1, done, len(plans[epoch]) if epoch < cfg.epochs else 0,
                    step, ckpt.get("world", "an unrecorded number of"), world)
    # Every batch of every epoch is trained (the last step of an epoch may
    # have fewer batches than devices); the learning rate follows batches.
    per_step = world * cfg.accumulate
    batches_before = np.cumsum([0] + [len(p) for p in plans])  # in the epochs before each
    total = int(batches_before[-1])
    total_steps = step + sum(-(-(len(p) - (done if e == epoch else 0)) // per_step)
                             for e, p in enumerate(plans) if e >= epoch)
    logger.info("training on %d samples (%s tokens), held out %d; %d epochs of %s batches, %d per step, TTT %d "
                "steps, draft vocab %d, device %s x %d (%s), %s", len(run.train_idx),
                f"{int(run.reader.num_tokens[run.train_idx].sum()):,}", len(run.held_idx), cfg.epochs,
                "/".join(str(len(p)) for p in plans) if len({len(p) for p in plans}) > 1 else len(plans[0]),
                per_step, cfg.ttt_steps, run.vocab.size, run.device, world,
                cfg.sharding if world > 1 else "one process",
                "bf16 autocast" if autocast_dtype(cfg.precision, run.device) else "fp32")

    def require_finite(what: str) -> None:
        # Every rank checks its weights and Adam state (under DDP equal to
        # rank 0's, under FSDP its shards), and the verdict is all-reduced,
        # so all raise together rather than leave the others waiting in a
        # collective.
        bad = nonfinite_tensors({"model": model.trainable_state(), "optimizer": opt.state_dict()["state"]})
        if world > 1:
            anywhere = torch.tensor([float(bool(bad))], device=run.device)
            torch.distributed.all_reduce(anywhere, op=torch.distributed.ReduceOp.MAX)
            if anywhere.item() and not bad:
                bad = ["another rank's shard"]
        if bad:
            raise TrainingError(f"refusing to write {what} at step {step}: non-finite values in "
                                f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; {ckpt_path} "
                                f"(the last good checkpoint) is kept")

    def save(epoch_: int, done_: int) -> None:
        require_finite(f"checkpoint {ckpt_path}")
        weights, optimizer = _whole(model.trainable_state(), rank == 0), _whole(opt.state_dict(), rank == 0)
        if rank == 0:
            # batches_done: of the epoch's order, whatever the device count;
            # world: for the log only, a resume may use another.
            _save_atomic({"identity": cfg.identity(), "model": weights,
                          "optimizer": optimizer, "epoch": epoch_, "batches_done": done_,
                          "fingerprint": fingerprint, "world": world, "step": step, "history": history,
                          "d2t": model.d2t.cpu(), "vocab_size": model.cfg.vocab_size}, ckpt_path)

    if not history:
        with _whole_weights(ttt):
            if rank == 0:
                history.append({"epoch": 0, "step": 0, **evaluate(run)})
                logger.info("untrained drafter, held out: %s", _describe(history[-1]))
                if on_eval:
                    on_eval(history[-1])
    wait_s = compute_s = 0.0
    tokens = 0
    skipped = in_a_row = 0
    while epoch < cfg.epochs:
        plan = plans[epoch]
        mine = assign_batches(len(plan), done, rank, world, cfg.accumulate)
        t_epoch, tok_epoch, steps_epoch = time.time(), 0, 0
        loaded = prefetch(lambda b: collate(run.reader, plan[b]), [b for _, batches in mine for b, _ in batches])
        t_wait = time.time()
        for first, batches in mine:
            for g in opt.param_groups:
                g["lr"] = lr_at(int(batches_before[epoch]) + first, total, cfg)
            opt.zero_grad(set_to_none=True)
            outs = []
            for i, (b, weight) in enumerate(batches):
                batch = next(loaded)
                t0 = time.time()
                wait_s += t0 - t_wait
                batch = _to(batch, run.device)
                with _gradient_sync(ttt, last=i == len(batches) - 1):
                    with _autocast(run):
                        out = ttt(batch, run.head_rows, cfg.ttt_steps, cfg.step_decay, run.full_head)
                    # weight: world/m on the slots with a batch of their own, 0
                    # on a slot repeating one (assign_batches), so that the
                    # mean over the ranks of the sum over each rank's batches
                    # is the mean over the step's batches.
                    (out.loss * weight).backward()
                outs.append(out)
                n_tok = int(batch["lengths"].sum()) if weight else 0
                tokens += n_tok
                tok_epoch += n_tok
                t_wait = time.time()
                compute_s += t_wait - t0
            t0 = time.time()
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
            if isinstance(grad_norm, DTensor):  # over FSDP's shards: the same on every rank
                grad_norm = grad_norm.full_tensor()
            # 1 where a loss / the total gradient norm is NaN or infinite.
            # Under DDP and FSDP the gradient norm agrees across ranks but the
            # losses do not: the flags are all-reduced (max), so every rank
            # makes the same decision and the weights stay identical.
            losses = torch.stack([o.loss.detach().float() for o in outs])
            flags = torch.stack([~torch.isfinite(losses).all(), ~torch.isfinite(grad_norm.detach().float())]).float()
            if world > 1:
                torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            bad_loss, bad_grad = (bool(f) for f in flags.tolist())
            if bad_loss or bad_grad:
                # Skip: the step's gradients are dropped and the weights (and
                # Adam's moments) are left as they were; the batches are spent.
                opt.zero_grad(set_to_none=True)
                skipped += 1
                in_a_row += 1
                what = "loss and gradient norm" if bad_loss and bad_grad else "loss" if bad_loss else "gradient norm"
                if rank == 0:
                    logger.warning("epoch %d/%d step %d: non-finite %s (loss %s, gradient norm %s): step skipped "
                                   "(%d in a row, %d in all; the run stops at %d in a row)", epoch + 1,
                                   cfg.epochs, step + 1, what, ", ".join(f"{x:.3g}" for x in losses.tolist()),
                                   f"{grad_norm.item():.3g}", in_a_row, skipped, cfg.max_nonfinite_steps)
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
            done = min(len(plan), first + per_step)
            t_wait = time.time()
            compute_s += t_wait - t0
            if step % cfg.log_every == 0 and rank == 0:
                rate = tok_epoch / max(1e-9, time.time() - t_epoch)
                left = (total_steps - step) * (time.time() - t_epoch) / steps_epoch
                acc0 = float(outs[0].correct[0]) / max(1, int(outs[0].counted[0]))
                logger.info("epoch %d/%d step %d/%d: loss %.3f, acc0 %.2f, lr %.2e, %.0f tok/s, ETA %.0f s",
                            epoch + 1, cfg.epochs, step, total_steps, outs[0].loss.item(), acc0,
                            opt.param_groups[0]["lr"], rate, left)
            if step % cfg.checkpoint_every == 0 and in_a_row == 0:
                # Not inside a run of skipped steps: should it end the run,
                # the checkpoint on disk is the one before it, and a resume
                # (say at a lower lr) replays its batches.
                save(epoch, done)
            if on_step:
                for (b, weight), out in zip(batches, outs):
                    on_step({"epoch": epoch, "step": step, "rank": rank, "world": world, "batch": b,
                             "sample_ids": [run.reader.sample_ids[i] for i in plan[b]], "weight": weight,
                             "loss": out.loss.item(), "grad_norm": grad_norm.item()})
        epoch, done = epoch + 1, 0
        with _whole_weights(ttt):
            if rank == 0:
                history.append({"epoch": epoch, "step": step, **evaluate(run)})
                logger.info("epoch %d/%d held out: %s", epoch, cfg.epochs, _describe(history[-1]))
                if on_eval:
                    on_eval(history[-1])
        save(epoch, 0)
    drafter_dir = out_dir / "drafter"
    require_finite(f"the export {drafter_dir}")
    with _whole_weights(ttt):
        if rank == 0:
            export_drafter(model, run.layers, drafter_dir, architecture=architecture_of(read_config(run.target)),
                           extra={"store": str(Path(cfg.store).resolve()), "target": str(run.target), "steps": step,
                                  "heldout": {k: v for k, v in history[-1].items() if k != "epoch"},
                                  "config": cfg.identity()})
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
