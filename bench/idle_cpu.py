"""CPU an idle SGLang server burns, with and without `--sleep-on-idle`, in
one run: each server (tiny model, capture on, as the test suite's) is
started, warmed with one capture, then left idle while the CPU time of its
whole process group is sampled from /proc.

    python bench/idle_cpu.py [--idle-s 20]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from tasks.capture.client import probe_capture
from tasks.server.config import ServerConfig
from tasks.server.launch import CaptureSpec, launch_server
from tasks.server.processes import group_members

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (the tiny models) is not installed
from tests.tiny_models import TINY, ensure_model  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    total = 0
    for pid in group_members(pgid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / TICK


def idle_cpu(model: Path, work: Path, sleep_on_idle: bool, idle_s: float) -> float:
    """Cores used, on average, by the idle server's process group."""
    cfg = CaptureSpec(ServerConfig(model=str(model), max_total_tokens=8192), dump_dir=work / "dumps",
                      sleep_on_idle=sleep_on_idle)
    with launch_server(cfg, work / f"server-{sleep_on_idle}.log") as server:
        probe_capture(server.url, cfg.dump_dir, api_key=server.api_key, rid_prefix=server.rid_prefix)
        time.sleep(5)  # start-up work settles
        pgid = server.process.pid
        t0, c0 = time.monotonic(), group_cpu_s(pgid)
        time.sleep(idle_s)
        return (group_cpu_s(pgid) - c0) / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle-s", type=float, default=20.0)
    args = ap.parse_args()
    model = ensure_model(TINY)
    with tempfile.TemporaryDirectory(prefix="e3-idle-") as tmp:
        spinning = idle_cpu(model, Path(tmp), False, args.idle_s)
        sleeping = idle_cpu(model, Path(tmp), True, args.idle_s)
    print(f"idle server, {args.idle_s:.0f} s: {spinning:.2f} cores without --sleep-on-idle, "
          f"{sleeping:.2f} cores with it; ratio {sleeping / spinning if spinning else float('nan'):.3f}")


if __name__ == "__main__":
    main()
