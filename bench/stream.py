"""Offline (capture, then train) against stream (train while capturing), in
one run, on one attached server and the same data and settings.

    .venv/bin/python bench/stream.py --model tiny-llama --samples 160 --epochs 2

Prints each mode's wall time for capture plus training, their ratio, the
store's size (the same in both today: a stream run keeps every shard), and
whether the two drafters' weights are equal bit for bit: each mode captures
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
from tasks.server.launch import LaunchSpec, launch_server  # noqa: E402
from tasks.store.config import StoreConfig  # noqa: E402
from tasks.store.verification import verify_store  # noqa: E402
from tasks.train.config import TrainConfig  # noqa: E402
from tasks.train.loop import train  # noqa: E402
from tasks.train.stream import plan_stream  # noqa: E402
from tests.conftest import demo_rows, write_jsonl  # noqa: E402
from tests.tiny_models import resolve_model_or_tiny  # noqa: E402


def store_bytes(store: Path) -> int:
    return sum(f.stat().st_size for f in (store / "shards").glob("*.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--samples", type=int, default=160)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    model = resolve_model_or_tiny(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    dataset = write_jsonl(work / "data.jsonl", demo_rows(args.samples))
    train_cfg = dict(draft_vocab_size=512, ttt_steps=3, epochs=args.epochs, tokens_per_batch=2048,
                     vocab_positions=4096)
    spec = LaunchSpec(ServerConfig(model=str(model), max_total_tokens=16384), dump_dir=work / "dumps")
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

        cfg = TrainConfig(out_dir=str(work / "stream"), stream=True, **train_cfg)
        t0 = time.time()
        stream_sections = sections(work / "stream-store")
        plan = plan_stream(str(model), stream_sections["capture"], cfg)
        failure: list[BaseException] = []

        def capture() -> None:
            try:
                capture_task.fn(**stream_sections, train=cfg, plan=plan)
            except BaseException as e:  # noqa: BLE001 - reported below
                failure.append(e)

        side = threading.Thread(target=capture)
        side.start()
        train(cfg, work / "stream-store")
        side.join()
        verify_store(work / "stream-store")  # as the pipeline does, before serving
        stream_s = time.time() - t0
        if failure:
            raise failure[0]
    a = load_file(work / "offline" / "drafter" / "model.safetensors")
    b = load_file(work / "stream" / "drafter" / "model.safetensors")
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"{args.samples} samples, {args.epochs} epochs, model {model.name}")
    print(f"offline (capture, verify, then train): {offline_s:.1f} s; store {store_bytes(work / 'offline-store') / 2**20:.1f} MiB")
    print(f"stream (train while capturing):        {stream_s:.1f} s; store {store_bytes(work / 'stream-store') / 2**20:.1f} MiB")
    print(f"stream / offline wall time: {stream_s / offline_s:.2f}; weights equal bit for bit: {equal}")
    print(f"(work dir {work})")


if __name__ == "__main__":
    main()
