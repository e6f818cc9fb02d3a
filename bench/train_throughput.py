"""Training throughput, split into data loading and compute, in one run.

    python bench/train_throughput.py --store runs/demo/store [--steps 20]

(a) the loader alone: batches collated from the shards (slices through the
    store's reader, padding, bf16) as fast as it can, tokens/s;
(b) training: the same batches through TTT forward + backward + AdamW, with
    the loader prefetching in a thread; per step, the time spent waiting for
    data and the time computing.
Printed ratio a/b: how many times faster the loader is than training
consumes; it must stay >= 5 so the loader never bounds training.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from tasks.train.config import TrainConfig
from tasks.train.data import collate, plan_batches, prefetch
from tasks.train.prepare import prepare
from tasks.train.eagle3.ttt import TTT


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="runs/demo/store")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    args = ap.parse_args(argv)
    store = Path(args.store).resolve()
    cfg = TrainConfig(out_dir="/dev/null", ttt_steps=args.ttt_steps, tokens_per_batch=args.tokens_per_batch,
                      draft_vocab_size=args.draft_vocab_size)
    run = prepare(cfg, store)
    batches = plan_batches(run.reader.num_tokens, run.train_idx, cfg.tokens_per_batch, cfg.seed)[:args.steps]

    t0 = time.perf_counter()
    loaded = sum(int(collate(run.reader, b)["lengths"].sum()) for b in batches)
    load_s = time.perf_counter() - t0

    ttt = TTT(run.model)
    opt = torch.optim.AdamW([p for p in run.model.parameters() if p.requires_grad], lr=cfg.lr)
    wait = compute = 0.0
    trained = 0
    t_wait = time.perf_counter()
    for batch in prefetch(lambda b: collate(run.reader, b), batches):
        t1 = time.perf_counter()
        wait += t1 - t_wait
        batch = run.on_device(batch)
        out = ttt(batch, run.head_rows, cfg.ttt_steps, cfg.step_decay, run.full_head)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        trained += int(batch["lengths"].sum())
        t_wait = time.perf_counter()
        compute += t_wait - t1

    loader_rate, train_rate = loaded / load_s, trained / (wait + compute)
    print(f"store {store}: {len(batches)} steps, {trained:,} tokens, TTT {cfg.ttt_steps}, "
          f"draft vocab {run.vocab.size}, device {run.device}")
    print(f"(a) loader alone     {loader_rate:10,.0f} tok/s")
    print(f"(b) training         {train_rate:10,.0f} tok/s   per step: data wait {1000 * wait / len(batches):.1f} ms, "
          f"compute {1000 * compute / len(batches):.0f} ms ({100 * wait / (wait + compute):.1f}% waiting)")
    print(f"a/b = {loader_rate / train_rate:.1f}  (loader headroom; must be >= 5)")


if __name__ == "__main__":
    main()
