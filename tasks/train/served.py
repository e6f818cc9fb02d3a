"""Served acceptance while training (train.serve_every): the current
weights, exported, served speculatively in SGLang on held-out prompts and
measured by SGLang's own counts.

Training's held-out τ is a simulation; what a drafter is for is what SGLang
accepts, and the two need not peak at the same epoch (DeepSpec's users saw
served τ peak mid-training). Every `serve_every` epochs and after the last,
rank 0 exports the weights into <out_dir>/served/epoch-<e>/drafter, starts
one speculative server of the target with them (the evaluation's settings:
float32 unless SGLang runs the target in one dtype only, prefix cache off,
top-1, serve_steps drafts; a DFlash drafter its block), generates greedily on the first serve_prompts
held-out prompts (serve_max_new_tokens each, EOS ignored), stops it, and
adds acceptance() of SGLang's meta_info to that epoch's history row, so the
metrics, the plot, the checkpoint and a resumed run have it. Each request's
raw counts are kept beside the export (requests.jsonl). With
keep_best_served the exported drafter is the epoch that served the most
accepted drafts per verify step (pooled), copied from its served export.

Under torchrun the other ranks wait at the next collective while rank 0
serves: a server start must fit the process group's timeout.
"""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from tasks.evaluation.acceptance import acceptance, raw_counts
from tasks.evaluation.generate import generate_all, serving_dtype
from tasks.server.config import ServerConfig
from tasks.server.launch import SpeculativeSpec, launch_server
from tasks.train.config import TrainConfig

logger = logging.getLogger("eagle3.training")

SERVED = "served"


def serve_now(cfg: TrainConfig, epoch: int) -> bool:
    """Whether the weights after `epoch` epochs are served (never the untrained ones)."""
    return bool(cfg.serve_every) and epoch > 0 and (epoch % cfg.serve_every == 0 or epoch == cfg.epochs)


def served_dir(out_dir: Path, epoch: int) -> Path:
    """Where the weights after `epoch` epochs are exported and their server's log and counts kept."""
    return Path(out_dir) / SERVED / f"epoch-{epoch:03d}"


def measure_served(drafter_dir: Path, target: Path, prompts: list[list[int]], cfg: TrainConfig,
                   startup_timeout_s: float = 600.0, request_timeout_s: float = 600.0) -> dict:
    """SGLang's acceptance of the drafter exported at `drafter_dir`, served
    beside `target` on `prompts`: pooled and mean-of-means accept length,
    per position, verify steps; each request's counts go to requests.jsonl
    beside it."""
    if not prompts:
        raise ValueError("no held-out prompts to serve the drafter on")
    dtype = serving_dtype(str(target), None, None, None)
    server = ServerConfig(model=str(target), dtype=dtype)
    if cfg.method == "dflash":  # its block: block_size - 1 drafts a verify step
        spec, drafts = SpeculativeSpec.dflash(server, drafter_dir), cfg.block_size - 1
    else:
        spec, drafts = SpeculativeSpec.chain(server, drafter_dir, cfg.serve_steps), cfg.serve_steps
    with launch_server(spec, drafter_dir.parent / "server.log", timeout_s=startup_timeout_s) as live:
        run = asyncio.run(generate_all(live.url, prompts, api_key=live.api_key,
                                       max_new_tokens=cfg.serve_max_new_tokens, ignore_eos=True,
                                       concurrency=len(prompts), timeout_s=request_timeout_s, tag="train"))
    (drafter_dir.parent / "requests.jsonl").write_text(
        "".join(json.dumps({"prompt": i, **raw_counts(m)}) + "\n"
                for i, m in enumerate(run.meta_infos)))
    a = acceptance(run.meta_infos, drafts)
    return {"pooled": a.pooled, "mean_of_means": a.mean_of_means, "per_position": a.per_position,
            "verify_steps": a.verify_steps, "requests": a.requests, "dtype": dtype}


def best_served(history: list[dict]) -> dict | None:
    """The history row that served best (the highest pooled accept length;
    the earlier of a tie), None when none was served."""
    served = [m for m in history if m.get("served")]
    return max(served, key=lambda m: (m["served"]["pooled"], -m["epoch"])) if served else None


def describe_served(m: dict, serve_steps: int) -> str:
    """One served measurement, as a log line beside training's own figure."""
    s = m["served"]
    return (f"epoch {m['epoch']} served in SGLang: accept length {s['pooled']:.2f} pooled, {s['mean_of_means']:.2f} "
            f"mean of means, per position {[round(p, 3) for p in s['per_position']]} over {s['verify_steps']} "
            f"verify steps ({s['requests']} held-out prompts); held-out tau_exact@{serve_steps} "
            f"{m[f'tau_exact@{serve_steps}']:.2f} simulated (+1 for the accept length)")


def export_checked_against_checkpoint(drafter_dir: Path, out_dir: Path, history: list[dict],
                                      exported_epoch: int | None) -> Path:
    """The export to compare with the checkpoint's weights (the last
    epoch's): drafter/ itself, or, when keep_best_served put an earlier
    epoch's there, the last epoch's served export; that earlier one is then
    checked to be drafter/ byte for byte (same_files)."""
    if exported_epoch is None:
        return Path(drafter_dir)
    return served_dir(out_dir, history[-1]["epoch"]) / "drafter"


def same_files(a: Path, b: Path) -> None:
    """Two exported drafters with the same files, byte for byte; raises naming the first that differs."""
    names = sorted(p.name for p in Path(a).iterdir())
    if names != sorted(p.name for p in Path(b).iterdir()):
        raise RuntimeError(f"{a} and {b} hold different files")
    for name in names:
        if (Path(a) / name).read_bytes() != (Path(b) / name).read_bytes():
            raise RuntimeError(f"{a}/{name} differs from {b}/{name}")

