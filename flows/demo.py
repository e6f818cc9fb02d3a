"""Capture the bundled demo conversations from SmolLM2-135M-Instruct on a real
SGLang server and check a sample against an independent HF forward.

    python -m flows.demo [--samples N] [--check K] [--concurrency C]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time

from transformers import AutoTokenizer

from tasks.capture_client import capture_many
from tasks.dataset import DEMO_DATASET, load_jsonl, tokenize_conversation
from tasks.layers import AuxLayers
from tasks.models import SMOLLM2, ensure_model
from tasks.paths import cache_root, default_dump_root
from tasks.reference import compare_with_reference, load_reference_model, reference_states
from tasks.server import ServerConfig, launch_server, probe_capture


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=None, help="capture only the first N conversations (default: all)")
    ap.add_argument("--check", type=int, default=4, help="compare this many captures with an HF forward (default 4)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    args = ap.parse_args(argv)

    model = ensure_model(SMOLLM2)
    n_layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    layers = AuxLayers.for_model(n_layers)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = load_jsonl(DEMO_DATASET)[: args.samples]
    id_lists = [tokenize_conversation(tokenizer, r["messages"])[0] for r in rows]
    print(f"{len(rows)} conversations, {sum(map(len, id_lists))} tokens; aux layers: {layers.describe()}")

    dump_dir = default_dump_root() / f"demo-{os.getpid()}"
    log = cache_root() / "logs" / "demo-server.log"
    cfg = ServerConfig(model_path=str(model), dump_dir=dump_dir, aux_layer_ids=layers.sglang_ids, max_total_tokens=65536)
    kept = {}
    print(f"starting SGLang (log: {log}) ...")
    try:
        with launch_server(cfg, log) as server:
            probe_capture(server.url, dump_dir, aux_layer_ids=layers.sglang_ids)

            def consume(i, capture):
                if i < args.check:
                    kept[i] = capture
                return capture.num_tokens

            t0 = time.perf_counter()
            results = capture_many(server.url, dump_dir, id_lists, consume,
                                   concurrency=args.concurrency, aux_layer_ids=layers.sglang_ids)
            elapsed = time.perf_counter() - t0
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)

    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, Exception)]
    tokens = sum(r for r in results if not isinstance(r, Exception))
    dtype = next(iter(kept.values())).final_hidden_state.dtype if kept else None
    reference = load_reference_model(str(model), dtype) if kept else None
    worst = {"min_cosine_aux": 1.0, "min_cosine_final": 1.0, "max_abs_diff": 0.0}
    for i, capture in kept.items():
        ref = compare_with_reference(capture, *reference_states(reference, id_lists[i], layers))
        worst = {k: (min if k.startswith("min") else max)(worst[k], ref[k]) for k in worst}

    table = [
        ("samples captured", f"{len(rows) - len(failed)} / {len(rows)}"),
        ("tokens", f"{tokens}"),
        ("tokens/s", f"{tokens / elapsed:.0f}"),
        ("checked vs HF forward", f"{len(kept)} samples"),
        ("min cosine (aux, final)", f"{worst['min_cosine_aux']:.5f}, {worst['min_cosine_final']:.5f}"),
        ("max |deviation|", f"{worst['max_abs_diff']:.4g}"),
    ]
    width = max(len(k) for k, _ in table)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in table))
    for i, err in failed[:10]:
        print(f"FAILED sample {rows[i].get('id', i)}: {err}")
    if failed or worst["min_cosine_aux"] < 0.999 or worst["min_cosine_final"] < 0.999:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
