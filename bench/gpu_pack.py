"""The GPU pack: the project's torch-only GPU checks in one command, one JSON.

    python3 bench/gpu_pack.py --out gpu-pack.json                    # a GPU machine with torch (< 8 min)
    .venv/bin/python bench/gpu_pack.py --quick --out /tmp/pack.json  # its plumbing, on a CPU (~1 min)

For a machine with an NVIDIA GPU and PyTorch but no SGLang, Prefect or
pydantic (what the device tool lends): nothing here imports them. Parts, each
kept in the JSON as it finishes (a part that fails records its error and the
next one runs):

  hook      the capture hook's cost with the CUDA background writer, as a
            fraction of the forward (bench/hook_cost.py), at H 4096 and 7168,
            8192-token batches in bf16;
  writer    tests/test_capture_writer.py, its CUDA test included (skipped
            without a GPU: the JSON says which ran);
  train     one TTT training step (K 7, bf16 autocast, fp32 weights), peak
            memory and tokens/s, at n 2048 and 8192, for a Llama-3.1-8B
            drafter and a Kimi-K2.5-shaped one (bench/train_memory.py, each in
            a fresh process; an out-of-memory is a result, recorded);
  fsdp2     the drafter under FSDP2 (fully_shard on a one-rank NCCL group),
            one step against the unsharded drafter from the same weights.

--quick runs every part at toy sizes on the CPU: what the test suite checks.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import hook_cost, train_memory  # noqa: E402

# The hook at a Llama-3.1-8B and a Kimi-K2.5 (DeepSeek-V3) width: heads of
# 128, the dense MLP's intermediate size.
HOOK_SIZES = {"full": [dict(hidden=4096, heads=32, intermediate=14336, layers=4, tokens=8192, batches=8),
                       dict(hidden=7168, heads=56, intermediate=18432, layers=4, tokens=8192, batches=6)],
              "quick": [dict(hidden=256, heads=4, intermediate=512, layers=2, tokens=64, batches=2)]}
TRAIN_SIZES = {"full": [(shape, n, 7, "bf16") for shape in ("llama-8b", "kimi") for n in (2048, 8192)],
               "quick": [("small", 64, 2, "fp32")]}


def with_repo() -> str:
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


def environment(device: str) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
    return env


def hook_part(size: str, device: str) -> list[dict]:
    return [hook_cost.measure(**s, requests=4, device=device) for s in HOOK_SIZES[size]]


def writer_part(work: Path) -> dict:
    """The writer's tests as pytest runs them, without the suite's conftest
    (it imports the server's config, which needs pydantic); each test's
    outcome from pytest's JUnit XML."""
    import xml.etree.ElementTree as ET

    xml = work / "writer-tests.xml"
    out = subprocess.run([sys.executable, "-m", "pytest", "--noconftest", "-q", "-p", "no:cacheprovider",
                          f"--junitxml={xml}", "tests/test_capture_writer.py"], cwd=REPO, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": with_repo()})
    if not xml.exists():
        raise RuntimeError(f"pytest wrote no report (exit {out.returncode}):\n{out.stdout[-1500:]}{out.stderr[-1500:]}")
    outcome = {}
    for case in ET.parse(xml).iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcome[case.get("name")] = kinds[0] if kinds else "passed"
    return {"returncode": out.returncode, "summary": (out.stdout.strip().splitlines() or [""])[-1],
            "cuda_test": next((v for k, v in outcome.items() if "device_states" in k), "not found"),
            "tests": outcome}


def train_part(size: str, device: str) -> list[dict]:
    results = []
    for shape, n, steps, precision in TRAIN_SIZES[size]:
        row = {"shape": shape, "n": n, "ttt_steps": steps, "precision": precision}
        try:
            r = train_memory.in_fresh_process(n, steps, "blockwise", device, 3, shape, precision)
            row.update(peak_gib=r["peak_mib"] / 1024, step_s=r["seconds"], tokens_per_s=n / r["seconds"],
                       trainable_params=r["trainable_params"])
        except RuntimeError as e:
            row["error"] = "out of memory" if "OutOfMemoryError" in str(e) else str(e)[-1500:]
        results.append(row)
    return results


def fsdp2_part(device: str) -> dict:
    """In a fresh process: a process group of its own, freed with it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": with_repo(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    out = subprocess.run([sys.executable, __file__, "--fsdp2-one", device], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"the FSDP2 step failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fsdp2_one(device: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tasks.train.eagle3.ttt import TTT, ttt_forward

    dev = torch.device(device)
    torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    try:
        torch.manual_seed(0)
        model = train_memory.build(train_memory.SMALL, dev)
        plain = copy.deepcopy(model)
        ttt = TTT(model)
        fully_shard(ttt, mesh=init_device_mesh(dev.type, (1,)), ignored_params={model.embed_tokens.weight})
        shape = train_memory.SMALL
        head_rows = torch.randn(shape["draft_vocab_size"], shape["hidden_size"], device=dev) * 0.02
        batch = train_memory.random_batch(shape, 256, dev)
        ref = ttt_forward(plain, batch, head_rows, steps=3, decay=0.8).loss
        ref.backward()
        t0 = time.perf_counter()
        loss = ttt(batch, head_rows, 3, 0.8).loss
        loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        worst = 0.0
        for p, q in zip(model.parameters(), plain.parameters()):
            if p.grad is None:
                continue
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            worst = max(worst, float((grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)))
        return {"loss": float(loss), "unsharded_loss": float(ref), "worst_relative_grad_difference": worst,
                "sharded_params": sum(hasattr(p, "full_tensor") for p in model.parameters()), "step_s": step_s,
                "ok": abs(float(loss) - float(ref)) <= 1e-5 * abs(float(ref)) and worst <= 1e-4}
    finally:
        torch.distributed.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-pack.json")
    ap.add_argument("--quick", action="store_true", help="toy sizes on the CPU: the pack's plumbing")
    ap.add_argument("--device", default=None, help="default: cuda if there is one, else cpu")
    ap.add_argument("--fsdp2-one", metavar="DEVICE", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fsdp2_one:
        print(json.dumps(fsdp2_one(args.fsdp2_one)))
        return
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    size = "quick" if args.quick else "full"
    out = Path(args.out)
    report = {"size": size, "environment": environment(device)}
    parts = {"hook": lambda: hook_part(size, device), "writer": lambda: writer_part(out.resolve().parent),
             "train": lambda: train_part(size, device), "fsdp2": lambda: fsdp2_part(device)}
    for name, part in parts.items():
        t0 = time.monotonic()
        print(f"gpu pack: {name} ...", flush=True)
        try:
            report[name] = {"ok": True, "result": part()}
        except Exception as e:  # the next part still runs; the JSON says what broke
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        report[name]["seconds"] = time.monotonic() - t0
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"gpu pack: {name} {'done' if report[name]['ok'] else 'FAILED: ' + report[name]['error']} "
              f"in {report[name]['seconds']:.0f} s", flush=True)
    print(f"gpu pack: wrote {out}")


if __name__ == "__main__":
    main()
