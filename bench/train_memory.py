"""Peak memory of one training step (TTT forward + backward) against sequence
length, the dense TTT attention this project had against the blockwise one
it has now, in one run; then what a Kimi-shaped drafter needs.

    python bench/train_memory.py [--lengths 512 1024 2048 4096 8192] [--dense-max 2048]

Each measurement runs in a fresh process: build the drafter and a random
batch, run a short step (so lazily loaded kernels are in the baseline), read
the resident set size (RSS), run the step, read the peak RSS (`ru_maxrss`);
the figure is peak minus before. RSS rather than torch's allocator
statistics because the CPU has no caching allocator to ask, because it
counts everything the step holds (autograd's saved tensors, oneDNN scratch,
the gradients) and because it is what the kernel kills a process for. glibc
is told to map every block of 64 KiB or more on its own (by default its
threshold rises with what was freed, and freed memory then stays resident),
and a fresh process per measurement keeps one run's heap from hiding the
next one's. On a GPU the same figure is `torch.cuda.max_memory_allocated`
minus allocated before.

The dense attention keeps fp32 [B, heads, n, n] scores per TTT step for
backward, so its step grows with n^2; lengths above --dense-max are not run
but predicted (the blockwise step plus the dense one's excess at the longest
length it ran, x (n/n0)^2), because they would not fit beside other work on
this machine. Printed: MiB per length, the ratio dense/blockwise, and the
step time ratio (the blockwise attention recomputes its scores in backward).

The Kimi-shaped drafter (H 7168, 64 heads, 8 KV heads, head_dim 128,
intermediate 18432, draft vocab 32k, target vocab 163,840) at n=2048, K=7 is
computed, not run: its parameters, gradients, optimizer state and frozen
matrices exactly, its activations from a count of what each TTT step keeps
per token (`activation_bytes_per_token_step`), calibrated by the small
drafter's measured slope against the same count. Running it needs more
memory than this machine has (see the output).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

import tasks.train.eagle3.model as drafter_module
from tasks.train.eagle3.model import DrafterConfig, Eagle3Drafter
from tasks.train.layers.rope import gqa_rotary
from tasks.train.eagle3.ttt import ttt_forward

GIB, MIB = 1 << 30, 1 << 20
SMALL = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=768,
             vocab_size=4096, draft_vocab_size=1024)
KIMI = dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=18432,
            vocab_size=163_840, draft_vocab_size=32_768)
# A Llama-3.1-8B target's drafter: the size most users train first.
LLAMA_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                vocab_size=128_256, draft_vocab_size=32_000)
SHAPES = {"small": SMALL, "llama-8b": LLAMA_8B, "kimi": KIMI}


def dense_ttt_attention(q, keys, values, valid, block=None, scale=None):
    """The implementation before the blockwise one (as in tests/test_drafter.py)."""
    def rep(x):
        return x.repeat_interleave(q.shape[1] // x.shape[1], dim=1)

    n, d = q.shape[2], q.shape[3]
    scale = d ** -0.5 if scale is None else scale
    k0, v0 = rep(keys[0]), rep(values[0])
    scores = (q @ k0.transpose(-1, -2)) * scale
    allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None, None] & valid[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    diag = [((q * rep(k)).sum(-1, keepdim=True)) * scale for k in keys[1:]]
    p = torch.softmax(torch.cat([scores, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = p[..., :n] @ v0
    for j, v in enumerate(values[1:]):
        out = out + p[..., n + j:n + j + 1] * rep(v)
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def build(shape: dict, device: torch.device) -> Eagle3Drafter:
    """A randomly initialised drafter of `shape`, built on the meta device and
    materialised once (no second copy); the frozen embeddings in bf16, as the
    target stores them."""
    cfg = DrafterConfig(rms_norm_eps=1e-5, **shape)
    target_config = {k: v for k, v in shape.items() if k != "draft_vocab_size"}
    target_config.update(rms_norm_eps=1e-5, rope_theta=50_000.0, max_position_embeddings=16_384,
                         num_hidden_layers=61, hidden_act="silu")
    with torch.device("meta"):
        model = Eagle3Drafter(cfg, target_config)
        model.embed_tokens.weight = torch.nn.Parameter(model.embed_tokens.weight.bfloat16(), requires_grad=False)
    model = model.to_empty(device=device)
    model.rotary = gqa_rotary(target_config, cfg.head_dim).to(device)  # its tables, built where they live
    with torch.no_grad():
        for name, p in model.named_parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() == 2 else p.fill_(1.0)
        model.d2t.zero_()
        model.t2d.zero_()
        model.t2d[:cfg.draft_vocab_size] = True
    return model


def random_batch(shape: dict, length: int, device: torch.device) -> dict:
    """One sample of `length` tokens as the loader collates it, the target's states random bf16."""
    h = shape["hidden_size"]
    return {"input_ids": torch.randint(0, shape["vocab_size"], (1, length), device=device),
            "loss_mask": torch.ones(1, length, dtype=torch.bool, device=device),
            "lengths": torch.tensor([length], device=device),
            "aux": torch.randn(1, length, 3 * h, device=device, dtype=torch.bfloat16),
            "final": torch.randn(1, length, h, device=device, dtype=torch.bfloat16)}


def measure(shape: dict, n: int, steps: int, attention: str, device: str, repeats: int, bf16: bool = False) -> dict:
    """TTT forward + backward in this process: extra peak memory, seconds (the
    fastest of `repeats`: this machine is shared and noisy). `bf16`: under
    bf16 autocast with fp32 weights, as training runs on a GPU."""
    dev = torch.device(device)
    torch.manual_seed(0)
    if attention == "dense":
        drafter_module.ttt_attention = dense_ttt_attention  # Eagle3Drafter.step looks it up at call time
    else:  # the memory-linear path at every length (training takes it above CHECKPOINT_ABOVE_BYTES only)
        drafter_module.CHECKPOINT_ABOVE_BYTES = 0
    model = build(shape, dev)
    h = shape["hidden_size"]
    head_rows = torch.randn(shape["draft_vocab_size"], h, device=dev) * 0.02

    def step(b: dict) -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = ttt_forward(model, b, head_rows, steps=steps, decay=0.8).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    # A short step first, so the kernels' lazily loaded code and buffers are in the baseline.
    step(random_batch(shape, 16, dev))
    batch = random_batch(shape, n, dev)
    if dev.type == "cuda":
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = _rss()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(batch)
        seconds.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_mib": (peak - before) / MIB, "seconds": min(seconds),
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}


# This checkout's tasks/ (not another install's); glibc told to map every
# block of 64 KiB or more on its own and unmap it when freed (by default its
# threshold rises with what was freed, and freed memory then stays resident),
# so RSS follows what the step holds.
_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                     os.environ.get("PYTHONPATH", "")]),
        "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def in_fresh_process(n: int, steps: int, attention: str, device: str, repeats: int, shape: str = "small",
                     precision: str = "fp32") -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", str(n), str(steps), attention, device, str(repeats),
                          shape, precision], capture_output=True, text=True, env=_ENV)
    if out.returncode != 0:
        raise RuntimeError(f"measuring n={n} K={steps} {attention} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def sweep(lengths: list[int], steps: int, dense_max: int, device: str, repeats: int) -> tuple[float, float]:
    """Prints the table; returns what the blockwise step keeps per token and
    TTT step (bytes, from the two longest lengths) and how many fp32 [heads,
    n, n] tensors per TTT step the dense attention keeps beyond it (at the
    longest length it ran at)."""
    print(f"one TTT step (forward + backward), K={steps}, B=1, {SMALL}, device {device}")
    print(f"{'n':>6} {'dense MiB':>11} {'blockwise MiB':>14} {'dense/blockwise':>16} {'time dense/blockwise':>21}")
    last_dense, blockwise = None, []
    for n in lengths:
        new = in_fresh_process(n, steps, "blockwise", device, repeats)
        blockwise.append((n, new["peak_mib"]))
        if n <= dense_max:
            old = in_fresh_process(n, steps, "dense", device, repeats)
            last_dense = (n, old["peak_mib"] - new["peak_mib"])
            dense, note, t = old["peak_mib"], "", f"{old['seconds'] / new['seconds']:21.2f}"
        else:  # what the blockwise step holds, plus the dense one's excess grown as n^2
            n0, excess = last_dense
            dense, note, t = new["peak_mib"] + excess * (n / n0) ** 2, " (predicted)", f"{'-':>21}"
        print(f"{n:>6} {dense:>11,.0f} {new['peak_mib']:>14,.0f} {dense / new['peak_mib']:>16.1f}{t}{note}")
    n0, excess = last_dense
    per_step = excess * MIB / (4 * SMALL["num_attention_heads"] * n0 ** 2 * steps)
    (n1, m1), (n2, m2) = blockwise[-2:]
    per_token_step = (m2 - m1) * MIB / ((n2 - n1) * steps)
    print(f"dense attention's excess at n={n0}: {per_step:.1f} fp32 [heads, n, n] tensors per TTT step; "
          f"blockwise: {per_token_step / 1024:.1f} KiB per token and TTT step (n={n1}..{n2})")
    return per_token_step, per_step


def activation_bytes_per_token_step(shape: dict) -> int:
    """What one TTT step keeps for backward per token, fp32, counted from the
    code: the two input norms and their concatenation (6H), q after rotary,
    the attention's prefix output, merge and o_proj input (4 x heads x d), k
    and v (2 x kv x d), o_proj/residual and the post-attention norm (3H), the
    MLP (gate, silu, up, product: 4I), the residual and final norm (4H), and
    the loss (log-softmax and the shifted target distribution: 2 x draft
    vocab)."""
    h, i, vd = shape["hidden_size"], shape["intermediate_size"], shape["draft_vocab_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    return 4 * (13 * h + 4 * q + 2 * kv + 4 * i + 2 * vd)


def kimi(per_token_step: float, dense_per_step: float, n: int = 2048, steps: int = 7) -> None:
    """What a Kimi-shaped drafter needs for one step at n tokens and K steps:
    the fixed parts exactly, the activations from the count above scaled by
    what the small drafter measured against the same count."""
    cfg = DrafterConfig(rms_norm_eps=1e-5, **KIMI)
    h, v, d = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    params = 3 * h * h + 2 * h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size \
        + cfg.draft_vocab_size * h + 4 * h
    calibration = per_token_step / activation_bytes_per_token_step(SMALL)
    activations = calibration * activation_bytes_per_token_step(KIMI) * n * steps
    weights, grads, adam = 4 * params, 4 * params, 8 * params
    frozen_bf16 = 2 * 2 * v * h  # embeddings and the full-vocabulary head (for the target's greedy token)
    dense = dense_per_step * steps * 4 * cfg.num_attention_heads * n ** 2
    print(f"\nKimi-shaped drafter {KIMI}, n={n}, K={steps}, B=1 (computed):")
    print(f"  small drafter: measured {per_token_step / 1024:.1f} KiB kept per token and TTT step, counted "
          f"{activation_bytes_per_token_step(SMALL) / 1024:.1f} (x{calibration:.2f}); Kimi-shaped: counted "
          f"{activation_bytes_per_token_step(KIMI) / MIB:.2f} MiB, x{calibration:.2f}")
    print(f"  trainable {params / 1e9:.2f} B params: weights {weights / GIB:.1f} GiB, gradients {grads / GIB:.1f}, "
          f"AdamW {adam / GIB:.1f}; frozen embeddings + full head {frozen_bf16 / GIB:.1f} in bf16 "
          f"({2 * frozen_bf16 / GIB:.1f} in fp32, as on a CPU); activations {activations / GIB:.1f}")
    step = weights + grads + frozen_bf16 + activations
    print(f"  forward + backward: {step / GIB:.0f} GiB with bf16 frozen matrices, {(step + frozen_bf16) / GIB:.0f} "
          f"in fp32; + AdamW: {(step + adam) / GIB:.0f} / {(step + frozen_bf16 + adam) / GIB:.0f} GiB. "
          f"This machine: {_mem_total() / GIB:.0f} GiB in all")
    print(f"  the dense attention would keep {dense / GIB:.0f} GiB more ({dense_per_step:.1f} fp32 "
          f"[{cfg.num_attention_heads}, n, n] per step, as measured above)")


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--dense-max", type=int, default=2048, help="longest length the dense attention runs at")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3, help="steps timed per measurement (the fastest counts)")
    ap.add_argument("--one", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        n, k, attention, device, repeats, shape, precision = args.one
        print(json.dumps(measure(SHAPES[shape], int(n), int(k), attention, device, int(repeats), precision == "bf16")))
        return
    per_token_step, dense_per_step = sweep(args.lengths, args.ttt_steps, args.dense_max, args.device, args.repeats)
    kimi(per_token_step, dense_per_step)


if __name__ == "__main__":
    main()
