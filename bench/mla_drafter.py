"""The two drafter layouts at Kimi-K2.5's dimensions, in one run: the Llama
layout (train.attention gqa, SGLang's LlamaForCausalLMEagle3) against MLA
(train.attention mla, Eagle3DeepseekV2ForCausalLM), each as this project
builds it for a Kimi-K2.5 target (its config.json's text sizes below).

    python bench/mla_drafter.py [--positions 256] [--repeats 3]

Computed: each layer's parameters; the draft KV cache per token and per
request at a served context (bf16), which at high concurrency and long
contexts bounds how many requests a server holds; the bytes a draft decode
step reads from that cache per token of context (decode is bound by them).
Measured on this machine: one draft step (our TTT step, `Eagle3Drafter.step`,
forward, fp32) over --positions positions of one sequence, the fastest of
--repeats, each layout in turn in this process. The drafters are random:
cost depends on shapes, not weights. Embedding and draft head are shrunk to
1024 rows (a lookup and the head are the same for both layouts and left out
of the step).
"""
from __future__ import annotations

import argparse
import time

import torch

from tasks.train.eagle3.model import DrafterConfig, Eagle3Drafter

# Kimi-K2.5's text model (config.json text_config): its sizes and MLA dims;
# a YaRN rope of its kind (the rope's values change none of the figures).
KIMI_K25 = dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, intermediate_size=18432,
                rms_norm_eps=1e-6, hidden_act="silu", vocab_size=1024, max_position_embeddings=131_072,
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                rope_interleave=True,
                rope_parameters={"rope_type": "yarn", "rope_theta": 50_000.0, "factor": 32.0,
                                 "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0,
                                 "mscale": 1.0, "mscale_all_dim": 1.0})
BF16 = 2


def build(attention: str) -> Eagle3Drafter:
    cfg = DrafterConfig.from_target(KIMI_K25, draft_vocab_size=1024, attention=attention)
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg, KIMI_K25)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(std=0.02)
    return model.eval()


def kv_bytes_per_token(cfg: DrafterConfig) -> int:
    """What SGLang's draft KV pool holds per token: MLA one latent and one
    rope key (MLATokenToKVPool), GQA a key and a value per KV head."""
    if cfg.attention == "mla":
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * BF16
    return 2 * cfg.num_key_value_heads * cfg.head_dim * BF16


def layer_params(model: Eagle3Drafter) -> int:
    return sum(p.numel() for p in model.midlayer.parameters())


def step_seconds(model: Eagle3Drafter, positions: int, repeats: int) -> float:
    h = model.cfg.hidden_size
    ids = torch.randint(0, 1024, (1, positions))
    hidden = torch.randn(1, positions, h)
    pos = torch.arange(positions)[None]
    valid = torch.ones(1, positions, dtype=torch.bool)
    best = float("inf")
    with torch.no_grad():
        model.step(ids, hidden, pos, [], [], valid)  # warm-up: lazily loaded kernels
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.step(ids, hidden, pos, [], [], valid)
            best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=32_768, help="served context for the per-request cache")
    args = parser.parse_args()
    rows = {}
    for attention in ("gqa", "mla"):
        model = build(attention)
        rows[attention] = {"params": layer_params(model), "kv": kv_bytes_per_token(model.cfg),
                           "step": step_seconds(model, args.positions, args.repeats)}
        del model
    print(f"Kimi-K2.5 drafters (H 7168, 64 heads), draft step over {args.positions} positions, fp32, "
          f"{torch.get_num_threads()} threads")
    print(f"{'':42s} {'gqa':>12s} {'mla':>12s} {'gqa/mla':>8s}")
    table = [("decoder layer parameters (M)", lambda r: r["params"] / 1e6),
             ("draft KV cache per token (bytes, bf16)", lambda r: r["kv"]),
             (f"draft KV cache per request at {args.context:,} (MiB)", lambda r: r["kv"] * args.context / 2 ** 20),
             ("draft step, measured (s)", lambda r: r["step"])]
    for label, value in table:
        g, m = value(rows["gqa"]), value(rows["mla"])
        print(f"{label:42s} {g:12,.2f} {m:12,.2f} {g / m:8.2f}")


if __name__ == "__main__":
    main()
