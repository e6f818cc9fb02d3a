"""EAGLE-3 drafter training over a verified store, with training-time test.

Alignment (SGLang's draft extend, SpecForge's offline training): at position t
the drafter takes the target's aux states h_t and the embedding of token
x_{t+1}, and must predict x_{t+2}, whose distribution the target gives at
position t+1 (its final state there, through its lm_head). TTT unrolls K
steps: step k feeds back the drafter's own hidden state, takes x_{t+1+k}, is
scored against the target at t+1+k, and attends to the step-0 keys of the
prefix (causal) plus its own chain (steps 1..k at the same t), as a draft
chain does at serving time. Loss: soft cross-entropy to the target
distribution over the draft vocabulary, weighted decay^k, on positions whose
predicted token is a loss-masked (assistant) token.

Metrics on held-out samples: acc_k (the drafter's top token equals the
target's greedy token, full vocabulary) and the simulated acceptance length
tau = sum_k prod_{i<=k} acc_i; `tau@S` stops at S steps, so 1 + tau@S is
comparable with SGLang's accept length at S speculative steps.

    python -m tasks.training --config cfg.json    # one process, or under torchrun
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from tasks.drafter import DraftVocab, Eagle3Drafter, build_drafter, count_target_tokens, export_drafter, \
    load_target_embeddings
from tasks.layers import AuxLayers
from tasks.store import StoreReader
from tasks.verification import require_verified

logger = logging.getLogger("eagle3.training")

CHECKPOINT = "checkpoint.pt"
# Positions counted to pick the draft vocabulary: plenty for a frequency estimate.
VOCAB_COUNT_TOKENS = 2_000_000


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
    tokens_per_batch: int = 4096  # padded tokens per optimizer step (per device)
    heldout_fraction: float = 0.05
    eval_max_samples: int = 256
    serve_steps: int = 3  # tau@serve_steps is what SGLang's --speculative-num-steps serves
    seed: int = 0
    # Not part of a run's identity: they may change between a run and its resume.
    checkpoint_every: int = 50
    log_every: int = 10
    devices: int = 1

    RESUMABLE = ("checkpoint_every", "log_every", "devices")

    def identity(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.RESUMABLE}


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

    @property
    def final(self) -> dict:
        return self.history[-1]


class TrainingError(RuntimeError):
    pass


# ------------------------------------------------------------------------- data

def is_heldout(sample_id: str, fraction: float) -> bool:
    """Held-out by a hash of the sample id: stable across runs, resumes and
    store growth (a sample never moves between the splits)."""
    h = int.from_bytes(hashlib.sha256(f"heldout:{sample_id}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def split(reader: StoreReader, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    held = np.array([is_heldout(s, fraction) for s in reader.sample_ids], dtype=bool)
    if len(reader) >= 2 and (held.all() or not held.any()):
        # Tiny stores: keep at least one sample on each side.
        held[:] = False
        held[int(np.argmax([hashlib.sha256(s.encode()).digest() for s in reader.sample_ids]))] = True
    return np.flatnonzero(~held), np.flatnonzero(held)


def plan_batches(lengths: np.ndarray, indices: np.ndarray, tokens_per_batch: int,
                 seed: int | None, epoch: int = 0) -> list[list[int]]:
    """Length-bucketed batches cut at a padded-token budget. With a seed the
    order is shuffled deterministically in (seed, epoch), so a resumed run
    replays the same order: shuffle, sort within windows of a few thousand
    samples by length (little padding), cut, shuffle the batches. Without a
    seed (evaluation): sorted by length, no shuffle."""
    rng = np.random.default_rng([seed, epoch]) if seed is not None else None
    order = rng.permutation(indices) if rng is not None else np.asarray(indices)
    window = 4096 if rng is not None else max(1, len(order))
    batches: list[list[int]] = []
    for w in range(0, len(order), window):
        current: list[int] = []
        for i in sorted(order[w:w + window], key=lambda i: lengths[i]):
            if current and lengths[i] * (len(current) + 1) > tokens_per_batch:
                batches.append(current)
                current = []
            current.append(int(i))
        if current:
            batches.append(current)
    return [batches[i] for i in rng.permutation(len(batches))] if rng is not None else batches


def collate(reader: StoreReader, indices: list[int]) -> dict[str, torch.Tensor]:
    """Right-padded tensors read straight from the shards (only these samples'
    slices are touched); hidden states stay bf16 until they reach the device."""
    items = [reader[i] for i in indices]
    lengths = [len(it["input_ids"]) for it in items]
    b, n = len(items), max(lengths)
    h = items[0]["final_hidden_state"].shape[-1]
    out = {
        "input_ids": torch.zeros(b, n, dtype=torch.long),
        "loss_mask": torch.zeros(b, n, dtype=torch.bool),
        "lengths": torch.tensor(lengths, dtype=torch.long),
        "aux": torch.zeros(b, n, items[0]["aux_hidden_states"].shape[1] * h, dtype=items[0]["aux_hidden_states"].dtype),
        "final": torch.zeros(b, n, h, dtype=items[0]["final_hidden_state"].dtype),
    }
    for r, (it, m) in enumerate(zip(items, lengths)):
        out["input_ids"][r, :m] = it["input_ids"].long()
        out["loss_mask"][r, :m] = it["loss_mask"].bool()
        out["aux"][r, :m] = it["aux_hidden_states"].reshape(m, -1)
        out["final"][r, :m] = it["final_hidden_state"]
    return out


def prefetch(make: Callable[[list[int]], dict], batches: Iterable[list[int]], depth: int = 4) -> Iterator[dict]:
    """Collate the next batches in a thread while the current one trains."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def work():
        try:
            for b in batches:
                q.put(make(b))
        except BaseException as e:  # surfaced in the consumer
            q.put(e)
        q.put(done)

    threading.Thread(target=work, daemon=True, name="eagle3-loader").start()
    while (item := q.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


# -------------------------------------------------------------------- the model

def _shift(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[:, t + by] at t, `fill` past the end (time is dim 1)."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  valid: torch.Tensor) -> torch.Tensor:
    """Step-k attention: the causal prefix of step-0 keys, plus the diagonal
    (same position) keys of steps 1..k. q [B, h, L, d]; valid [B, L]."""
    heads, n, d = q.shape[1], q.shape[2], q.shape[3]
    scale = d ** -0.5
    k0, v0 = _repeat_kv(keys[0], heads), _repeat_kv(values[0], heads)
    scores = (q @ k0.transpose(-1, -2)) * scale
    allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None, None] & valid[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    diag = [((q * _repeat_kv(k, heads)).sum(-1, keepdim=True)) * scale for k in keys[1:]]
    p = torch.softmax(torch.cat([scores, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = p[..., :n] @ v0
    for j, v in enumerate(values[1:]):
        out = out + p[..., n + j:n + j + 1] * _repeat_kv(v, heads)
    return out


@dataclass
class StepOutput:
    loss: torch.Tensor
    correct: torch.Tensor  # [K] positions where the drafter's top token = the target's
    counted: torch.Tensor  # [K] positions scored
    step_losses: torch.Tensor  # [K]


def ttt_forward(model: Eagle3Drafter, batch: dict, head_rows: torch.Tensor, *, steps: int, decay: float,
                full_head: torch.Tensor | None = None) -> StepOutput:
    """One TTT unroll over a padded batch. `head_rows` are the target lm_head
    rows of the draft vocabulary (the target distribution restricted to it);
    with `full_head`, accuracy is against the target's full-vocabulary greedy
    token, as at serving time, else against its top draft-vocab token."""
    dtype = head_rows.dtype
    ids, mask, lengths = batch["input_ids"], batch["loss_mask"], batch["lengths"]
    aux, final = batch["aux"].to(dtype), batch["final"].to(dtype)
    b, n = ids.shape
    pos = torch.arange(n, device=ids.device)
    valid = pos[None, :] < lengths[:, None]
    with torch.no_grad():
        target_logits = final @ head_rows.T
        target_p = torch.softmax(target_logits.float(), dim=-1)
        d2t = model.draft_to_target
        target_top = (final @ full_head.T).argmax(-1) if full_head is not None else d2t[target_logits.argmax(-1)]
    hidden = model.fc(aux)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    loss = torch.zeros((), device=ids.device)
    correct, counted, step_losses = [], [], []
    for k in range(steps):
        j = k + 1
        embeds = model.embed_tokens(_shift(ids, j))
        q, kk, v = model.midlayer.qkv(embeds, hidden)
        q, kk = model.rotary(q, kk, (pos + k)[None].expand(b, n))
        keys.append(kk)
        values.append(v)
        hidden = model.midlayer.finish(ttt_attention(q, keys, values, valid), hidden)
        logits = model.logits(hidden)
        weight = _shift(mask, j + 1, False) & ((pos + j + 1)[None, :] < lengths[:, None])
        ce = -(_shift(target_p, j) * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        count = weight.sum()
        step_loss = (ce * weight).sum() / count.clamp(min=1)
        loss = loss + decay ** k * step_loss
        with torch.no_grad():
            hit = (d2t[logits.argmax(-1)] == _shift(target_top, j)) & weight
        correct.append(hit.sum())
        counted.append(count)
        step_losses.append(step_loss.detach())
    return StepOutput(loss, torch.stack(correct), torch.stack(counted), torch.stack(step_losses))


class TTT(torch.nn.Module):
    """`ttt_forward` as a module's forward, so DDP (which syncs gradients only
    for calls through its own forward) can wrap it."""

    def __init__(self, drafter: Eagle3Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: dict, head_rows: torch.Tensor, steps: int, decay: float) -> StepOutput:
        return ttt_forward(self.drafter, batch, head_rows, steps=steps, decay=decay)


def acceptance_length(acc: Iterable[float]) -> float:
    """tau = sum_k prod_{i<=k} acc_i."""
    tau, run = 0.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau


# ------------------------------------------------------------------ checkpoints

def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine to 10%: a function of the step alone, so a
    resume needs no scheduler state."""
    warm = max(1, int(cfg.warmup_fraction * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# --------------------------------------------------------------------- training

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


def prepare(cfg: TrainConfig, vocab: DraftVocab | None = None) -> _Run:
    store = Path(cfg.store)
    require_verified(store)
    reader = StoreReader(store)
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
    if vocab is None:
        counts = count_target_tokens((reader[int(i)] for i in train_idx), head, VOCAB_COUNT_TOKENS)
        vocab = DraftVocab.from_counts(counts, cfg.draft_vocab_size)
        covered = counts[vocab.target_ids].sum() / max(1, counts.sum())
        logger.info("draft vocabulary: %d of %d target ids cover %.1f%% of the target's greedy tokens at %s "
                    "loss-masked training positions", vocab.size, vocab.vocab_size, 100 * covered,
                    f"{counts.sum():,}")
    device = _device()
    model = build_drafter(target, vocab, seed=cfg.seed, num_aux=len(layers.sglang_ids),
                          embeddings=(embed, head)).to(device)
    head = head.to(device)
    return _Run(cfg, reader, train_idx, held_idx, layers, target, model,
                head[torch.from_numpy(vocab.target_ids).to(device)], head, device, vocab=vocab)


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def evaluate(run: _Run) -> dict:
    """Held-out loss, per-step accuracy and tau, over up to eval_max_samples."""
    cfg = run.cfg
    model = run.model
    model.eval()
    idx = run.held_idx[:cfg.eval_max_samples]
    correct = torch.zeros(cfg.ttt_steps, dtype=torch.long)
    counted = torch.zeros(cfg.ttt_steps, dtype=torch.long)
    losses = torch.zeros(cfg.ttt_steps)
    batches = plan_batches(run.reader.num_tokens, idx, cfg.tokens_per_batch, None)
    for batch in prefetch(lambda b: collate(run.reader, b), batches):
        out = ttt_forward(model, _to(batch, run.device), run.head_rows, steps=cfg.ttt_steps, decay=cfg.step_decay,
                          full_head=run.full_head)
        correct += out.correct.cpu()
        counted += out.counted.cpu()
        losses += out.step_losses.cpu() * out.counted.cpu()
    model.train()
    acc = (correct / counted.clamp(min=1)).tolist()
    step_loss = (losses / counted.clamp(min=1)).tolist()
    return {
        "loss": sum(cfg.step_decay ** k * l for k, l in enumerate(step_loss)),
        "acc": acc,
        "tau": acceptance_length(acc),
        f"tau@{cfg.serve_steps}": acceptance_length(acc[:cfg.serve_steps]),
        "heldout_tokens": int(counted[0]),
    }


def _distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (torch.distributed.get_rank(), world) if world > 1 else (0, 1)


def train(cfg: TrainConfig, *, on_eval: Callable[[dict], None] | None = None) -> TrainResult:
    """Train (or resume) a drafter; returns its exported directory and metrics.
    Checkpoints hold the weights, the optimizer, the draft vocabulary and the
    data position (epoch, batch); the batch order is a function of the seed
    and the epoch, so a resumed run replays exactly what is left."""
    started = time.time()
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / CHECKPOINT
    rank, world = _distributed()
    ckpt = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    if ckpt is not None and ckpt["identity"] != cfg.identity():
        changed = {k: (ckpt["identity"].get(k), v) for k, v in cfg.identity().items() if ckpt["identity"].get(k) != v}
        raise TrainingError(f"{ckpt_path} belongs to a run with other settings {changed} (old, new): "
                            f"use another out_dir, or delete the checkpoint to start over")
    run = prepare(cfg, DraftVocab.from_d2t(ckpt["d2t"], ckpt["vocab_size"]) if ckpt else None)
    run.rank, run.world = rank, world
    model = run.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    history: list[dict] = []
    epoch, batch_pos, step = 0, 0, 0
    resumed = None
    if ckpt is not None:
        model.load_state_dict(ckpt["model"], strict=False)
        opt.load_state_dict(ckpt["optimizer"])
        epoch, batch_pos, step, history = ckpt["epoch"], ckpt["batch"], ckpt["step"], ckpt["history"]
        resumed = {"epoch": epoch, "batch": batch_pos, "step": step}
        logger.info("resuming from %s: epoch %d, batch %d, step %d", ckpt_path, epoch + 1, batch_pos, step)
    ttt = TTT(model)
    ttt = torch.nn.parallel.DistributedDataParallel(ttt, broadcast_buffers=False) if world > 1 else ttt
    plans = [plan_batches(run.reader.num_tokens, run.train_idx, cfg.tokens_per_batch, cfg.seed, e)
             for e in range(cfg.epochs)]
    per_epoch = min(len(p) for p in plans) // world
    total = per_epoch * cfg.epochs
    logger.info("training on %d samples (%s tokens), held out %d; %d epochs x %d steps, TTT %d steps, "
                "draft vocab %d, device %s x %d", len(run.train_idx),
                f"{int(run.reader.num_tokens[run.train_idx].sum()):,}", len(run.held_idx), cfg.epochs, per_epoch,
                cfg.ttt_steps, run.vocab.size, run.device, world)

    def save(epoch_: int, batch_: int) -> None:
        if rank == 0:
            _save_atomic({"identity": cfg.identity(), "model": model.trainable_state(),
                          "optimizer": opt.state_dict(), "epoch": epoch_, "batch": batch_, "step": step,
                          "history": history, "d2t": model.d2t.cpu(), "vocab_size": model.cfg.vocab_size},
                         ckpt_path)

    if not history and rank == 0:
        history.append({"epoch": 0, "step": 0, **evaluate(run)})
        logger.info("untrained drafter, held out: %s", _describe(history[-1]))
        if on_eval:
            on_eval(history[-1])
    wait_s = compute_s = 0.0
    tokens = 0
    while epoch < cfg.epochs:
        mine = plans[epoch][rank::world][:per_epoch]
        t_epoch, tok_epoch = time.time(), 0
        t_wait = time.time()
        for i, batch in enumerate(prefetch(lambda b: collate(run.reader, b), mine[batch_pos:]), start=batch_pos):
            t0 = time.time()
            wait_s += t0 - t_wait
            batch = _to(batch, run.device)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, cfg)
            out = ttt(batch, run.head_rows, cfg.ttt_steps, cfg.step_decay)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
            opt.step()
            step += 1
            n_tok = int(batch["lengths"].sum())
            tokens += n_tok
            tok_epoch += n_tok
            t_wait = time.time()
            compute_s += t_wait - t0
            if step % cfg.log_every == 0 and rank == 0:
                rate = tok_epoch / max(1e-9, time.time() - t_epoch)
                left = (total - step) * (time.time() - t_epoch) / max(1, i + 1 - batch_pos)
                acc0 = float(out.correct[0]) / max(1, int(out.counted[0]))
                logger.info("epoch %d/%d step %d/%d: loss %.3f, acc0 %.2f, lr %.2e, %.0f tok/s, ETA %.0f s",
                            epoch + 1, cfg.epochs, step, total, out.loss.item(), acc0, lr_at(step, total, cfg),
                            rate, left)
            if step % cfg.checkpoint_every == 0:
                save(epoch, i + 1)
        epoch, batch_pos = epoch + 1, 0
        if rank == 0:
            history.append({"epoch": epoch, "step": step, **evaluate(run)})
            logger.info("epoch %d/%d held out: %s", epoch, cfg.epochs, _describe(history[-1]))
            if on_eval:
                on_eval(history[-1])
        save(epoch, 0)
    drafter_dir = out_dir / "drafter"
    if rank == 0:
        export_drafter(model, run.layers, drafter_dir, extra={
            "store": str(Path(cfg.store).resolve()), "target": str(run.target), "steps": step,
            "heldout": {k: v for k, v in history[-1].items() if k != "epoch"}, "config": cfg.identity()})
        write_metrics(out_dir, history)
    if world > 1:
        torch.distributed.barrier()
    return TrainResult(str(drafter_dir), history, step, len(run.train_idx), len(run.held_idx), run.vocab.size,
                       str(run.target), resumed, time.time() - started, wait_s, compute_s, tokens)


def _describe(m: dict) -> str:
    acc = ", ".join(f"{a:.2f}" for a in m["acc"])
    tau_s = next(k for k in m if k.startswith("tau@"))
    return f"loss {m['loss']:.3f}, tau {m['tau']:.2f}, {tau_s} {m[tau_s]:.2f}, acc [{acc}]"


# ---------------------------------------------------------------------- metrics

def metrics_table(history: list[dict]) -> list[dict]:
    rows = []
    for m in history:
        row = {"epoch": m["epoch"], "step": m["step"], "loss": round(m["loss"], 4), "tau": round(m["tau"], 3)}
        row.update({k: round(v, 3) for k, v in m.items() if k.startswith("tau@")})
        row.update({f"acc{k}": round(a, 3) for k, a in enumerate(m["acc"])})
        rows.append(row)
    return rows


def plot_metrics(history: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [m["epoch"] for m in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.plot(epochs, [m["loss"] for m in history], marker="o")
    a.set(xlabel="epoch", ylabel="held-out TTT loss", title="loss")
    b.plot(epochs, [m["tau"] for m in history], marker="o", label="tau (all TTT steps)")
    tau_s = next(k for k in history[0] if k.startswith("tau@"))
    b.plot(epochs, [m[tau_s] for m in history], marker="s", label=tau_s)
    b.set(xlabel="epoch", ylabel="simulated acceptance length", title="held-out tau")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_metrics(out_dir: Path, history: list[dict]) -> dict:
    import pandas as pd

    csv = out_dir / "metrics.csv"
    pd.DataFrame(metrics_table(history)).to_csv(csv, index=False)
    (out_dir / "metrics.json").write_text(json.dumps(history, indent=2) + "\n")
    return {"csv": str(csv), "plot": str(plot_metrics(history, out_dir / "metrics.png"))}


# ------------------------------------------------------------------ launching

def launch_distributed(cfg: TrainConfig, log: logging.Logger = logger) -> TrainResult:
    """More than one device: the same `train` under torchrun (DDP), one
    process per device; its output is forwarded line by line."""
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = out_dir / "train-config.json"
    cfg_path.write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.devices}",
           "-m", "tasks.training", "--config", str(cfg_path)]
    log.info("launching %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(Path(__file__).resolve().parent.parent))
    for line in proc.stdout:
        log.info("%s", line.rstrip())
    if proc.wait() != 0:
        raise TrainingError(f"torchrun exited with {proc.returncode}; the checkpoint in {out_dir} resumes the run")
    return result_from_dir(out_dir)


def result_from_dir(out_dir: Path) -> TrainResult:
    ckpt = torch.load(Path(out_dir) / CHECKPOINT, weights_only=False)
    drafter_dir = Path(out_dir) / "drafter"
    target = json.loads((drafter_dir / "config.json").read_text())["eagle3_training"]["target"]
    return TrainResult(str(drafter_dir), ckpt["history"], ckpt["step"], 0, 0, len(ckpt["d2t"]), target)


def trained_drafter(out_dir: Path, target: Path) -> Eagle3Drafter:
    """The drafter as the last checkpoint holds it (fp32), to check an export against."""
    ckpt = torch.load(Path(out_dir) / CHECKPOINT, weights_only=False)
    model = build_drafter(Path(target), DraftVocab.from_d2t(ckpt["d2t"], ckpt["vocab_size"]))
    model.load_state_dict(ckpt["model"], strict=False)
    return model


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Train an EAGLE-3 drafter (one process, or under torchrun)")
    parser.add_argument("--config", required=True, help="JSON file of TrainConfig fields")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in json.loads(Path(args.config).read_text()).items() if k in fields})
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"drafter_dir": result.drafter_dir, "final": result.final}))


if __name__ == "__main__":
    main()


def heldout_prompts(store: Path, heldout_fraction: float, count: int) -> list[list[int]]:
    """Prompts of held-out samples (every token before the first loss-masked
    one: the conversation up to the assistant's answer), for serving checks
    on data the drafter never trained on."""
    reader = StoreReader(Path(store))
    _, held = split(reader, heldout_fraction)
    prompts = []
    for i in held:
        s = reader[int(i)]
        mask = s["loss_mask"].bool()
        if mask.any():
            first = int(mask.nonzero()[0])
            if first > 0:
                prompts.append(s["input_ids"][:first].tolist())
        if len(prompts) == count:
            break
    return prompts
