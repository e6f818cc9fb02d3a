"""Training's held-out chain over the answers' first W tokens against the
rest, for a trained drafter and its store: is a served figure, which covers
only the first max_new_tokens of each answer, low because of where in the
answer it looks?

    python bench/heldout_window.py [--store runs/demo/store] [--drafter runs/demo/train/drafter] \\
        [--tokens 48] [--heldout-fraction 0.05]

Prints, per draft position k, the share of starting positions whose drafts
1..k all hit (training's exact chain, tasks/train/eagle3/ttt.py) over the held-out
answers: every position (training's own held-out figure), chains inside the
first W answer tokens, and the rest; and the ratio first/rest.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tasks.evaluation.served_text import load_drafter
from tasks.store.reader import StoreReader
from tasks.target.embeddings import load_target_embeddings
from tasks.target.layers import AuxLayers
from tasks.train.data import collate, split
from tasks.train.eagle3.ttt import chain_hits, ttt_forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="runs/demo/store")
    parser.add_argument("--drafter", default="runs/demo/train/drafter")
    parser.add_argument("--tokens", type=int, default=48, help="W: the answer tokens a served request covers")
    parser.add_argument("--heldout-fraction", type=float, default=0.05, help="the run's train.heldout_fraction")
    args = parser.parse_args()
    reader = StoreReader(Path(args.store))
    target = Path(reader.manifest["target_path"])
    model, layers = load_drafter(Path(args.drafter), target)
    positions = tuple(layers.positions_in(AuxLayers(tuple(reader.manifest["aux_layers"]["sglang_layer_output_ids"]))))
    head = load_target_embeddings(target)[1].float()
    steps = json.loads((Path(args.drafter) / "config.json").read_text())["eagle3_training"]["config"]["ttt_steps"]
    _, held = split(reader.sample_ids, args.heldout_fraction)
    sums = {w: [torch.zeros(steps, dtype=torch.long), torch.zeros(steps, dtype=torch.long)]
            for w in ("every position", f"first {args.tokens}", "the rest")}
    for i in held:
        batch = collate(reader, [int(i)], positions)  # one sample: no padding
        n, start = batch["input_ids"].shape[1], int(batch["loss_mask"][0].nonzero()[0])
        with torch.no_grad():
            out = ttt_forward(model, batch, head[model.draft_to_target], steps=steps, decay=1.0, full_head=head)
        pos = torch.arange(n)
        # Step k of the chain starting at t predicts token t + k + 2.
        first = torch.stack([pos + k + 2 < start + args.tokens for k in range(steps)])
        for name, inside in zip(sums, (torch.ones_like(first), first, ~first)):
            chained, counted = chain_hits(list(out.hits[:, 0] & inside), list(out.scored[:, 0] & inside))
            sums[name][0] += chained
            sums[name][1] += counted
    print(f"{len(held)} held-out samples of {args.store}, drafter {args.drafter}")
    for name, (chained, counted) in sums.items():
        shares = (chained / counted.clamp(min=1)).tolist()
        print(f"  {name:<16} " + "  ".join(f"{p:.3f}" for p in shares) + f"   (chains counted {counted.tolist()})")
    first, rest = list(sums.values())[1:]
    ratio = (first[0] / first[1].clamp(min=1)) / (rest[0] / rest[1].clamp(min=1))
    print("  first/rest ratio " + "  ".join(f"{r:.2f}" for r in ratio.tolist()))


if __name__ == "__main__":
    main()
