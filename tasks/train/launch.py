"""Training on more than one device: the same `train` under torchrun (DDP),
one process per device.

    python -m tasks.train.launch --config cfg.json    # one process, or under torchrun
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from tasks.paths import REPO_ROOT
from tasks.train.loop import RESULT, TrainConfig, TrainResult, TrainingError, train

logger = logging.getLogger("eagle3.training")


def launch_distributed(cfg: TrainConfig, log: logging.Logger = logger) -> TrainResult:
    """More than one device: the same `train` under torchrun (DDP), one
    process per device; its output is forwarded line by line."""
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = out_dir / "train-config.json"
    cfg_path.write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.devices}",
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
