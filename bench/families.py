"""An EAGLE-3 and a DFlash drafter from one capture, served side by side, in
one run: the store captures the union of both drafters' layers (SGLang's
default EAGLE-3 triple and five spread as DFlash spreads them), the
pipeline trains the EAGLE-3 drafter on its three, `train_drafter` trains
the DFlash drafter on its five, and `flows.evaluate` serves both beside the
plain target on the same prompts (a rerun finds the store and both runs
complete and only serves). Needs a machine that can run SGLang servers.

    .venv/bin/python bench/families.py             # configs/demo.yaml: SmolLM2-135M, the demo conversations
    .venv/bin/python bench/families.py --run-dir runs/families --train.epochs 6

Prints, per drafter: training's held-out tau, SGLang's accept length pooled
and as a mean of means, its per-position acceptance, drafts proposed per
verify step, whether greedy output is unchanged, and DFlash against EAGLE-3.
"""
from __future__ import annotations

import json
import sys
import time

from flows.demo import DEMO_CONFIG, run_dir_and_values
from flows.evaluate import evaluate_drafter
from flows.pipeline import eagle3_pipeline
from flows.train import train_drafter
from tasks.paths import REPO_ROOT
from tasks.server.cpu.shim import gpu_present
from tasks.target.layers import default_aux_layer_ids
from tasks.target.models import resolve_model
from tasks.train.config import TrainConfig

DFLASH_LAYERS = 5
# Sized for a 2-core CPU: every anchor's block is scored over the target's
# whole vocabulary (49,152 for SmolLM2), so anchors and block are what a
# CPU epoch costs (at 64 anchors of 8, 150 tokens/s, an epoch 3x an EAGLE-3
# one; at 32, 450 tokens/s); a GPU takes the defaults (16, 512) and the
# run's epochs.
DFLASH_BLOCK_SIZE = 8
DFLASH_MAX_ANCHORS = 32
DFLASH_EPOCHS = 6


def dflash_layer_ids(num_hidden_layers: int, count: int = DFLASH_LAYERS) -> tuple[int, ...]:
    """`count` layers spread evenly over [1, n - 3], as DFlash's trainers
    choose them by default."""
    n = num_hidden_layers
    return tuple(sorted({round(1 + i * (n - 4) / (count - 1)) for i in range(count)}))


def main(argv: list[str] | None = None) -> None:
    parsed = run_dir_and_values(eagle3_pipeline, sys.argv[1:] if argv is None else argv, DEMO_CONFIG,
                                REPO_ROOT / "runs" / "families", __doc__ + "\n  --run-dir DIR  the store, both "
                                "trainings and the evaluation go under DIR", "bench/families.py")
    if parsed is None:
        return
    run_dir, values = parsed
    model = resolve_model(values["server"].model)
    n = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    eagle_ids, dflash_ids = default_aux_layer_ids(n), dflash_layer_ids(n)
    union = sorted(set(eagle_ids) | set(dflash_ids))
    train, evaluate = values["train"], values["evaluate"]
    t0 = time.perf_counter()
    eagle = eagle3_pipeline(**{
        **values, "capture": values["capture"].model_copy(update={"aux_layer_ids": union}),
        "store": values["store"].model_copy(update={"path": str(run_dir / "store")}),
        "train": train.model_copy(update={"out_dir": str(run_dir / "eagle3"), "aux_layer_ids": list(eagle_ids)}),
        "evaluate": evaluate.model_copy(update={"enabled": False})})
    minutes = {"capture and EAGLE-3 training": (time.perf_counter() - t0) / 60}
    t0 = time.perf_counter()
    dflash_epochs = train.epochs if gpu_present() else min(train.epochs, DFLASH_EPOCHS)
    dflash = train_drafter(store=eagle["store"], train=TrainConfig(
        out_dir=str(run_dir / "dflash"), method="dflash", aux_layer_ids=list(dflash_ids),
        block_size=DFLASH_BLOCK_SIZE, max_anchors=DFLASH_MAX_ANCHORS, serve_steps=DFLASH_BLOCK_SIZE - 1,
        epochs=dflash_epochs,
        **{k: getattr(train, k) for k in ("lr", "tokens_per_batch", "heldout_fraction", "seed")}))
    minutes["DFlash training"] = (time.perf_counter() - t0) / 60
    t0 = time.perf_counter()
    # The held-out split is the same for both runs (same fraction and seed): neither trained on its prompts.
    # Greedy only: the figures compared (simulate replays EAGLE-3 chains alone).
    report = evaluate_drafter(drafter_dirs=[eagle["drafter_dir"], dflash["drafter_dir"]], store=eagle["store"],
                              server=values["server"], out_dir=str(run_dir / "evaluation"),
                              evaluate=evaluate.model_copy(update={"simulate": False, "temperature": 0.0}))
    minutes["evaluation"] = (time.perf_counter() - t0) / 60

    print(f"\nmodel {model.name} ({n} layers); store {eagle['store']} holds layers {union}: EAGLE-3 reads "
          f"{list(eagle_ids)} ({train.epochs} epochs), DFlash {list(dflash_ids)} (block {DFLASH_BLOCK_SIZE}, "
          f"{dflash_epochs} epochs)")
    names = [d["name"] for d in report["drafters"]]
    held = {names[0]: eagle["heldout_tau"], names[1]: dflash["heldout"]["tau"]}
    for row in report["acceptance"]:
        print(f"{row['drafter']:>18s} {row['prompt_set']:>10s} {row['mode']:>16s}: accept length "
              f"{row['pooled']:.3f} pooled, {row['mean_of_means']:.3f} mean of means; drafts per step "
              f"{len(row['per_position'])}; per position {[round(p, 3) for p in row['per_position']]}; "
              f"held-out tau {held[row['drafter']]:.3f}; greedy unchanged {row['outputs_equal']}")
    greedy = {(r["drafter"], r["prompt_set"]): r["pooled"] for r in report["acceptance"] if r["mode"] == "greedy"}
    for (name, prompt_set), pooled in greedy.items():
        if name == names[1]:
            print(f"DFlash / EAGLE-3 accept length on {prompt_set}: "
                  f"{pooled / greedy[(names[0], prompt_set)]:.3f}")
    for point in report["sweep"]:
        print(f"{point['drafter']:>18s} at {point['concurrency']} stream(s): per-user speed-up "
              f"{point['per_user_speedup']:.2f}x")
    print("minutes: " + ", ".join(f"{k} {v:.1f}" for k, v in minutes.items()))
    if not gpu_present():
        print("(on a CPU SGLang's speed is not the GPU figure; tau and the accept length are)")


if __name__ == "__main__":
    main()
