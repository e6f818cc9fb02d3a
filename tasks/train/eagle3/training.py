"""An EAGLE-3 drafter in the training run (train.method eagle3): prepared
from the store's aux layers it reads, the target's embedding and head and
its draft vocabulary (counted by rank 0, broadcast), trained by TTT
(ttt.py), scored per step on held-out samples, exported as SGLang's
LlamaForCausalLMEagle3 (or its MLA layout) loads it, served as a chain of
serve_steps."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from tasks.server.config import ServerConfig
from tasks.server.launch import SpeculativeSpec
from tasks.store.reader import StoreReader
from tasks.target.architectures import architecture_of, read_config
from tasks.target.embeddings import load_target_embeddings
from tasks.target.layers import AuxLayers
from tasks.train.config import TrainConfig, TrainingError
from tasks.train.data import plan_batches, prefetch
from tasks.train.eagle3.model import DrafterConfig, Eagle3Drafter, build_drafter
from tasks.train.eagle3.ttt import TTT, ttt_forward
from tasks.train.checkpoint import CHECKPOINT, load_checkpoint
from tasks.train.eagle3.export import ARCHITECTURES, export_drafter, export_weights, load_exported
from tasks.train.init_from import load_init, read_init
from tasks.train.metrics import acceptance_length, exact_acceptance_length
from tasks.train.run import Family, Run, autocast_dtype, in_precision, positions_read
from tasks.train.vocab import DraftVocab, GreedyCache, count_target_tokens

logger = logging.getLogger("eagle3.training")


def drafter_config(cfg: TrainConfig, target_config: dict, num_aux: int) -> DrafterConfig:
    return DrafterConfig.from_target(target_config, cfg.draft_vocab_size, num_aux, cfg.variant, cfg.attention,
                                     cfg.mla_dims, cfg.head_dim)


def layout(cfg: TrainConfig) -> str:
    """Its attention layout, as a refusal names it (an MLA layer's heads all carry their own keys)."""
    return cfg.attention


def prepare(family: Family, cfg: TrainConfig, reader: StoreReader, target: Path, sizes: dict,
            split: tuple[np.ndarray, np.ndarray], device: torch.device, rank: int, world: int,
            vocab: DraftVocab | None = None) -> Run:
    """The drafter on the aux layers train.aux_layer_ids picks among the
    store's, its draft vocabulary (unless given: a resumed run's, or
    train.init_from's), started from init_from where given."""
    manifest = reader.manifest
    held = AuxLayers(tuple(manifest["aux_layers"]["sglang_layer_output_ids"]))
    try:
        layers = AuxLayers(tuple(cfg.aux_layer_ids)) if cfg.aux_layer_ids is not None else held
        positions = layers.positions_in(held)
    except ValueError as e:
        raise TrainingError(f"train.aux_layer_ids {cfg.aux_layer_ids}: {e}") from None
    # Only once the settings are known to fit the store: the two target-vocabulary matrices are the
    # run's largest read (4.7 GB each in fp32 at 160k x 7168).
    # A fresh run from an exported drafter (a resumed one has its checkpoint's
    # vocabulary and weights): checked before the big read.
    init = None
    if cfg.init_from and vocab is None:
        vocab, init = read_init(cfg.init_from, cfg, sizes, layers, architecture_of(read_config(target)),
                                manifest)
    embed, head = load_target_embeddings(target)
    head = head.to(device)
    train_idx, held_idx = split
    if vocab is None:
        vocab = draft_vocab(cfg, reader, train_idx, head, device, rank, world)
    try:
        model = build_drafter(target, vocab, seed=cfg.seed, num_aux=len(layers.sglang_ids),
                              variant=cfg.variant, attention=cfg.attention, mla_dims=cfg.mla_dims,
                              head_dim=cfg.head_dim, embeddings=(embed, head))
    except ValueError as e:
        raise TrainingError(f"train.attention {cfg.attention} on target {target}: {e}") from None
    if init is not None:
        load_init(model, init, cfg.init_from)
        logger.info("starting from the drafter in %s (train.init_from; its %d-token vocabulary)", cfg.init_from,
                    vocab.size)
    model = model.to(device)
    head_rows = head[torch.from_numpy(vocab.target_ids).to(device)]
    low = autocast_dtype(cfg.precision, device)
    if low is not None:
        head = head.to(low)
    return Run(cfg, family, reader, train_idx, held_idx, layers, target, in_precision(model, cfg, device),
               head_rows, head, device, rank, world, vocab, positions_read(positions, manifest),
               greedy=GreedyCache() if remembers_greedy(cfg, device, world) else None)


def remembers_greedy(cfg: TrainConfig, device: torch.device, world: int) -> bool:
    """Whether the target's greedy tokens are remembered across epochs
    (vocab.GreedyCache): measured to pay on a CPU (17% of a step). Not on a
    GPU, where the product is a smaller share and the host copies would
    stall the stream; not over several ranks, which deal each epoch's
    batches out again (a rank would rarely hold a whole batch); not where a
    stream run captures each epoch's samples again (spooled, not cached),
    whose greedy tokens must be the new capture's."""
    respooled = cfg.stream and cfg.spool_bytes is not None and not cfg.cache_epochs
    return device.type == "cpu" and world == 1 and not respooled


def draft_vocab(cfg: TrainConfig, reader, train_idx: np.ndarray, head: torch.Tensor, device: torch.device,
                rank: int, world: int) -> DraftVocab:
    """The draft vocabulary, counted by rank 0 over the first vocab_positions
    of the training samples in the first epoch's batch order, and broadcast.
    That order is a seeded random one, known before a sample is captured,
    and the one a stream run captures in: it can count the vocabulary from
    its first captures and start training."""
    size = min(cfg.draft_vocab_size, head.shape[0])
    target_ids = torch.zeros(size, dtype=torch.long, device=device)
    if rank == 0:
        order = [i for batch in plan_batches(reader.num_tokens, train_idx, cfg.tokens_per_batch, cfg.seed, 0)
                 for i in batch]
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


def module(run: Run) -> torch.nn.Module:
    return TTT(run.model)


def forward(run: Run, module: torch.nn.Module, batch: dict, epoch: int, index: int):
    cfg = run.cfg
    out = module(batch, run.head_rows, cfg.ttt_steps, cfg.step_decay, run.full_head, cfg.loss)
    run.remember(batch, out)
    return out


def describe(run: Run) -> str:
    return f"TTT {run.cfg.ttt_steps} steps, draft vocab {run.vocab.size}"


@torch.no_grad()
def evaluate(run: Run) -> dict:
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
    for batch in prefetch(run.collate, batches):
        with run.autocast():
            batch = run.on_device(batch)
            out = ttt_forward(model, batch, run.head_rows, steps=cfg.ttt_steps,
                              decay=cfg.step_decay, full_head=run.full_head, loss=cfg.loss)
            run.remember(batch, out)
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
        # Per step k: the share of starting positions whose steps 0..k all hit (the exact tau's terms).
        "chain": [c / max(1, n) for c, n in zip(chained, chain_counted)],
        "chain_counted": chain_counted,
        "heldout_tokens": int(counted[0]),
        # Scored positions whose target greedy token the draft vocabulary lacks (left out of the loss).
        "unproposable": 1 - int(in_loss[0]) / max(1, int(counted[0])),
    }


def export(run: Run, drafter_dir: Path, extra: dict) -> Path:
    """The drafter as it is now, as SGLang's EAGLE-3 classes load it."""
    return export_drafter(run.model, run.layers, drafter_dir, architecture=architecture_of(read_config(run.target)),
                          extra=extra)


def served_spec(launch: ServerConfig, drafter_dir: Path, drafts: int, **options) -> SpeculativeSpec:
    """Served as a chain of `drafts` steps."""
    return SpeculativeSpec.chain(launch, drafter_dir, drafts, **options)


def drafts(cfg: TrainConfig) -> int:
    """The tokens a verify step drafts: its chain of serve_steps."""
    return cfg.serve_steps


def served_metric(cfg: TrainConfig) -> str:
    """Training's simulation of what SGLang serves: the chain's exact tau."""
    return f"tau_exact@{cfg.serve_steps}"


def is_export(config: dict) -> bool:
    return config.get("architectures") in [[a] for a in ARCHITECTURES.values()]


def exported_drafts(config: dict, asked: int | None) -> int | None:
    """The steps asked for, else the ones it was trained to serve with."""
    return asked or (config.get("eagle3_training") or {}).get("config", {}).get("serve_steps")


def read_back(drafter_dir: Path, out_dir: Path, target: Path) -> tuple[dict, dict]:
    return export_weights(load_exported(drafter_dir, target)), export_weights(trained_drafter(out_dir, target))


def serve_flags(drafts: int) -> str:
    return (f"--speculative-algorithm EAGLE3 --speculative-num-steps {drafts} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {drafts + 1}")


def trained_drafter(out_dir: Path, target: Path) -> Eagle3Drafter:
    """The drafter as the last checkpoint holds it (fp32), to check an export against."""
    ckpt = load_checkpoint(Path(out_dir) / CHECKPOINT)
    fc = ckpt["model"]["fc.weight"]
    identity = ckpt["identity"]
    model = build_drafter(Path(target), DraftVocab.from_d2t(ckpt["d2t"], ckpt["vocab_size"]),
                          num_aux=fc.shape[1] // fc.shape[0], variant=identity.get("variant", "eagle3"),
                          attention=identity.get("attention", "gqa"), mla_dims=identity.get("mla_dims") or {},
                          head_dim=identity.get("head_dim"))
    missing, unexpected = model.load_state_dict(ckpt["model"], strict=False)
    missing = [k for k in missing if not k.startswith(Eagle3Drafter.FROZEN)]  # not checkpointed
    if missing or unexpected:
        raise TrainingError(f"checkpoint in {out_dir} does not fit its drafter: missing {missing}, "
                            f"unexpected {unexpected}")
    return model
