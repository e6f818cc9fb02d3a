"""What the capture canary costs, in one run.

    .venv/bin/python bench/canary_cost.py                 # SmolLM2 (H 576) on SGLang, then a Kimi-sized head
    .venv/bin/python bench/canary_cost.py --skip-server   # the Kimi-sized head only

(a) H 576: SmolLM2-135M-Instruct served by SGLang on this machine, one batch
    of demo conversations captured twice through the pipeline's
    extract_batch, without canaries and with every sample a canary; and the
    client time of one canary check, against the batch's time.
(b) Kimi-K2.5's head, 163,840 x 7,168 in bf16 (a random tensor standing in
    for the checkpoint's: the cost does not depend on the values), scoring
    one canary sample of the dataset's mean length (2,380 tokens = 88M/37k)
    at the default 8 positions; against the time of a batch of 32 such
    samples at an assumed 10k prefill tokens/s per 8-GPU node (named, not
    measured here: SpecForge saw ~27k on 8 x H200 for a smaller target).
The check runs in the client's dump-reading threads while other requests
are in flight, so it adds to the batch only if the client's CPU is the
bottleneck; the ratios say how far it is from that.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from tasks.capture import canary
from tasks.capture.dump import Capture

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KIMI_VOCAB, KIMI_HIDDEN = 163_840, 7_168
MEAN_TOKENS = 2_380  # 88M tokens / 37k samples
ASSUMED_PREFILL_TOK_S = 10_000


def time_check(head: canary.Head, n: int, positions: int, repeats: int = 3, storage: str = "bfloat16") -> float:
    g = torch.Generator().manual_seed(0)
    h = head.hidden_size
    final = torch.randn(n, h, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, head.weight.shape[0], (n,), generator=g)
    cap = Capture("bench", ids, final[:, None].expand(n, 3, h), final, (1, 2, 3), [])
    logprobs = [None] + [0.0] * (n - 1)  # the values do not change the cost; the check will fail, which is fine
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            canary.check_capture(cap, logprobs, head, sample_id="bench", positions=positions, storage_dtype=storage)
        except canary.CanaryMismatch:
            pass
        best = min(best, time.perf_counter() - t0)
    return best


def smollm2(samples: int) -> dict:
    from tasks.capture.config import CaptureConfig
    from tasks.capture.extraction import Endpoint, extract_batch
    from tasks.data.dataset import DEMO_DATASET, prepare_samples
    from tasks.paths import default_dump_root
    from tasks.server.config import ServerConfig
    from tasks.server.launch import CaptureSpec, launch_server
    from tasks.store.handle import Store
    from tasks.store.ledger.open import open_store
    from tasks.store.manifest import build_manifest
    from tasks.target.checkpoint import Target

    target = Target.load("smollm2-135m-instruct")
    rows, _ = prepare_samples(DEMO_DATASET, target.tokenizer(), max_length=2048)
    batch = rows[:samples]
    work = Path(tempfile.mkdtemp(prefix="canary-bench-"))
    dump_dir = default_dump_root() / f"canary-bench-{time.time_ns()}"
    try:
        spec = CaptureSpec(ServerConfig(model=str(target.path), max_total_tokens=65536), dump_dir=dump_dir,
                           aux_layer_ids=target.served_layer_ids, capture_module=target.arch.decoder_stack)
        with launch_server(spec, work / "server.log", timeout_s=600) as server:
            endpoint = Endpoint(server.url, dump_dir, target.layers.sglang_ids, target.path, api_key=server.api_key,
                                rid_prefix=server.rid_prefix)
            canary.load_head(str(target.path))  # read once per process, as in a run
            out = {}
            for name, fraction in (("warm-up", 0.0), ("without", 0.0), ("every sample a canary", 1.0)):
                store = work / name
                open_store(store, build_manifest(target.path, target.tokenizer(), target.layers, target.arch,
                                                 max_length=2048, policy="truncate", sources=["demo"]))
                t0 = time.perf_counter()
                result = extract_batch(endpoint, Store.open(store), "demo", batch,
                                       CaptureConfig(canary_fraction=fraction))
                out[name] = (time.perf_counter() - t0, result.canaries, result.tokens)
        check = time_check(canary.load_head(str(target.path)), MEAN_TOKENS, 8)
        return {"runs": out, "check_s": check}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(dump_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=32, help="samples in the SmolLM2 batch")
    ap.add_argument("--skip-server", action="store_true", help="only the Kimi-sized head")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    if not args.skip_server:
        r = smollm2(args.samples)
        (t0, _, tokens), (t1, n1, _) = r["runs"]["without"], r["runs"]["every sample a canary"]
        print(f"(a) SmolLM2 H 576, one batch of {args.samples} samples ({tokens:,} tokens) on SGLang (CPU):")
        print(f"    batch without canaries {t0:.2f} s; with all {n1} samples canaries {t1:.2f} s "
              f"(ratio {t1 / t0:.2f}, {(t1 - t0) / max(n1, 1) * 1000:.1f} ms per canary sample)")
        print(f"    one check at 8 positions on {MEAN_TOKENS} tokens: {r['check_s'] * 1000:.1f} ms client time = "
              f"{r['check_s'] / t0:.3f} of the batch's time (a batch has one canary by default)")
    t = time.perf_counter()
    head = canary.Head.of((torch.randn(KIMI_VOCAB, KIMI_HIDDEN) * 0.01).to(torch.bfloat16))
    load = time.perf_counter() - t
    check = time_check(head, MEAN_TOKENS, 8, repeats=2)
    check_fp8 = time_check(head, MEAN_TOKENS, 8, repeats=2, storage="float8_e4m3fn")
    batch_s = 32 * MEAN_TOKENS / ASSUMED_PREFILL_TOK_S
    print(f"(b) Kimi-K2.5-sized head {KIMI_VOCAB:,} x {KIMI_HIDDEN:,} bf16 ({head.weight.nbytes / 2**30:.2f} GiB; "
          f"row norms, once per process: {load:.1f} s incl. the random draw)")
    print(f"    one check at 8 positions: {check:.2f} s client time on {torch.get_num_threads()} threads = "
          f"{check / batch_s:.3f} of a {batch_s:.1f} s batch (32 x {MEAN_TOKENS} tokens at an assumed "
          f"{ASSUMED_PREFILL_TOK_S:,} tok/s per node)")
    print(f"    into an FP8 store (the storage rounding's variance: a second head matmul): {check_fp8:.2f} s = "
          f"{check_fp8 / batch_s:.3f} of that batch")


if __name__ == "__main__":
    main()
