"""Training on more than one device: the same `train` under torchrun (DDP
or FSDP2, tasks/train/loop.py), one process per device, on one node or
several.

    python -m tasks.train.launch --config cfg.json    # one process, or under torchrun
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from tasks.durable import replace_durably
from tasks.paths import REPO_ROOT
from tasks.train.loop import RESULT, TrainConfig, TrainResult, TrainingError, train

logger = logging.getLogger("eagle3.training")


def torchrun_args(cfg: TrainConfig) -> list[str]:
    """One node: `--standalone` (a rendezvous of its own on a free local
    port). Several: c10d rendezvous at `rdzv_endpoint`, which the node whose
    address it is serves and the others join, and which numbers the nodes
    itself (ranks follow the nodes, `devices` consecutive ranks each), so
    every node runs this very same command, and none needs to be told which
    it is: a node rank is only for torchrun's static rendezvous. The run id
    keeps two runs meeting at one endpoint apart; it is the out_dir's, the
    same on every node (they share it: ranks read the one checkpoint that
    rank 0 writes)."""
    if cfg.nnodes == 1:
        return ["--standalone", f"--nproc-per-node={cfg.devices}"]
    run_id = hashlib.sha256(str(Path(cfg.out_dir).resolve()).encode()).hexdigest()[:16]
    return [f"--nnodes={cfg.nnodes}", f"--nproc-per-node={cfg.devices}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={cfg.rdzv_endpoint}", f"--rdzv-id=eagle3-{run_id}"]


def launch_distributed(cfg: TrainConfig, log: logging.Logger = logger) -> TrainResult:
    """More than one device, or node: the same `train` under torchrun, one
    process per device; its output is forwarded line by line. On several
    nodes each node calls this with the same `cfg`, and all must see the
    same out_dir (a shared filesystem) and store."""
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = out_dir / "train-config.json"
    # Replaced whole: on a shared out_dir another node may be reading it.
    replace_durably(cfg_path, lambda tmp: tmp.write_text(json.dumps(dataclasses.asdict(cfg), indent=2)))
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(cfg),
           "-m", "tasks.train.launch", "--config", str(cfg_path)]
    log.info("launching %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO_ROOT))
    for line in proc.stdout:
        log.info("%s", line.rstrip())
    if proc.wait() != 0:
        raise TrainingError(f"torchrun exited with {proc.returncode}; the checkpoint in {out_dir} resumes the run")
    return result_from_dir(out_dir)


def result_from_dir(out_dir: Path) -> TrainResult:
    """What rank 0 of a finished run recorded (`result.json`)."""
    return TrainResult(**json.loads((Path(out_dir) / RESULT).read_text()))


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Train an EAGLE-3 drafter (one process, or under torchrun)")
    parser.add_argument("--config", required=True, help="JSON file of TrainConfig fields")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in json.loads(Path(args.config).read_text()).items() if k in fields})
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"drafter_dir": result.drafter_dir, "final": result.final}))


if __name__ == "__main__":
    main()
