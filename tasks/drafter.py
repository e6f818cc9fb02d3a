"""The EAGLE-3 drafter, in the layout SGLang serves (`LlamaForCausalLMEagle3`).

    fc          [H, 3H]    the three aux states of the target, concatenated
    midlayer    one Llama decoder layer whose q/k/v take 2H inputs: the
                normed token embedding concatenated with the normed hidden
                state (input_layernorm, hidden_norm); residual = the hidden
                state entering the layer
    norm        final RMSNorm
    lm_head     [N, H]     over the draft vocabulary
    d2t, t2d    draft id j is target id j + d2t[j]; t2d[t] marks target ids
                in the draft vocabulary

The token embeddings are the target's (frozen here; SGLang shares the
target's at serving time). The forward below mirrors SGLang's
`llama_eagle3.LlamaDecoderLayer.forward` step by step, so what is trained is
what is served; `tests/test_drafter.py` checks the exported weights load into
SGLang's own class with the same values.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tasks.layers import AuxLayers

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Target config keys the drafter must share so SGLang builds the same shapes,
# rotary embedding and activation.
_SHARED_CONFIG_KEYS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_parameters", "rope_theta",
    "rope_scaling", "attention_bias", "mlp_bias", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id",
)


# ------------------------------------------------------------- draft vocabulary

@dataclass(frozen=True)
class DraftVocab:
    """The N target ids the drafter can propose, ascending."""
    target_ids: np.ndarray  # int64 [N]
    vocab_size: int  # the target's

    @property
    def size(self) -> int:
        return len(self.target_ids)

    @property
    def d2t(self) -> torch.Tensor:
        return torch.from_numpy(self.target_ids - np.arange(self.size)).long()

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[torch.from_numpy(self.target_ids)] = True
        return mask

    @classmethod
    def from_counts(cls, counts: np.ndarray, size: int) -> "DraftVocab":
        """The `size` most frequent ids; ties, and ids never seen, by id, so
        the choice is deterministic."""
        size = min(size, len(counts))
        order = np.lexsort((np.arange(len(counts)), -counts))  # count desc, then id asc
        return cls(np.sort(order[:size]).astype(np.int64), len(counts))

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int) -> "DraftVocab":
        return cls((d2t.long() + torch.arange(len(d2t))).numpy(), vocab_size)


def count_target_tokens(samples, head: torch.Tensor, max_tokens: int | None = None) -> np.ndarray:
    """How often each target id is the target's greedy next token at a
    loss-masked position: the tokens the drafter must be able to propose.
    `samples` yield dicts with `loss_mask` and `final_hidden_state`; the
    target's greedy token at position j (final state j through its lm_head)
    predicts token j+1, which counts if it is loss-masked. On data the target
    answered itself these are the data's own tokens; on other data they are
    not, which is why the data tokens are not counted. Stops after
    `max_tokens` counted positions (a frequency estimate needs no more)."""
    counts = np.zeros(head.shape[0], dtype=np.int64)
    for s in samples:
        mask = torch.as_tensor(np.asarray(s["loss_mask"]), dtype=torch.bool)[1:]
        final = s["final_hidden_state"][:-1][mask]
        if len(final):
            top = (final.to(head.dtype) @ head.T).argmax(-1)
            counts += np.bincount(top.numpy(), minlength=len(counts))
        if max_tokens is not None and counts.sum() >= max_tokens:
            break
    return counts


# ------------------------------------------------------------------------ model

@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    num_aux: int = 3

    @classmethod
    def from_target(cls, target_config: dict, draft_vocab_size: int, num_aux: int = 3) -> "DrafterConfig":
        if target_config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"the drafter is a Llama layer with SiLU; the target uses {target_config['hidden_act']}")
        heads = target_config["num_attention_heads"]
        return cls(
            hidden_size=target_config["hidden_size"], num_attention_heads=heads,
            num_key_value_heads=target_config.get("num_key_value_heads", heads),
            head_dim=target_config.get("head_dim") or target_config["hidden_size"] // heads,
            intermediate_size=target_config["intermediate_size"], rms_norm_eps=target_config["rms_norm_eps"],
            vocab_size=target_config["vocab_size"], draft_vocab_size=draft_vocab_size, num_aux=num_aux,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """The target's rotary embedding (any rope type transformers knows), so
    positions mean the same to the drafter as to SGLang's draft layer."""

    def __init__(self, target_config: dict):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rope = LlamaRotaryEmbedding(LlamaConfig(**target_config))

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        # q, k: [B, heads, L, d]; positions: [B, L]
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cos, sin = self.rope(q, positions)
        return apply_rotary_pos_emb(q, k, cos, sin)


class MidLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor):
        """[B, L, H] each -> q [B, heads, L, d], k, v [B, kv_heads, L, d]."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        b, n, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, n, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, -1, d).transpose(1, 2)
        return q, k, v

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn [B, heads, L, d] -> the layer's pre-norm output (SGLang's
        `hidden + residual` after the MLP), what the next draft step takes in."""
        b, _, n, _ = attn.shape
        residual = self.o_proj(attn.transpose(1, 2).reshape(b, n, -1)) + residual
        x = self.post_attention_layernorm(residual)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) + residual


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, target_config: dict):
        super().__init__()
        self.cfg = cfg
        self.target_config = dict(target_config)
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.num_aux * h, h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(target_config)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def set_vocab(self, vocab: DraftVocab) -> None:
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def trainable_state(self) -> dict:
        """Everything but the frozen target embeddings."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens.", "rotary."))}


def build_drafter(target_path: Path, vocab: DraftVocab, *, seed: int = 0, num_aux: int = 3,
                  embeddings: tuple[torch.Tensor, torch.Tensor] | None = None) -> Eagle3Drafter:
    """A fresh drafter: random layers, the target's embeddings (frozen), and
    lm_head rows copied from the target's for the draft vocabulary (a far
    better start than random: step 0 then starts near the target's own head).
    `embeddings`: the target's (embed, head) if the caller has read them
    already (for a large target they are gigabytes)."""
    target_config = json.loads((Path(target_path) / "config.json").read_text())
    cfg = DrafterConfig.from_target(target_config, vocab.size, num_aux)
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


def load_target_embeddings(target_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) in fp32, read from the target's
    safetensors without loading the rest; a tied target has no lm_head tensor,
    and its head is the embedding."""
    target_path = Path(target_path)
    found: dict[str, torch.Tensor] = {}
    wanted = {"model.embed_tokens.weight": "embed", "lm_head.weight": "head"}
    for file in sorted(target_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in wanted:
                    found[wanted[key]] = f.get_tensor(key).float()
    if "embed" not in found:
        raise FileNotFoundError(f"no model.embed_tokens.weight in {target_path}/*.safetensors: is it a Llama checkpoint?")
    config = json.loads((target_path / "config.json").read_text())
    if "head" not in found:
        if not config.get("tie_word_embeddings", False):
            raise FileNotFoundError(f"{target_path} has no lm_head.weight and does not tie its embeddings")
        found["head"] = found["embed"]
    return found["embed"], found["head"]


# ----------------------------------------------------------------------- export

def export_weights(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """SGLang's names: it maps `midlayer` to `layers.0` and fuses q/k/v and
    gate/up itself; embeddings are not exported (served from the target)."""
    m = model.midlayer
    out = {
        "fc.weight": model.fc.weight,
        "norm.weight": model.norm.weight,
        "lm_head.weight": model.lm_head.weight,
        "d2t": model.d2t,
        "t2d": model.t2d,
    }
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[f"midlayer.self_attn.{name}.weight"] = getattr(m, name).weight
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[f"midlayer.mlp.{name}.weight"] = getattr(m, name).weight
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"midlayer.{name}.weight"] = getattr(m, name).weight
    return out


def export_config(model: Eagle3Drafter, layers: AuxLayers, dtype: torch.dtype) -> dict:
    config = {k: model.target_config[k] for k in _SHARED_CONFIG_KEYS if k in model.target_config}
    config.update({
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "draft_vocab_size": model.cfg.draft_vocab_size,
        # SGLang would otherwise make lm_head the (full-vocab) embedding.
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(layers.sglang_ids),
            "use_aux_hidden_state": True,
            # The same tensors in the other conventions, for readers of vLLM/EAGLE.
            "hf_hidden_state_indices": list(layers.hf_hidden_state_indices),
        },
    })
    return config


def export_drafter(model: Eagle3Drafter, layers: AuxLayers, out_dir: Path, *,
                   dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors`, atomically (a temp dir renamed
    into place), loadable by `--speculative-draft-model-path out_dir`."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
               for k, v in export_weights(model).items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = export_config(model, layers, dtype)
    if extra:
        config["eagle3_training"] = extra
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def load_exported(out_dir: Path, target_path: Path) -> Eagle3Drafter:
    """Read an exported drafter back (embeddings from the target)."""
    out_dir = Path(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    target_config = json.loads((Path(target_path) / "config.json").read_text())
    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    vocab = DraftVocab.from_d2t(tensors["d2t"], config["vocab_size"])
    cfg = DrafterConfig.from_target(target_config, vocab.size, len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]))
    model = Eagle3Drafter(cfg, target_config)
    embed, _ = load_target_embeddings(target_path)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        names = export_weights(model)
        for k, p in names.items():
            p.copy_(tensors[k].to(p.dtype))
    return model


def export_random_drafter(target_model_path: Path, out_dir: Path, *, draft_vocab_size: int,
                          aux_layer_ids: Sequence[int] | None = None, seed: int = 0) -> Path:
    """An untrained drafter in the served layout (serving tests, baselines):
    the draft vocabulary is the lowest `draft_vocab_size` target ids."""
    target_config = json.loads((Path(target_model_path) / "config.json").read_text())
    vocab = DraftVocab.from_counts(np.zeros(target_config["vocab_size"], dtype=np.int64), draft_vocab_size)
    model = build_drafter(Path(target_model_path), vocab, seed=seed)
    layers = AuxLayers.for_model(target_config["num_hidden_layers"], aux_layer_ids)
    return export_drafter(model, layers, Path(out_dir))
