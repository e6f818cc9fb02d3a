"""What training takes, returns and raises: `TrainConfig`, the training
section of a run's settings (each field declared once, with its type,
default, limits and description; the store is not one of them: it is the
store section's, and `train` takes it beside the config), `TrainResult`
(also written as the run's result.json) and `TrainingError`."""
from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, ValidationError, field_validator, model_validator

from tasks.config import AuxLayerIds, Section
from tasks.failures import Permanent


# A setting that is not part of a run's identity: it may change between a
# run and its resume (how it runs, not what it trains).
RESUMABLE = {"resumable": True}
# Settings only a DFlash drafter reads: an EAGLE-3 run's identity leaves them out.
DFLASH_ONLY = {"block_size", "draft_layers", "max_anchors", "loss_gamma", "labels"}
# What a checkpoint written before a setting existed ran with, where that is
# not the setting's default today (DFlash was labelled with the data's tokens).
BEFORE_THE_SETTING = {"labels": "data"}


class TrainConfig(Section):
    """The drafter's training: its vocabulary and TTT depth, the optimiser and schedule, the held-out split,
    devices, sharding and nodes."""

    out_dir: str = Field("runs/demo/train", description="checkpoints, metrics and the exported drafter/ go here; a "
                                                        "rerun resumes")
    target: Optional[str] = Field(None, description="target checkpoint (default: the one the store was captured "
                                                    "from)")
    method: Literal["eagle3", "dflash"] = Field("eagle3", description=(
        "the drafter family: eagle3 (a one-layer drafter unrolled step by step, TTT) or dflash (block "
        "diffusion: one forward drafts block_size - 1 tokens from several target layers' states; SGLang's "
        "DFlashDraftModel, --speculative-algorithm DFLASH). Both train on the same store"))
    block_size: int = Field(16, ge=2, le=64, description=(
        "dflash: tokens a draft block holds (the bonus token, then block_size - 1 drafts); SGLang serves it "
        "with the same block size"))
    draft_layers: int = Field(1, ge=1, le=16, description="dflash: decoder layers of the drafter")
    max_anchors: int = Field(512, ge=1, description=(
        "dflash: random block starts per sample and batch (among its loss-masked positions)"))
    loss_gamma: Optional[float] = Field(None, gt=0, description=(
        "dflash: the loss weight of draft slot k is exp(-(k - 1) / loss_gamma) (default: by the block, the DFlash "
        "paper's 4 for blocks of 8, 5 for 10, 7 for 16, linear between and beyond)"))
    labels: Literal["target", "data"] = Field("target", description=(
        "dflash: what each draft slot is trained to predict: the target's greedy token there (from the store's "
        "final states: what SGLang accepts, a draft matching the target's argmax), or the dataset's token"))
    variant: Literal["eagle3", "eagle3.1"] = Field("eagle3", description=(
        "the drafter: eagle3, or eagle3.1 (an RMSNorm per aux state before fc, and draft steps fed the normed "
        "output; SGLang's fc_norm and norm_output). The capture is the same"))
    attention: Literal["gqa", "mla"] = Field("gqa", description=(
        "the drafter's attention: gqa, a Llama decoder layer (SGLang's LlamaForCausalLMEagle3, for any target), or "
        "mla, DeepSeek-V2 multi-latent attention (SGLang's Eagle3DeepseekV2ForCausalLM, the layout of the "
        "Kimi-K2.x MLA drafters: its draft KV cache holds one latent of kv_lora_rank + qk_rope_head_dim per "
        "token). The capture is the same"))
    mla_dims: dict[str, int] = Field(default_factory=dict, description=(
        "attention mla: any of q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim; the "
        "others are the target's (a target without MLA needs all five)"))
    head_dim: Optional[int] = Field(None, ge=8, description=(
        "the drafter's attention head dim (gqa and dflash; default: the target's, or 128 with the target's head "
        "count and 8 KV heads where the target's config gives none SGLang's GPU kernels take, as for DeepSeek-V3 "
        "and Kimi-K2.5)"))
    aux_layer_ids: AuxLayerIds = Field(None, description=(
        "SGLang 'output of layer i' ids of the aux layers the drafter reads, among the store's (default: all of "
        "the store's; three for an EAGLE-3 drafter of SGLang's kind)"))
    init_from: Optional[str] = Field(None, description=(
        "eagle3: start from this exported drafter (an earlier run's drafter/ or a published one in SGLang's "
        "layout) instead of random weights, keeping its vocabulary map; refused, naming why, unless it was made "
        "for this target, these aux layers, this layout, variant and draft_vocab_size"))
    draft_vocab_size: int = Field(8192, ge=16, description=(
        "eagle3: draft vocabulary, the N most frequent target tokens (a DFlash drafter drafts from the whole)"))
    ttt_steps: int = Field(7, ge=1, description="eagle3: training-time-test unroll depth K (loss weights decay^k)")
    step_decay: float = Field(0.8, gt=0, le=1, description="eagle3: loss weight decay per TTT step")
    loss: Literal["forward_kl", "tv", "kl_tv"] = Field("forward_kl", description=(
        "eagle3: the loss against the target's distribution over the draft vocabulary: forward_kl (soft "
        "cross-entropy), tv (total variation: what speculative sampling rejects), kl_tv (their sum); "
        "bench/recipe.py measures each served in SGLang"))
    epochs: int = Field(2, ge=1, description="passes over the training split")
    lr: float = Field(3e-4, gt=0, description="peak learning rate (AdamW, warm-up then cosine)")
    warmup_fraction: float = Field(0.05, ge=0, le=1, description=(
        "share of the run's batches over which the learning rate rises linearly to lr, before its cosine decay to "
        "lr/10"))
    max_grad_norm: float = Field(0.5, gt=0, description="the step's gradients are clipped to this total norm")
    tokens_per_batch: int = Field(4096, ge=64, description="padded tokens per batch (one per device and "
                                                           "accumulation step)")
    heldout_fraction: float = Field(0.05, gt=0, lt=1, description="share of samples held out (by sample-id hash)")
    eval_max_samples: int = Field(256, ge=1, description="held-out samples evaluated after each epoch (the first "
                                                         "of the held-out split; all of it when fewer)")
    serve_steps: int = Field(3, ge=1, description="speculative steps the drafter will be served with (for tau@S: "
                                                  "SGLang's --speculative-num-steps)")
    serve_every: int = Field(0, ge=0, json_schema_extra=RESUMABLE, description=(
        "every this many epochs, and after the last, the current weights are exported and served speculatively "
        "in SGLang on held-out prompts: SGLang's accept length, pooled and per position, goes into the metrics "
        "beside the held-out tau (0: off; each measurement starts one server of the target)"))
    serve_prompts: int = Field(8, ge=1, json_schema_extra=RESUMABLE, description=(
        "serve_every: held-out prompts each measurement generates on"))
    serve_max_new_tokens: int = Field(48, ge=1, json_schema_extra=RESUMABLE, description=(
        "serve_every: tokens each prompt generates (greedy, EOS ignored)"))
    keep_best_served: bool = Field(False, json_schema_extra=RESUMABLE, description=(
        "serve_every: export the weights of the epoch SGLang accepted the most drafts of (pooled accept length) "
        "instead of the last epoch's, if it beat the last by more than keep_best_margin standard errors"))
    keep_best_margin: float = Field(2.0, ge=0, json_schema_extra=RESUMABLE, description=(
        "keep_best_served: standard errors (the same prompts, request by request) by which an earlier epoch's "
        "served accept length must beat the last epoch's to be exported instead"))
    export_formats: list[Literal["sglang", "speculators"]] = Field(["sglang"], json_schema_extra=RESUMABLE,
                                                                   description=(
        "the drafter's exports: sglang (drafter/, what SGLang loads and the evaluation and init_from read; always "
        "written) and speculators (drafter-speculators/ beside it: the same weights in the format vLLM serves, "
        "as vLLM's speculators 0.9.0 writes it; EAGLE-3 with gqa attention)"))
    seed: int = Field(0, ge=0, description="initialisation and data-order seed")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description=(
        "auto: bf16 autocast on GPUs (fp32 weights, softmax and loss), fp32 on CPUs (no bf16 matmul units); fp32 "
        "or bf16 force either"))
    vocab_positions: int = Field(2_000_000, ge=1, description=(
        "training positions counted to pick the draft vocabulary: the first ones of the first epoch's batch order"))
    stream: bool = Field(False, json_schema_extra=RESUMABLE, description=(
        "train while the capture runs (the pipeline's mode stream): batches are planned from the dataset's "
        "tokenisation, each sample is read as soon as its shard is committed, and the weights are those of an "
        "offline run over the finished store"))
    checkpoint_every: int = Field(50, ge=1, json_schema_extra=RESUMABLE, description="steps between checkpoints")
    log_every: int = Field(10, ge=1, json_schema_extra=RESUMABLE, description=(
        "steps between progress lines in the log"))
    devices: int = Field(1, ge=1, json_schema_extra=RESUMABLE, description=(
        "GPUs to train on (per node); >1 runs torchrun"))
    accumulate: int = Field(1, ge=1, json_schema_extra=RESUMABLE, description=(
        "batches per device and optimizer step (gradient accumulation): a step takes devices x nnodes x "
        "accumulate batches"))
    sharding: Literal["ddp", "fsdp", "hsdp"] = Field("ddp", json_schema_extra=RESUMABLE, description=(
        "with more than one device: ddp (every GPU holds the whole drafter and its AdamW state), fsdp (weights, "
        "gradients and AdamW state sharded over all GPUs), hsdp (sharded within a node, replicated across nodes). "
        "The frozen target embedding is never sharded: it has no gradients or optimizer state"))
    nnodes: int = Field(1, ge=1, json_schema_extra=RESUMABLE, description=(
        "nodes to train on: run this flow on each, with the same parameters but node_rank, a shared out_dir and "
        "store"))
    node_rank: int = Field(0, ge=0, json_schema_extra=RESUMABLE, description=(
        "this node, 0..nnodes-1: node 0's run holds out_dir's lock, checks the export and writes the artifacts; "
        "the others only train"))
    rdzv_endpoint: Optional[str] = Field(None, json_schema_extra=RESUMABLE, description=(
        "nnodes > 1: host:port of one of the nodes (the same on all), where torchrun's c10d rendezvous meets (e.g. "
        "node 0's address, a free port)"))
    max_nonfinite_steps: int = Field(3, ge=1, json_schema_extra=RESUMABLE, description=(
        "optimizer steps in a row whose loss or gradient norm is NaN or infinite that are skipped (gradients "
        "dropped, weights untouched) before the run stops. A safety limit, not a training setting: a run that "
        "stopped on it may be resumed with another"))
    on_store_change: Literal["refuse", "replan"] = Field("refuse", json_schema_extra=RESUMABLE, description=(
        "a resume whose store has changed since the checkpoint (samples added, removed or altered): refuse (train "
        "in a new out_dir), or replan: start the current epoch again over the store as it is now"))

    spool_bytes: Optional[int] = Field(None, ge=1, json_schema_extra=RESUMABLE, description=(
        "stream: the disk the captured training data may take. Each epoch is captured again into a spool and each "
        "shard removed once trained on (held-out samples are kept in the store); capture waits while the spool is "
        "full. None: keep every shard in the store, captured once"))
    cache_epochs: bool = Field(False, json_schema_extra=RESUMABLE, description=(
        "stream with spool_bytes: keep the first capture of as many training samples as the budget has room for "
        "beside the spool's working set (the first ones of the first epoch's order), and capture only the others "
        "again in later epochs: fewer target forwards for the same disk"))

    @field_validator("*", mode="wrap")
    @classmethod
    def _one_of_the_choices(cls, value, handler, info):
        # Pydantic's message puts the setting's name, the value and the
        # choices on three lines; a log line should say all three.
        try:
            return handler(value)
        except ValidationError:
            annotation = cls.model_fields[info.field_name].annotation
            if typing.get_origin(annotation) is not Literal:
                raise
            raise ValueError(f"{info.field_name} {value!r}: use one of "
                             f"{', '.join(map(str, typing.get_args(annotation)))}") from None

    @field_validator("mla_dims")
    @classmethod
    def _mla_dims(cls, dims: dict[str, int]) -> dict[str, int]:
        from tasks.train.eagle3.mla import check_mla_dims

        return check_mla_dims(dims)

    @model_validator(mode="after")
    def _nodes(self) -> TrainConfig:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nnodes {self.nnodes} needs rdzv_endpoint host:port: an address of one of the nodes "
                             f"(the same on every node), where torchrun's rendezvous meets")
        if self.cache_epochs and self.spool_bytes is None:
            raise ValueError("train.cache_epochs keeps what a spool's budget has room for: set train.spool_bytes "
                             "too, or leave cache_epochs false (without a spool every shard is kept anyway)")
        if self.keep_best_served and not self.serve_every:
            raise ValueError("train.keep_best_served picks among the epochs served in SGLang: set train.serve_every "
                             "too (e.g. 1: after every epoch)")
        if self.mla_dims and self.attention != "mla":
            raise ValueError(f"train.mla_dims {self.mla_dims} sizes an MLA drafter: set train.attention mla too, "
                             f"or leave mla_dims empty")
        if "sglang" not in self.export_formats:
            raise ValueError(f"train.export_formats {self.export_formats}: sglang's export is the one the evaluation "
                             f"and init_from read, and the others are written from it: keep sglang in the list")
        if "speculators" in self.export_formats and (self.method, self.attention) != ("eagle3", "gqa"):
            raise ValueError(f"train.export_formats speculators: speculators 0.9.0 has an EAGLE-3 drafter with Llama "
                             f"or Qwen3 layers only, not {self.method} with {self.attention} attention: leave "
                             f"export_formats [sglang]")
        if self.method == "dflash":
            defaults = {"variant": "eagle3", "attention": "gqa", "mla_dims": {}, "loss": "forward_kl",
                        "init_from": None}
            eagle3_only = [f"{k} {getattr(self, k)!r}" for k, v in defaults.items() if getattr(self, k) != v]
            if eagle3_only:
                raise ValueError(f"train.method dflash: {', '.join(eagle3_only)} set(s) an EAGLE-3 drafter; leave "
                                 f"them at their defaults for a DFlash one")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} of nnodes {self.nnodes}: node ranks are "
                             f"0..{self.nnodes - 1}")
        return self

    def identity(self, store: str | Path) -> dict:
        """What a checkpoint must have been written under to be resumed: the
        store and every setting but the resumable ones and those another
        drafter family's alone reads."""
        unread = DFLASH_ONLY if self.method == "eagle3" else set()
        identity = {"store": str(store), **self.model_dump(exclude=self.resumable() | unread)}
        if self.method == "dflash":  # the decay it trains with, given or the block's
            from tasks.train.dflash.model import loss_gamma_for

            identity["loss_gamma"] = self.loss_gamma or loss_gamma_for(self.block_size)
        return identity

    @classmethod
    def resumable(cls) -> set[str]:
        """The settings that may change between a run and its resume."""
        return {name for name, f in cls.model_fields.items() if f.json_schema_extra == RESUMABLE}


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
    exported_epoch: int | None = None  # the epoch whose weights drafter/ holds (keep_best_served); None: the last
    served_choice: dict | None = None  # keep_best_served: the best and last served epochs compared (served.choose_served)

    @property
    def final(self) -> dict:
        return self.history[-1]


class TrainingError(RuntimeError):
    pass


class CheckpointMismatch(Permanent, TrainingError):
    """The out_dir's checkpoint belongs to another run (other settings, a
    changed store, unreadable): resuming it again fails the same way."""


class DrafterRefused(Permanent, TrainingError):
    """The settings make a drafter this target cannot have (one SGLang's GPU
    kernels would refuse, say): a retry fails the same way."""
