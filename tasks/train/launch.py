"""Training on more than one device: the same `train` under torchrun (DDP
or FSDP2, tasks/train/distributed.py), one process per device, on one node or
several.

    python -m tasks.train.launch --config train-config.json    # one process, or under torchrun

train-config.json: {"store": the store's path, "train": TrainConfig's fields}.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from tasks.durable import replace_durably
from tasks.failures import Permanent
from tasks.paths import REPO_ROOT
from tasks.server.config import ServerConfig
from tasks.train.config import TrainConfig, TrainingError, TrainResult
from tasks.train.loop import RESULT, train

logger = logging.getLogger("eagle3.training")
# What a stopped run waits for torchrun's ranks to exit on SIGTERM before SIGKILL.
RANKS_STOP_S = 15.0


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


# What a launched server's section never carries to the ranks: they launch
# their own (serve_every), with a key and rid prefix of its own.
_ATTACH_ONLY = {"url", "api_key", "rid_prefix"}


def write_launch_config(path: Path, cfg: TrainConfig, store: str | Path, server: ServerConfig | None = None) -> None:
    """What `main` trains: the config, the store and the run's server
    settings beside it. Replaced whole: on a shared out_dir another node may
    be reading it. Without node_rank, so that every node writes the same file
    (training does not read it: the rendezvous numbers the nodes)."""
    doc = {"store": str(store), "train": cfg.model_dump(mode="json", exclude={"node_rank"})}
    if server is not None:
        doc["server"] = server.model_dump(mode="json", exclude=_ATTACH_ONLY)
    text = json.dumps(doc, indent=2)
    replace_durably(Path(path), lambda tmp: tmp.write_text(text))


def read_launch_config(path: Path) -> tuple[TrainConfig, str, ServerConfig | None]:
    doc = json.loads(Path(path).read_text())
    server = ServerConfig.model_validate(doc["server"]) if doc.get("server") else None
    return TrainConfig.model_validate(doc["train"]), doc["store"], server


def launch_distributed(cfg: TrainConfig, store: str | Path, log: logging.Logger = logger,
                       server: ServerConfig | None = None) -> TrainResult:
    """More than one device, or node: the same `train` under torchrun, one
    process per device; its output is forwarded line by line. On several
    nodes each node calls this with the same `cfg` and store, and all must
    see the same out_dir (a shared filesystem) and store."""
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = out_dir / "train-config.json"
    write_launch_config(cfg_path, cfg, store, server)
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(cfg),
           "-m", "tasks.train.launch", "--config", str(cfg_path)]
    log.info("launching %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO_ROOT))
    permanent = None
    try:
        for line in proc.stdout:
            log.info("%s", line.rstrip())
            permanent = permanent or permanent_error_in(line)
        proc.wait()
    except BaseException:  # the run was stopped (Ctrl-C, SIGTERM, a cancel): its ranks stop with it
        proc.terminate()  # torchrun passes it to its ranks; their last checkpoint resumes the run
        try:
            proc.wait(timeout=RANKS_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    if proc.returncode != 0:
        if permanent:
            # A rank stopped on data or settings a retry meets again.
            raise DistributedPermanentError(f"torchrun exited with {proc.returncode} after a rank's {permanent}")
        raise TrainingError(f"torchrun exited with {proc.returncode}; the checkpoint in {out_dir} resumes the run")
    return result_from_dir(out_dir)


class DistributedPermanentError(Permanent, TrainingError):
    """A rank under torchrun failed with an error a retry cannot mend."""


def _permanent_names(cls=Permanent) -> set[str]:
    return {cls.__name__} | {name for sub in cls.__subclasses__() for name in _permanent_names(sub)}


def permanent_error_in(line: str) -> str | None:
    """The `Name: message` of a traceback's last line in a rank's output,
    when Name is a Permanent error (tasks/failures.py)."""
    head, sep, _ = line.strip().partition(": ")
    name = head.rsplit(".", 1)[-1]
    if sep and name in _permanent_names() - {"Permanent"}:
        return line.strip()[:500]
    return None


def result_from_dir(out_dir: Path) -> TrainResult:
    """What rank 0 of a finished run recorded (`result.json`)."""
    return TrainResult(**json.loads((Path(out_dir) / RESULT).read_text()))


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Train an EAGLE-3 drafter (one process, or under torchrun)")
    parser.add_argument("--config", required=True, help="JSON file: the store and TrainConfig's fields "
                                                        "(write_launch_config)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg, store, server = read_launch_config(Path(args.config))
    result = train(cfg, store, server=server)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"drafter_dir": result.drafter_dir, "final": result.final}))


if __name__ == "__main__":
    main()
