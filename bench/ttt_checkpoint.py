"""What checkpointing the TTT attention's prefix blocks costs in time where
its scores are small, in one run: a training step (TTT forward + backward)
of a small drafter with every block checkpointed against none.

    python bench/ttt_checkpoint.py [--length 1024] [--batch 4] [--steps 20]

Both variants run interleaved on the same batch, the fastest of `--steps`
each (this machine is shared and noisy). Printed: seconds per step and the
ratio checkpointed/kept, the time training saves below
tasks/train/eagle3/model.py CHECKPOINT_ABOVE_BYTES, and the scores' size there.
"""
from __future__ import annotations

import argparse
import time

import torch

from tasks.train.eagle3.model import CHECKPOINT_ABOVE_BYTES, ttt_attention


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--depth", type=int, default=3, help="TTT steps: keys and values of steps 1..depth-1")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    b, n = args.batch, args.length
    q = torch.randn(b, args.heads, n, args.head_dim, requires_grad=True)
    keys = [torch.randn(b, args.kv_heads, n, args.head_dim, requires_grad=True) for _ in range(args.depth)]
    values = [torch.randn(b, args.kv_heads, n, args.head_dim, requires_grad=True) for _ in range(args.depth)]
    valid = torch.ones(b, n, dtype=torch.bool)
    best = {"checkpointed": float("inf"), "kept": float("inf")}
    for _ in range(args.steps):
        for name, above in (("checkpointed", 0), ("kept", 2**62)):
            t0 = time.perf_counter()
            ttt_attention(q, keys, values, valid, checkpoint_above=above).square().sum().backward()
            best[name] = min(best[name], time.perf_counter() - t0)
    scores = b * args.heads * n * n * 4
    print(f"B {b}, {args.heads} heads, L {n}: fp32 scores {scores / 2**20:.0f} MiB per TTT step "
          f"(checkpointed above {CHECKPOINT_ABOVE_BYTES / 2**20:.0f} MiB)")
    print(f"checkpointed {best['checkpointed'] * 1e3:.1f} ms, kept {best['kept'] * 1e3:.1f} ms per step: "
          f"ratio {best['checkpointed'] / best['kept']:.2f}")


if __name__ == "__main__":
    main()
