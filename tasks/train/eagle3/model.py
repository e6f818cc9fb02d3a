"""The EAGLE-3 drafter, in the layouts SGLang serves (`LlamaForCausalLMEagle3`;
`Eagle3DeepseekV2ForCausalLM` with attention "mla"), and its forward: the
computation SGLang serves, step by step.

    fc          [H, N*H]   the target's N aux states (three for EAGLE-3), concatenated
    midlayer    one decoder layer whose attention takes 2H inputs: the
                normed token embedding concatenated with the normed hidden
                state (input_layernorm, hidden_norm); residual = the hidden
                state entering the layer. Its attention is a Llama layer's
                (q/k/v, grouped KV heads) or DeepSeek-V2's multi-latent one
                (`MLAMidLayer`); the MLP is a SiLU one either way
    norm        final RMSNorm
    lm_head     [N, H]     over the draft vocabulary
    d2t, t2d    draft id j is target id j + d2t[j]; t2d[t] marks target ids
                in the draft vocabulary

Variants (`VARIANTS`, the two flags SGLang's class reads from config.json):
eagle3 as above; eagle3.1 adds `fc_norm` (one RMSNorm per aux state before
fc) and `norm_output` (a draft decode step is fed the previous step's normed
output, the one lm_head scores, instead of its pre-norm one). The capture is
the same for both.

The token embeddings are the target's (frozen here; SGLang shares the
target's at serving time). `Eagle3Drafter.step` mirrors SGLang's
`llama_eagle3.LlamaDecoderLayer.forward` (and `kimi_k25_eagle3`'s
`Eagle3MLADecoderLayer`), so what is trained is what is served;
tests/test_drafter_in_sglang.py checks the exported weights load into
SGLang's own classes and compute the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tasks.target.embeddings import load_target_embeddings
from tasks.train.eagle3.gqa import MidLayer
from tasks.train.eagle3.mla import MLA_DIMS, MLAMidLayer, mla_config
from tasks.train.layers.decoder_layer import RMSNorm
from tasks.train.layers.gpu_kernels import check_gqa_heads
from tasks.train.layers.rope import check_gqa_rope, gqa_rotary, mla_rotary, mla_softmax_scale
from tasks.train.layers.sizes import LayerSizes, target_sizes
from tasks.train.vocab import DraftVocab


def _prefix_block(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, valid: torch.Tensor,
                  start: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the queries at positions start.. to the step-0 keys,
    grouped by KV head so the keys are never repeated: q [B, kv, rep, m, d],
    k0 [B, kv, n, d], v0 [B, kv, n, dv]. Returns the normalised output
    [B, kv, rep, m, dv] and the fp32 log-sum-exp [B, kv, rep, m] (-inf where
    no key is allowed)."""
    b, kv, rep, m, d = q.shape
    end = start + m  # keys past the block's last query are masked anyway
    k0, v0 = k0[:, :, :end], v0[:, :, :end]
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax in fp32 at least
    scores = (q.reshape(b, kv, rep * m, d) @ k0.transpose(-1, -2)).to(acc).view(b, kv, rep, m, end) * scale
    rows = torch.arange(start, end, device=q.device)
    allowed = (torch.arange(end, device=q.device)[None, :] <= rows[:, None])[None] & valid[:, None, :end]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0)[..., None]).to(v0.dtype)
    out = (p.view(b, kv, rep * m, end) @ v0).view(b, kv, rep, m, v0.shape[-1])
    return out, lse


# Above this many bytes of fp32 scores per TTT step ([B, h, L, L]), the
# prefix attention's blocks are checkpointed; below it keeping them costs
# little memory and recomputing them costs time (a fifth of a small
# drafter's training step on a CPU).
CHECKPOINT_ABOVE_BYTES = 256 * 2**20


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  valid: torch.Tensor, block: int = 512, scale: float | None = None,
                  checkpoint_above: int | None = None) -> torch.Tensor:
    """Step-k attention: the causal prefix of step-0 keys, plus the diagonal
    (same position) keys of steps 1..k. q [B, h, L, d]; keys [B, kv_heads, L,
    d]; values [B, kv_heads, L, dv] (MLA's dv differs from d); valid [B, L];
    scale: the softmax's, d^-0.5 unless given (MLA's carries YaRN's mscale).

    Memory-linear: the prefix part runs over blocks of `block` queries, each
    under activation checkpointing once the scores pass `checkpoint_above`
    bytes (CHECKPOINT_ABOVE_BYTES unless given), so backward keeps only its
    output and log-sum-exp ([B, h, L] per step) and recomputes one block's
    scores at a time, instead of keeping fp32 [B, h, L, L] per TTT step (8k
    tokens x 64 heads x 7 steps do not fit any GPU). The diagonal terms are merged with the prefix by log-sum-exp,
    which is exactly one softmax over both."""
    b, heads, n, d = q.shape
    kv = keys[0].shape[1]
    scale = d ** -0.5 if scale is None else scale
    qg = q.reshape(b, kv, heads // kv, n, d)
    above = CHECKPOINT_ABOVE_BYTES if checkpoint_above is None else checkpoint_above
    recompute = torch.is_grad_enabled() and b * heads * n * n * 4 > above
    outs, lses = [], []
    for start in range(0, n, block):
        args = (qg[:, :, :, start:start + block], keys[0], values[0], valid, start, scale)
        if recompute:
            o, s = checkpoint(_prefix_block, *args, use_reentrant=False)
        else:
            o, s = _prefix_block(*args)
        outs.append(o)
        lses.append(s)
    prefix, prefix_lse = torch.cat(outs, dim=3), torch.cat(lses, dim=3)
    acc = torch.promote_types(q.dtype, torch.float32)
    diag = [(qg * k[:, :, None]).sum(-1).to(acc) * scale for k in keys[1:]]  # [B, kv, rep, L] each
    total = torch.logsumexp(torch.stack([prefix_lse, *diag]), dim=0)
    out = torch.exp(prefix_lse - total)[..., None] * prefix.to(acc)
    for s, v in zip(diag, values[1:]):
        out = out + torch.exp(s - total)[..., None] * v[:, :, None].to(acc)
    return out.to(q.dtype).view(b, heads, n, values[0].shape[-1])


# What each drafter variant sets in SGLang 0.5.23's LlamaForCausalLMEagle3
# (llama_eagle3.py reads both from the drafter's config.json).
VARIANTS = {
    "eagle3": {"fc_norm": False, "norm_output": False},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
}


def variant_flags(variant: str) -> dict:
    if variant not in VARIANTS:
        raise ValueError(f"drafter variant {variant!r}: SGLang serves {', '.join(VARIANTS)}")
    return dict(VARIANTS[variant])


def variant_named(**flags: bool) -> str:
    """The variant these flags make, or ValueError naming the flags."""
    for name, want in VARIANTS.items():
        if flags == want:
            return name
    raise ValueError(f"drafter config with {flags}: not a variant this project trains ({', '.join(VARIANTS)})")


@dataclass(frozen=True)
class DrafterConfig(LayerSizes):
    draft_vocab_size: int
    num_aux: int = 3
    fc_norm: bool = False
    norm_output: bool = False
    # "gqa": a Llama layer (LlamaForCausalLMEagle3); "mla": DeepSeek-V2's
    # multi-latent attention (Eagle3DeepseekV2ForCausalLM), with these dims.
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True

    @classmethod
    def from_target(cls, target_config: dict, draft_vocab_size: int, num_aux: int = 3,
                    variant: str = "eagle3", attention: str = "gqa",
                    mla_dims: dict | None = None, head_dim: int | None = None) -> "DrafterConfig":
        if target_config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"the drafter's MLP uses SiLU; the target uses {target_config['hidden_act']}")
        if attention not in ("gqa", "mla"):
            raise ValueError(f"drafter attention {attention!r}: gqa or mla")
        mla = mla_config(target_config, mla_dims or {}) if attention == "mla" else {}
        # MLA's heads all carry their own keys and values.
        kv_heads = target_config["num_attention_heads"] if attention == "mla" else None
        sizes = LayerSizes.of(target_config, kv_heads, head_dim, whole_heads=attention == "gqa")
        if attention == "gqa":
            check_gqa_heads(sizes["num_attention_heads"], sizes["num_key_value_heads"], sizes["head_dim"],
                            target_config, "an EAGLE-3 drafter")
            check_gqa_rope(target_config, sizes["head_dim"])
        return cls(**sizes, draft_vocab_size=draft_vocab_size, num_aux=num_aux, attention=attention, **mla,
                   **variant_flags(variant))

    @property
    def variant(self) -> str:
        return variant_named(fc_norm=self.fc_norm, norm_output=self.norm_output)

    @property
    def mla_dims(self) -> dict:
        return {k: getattr(self, k) for k in MLA_DIMS} if self.attention == "mla" else {}


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, target_config: dict):
        super().__init__()
        self.cfg = cfg
        self.target_config = dict(target_config)
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc_norm = nn.ModuleList([RMSNorm(h, cfg.rms_norm_eps) for _ in range(cfg.num_aux)]) if cfg.fc_norm else None
        self.fc = nn.Linear(cfg.num_aux * h, h, bias=False)
        if cfg.attention == "mla":
            self.midlayer = MLAMidLayer(cfg, mla_softmax_scale(target_config,
                                                               cfg.qk_nope_head_dim + cfg.qk_rope_head_dim))
            self.rotary = mla_rotary(target_config, cfg.qk_rope_head_dim, cfg.rope_interleave)
        else:
            self.midlayer = MidLayer(cfg)
            self.rotary = gqa_rotary(target_config, cfg.head_dim)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def set_vocab(self, vocab: DraftVocab) -> None:
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [B, L, num_aux * H], concatenated in layer
        order, to the hidden state the first draft step takes in."""
        if self.fc_norm is not None:
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, aux.chunk(self.cfg.num_aux, dim=-1))],
                            dim=-1)
        return self.fc(aux)

    def step(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             keys: list[torch.Tensor], values: list[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
        """One draft step, as SGLang serves it: the embedding of the token
        each position has just seen (`next_ids` [B, L]) with the hidden state
        it carries (`hidden` [B, L, H]: `project` of the target's aux states
        at step 0, `readout`'s feedback of the step before after), through
        the decoder layer. Step k
        attends to the step-0 keys of the causal prefix and to its own chain
        (steps 1..k at the same position); this step's keys and values are
        appended to `keys`/`values`. Returns the layer's pre-norm output
        (`readout` scores it and says what the next step takes in)."""
        q, k, v = self.midlayer.qkv(self.embed_tokens(next_ids), hidden, positions, self.rotary)
        keys.append(k)
        values.append(v)
        return self.midlayer.finish(ttt_attention(q, keys, values, valid, scale=self.midlayer.scale), hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores over the draft vocabulary of a step's output."""
        return self.lm_head(self.norm(hidden))

    def readout(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's pre-norm output -> (its scores over the draft vocabulary,
        the hidden state the next step is fed: the pre-norm output, or with
        norm_output the normed one lm_head reads)."""
        normed = self.norm(out)
        return self.lm_head(normed), normed if self.cfg.norm_output else out

    # Not trained, not checkpointed, not exported: the target's embedding
    # (SGLang shares the target's) and the rope's tables.
    FROZEN = ("embed_tokens.", "rotary.")

    def trainable_state(self) -> dict:
        """Everything but the frozen target embeddings."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(self.FROZEN)}

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        """The trained parameters and the vocabulary maps, as the module holds
        them now: under FSDP2 between `unshard` and `reshard` these are the
        whole tensors, where `state_dict()` would give the shards."""
        named = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        return {k: v for k, v in named.items() if not k.startswith(self.FROZEN)}


def build_drafter(target_path: Path, vocab: DraftVocab, *, seed: int = 0, num_aux: int = 3,
                  variant: str = "eagle3", attention: str = "gqa", mla_dims: dict | None = None,
                  head_dim: int | None = None,
                  embeddings: tuple[torch.Tensor, torch.Tensor] | None = None) -> Eagle3Drafter:
    """A fresh drafter: random layers, the target's embeddings (frozen), and
    lm_head rows copied from the target's for the draft vocabulary (a far
    better start than random: step 0 then starts near the target's own head).
    `embeddings`: the target's (embed, head) if the caller has read them
    already (for a large target they are gigabytes)."""
    target_config = target_sizes(target_path)
    cfg = DrafterConfig.from_target(target_config, vocab.size, num_aux, variant, attention, mla_dims, head_dim)
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg, target_config)
    std = target_config.get("initializer_range", 0.02)
    for name, p in model.named_parameters():
        if p.dim() == 2 and not name.startswith("embed_tokens"):
            nn.init.normal_(p, std=std)
    embed, head = embeddings if embeddings is not None else load_target_embeddings(target_path)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head[torch.from_numpy(vocab.target_ids)])
    model.set_vocab(vocab)
    return model
