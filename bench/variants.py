"""eagle3 against eagle3.1, in one run: the pipeline once per variant on the
same store, model, data, seed and training settings (the first run captures
the store or finds it complete; the second finds it complete and only trains
and serves). Needs a machine that can run SGLang servers.

    .venv/bin/python bench/variants.py            # configs/demo.yaml: SmolLM2-135M, the demo conversations
    .venv/bin/python bench/variants.py --run-dir runs/variants --config run.yaml --server.model /path/to/llama

Prints, per variant: held-out tau by both estimators (the product of the
per-step accuracies, and the exact chained one), at the served depth too,
SGLang's accept length and rate with the drafter served, and eagle3.1
against eagle3 for each. Then what a store of five aux layers costs per
token against three: the store's stored bytes per token, and the shard
contract's figures for 3 and 5 layers at its H and at Kimi-K2.5's.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from flows.demo import run_dir_and_values
from flows.demo import DEMO_CONFIG
from flows.pipeline import eagle3_pipeline
from tasks.paths import REPO_ROOT
from tasks.store.ledger.open import open_ledger
from tasks.store.reader import StoreReader
from tasks.store.shards import bytes_per_token

VARIANTS = ("eagle3", "eagle3.1")
KIMI_HIDDEN = 7168


def main(argv: list[str] | None = None) -> None:
    """--run-dir DIR (each variant's training under DIR/<variant>), then the
    pipeline's own command line (default run file: configs/demo.yaml); the
    variant and training dirs are the bench's."""
    parsed = run_dir_and_values(eagle3_pipeline, sys.argv[1:] if argv is None else argv, DEMO_CONFIG,
                                REPO_ROOT / "runs" / "variants", __doc__ + "\n  --run-dir DIR  the two trainings go "
                                "to DIR/eagle3 and DIR/eagle3.1", "bench/variants.py")
    if parsed is None:
        return
    run_dir, values = parsed

    results = {}
    for variant in VARIANTS:
        t0 = time.perf_counter()
        results[variant] = {**eagle3_pipeline(**{**values, "train": values["train"].model_copy(update={
            "variant": variant, "out_dir": str(run_dir / variant / "train")})}),
            "minutes": (time.perf_counter() - t0) / 60}
    steps = values["train"].serve_steps
    rows = [("held-out tau", "heldout_tau"), ("held-out tau, exact", "heldout_tau_exact"),
            (f"held-out tau@{steps}", f"heldout_tau@{steps}"),
            (f"held-out tau@{steps}, exact", f"heldout_tau_exact@{steps}"),
            ("SGLang accept length", "sglang_accept_length"), ("SGLang accept rate", "sglang_accept_rate"),
            ("pipeline minutes", "minutes")]
    print(f"\nmodel {values['server'].model}, dataset {values['capture'].dataset}; training {values['train']}")
    print(f"{'':28s} {'eagle3':>9s} {'eagle3.1':>9s} {'ratio':>7s}")
    for label, key in rows:
        a, b = results["eagle3"][key], results["eagle3.1"][key]
        print(f"{label:28s} {a:9.3f} {b:9.3f} {b / a if a else float('nan'):7.3f}")
    print(f"greedy output identical to the plain target: eagle3 {results['eagle3']['outputs_equal']}, "
          f"eagle3.1 {results['eagle3.1']['outputs_equal']}")

    store = Path(results["eagle3"]["store"])
    summary, manifest = open_ledger(store).summary(), StoreReader(store).manifest
    hidden, layers = manifest["hidden_size"], len(manifest["aux_layers"]["sglang_layer_output_ids"])
    print(f"\nstore: {layers} aux layers at H {hidden}, {summary['bytes'] / max(summary['tokens'], 1):,.0f} stored "
          f"bytes per token ({bytes_per_token(hidden, layers):,} by the shard contract)")
    for h in (hidden, KIMI_HIDDEN):
        three, five = bytes_per_token(h, 3), bytes_per_token(h, 5)
        print(f"H {h}: 3 aux layers {three:,} B/token, 5 aux layers {five:,} B/token ({five / three:.2f}x)")
    if not torch.cuda.is_available():
        print("(on a CPU SGLang's speed is not the GPU figure; tau and the accept length are)")


if __name__ == "__main__":
    main()
