"""The DFlash drafter (block diffusion), in the layout SGLang 0.5.23 serves as
`DFlashDraftModel` (`--speculative-algorithm DFLASH`), and its training
forward.

    fc           [H, K*H]  the target's K layer states of a token, concatenated
    hidden_norm  RMSNorm of fc's output: the context state ctx of a token
    layers.{i}   N Qwen3-style decoder layers: q/k/v/o_proj, q_norm, k_norm
                 (per head), input/post_attention_layernorm, a SiLU MLP
    norm         final RMSNorm

Served (dflash_worker_v2.py): every committed token's ctx goes into each
layer's KV cache as k_norm(k_proj(ctx)) with rope at its position and
v_proj(ctx), with no input_layernorm (dflash_worker_v2.py:2009-2038). A
draft is one block [bonus token, MASK x (B-1)] at positions p..p+B-1, embedded
by the TARGET's embedding, run through the layers with attention to the
cached ctx of positions < p and to the whole block (non-causal: SGLang's
ENCODER_ONLY when config.layer_types is absent or full, dflash.py:166-191);
slots 1..B-1 go through `norm` and the target's lm_head, argmax. The drafter
has no embedding or head of its own: both are the target's, frozen here.

Training (SpecForge specforge/algorithms/common/dflash_family_model.py):
random anchors a where tokens a and a+1 are both loss-masked; the block at
anchor a is [x_a, MASK...] at positions a..a+B-1 and sees the ctx of tokens
< a and its own block; slot k is labelled with the target's greedy token at
a+k (what SGLang's verify accepts; the data's x_{a+k} with labels "data", as
SpecForge does), scored where a+k is a loss-masked token of the sequence,
cross-entropy weighted exp(-(k-1)/gamma) (gamma by the block size) over the
full target vocabulary, normalised by the weights' sum.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tasks.train.layers.decoder_layer import RMSNorm
from tasks.train.layers.gpu_kernels import check_dflash_head_dim, check_gqa_heads
from tasks.train.layers.sizes import LayerSizes
from tasks.train.layers.rope import Rotary, check_gqa_rope, gqa_rotary, rope_config

# SpecForge's defaults (and the reference DFlash's).
BLOCK_SIZE = 16
MAX_ANCHORS = 512
LOSS_GAMMA = 7.0  # for blocks of 16: loss_gamma_for
# Rows of the full-vocabulary logits materialised at once (x vocab x 4 bytes:
# 256 MB at 1024 rows of a 160k vocabulary).
LOGIT_ROWS = 1024


@dataclass(frozen=True)
class DFlashConfig(LayerSizes):
    num_layers: int
    num_context: int  # K: target layers whose states are concatenated per token
    rope: tuple = ()  # (key, value) pairs of the rope keys its config.json carries (rope.rope_config)

    @classmethod
    def from_target(cls, target_config: dict, num_layers: int, num_context: int,
                    head_dim: int | None = None) -> "DFlashConfig":
        if num_layers < 1 or num_context < 1:
            raise ValueError(f"a DFlash drafter needs at least one layer and one target layer to read; got "
                             f"{num_layers} layers reading {num_context}")
        sizes = LayerSizes.of(target_config, head_dim=head_dim)
        check_dflash_head_dim(sizes["head_dim"])
        check_gqa_heads(sizes["num_attention_heads"], sizes["num_key_value_heads"], sizes["head_dim"], target_config,
                        "a DFlash drafter")
        check_gqa_rope(target_config, sizes["head_dim"])
        return cls(**sizes, num_layers=num_layers, num_context=num_context,
                   rope=tuple(rope_config(target_config).items()))


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, -1, self.cfg.head_dim).transpose(1, 2)

    def kv(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, n, H] -> k (normed, rotated), v [B, kv_heads, n, d]: what
        SGLang writes into the draft KV cache for the context."""
        k = self.k_norm(self._heads(self.k_proj(x)))
        _, k = rotary(k, k, positions)
        return k, self._heads(self.v_proj(x))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """x [B, m, H] (the block tokens, normed) attends to the context keys
        and its own; `allowed` [B, m, n_ctx + m]."""
        q = self.q_norm(self._heads(self.q_proj(x)))
        k = self.k_norm(self._heads(self.k_proj(x)))
        q, k = rotary(q, k, positions)
        k = torch.cat([ctx_k, k], dim=2)
        v = torch.cat([ctx_v, self._heads(self.v_proj(x))], dim=2)
        rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        b, _, m, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, m, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: Rotary, ctx: torch.Tensor,
                ctx_positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        # The context enters every layer as the same ctx, un-normed (SGLang's
        # kv_proj_only on ctx_hidden); only the block goes through the layer.
        ctx_k, ctx_v = self.self_attn.kv(ctx, ctx_positions, rotary)
        h = h + self.self_attn(self.input_layernorm(h), positions, rotary, ctx_k, ctx_v, allowed)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    # Not trained, not exported: the target's embedding and head (SGLang
    # borrows the target's) and the rope's tables.
    FROZEN = ("embed_tokens.", "lm_head.", "rotary.")

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)
        self.fc = nn.Linear(cfg.num_context * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        # The target's rope keys, nothing else: SGLang rotates the whole head.
        self.rotary = gqa_rotary(dict(self.cfg.rope), cfg.head_dim)

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        """The drafter's own parameters, by the names SGLang's checkpoint uses."""
        return {k: v for k, v in self.named_parameters() if not k.startswith(self.FROZEN)}

    def trainable_state(self) -> dict:
        """What a checkpoint holds: everything but the target's embedding and
        head and the rope's tables."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(self.FROZEN)}

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """[B, S, K*H] target states -> ctx [B, S, H] (SGLang's project_target_hidden)."""
        return self.hidden_norm(self.fc(features))

    def blocks(self, features: torch.Tensor, block_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Every block of a batch in one pass: block_ids [B, N, Bk] (the token at
        the anchor, then MASK), anchors [B, N]; each block at positions
        anchor.., seeing the ctx of the tokens before its anchor and its
        whole block. Returns the normed hidden states [B, N, Bk, H], what the
        target's head scores."""
        b, n, bk = block_ids.shape
        s = features.shape[1]
        ctx = self.context(features.to(self.fc.weight.dtype))
        ctx_positions = torch.arange(s, device=features.device)[None].expand(b, s)
        positions = (anchors[:, :, None] + torch.arange(bk, device=anchors.device)).reshape(b, n * bk)
        block_of = torch.arange(n * bk, device=anchors.device) // bk
        sees_ctx = torch.arange(s, device=anchors.device)[None, None, :] < anchors[:, block_of, None]
        sees_block = (block_of[:, None] == block_of[None, :])[None].expand(b, -1, -1)
        allowed = torch.cat([sees_ctx, sees_block], dim=-1)
        h = self.embed_tokens(block_ids.reshape(b, n * bk)).to(ctx.dtype)
        for layer in self.layers:
            h = layer(h, positions, self.rotary, ctx, ctx_positions, allowed)
        return self.norm(h).view(b, n, bk, -1)


def loss_gamma_for(block_size: int) -> float:
    """The slot weights' decay for a block size, as the DFlash paper tuned it
    (SpecForge's train_dflash.py: 7 for blocks of 16, 5 for 10, 4 for 8),
    linear between those and beyond: a short block's late slots are
    accepted rarely, and weighting them as a long block's would spend its
    loss where little is accepted."""
    if block_size <= 10:
        return 4.0 + (block_size - 8) / 2
    return 5.0 + (block_size - 10) / 3


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `max_anchors` random anchors per sequence, ascending, among the
    positions a where tokens a and a+1 are both loss-masked (a block whose
    first prediction is not trained on teaches nothing; SpecForge's
    _sample_anchor_positions). Returns (anchors [B, N], keep [B, N]): rows
    with fewer valid positions are padded with anchor 0, keep False.
    `generator` (CPU) makes the draw reproducible."""
    mask = loss_mask.bool()
    b, s = mask.shape
    valid = mask[:, :-1] & mask[:, 1:]
    counts = valid.sum(1)
    width = min(max_anchors, int(counts.max()) if s > 1 else 0)
    if width == 0:
        empty = torch.zeros(b, 0, dtype=torch.long, device=mask.device)
        return empty, empty.bool()
    draw = torch.rand(valid.shape, generator=generator).to(mask.device).masked_fill(~valid, 2.0)
    picked = draw.argsort(dim=1)[:, :width]
    keep = torch.arange(width, device=mask.device)[None] < counts.clamp(max=width)[:, None]
    anchors = torch.where(keep, picked, s).sort(dim=1).values
    keep = anchors < s
    return torch.where(keep, anchors, 0), keep


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                 block_size: int, mask_token_id: int, gamma: float = LOSS_GAMMA,
                 targets: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks' inputs and targets: (block_ids [B, N, Bk]: the anchor's
    token then MASK; labels [B, N, Bk]: token anchor+k of `targets` (the
    token each position should hold: the target's greedy one, see
    greedy_targets; the data's when None); scored [B, N, Bk]: slot k >= 1 of
    a kept block with anchor+k a loss-masked position of the sequence;
    weights [B, N, Bk]: exp(-(k-1)/gamma) where scored, else 0)."""
    b, s = input_ids.shape
    k = torch.arange(block_size, device=input_ids.device)
    at = anchors[:, :, None] + k
    inside = at < s
    at = at.clamp(max=s - 1)
    rows = torch.arange(b, device=input_ids.device)[:, None, None]
    labels = (input_ids if targets is None else targets)[rows, at]
    scored = keep[:, :, None] & inside & (k > 0) & loss_mask.bool()[rows, at]
    weights = torch.exp(-(k - 1).clamp(min=0).float() / gamma) * scored
    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[:, :, 0] = input_ids[rows[:, :, 0], anchors]
    return block_ids, labels, scored, weights


def _score_rows(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ head.T).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return torch.stack([ce, logits.argmax(-1).to(ce.dtype)])


def score(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor,
          rows: int = LOGIT_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy [n], argmax [n]) of hidden [n, H] through `head`
    [V, H] against labels [n]: `rows` at a time, each chunk under activation
    checkpointing, so neither pass holds more than one chunk's logits."""
    ces, tops = [], []
    for start in range(0, hidden.shape[0], rows):
        args = (hidden[start:start + rows], head, labels[start:start + rows])
        out = checkpoint(_score_rows, *args, use_reentrant=False) if torch.is_grad_enabled() else _score_rows(*args)
        ces.append(out[0])
        tops.append(out[1].detach().long())
    if not ces:
        return hidden.new_zeros(0, dtype=torch.float32), labels.new_zeros(0)
    return torch.cat(ces), torch.cat(tops)


@dataclass
class DFlashOutput:
    """One forward's loss and counts per draft slot k = 1..Bk-1 (index k-1),
    the shape of the loop's StepOutput where the two meet (loss, correct,
    counted)."""
    loss: torch.Tensor
    correct: torch.Tensor  # [Bk-1] scored slots whose top token is the label
    counted: torch.Tensor  # [Bk-1] slots scored
    chained: torch.Tensor  # [Bk-1] kept blocks whose slots 1..k are all scored and hit
    chain_counted: torch.Tensor  # [Bk-1] kept blocks whose slots 1..k are all scored
    blocks: torch.Tensor  # kept blocks

    @property
    def accuracy(self) -> list[float]:
        return [float(h) / max(1, int(s)) for h, s in zip(self.correct, self.counted)]

    @property
    def chain_share(self) -> list[float]:
        """Per slot k, the share of the blocks scored through k whose drafts
        1..k would all be accepted (a block near a sample's end is scored
        on fewer slots: served, the text would go on)."""
        return [float(c) / max(1, int(n)) for c, n in zip(self.chained, self.chain_counted)]

    @property
    def accept_length(self) -> float:
        """Tokens a verify step would commit on average: the bonus token plus
        each slot while the chain holds (SpecForge's accepted length)."""
        return 1.0 + sum(self.chain_share)


@torch.no_grad()
def greedy_targets(input_ids: torch.Tensor, wanted: torch.Tensor, final: torch.Tensor,
                   head: torch.Tensor) -> torch.Tensor:
    """The target's greedy token at each `wanted` position t (argmax of its
    head over the final state of t - 1, from the store, as EAGLE-3 distils
    it), the data's elsewhere. Where the data is the target's own greedy
    text (regenerated) these are the tokens SGLang's verify accepts; on
    other data, the target's next token after the data's prefix. Only the
    wanted positions pay for a head's matmul (a 160k vocabulary x 7168 per
    token)."""
    from tasks.train.vocab import target_greedy

    targets = input_ids.clone()
    b, t = (wanted & (torch.arange(wanted.shape[1], device=wanted.device) > 0)).nonzero(as_tuple=True)
    if len(b):
        targets[b, t] = target_greedy(final[b, t - 1], head).to(targets.dtype)
    return targets


def dflash_forward(model: DFlashDrafter, batch: dict, *, block_size: int = BLOCK_SIZE, mask_token_id: int,
                   max_anchors: int = MAX_ANCHORS, gamma: float | None = None, labels: str = "target",
                   generator: torch.Generator | None = None, rows: int = LOGIT_ROWS) -> DFlashOutput:
    """One training forward over a collated batch (`input_ids`, `loss_mask`,
    `aux`: the K target layers' states concatenated per token, in the order
    of the drafter's target_layer_ids; `final`: the target's final states,
    for labels "target"). `gamma`: None for the block's (loss_gamma_for)."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    gamma = loss_gamma_for(block_size) if gamma is None else gamma
    anchors, keep = sample_anchors(mask, max_anchors, generator)
    targets = None
    if labels == "target":  # at the positions the blocks score: slot k of block n scores anchor + k
        _, _, scored, _ = block_labels(ids, mask, anchors, keep, block_size, mask_token_id, gamma)
        b, n, k = scored.nonzero(as_tuple=True)
        needed = torch.zeros_like(mask, dtype=torch.bool)
        needed[b, anchors[b, n] + k] = True
        targets = greedy_targets(ids, needed, batch["final"], model.lm_head.weight)
    block_ids, wanted, scored, weights = block_labels(ids, mask, anchors, keep, block_size, mask_token_id, gamma,
                                                      targets)
    slots = block_size - 1
    if anchors.shape[1] == 0:
        zero = torch.zeros(slots, dtype=torch.long, device=ids.device)
        # Still through the parameters, so every rank's backward has a graph.
        loss = sum(p.sum() for p in model.trained_tensors().values()) * 0.0
        return DFlashOutput(loss, zero, zero.clone(), zero.clone(), zero.clone(), zero.new_zeros(()))
    hidden = model.blocks(batch["aux"], block_ids, anchors)
    ce, top = score(hidden[scored], model.lm_head.weight, wanted[scored], rows)
    w = weights[scored]
    loss = (ce * w).sum() / w.sum().clamp(min=torch.finfo(w.dtype).tiny)
    with torch.no_grad():
        hit = torch.zeros_like(scored)
        hit[scored] = top == wanted[scored]
        alive = (hit & scored)[:, :, 1:].long().cumprod(dim=-1).bool() & keep[:, :, None]
        through = scored[:, :, 1:].long().cumprod(dim=-1).bool() & keep[:, :, None]
        return DFlashOutput(loss, hit[:, :, 1:].sum((0, 1)), scored[:, :, 1:].sum((0, 1)), alive.sum((0, 1)),
                            through.sum((0, 1)), keep.sum())


def build_dflash(target_config: dict, embeddings: tuple[torch.Tensor, torch.Tensor], *, num_layers: int,
                 num_context: int, seed: int = 0, head_dim: int | None = None) -> DFlashDrafter:
    """A fresh drafter: random layers (the target's initializer_range), the
    target's embedding and head (frozen)."""
    cfg = DFlashConfig.from_target(target_config, num_layers, num_context, head_dim)
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    std = target_config.get("initializer_range", 0.02)
    for name, p in model.trained_tensors().items():
        if p.dim() == 2:
            nn.init.normal_(p, std=std)
    embed, head = embeddings
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
    return model

