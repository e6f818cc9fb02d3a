"""Offline (capture, then train) against stream (train while capturing), in
one run, on one attached server and the same data and settings.

    .venv/bin/python bench/stream.py --model tiny-llama --samples 160 --epochs 2

Three runs: offline, stream keeping every shard, and stream with a spool
(train.spool_bytes, a share of the offline store: each epoch captured
again). Prints each one's wall time for capture plus training, its peak
disk, their ratios against offline, and whether the drafters' weights equal
the offline one bit for bit: each mode captures
for itself, in its own order and batches, so they are equal only where the
server's states do not depend on what else was in the batch. Ratios, not
absolute numbers, are the result: this machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (the tiny models) is not installed
from flows.extract import extract_hidden_states  # noqa: E402
from flows.stream import capture_task  # noqa: E402
from tasks.capture.config import CaptureConfig  # noqa: E402
from tasks.server.config import ServerConfig  # noqa: E402
from tasks.server.launch import CaptureSpec, launch_server  # noqa: E402
from tasks.store.config import StoreConfig  # noqa: E402
from tasks.store.verification import verify_store  # noqa: E402
from tasks.train.config import TrainConfig  # noqa: E402
from tasks.train.loop import train  # noqa: E402
from tasks.stream.plan import plan_stream  # noqa: E402
from tests.conftest import demo_rows, write_jsonl  # noqa: E402
from tests.tiny_models import resolve_model_or_tiny  # noqa: E402


def store_bytes(store: Path) -> int:
    return sum(f.stat().st_size for f in (store / "shards").glob("*.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--samples", type=int, default=160)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--spool-fraction", type=float, default=0.6, help="the spool's budget, a share of the offline store")
    args = p.parse_args()
    model = resolve_model_or_tiny(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    dataset = write_jsonl(work / "data.jsonl", demo_rows(args.samples))
    train_cfg = dict(draft_vocab_size=512, ttt_steps=3, epochs=args.epochs, tokens_per_batch=2048,
                     vocab_positions=4096)
    spec = CaptureSpec(ServerConfig(model=str(model), max_total_tokens=16384), dump_dir=work / "dumps")
    with launch_server(spec, work / "server.log", timeout_s=600) as server:
        def sections(store: Path) -> dict:
            return {"server": ServerConfig(model=str(model), url=server.url, api_key=server.api_key,
                                           rid_prefix=server.rid_prefix),
                    "capture": CaptureConfig(dataset=str(dataset), dump_dir=str(spec.dump_dir), batch_size=8,
                                             max_length=512),
                    "store": StoreConfig(path=str(store))}

        t0 = time.time()
        extract_hidden_states(**sections(work / "offline-store"), verify=True)
        train(TrainConfig(out_dir=str(work / "offline"), **train_cfg), work / "offline-store")
        offline_s = time.time() - t0

        def streamed(name: str, **extra) -> tuple[float, dict]:
            cfg = TrainConfig(out_dir=str(work / name), stream=True, **train_cfg, **extra)
            t0 = time.time()
            parts = sections(work / f"{name}-store")
            plan = plan_stream(str(model), parts["capture"], cfg)
            failure: list[BaseException] = []
            report: dict = {}

            def capture() -> None:
                try:
                    report.update(capture_task.fn(**parts, train=cfg, plan=plan))
                except BaseException as e:  # noqa: BLE001 - reported below
                    failure.append(e)

            side = threading.Thread(target=capture)
            side.start()
            train(cfg, work / f"{name}-store")
            side.join()
            verify_store(work / f"{name}-store")  # as the pipeline does, before serving
            if failure:
                raise failure[0]
            return time.time() - t0, report

        stream_s, _ = streamed("stream")
        offline_bytes = store_bytes(work / "offline-store")
        budget = int(offline_bytes * args.spool_fraction)
        spool_s, spooled = streamed("spool", spool_bytes=budget)

    def weights(name: str) -> dict:
        return load_file(work / name / "drafter" / "model.safetensors")

    def equal(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    mib = 2**20
    print(f"{args.samples} samples, {args.epochs} epochs, model {model.name}, one attached server")
    print(f"offline (capture, verify, then train): {offline_s:6.1f} s; disk {offline_bytes / mib:.1f} MiB")
    print(f"stream (train while capturing):        {stream_s:6.1f} s; disk {store_bytes(work / 'stream-store') / mib:.1f}"
          f" MiB")
    print(f"stream, spool of {budget / mib:.1f} MiB (each epoch captured again): {spool_s:6.1f} s; disk peak "
          f"{(spooled['spool_peak_bytes'] + store_bytes(work / 'spool-store')) / mib:.1f} MiB (spool peak "
          f"{spooled['spool_peak_bytes'] / mib:.1f} + held-out {store_bytes(work / 'spool-store') / mib:.1f}), "
          f"capture paused {spooled['paused_s']:.0f} s")
    print(f"wall time against offline: stream {stream_s / offline_s:.2f}, spooled {spool_s / offline_s:.2f}; "
          f"peak disk against offline: spooled "
          f"{(spooled['spool_peak_bytes'] + store_bytes(work / 'spool-store')) / offline_bytes:.2f}")
    print(f"weights equal to offline bit for bit: stream {equal(weights('offline'), weights('stream'))}, spooled "
          f"{equal(weights('offline'), weights('spool'))} (separate captures: see the docstring)")
    print(f"(work dir {work})")


if __name__ == "__main__":
    main()
