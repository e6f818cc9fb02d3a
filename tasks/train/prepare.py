"""What a training run needs, prepared once: the verified store and its
split, the target's embeddings, the draft vocabulary (an EAGLE-3 drafter's:
counted by rank 0 alone, broadcast to the others) and the drafter, on the
rank's device in the precision the config asks for."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tasks.server.config import ServerConfig
from tasks.store.reader import StoreReader
from tasks.store.verification import require_verified
from tasks.target.architectures import architecture_of, read_config
from tasks.target.layers import AuxLayers
from tasks.train import distributed
from tasks.train.config import DrafterRefused, TrainConfig, TrainingError
from tasks.train.data import collate, plan_batches, split
from tasks.target.embeddings import load_target_embeddings
from tasks.train.dflash import DFlashConfig, DFlashDrafter
from tasks.train.dflash_training import DFlashSetup, DFlashStep, anchor_generator, prepare_dflash
from tasks.train.drafter import DrafterConfig, Eagle3Drafter, build_drafter, target_sizes
from tasks.train.gpu_kernels import check_tensor_parallel
from tasks.train.init_from import load_init, read_init
from tasks.stream.reader import StreamReader
from tasks.train.ttt import TTT
from tasks.train.vocab import DraftVocab, GreedyCache, count_target_tokens

logger = logging.getLogger("eagle3.training")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of a precision setting on a device; None: plain fp32."""
    if precision == "fp32" or (precision == "auto" and device.type == "cpu"):
        return None
    return torch.bfloat16


@dataclass
class Run:
    """What the loop needs, prepared once."""
    cfg: TrainConfig
    reader: StoreReader
    train_idx: np.ndarray
    held_idx: np.ndarray
    layers: AuxLayers | None  # what an EAGLE-3 drafter reads, a subset of the store's
    target: Path
    model: Eagle3Drafter | DFlashDrafter
    head_rows: torch.Tensor | None  # EAGLE-3: the target head's rows of the draft vocabulary
    full_head: torch.Tensor
    device: torch.device
    rank: int = 0
    world: int = 1
    vocab: DraftVocab | None = None  # EAGLE-3's; a DFlash drafter drafts from the whole vocabulary
    aux_positions: tuple[int, ...] | None = None  # of the layers read, in the store's layer axis; None: all of them
    dflash: DFlashSetup | None = None
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
        return DFlashStep(self.model, self.cfg, self.dflash) if self.dflash else TTT(self.model)

    def forward(self, module: torch.nn.Module, batch: dict, epoch: int, index: int):
        """Batch `index` of `epoch`'s order through `module` (self.module(),
        wrapped): its loss and per-step (EAGLE-3) or per-slot (DFlash) counts."""
        cfg = self.cfg
        if self.dflash:
            return module(batch, anchor_generator(cfg.seed, epoch, index))
        out = module(batch, self.head_rows, cfg.ttt_steps, cfg.step_decay, self.full_head, cfg.loss)
        self.remember(batch, out)
        return out


def prepare(cfg: TrainConfig, store: str | Path, vocab: DraftVocab | None = None, rank: int = 0,
            world: int = 1, server: ServerConfig | None = None) -> Run:
    """Read the store and the target's embeddings, pick the draft vocabulary
    (unless given: a resumed run's) and build the drafter. Under DDP only rank
    0 counts the vocabulary and broadcasts it, so every rank has the same one
    (counting is the slow part: it reads the target's final states)."""
    store = Path(store)
    if cfg.stream:
        # Each sample as its shard is committed (the capture verified it
        # against what was sent), checked against its checksum as it is read.
        reader = StreamReader(store, cfg)
    else:
        require_verified(store)
        # Verification passed once; each sample is checked again as it is
        # read, so bytes changed since then are never trained on.
        reader = StoreReader(store, verify_checksums=True)
    if len(reader) < 2:
        raise TrainingError(f"store {store} holds {len(reader)} samples: training needs at least 2")
    manifest = reader.manifest
    target = Path(cfg.target or manifest["target_path"])
    if not (target / "config.json").exists():
        raise TrainingError(f"target checkpoint {target} not found: pass `target` (the model the store was "
                            f"captured from, {manifest.get('target')})")
    sizes = target_sizes(target)
    drafter_config(cfg, sizes, target, server=server)
    train_idx, held_idx = split(reader.sample_ids, cfg.heldout_fraction)
    device = distributed.device()
    if cfg.method == "dflash":
        model, setup, positions = prepare_dflash(cfg, reader, target)
        model = _in_precision(model.to(device), cfg, device)
        # The drafter holds the target's head (its own lm_head, frozen): no second copy.
        return Run(cfg, reader, train_idx, held_idx, None, target, model, None, model.lm_head.weight.detach(),
                   device, rank, world, None, _unless_all(positions, manifest), setup)
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
    return Run(cfg, reader, train_idx, held_idx, layers, target, _in_precision(model, cfg, device), head_rows, head,
               device, rank, world, vocab, _unless_all(positions, manifest),
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


def drafter_config(cfg: TrainConfig, target_config: dict, target: Path | str = "the target",
                   num_aux: int = 3, server: ServerConfig | None = None) -> DrafterConfig | DFlashConfig:
    """The drafter the settings make for this target, derived from its config
    alone: refused here, before the store or the target's weights are read,
    where SGLang could not serve it (tasks/train/gpu_kernels.py), on the
    tensor parallelism of `server` (the run's server section) too, or the
    settings cannot make it."""
    try:
        if cfg.method == "dflash":
            made = DFlashConfig.from_target(target_config, cfg.draft_layers, num_aux, cfg.head_dim)
        else:
            made = DrafterConfig.from_target(target_config, cfg.draft_vocab_size, num_aux, cfg.variant, cfg.attention,
                                             cfg.mla_dims, cfg.head_dim)
        if server is not None:
            # A draft layer splits its heads over the attention-TP group (gpu_kernels.py); MLA's heads all carry
            # their own keys.
            mla = cfg.method == "eagle3" and cfg.attention == "mla"
            check_tensor_parallel(made.num_attention_heads, None if mla else made.num_key_value_heads,
                                  server.attention_tp,
                                  f"the drafter served at server.tp_size {server.tp_size}"
                                  + (f" over {server.dp_size} attention groups" if server.dp_attention else ""))
        return made
    except ValueError as e:
        raise DrafterRefused(f"train.method {cfg.method} ({cfg.attention if cfg.method == 'eagle3' else 'gqa'}) on "
                            f"target {target}: {e}") from None


def _in_precision(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    low = autocast_dtype(cfg.precision, device)
    if low is not None:
        # The two target-vocabulary matrices (4.7 GB each in fp32 for a 160k x
        # 7168 target) are frozen and only feed bf16 matmuls under autocast;
        # a bf16 checkpoint's values are bf16 anyway.
        model.embed_tokens.to(low)
        if isinstance(model, DFlashDrafter):
            model.lm_head.to(low)
    return model


def _unless_all(positions: tuple[int, ...], manifest: dict) -> tuple[int, ...] | None:
    """None where the drafter reads every layer of the store, in its order."""
    return None if positions == tuple(range(len(manifest["aux_layers"]["sglang_layer_output_ids"]))) else positions


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
