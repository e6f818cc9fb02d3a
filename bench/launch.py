"""Launch-to-ready time of a CPU server (tiny model, capture on, as the test
suite's) with SGLang's workers spawned, as SGLang starts them, against
forked (tasks/server/cpu/workers.py), alternating in one run.

    python bench/launch.py [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tasks.server.config import ServerConfig
from tasks.server.cpu.workers import WORKERS_SWITCH
from tasks.server.launch import CaptureSpec, launch_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (the tiny models) is not installed
from tests.tiny_models import TINY, ensure_model  # noqa: E402


def launch_s(model: Path, work: Path, workers: str) -> float:
    os.environ[WORKERS_SWITCH] = workers  # the server's environment starts from this one
    spec = CaptureSpec(ServerConfig(model=str(model), max_total_tokens=8192), dump_dir=work / "dumps")
    t0 = time.monotonic()
    with launch_server(spec, work / f"server-{workers}.log"):
        return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = ensure_model(TINY)
    times: dict[str, list[float]] = {"spawn": [], "fork": []}
    with tempfile.TemporaryDirectory(prefix="e3-launch-") as tmp:
        for _ in range(args.rounds):
            for workers in times:
                times[workers].append(launch_s(model, Path(tmp), workers))
    spawn, fork = (statistics.median(times[w]) for w in ("spawn", "fork"))
    print(f"launch to ready, median of {args.rounds}: spawned workers {spawn:.1f} s "
          f"{[round(t, 1) for t in times['spawn']]}, forked {fork:.1f} s "
          f"{[round(t, 1) for t in times['fork']]}; ratio {fork / spawn:.2f}")


if __name__ == "__main__":
    main()
