"""The GQA layout of the EAGLE-3 drafter's decoder layer: SGLang's
`LlamaForCausalLMEagle3` (llama_eagle3.py), a Llama layer whose q/k/v take
the 2H-wide input (the normed token embedding beside the normed hidden
state), rotated with the rope SGLang builds from the drafter's config
(tasks/train/layers/rope.py)."""
from __future__ import annotations

import torch
from torch import nn

from tasks.train.layers.decoder_layer import DecoderLayer


class MidLayer(DecoderLayer):
    def __init__(self, cfg):
        super().__init__(cfg)
        h, d = cfg.hidden_size, cfg.head_dim
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.add_mlp()

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, rotary: nn.Module):
        """[B, L, H] each -> q [B, heads, L, d], k, v [B, kv_heads, L, d],
        q and k rotated."""
        x = self.attention_input(embeds, hidden)
        b, n, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, n, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, -1, d).transpose(1, 2)
        q, k = rotary(q, k, positions)
        return q, k, v
