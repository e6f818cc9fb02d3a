"""The embedded default, end to end: run `extract_hidden_states` on
SmolLM2-135M-Instruct and the bundled demo conversations, then check stored
samples against an independent HF forward and print a short table.

    python -m flows.demo [--store DIR] [--samples-checked K]
"""
from __future__ import annotations

import argparse
import time

import torch

from flows.extract import extract_hidden_states
from tasks.dataset import DEMO_DATASET
from tasks.layers import AuxLayers
from tasks.models import SMOLLM2, resolve_model
from tasks.paths import REPO_ROOT
from tasks.reference import load_reference_model, per_token_cosine, reference_states
from tasks.store import StoreReader


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
    ap.add_argument("--store", default=str(REPO_ROOT / "runs" / "demo" / "store"))
    ap.add_argument("--samples-checked", type=int, default=4)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    result = extract_hidden_states(dataset=str(DEMO_DATASET), model=SMOLLM2, store=args.store)
    elapsed = time.perf_counter() - t0
    check = check_against_reference(result["store"], resolve_model(SMOLLM2), args.samples_checked)
    rows = [
        ("samples stored", f"{result['samples']} (quarantined {result['quarantined']})"),
        ("tokens", f"{result['tokens']:,}"),
        ("run time, tokens/s", f"{elapsed:.0f} s, {result['tokens'] / elapsed:.0f} tok/s (whole DAG, server start included)"),
        ("vs HF forward", f"{args.samples_checked} samples: min cosine aux {check['aux']:.4f}, final {check['final']:.4f}, "
                          f"mean {check['mean']:.5f}"),
        ("store", result["store"]),
        ("verification", f"{'passed' if result['verification']['ok'] else 'FAILED'}: "
                         f"{result['verification']['summary_report']}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    # Stored bf16 against an fp32 forward: rounding alone keeps this near 1.
    if check["mean"] < 0.999 or check["aux"] < 0.99 or check["final"] < 0.99:
        raise SystemExit("stored states deviate from the independent forward")


if __name__ == "__main__":
    main()
