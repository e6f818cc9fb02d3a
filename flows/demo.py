"""The embedded default, end to end: `eagle3_pipeline` on SmolLM2-135M-Instruct
and the bundled demo conversations (answered by SmolLM2 itself), then a check
of stored samples against an independent HF forward, and a table of held-out
tau, SGLang's accept length and the speed-up.

    python -m flows.demo [--run-dir DIR] [--epochs N]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from flows.pipeline import eagle3_pipeline
from tasks.data.dataset import DEMO_DATASET
from tasks.paths import REPO_ROOT
from tasks.server.cpu_shim import gpu_present
from tasks.store.ledger import open_ledger
from tasks.store.reader import StoreReader
from tasks.target.layers import AuxLayers
from tasks.target.models import SMOLLM2, resolve_model
from tasks.target.reference import load_reference_model, per_token_cosine, reference_states
from tasks.train.launch import result_from_dir

# Sized for a 2-core CPU: well under an hour in all.
DEMO_TRAINING = dict(draft_vocab_size=4096, ttt_steps=3, epochs=12, lr=2e-3, tokens_per_batch=2048,
                     serve_prompts=8, serve_new_tokens=48, serve_steps=3)
CPU_NOTE = (" — on this CPU the drafter's attention runs as plain-PyTorch stand-ins for SGLang's CPU "
            "kernels, so this is not the GPU figure")


def check_against_reference(store, model_path, count: int) -> dict:
    """Worst per-token cosine between stored (bf16) states and an fp32 HF
    forward, over `count` samples spread across the store."""
    reader = StoreReader(store)
    layers = AuxLayers(tuple(reader.manifest["aux_layers"]["sglang_layer_output_ids"]))
    model = load_reference_model(str(model_path), torch.float32)
    worst = {"aux": 1.0, "final": 1.0, "mean": []}
    for i in range(0, len(reader), max(1, len(reader) // count))[:count]:
        s = reader[i]
        aux, final = reference_states(model, s["input_ids"].tolist(), layers)
        cos_aux, cos_final = per_token_cosine(s["aux_hidden_states"], aux), per_token_cosine(s["final_hidden_state"], final)
        worst["aux"] = min(worst["aux"], cos_aux.min().item())
        worst["final"] = min(worst["final"], cos_final.min().item())
        worst["mean"].append(torch.cat([cos_aux.flatten(), cos_final]).mean().item())
    worst["mean"] = sum(worst["mean"]) / len(worst["mean"])
    return worst


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default=str(REPO_ROOT / "runs" / "demo"))
    ap.add_argument("--samples-checked", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=DEMO_TRAINING["epochs"])
    ap.add_argument("--heldout-fraction", type=float, default=0.05, help="share of samples held out")
    ap.add_argument("--serve-prompts", type=int, default=DEMO_TRAINING["serve_prompts"],
                    help="held-out prompts SGLang serves with the drafter")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    result = eagle3_pipeline(dataset=str(DEMO_DATASET), model=SMOLLM2, run_dir=args.run_dir,
                             **{**DEMO_TRAINING, "epochs": args.epochs, "serve_prompts": args.serve_prompts},
                             heldout_fraction=args.heldout_fraction)
    elapsed = time.perf_counter() - t0
    check = check_against_reference(result["store"], resolve_model(SMOLLM2), args.samples_checked)
    summary = open_ledger(Path(result["store"])).summary()
    steps = DEMO_TRAINING["serve_steps"]
    held_out = result_from_dir(Path(args.run_dir) / "train").heldout_samples
    rows = [
        ("store", f"{result['store']}: {summary['samples']} samples, {summary['tokens']:,} tokens, verified"),
        ("stored vs HF forward", f"{args.samples_checked} samples: min cosine aux {check['aux']:.4f}, "
                                 f"final {check['final']:.4f}, mean {check['mean']:.5f}"),
        ("drafter", result["drafter_dir"]),
        ("held-out tau", f"{held_out} samples: {result['heldout_tau']:.2f} over {DEMO_TRAINING['ttt_steps']} "
                         f"TTT steps, tau@{steps} {result[f'heldout_tau@{steps}']:.2f}, exact (chained) "
                         f"{result[f'heldout_tau_exact@{steps}']:.2f} (untrained {result['untrained_tau']:.2f})"),
        ("SGLang accept length", f"{args.serve_prompts} prompts: {result['sglang_accept_length']:.2f} tokens per "
                                 f"verify step at {steps} steps (accept rate {result['sglang_accept_rate']:.2f}); "
                                 f"greedy output identical: {result['outputs_equal']}"),
        ("speed-up", f"{result['speedup']:.2f}x ({result['spec_tokens_per_s']:.1f} vs "
                     f"{result['plain_tokens_per_s']:.1f} tok/s){CPU_NOTE if not gpu_present() else ''}"),
        ("run time", f"{elapsed / 60:.1f} min (whole pipeline, server start-ups included)"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    # Stored bf16 against an fp32 forward: rounding alone keeps this near 1.
    if check["mean"] < 0.999 or check["aux"] < 0.99 or check["final"] < 0.99:
        raise SystemExit("stored states deviate from the independent forward")


if __name__ == "__main__":
    main()
