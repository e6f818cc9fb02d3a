"""Does FP8 storage cost the drafter anything? The whole pipeline twice, in one
run, on the same model, data, seed and settings: once into a bf16 store and
once into an FP8 store (e4m3, per-token scale; tasks/store/fp8.py). Needs a
machine that can run SGLang servers (extraction and the serving check).

    .venv/bin/python bench/fp8_quality.py            # configs/demo.yaml: SmolLM2-135M, the demo conversations
    .venv/bin/python bench/fp8_quality.py --run-dir runs/fp8q --config run.yaml --server.model /path/to/llama

Prints, per store: bytes per stored token, held-out tau and tau@S (the
drafter's own metric on held-out samples), SGLang's accept length and accept
rate with the drafter served, and the speed-up; then FP8 against bf16 for
each, and how close the FP8 store's states are to the bf16 store's for the
same samples (per-token cosine). Everything but the store dtype is equal:
the sample ids are content hashes, so both stores hold the same samples, and
the training order is a function of the seed.
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
from tasks.store.shards import BF16, FP8
from tasks.target.reference import per_token_cosine


def state_agreement(bf16_store: str, fp8_store: str, count: int = 16) -> dict:
    """Worst and mean per-token cosine of FP8-stored states against the bf16
    store's, over up to `count` samples both hold."""
    a, b = StoreReader(Path(bf16_store)), StoreReader(Path(fp8_store))
    where = {sid: i for i, sid in enumerate(b.sample_ids)}
    worst, means = 1.0, []
    for i, sid in enumerate(a.sample_ids[:count]):
        if sid not in where:
            continue
        x, y = a[i], b[where[sid]]
        for name in ("aux_hidden_states", "final_hidden_state"):
            cos = per_token_cosine(y[name], x[name])
            worst = min(worst, cos.min().item())
            means.append(cos.mean().item())
    return {"min_cosine": worst, "mean_cosine": sum(means) / max(len(means), 1)}


def main(argv: list[str] | None = None) -> None:
    """--run-dir DIR (each store's run under DIR/<dtype>), then the
    pipeline's own command line (default run file: configs/demo.yaml); the
    store dtype and paths are the bench's."""
    parsed = run_dir_and_values(eagle3_pipeline, sys.argv[1:] if argv is None else argv, DEMO_CONFIG,
                                REPO_ROOT / "runs" / "fp8-quality", __doc__ + "\n  --run-dir DIR  the two runs go "
                                "to DIR/bfloat16 and DIR/float8_e4m3fn", "bench/fp8_quality.py")
    if parsed is None:
        return
    run_dir, values = parsed

    results = {}
    for storage in (BF16, FP8):
        t0 = time.perf_counter()
        result = eagle3_pipeline(**{
            **values, "store": values["store"].model_copy(update={"path": str(run_dir / storage / "store"),
                                                                  "dtype": storage}),
            "train": values["train"].model_copy(update={"out_dir": str(run_dir / storage / "train")})})
        summary = open_ledger(Path(result["store"])).summary()
        results[storage] = {**result, "bytes_per_token": summary["bytes"] / max(summary["tokens"], 1),
                            "tokens": summary["tokens"], "minutes": (time.perf_counter() - t0) / 60}
    training = values["train"]
    steps = training.serve_steps
    rows = [("stored bytes per token", "bytes_per_token", "{:,.0f}"),
            ("held-out tau", "heldout_tau", "{:.3f}"),
            (f"held-out tau@{steps}", f"heldout_tau@{steps}", "{:.3f}"),
            ("SGLang accept length", "sglang_accept_length", "{:.3f}"),
            ("SGLang accept rate", "sglang_accept_rate", "{:.3f}"),
            ("speed-up", "speedup", "{:.2f}"),
            ("greedy output identical", "outputs_equal", "{}"),
            ("pipeline minutes", "minutes", "{:.1f}")]
    print(f"\nmodel {values['server'].model}, dataset {values['capture'].dataset}, "
          f"{results[BF16]['tokens']:,} tokens per store; training {training}")
    print(f"{'':26s} {'bf16':>12s} {'fp8':>12s} {'fp8/bf16':>9s}")
    for label, key, fmt in rows:
        a, b = results[BF16][key], results[FP8][key]
        ratio = f"{b / a:9.3f}" if isinstance(a, (int, float)) and not isinstance(a, bool) and a else ""
        print(f"{label:26s} {fmt.format(a):>12s} {fmt.format(b):>12s} {ratio}")
    agree = state_agreement(results[BF16]["store"], results[FP8]["store"])
    print(f"FP8 store vs bf16 store, same samples: per-token cosine min {agree['min_cosine']:.5f}, "
          f"mean {agree['mean_cosine']:.6f}")
    if not torch.cuda.is_available():
        print("(on a CPU the speed-up is not the GPU figure; tau and the accept length are)")


if __name__ == "__main__":
    main()
