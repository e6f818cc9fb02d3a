"""What a training run needs, prepared once: the verified store and its
split, the target, and the drafter its family (tasks/train/families.py)
builds on the rank's device in the precision the config asks for (an
EAGLE-3 drafter's draft vocabulary counted by rank 0 alone, broadcast to
the others)."""
from __future__ import annotations

from pathlib import Path

from tasks.server.config import ServerConfig
from tasks.store.reader import StoreReader
from tasks.store.verification import require_verified
from tasks.stream.reader import StreamReader
from tasks.train import distributed
from tasks.train.config import DrafterRefused, TrainConfig, TrainingError
from tasks.train.data import split
from tasks.train.families import family_of
from tasks.train.layers.gpu_kernels import check_tensor_parallel
from tasks.train.layers.sizes import target_sizes
from tasks.train.run import Run
from tasks.train.vocab import DraftVocab


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
    family = family_of(cfg)
    return family.prepare(family, cfg, reader, target, sizes, split(reader.sample_ids, cfg.heldout_fraction),
                          distributed.device(), rank, world, vocab)


def drafter_config(cfg: TrainConfig, target_config: dict, target: Path | str = "the target",
                   num_aux: int = 3, server: ServerConfig | None = None):
    """The drafter the settings make for this target, derived from its config
    alone: refused here, before the store or the target's weights are read,
    where SGLang could not serve it (tasks/train/layers/gpu_kernels.py), on the
    tensor parallelism of `server` (the run's server section) too, or the
    settings cannot make it."""
    family = family_of(cfg)
    try:
        made = family.drafter_config(cfg, target_config, num_aux)
        if server is not None:
            # A draft layer splits its heads over the attention-TP group (layers/gpu_kernels.py); MLA's heads all carry
            # their own keys.
            check_tensor_parallel(made.num_attention_heads,
                                  None if family.layout(cfg) == "mla" else made.num_key_value_heads,
                                  server.attention_tp,
                                  f"the drafter served at server.tp_size {server.tp_size}"
                                  + (f" over {server.dp_size} attention groups" if server.dp_attention else ""))
        return made
    except ValueError as e:
        raise DrafterRefused(f"train.method {cfg.method} ({family.layout(cfg)}) on target {target}: {e}") from None
