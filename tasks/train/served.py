"""Served acceptance while training (train.serve_every): the current
weights, exported, served speculatively in SGLang on held-out prompts and
measured by SGLang's own counts.

Training's held-out τ is a simulation; what a drafter is for is what SGLang
accepts, and the two need not peak at the same epoch (DeepSpec's users saw
served τ peak mid-training). Every `serve_every` epochs and after the last,
rank 0 exports the weights into <out_dir>/served/epoch-<e>/drafter, starts
one speculative server of the target with them on the run's own server
settings (its server section: TP, DP attention, memory, quantization, dtype;
on a GPU node on the GPUs after training's, refused before any work where
they are not free), prefix cache off, top-1, serve_steps drafts (a DFlash
drafter its block), generates greedily on the first serve_prompts held-out
prompts (serve_max_new_tokens each, EOS ignored), stops it, and adds
acceptance() of SGLang's meta_info to that epoch's history row, so the
metrics, the plot, the checkpoint and a resumed run have it. Each request's
raw counts are kept beside the export (requests.jsonl). With
keep_best_served the exported drafter is an earlier epoch only if it served
more accepted tokens per verify step than the last by more than
keep_best_margin standard errors (choose_served), copied from its served
export.

Under torchrun the other ranks wait at the next collective while rank 0
serves: a server start must fit the process group's timeout.
"""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from statistics import NormalDist

from tasks.capture.dump import RID_PREFIX
from tasks.evaluation.acceptance import acceptance, paired_difference, raw_counts
from tasks.evaluation.generate import generate_all, serving_dtype
from tasks.failures import Permanent
from tasks.server.config import ServerConfig
from tasks.server.cpu.shim import gpu_present
from tasks.server.launch import SpeculativeSpec, launch_server
from tasks.train.config import TrainConfig, TrainingError
from tasks.train.families import family_of

logger = logging.getLogger("eagle3.training")

SERVED = "served"


class ServingRefused(Permanent, TrainingError):
    """train.serve_every cannot serve beside training here: a retry fails the same way."""


def serve_now(cfg: TrainConfig, epoch: int) -> bool:
    """Whether the weights after `epoch` epochs are served (never the untrained ones)."""
    return bool(cfg.serve_every) and epoch > 0 and (epoch % cfg.serve_every == 0 or epoch == cfg.epochs)


def served_dir(out_dir: Path, epoch: int) -> Path:
    """Where the weights after `epoch` epochs are exported and their server's log and counts kept."""
    return Path(out_dir) / SERVED / f"epoch-{epoch:03d}"


def gpus_here() -> int:
    """GPUs this node's processes see (0 on a CPU)."""
    if not gpu_present():
        return 0
    import torch

    return torch.cuda.device_count()


def check_serving_fits(cfg: TrainConfig, server: ServerConfig | None, gpus: int) -> None:
    """Refuse serve_every before any work where the target's server cannot
    start beside training: it takes the server section's GPUs after the
    train.devices training holds on this node. On a CPU both share the cores."""
    if not cfg.serve_every or not gpus:
        return
    server = server or ServerConfig()
    need = server.ranks
    if cfg.devices + need > gpus:
        raise ServingRefused(
            f"train.serve_every serves the drafter on a server of the target with the run's server settings "
            f"(server.tp_size {server.tp_size}, server.dp_size {server.dp_size}"
            f"{', dp_attention' if server.dp_attention else ''}: {need} GPU(s)) beside the {cfg.devices} GPU(s) "
            f"training holds (train.devices), but this node has {gpus}: set train.serve_every 0 and measure the "
            f"drafter once trained (flows.evaluate, or the pipeline's evaluate section), or train on "
            f"{max(0, gpus - need)} device(s)")


def served_spec(drafter_dir: Path, target: Path, cfg: TrainConfig, server: ServerConfig | None,
                gpus: int) -> SpeculativeSpec:
    """The speculative server a measurement launches: the run's server
    section (tensor and data parallelism, memory, quantization and other
    extra_args, dtype) serving the training target, on a GPU node on the
    GPUs after those training holds. Its dtype is the section's; "auto" is
    the checkpoint's on a GPU, what users serve, and on a CPU float32 (or the
    one dtype SGLang runs the target in), as every CPU test compares."""
    server = server or ServerConfig()
    dtype = server.dtype
    if dtype == "auto" and not gpus:
        dtype = serving_dtype(str(target), None, None, None)
    launch = server.model_copy(update={"model": str(target), "url": None, "api_key": None, "rid_prefix": RID_PREFIX,
                                       "dtype": dtype})
    where = {"base_gpu_id": cfg.devices} if gpus else {}
    family = family_of(cfg)
    return family.served_spec(launch, drafter_dir, family.drafts(cfg), **where)


def measure_served(drafter_dir: Path, target: Path, prompts: list[list[int]], cfg: TrainConfig,
                   server: ServerConfig | None = None, startup_timeout_s: float = 600.0,
                   request_timeout_s: float = 600.0) -> dict:
    """SGLang's acceptance of the drafter exported at `drafter_dir`, served
    beside `target` on `prompts` with the run's server settings (served_spec):
    pooled accept length and its standard error, mean of means, per
    position, verify steps, each request's counts; the raw counts go to
    requests.jsonl beside it."""
    if not prompts:
        raise ValueError("no held-out prompts to serve the drafter on")
    spec = served_spec(drafter_dir, target, cfg, server, gpus_here())
    drafts = family_of(cfg).drafts(cfg)
    with launch_server(spec, drafter_dir.parent / "server.log", timeout_s=startup_timeout_s) as live:
        run = asyncio.run(generate_all(live.url, prompts, api_key=live.api_key,
                                       max_new_tokens=cfg.serve_max_new_tokens, ignore_eos=True,
                                       concurrency=len(prompts), timeout_s=request_timeout_s, tag="train"))
    (drafter_dir.parent / "requests.jsonl").write_text(
        "".join(json.dumps({"prompt": i, **raw_counts(m)}) + "\n"
                for i, m in enumerate(run.meta_infos)))
    a = acceptance(run.meta_infos, drafts)
    return {"pooled": a.pooled, "pooled_se": a.pooled_se, "mean_of_means": a.mean_of_means,
            "per_position": a.per_position, "verify_steps": a.verify_steps, "requests": a.requests,
            "per_request": [list(c) for c in a.per_request], "dtype": spec.server.dtype,
            "tensor_parallel": spec.server.tp_size}


def choose_served(history: list[dict], margin: float) -> dict | None:
    """Which served epoch to export (keep_best_served): the last, unless the
    best earlier one served more accepted tokens per verify step by more
    than `margin` standard errors of the difference (the same prompts
    request by request, acceptance.paired_difference), the margin widened
    for the number of earlier epochs it was the best of (Bonferroni: the
    best of K is K chances at a lucky draw). A handful of prompts measures
    accept length to about 0.04: keeping the best of several epochs on less
    picks noise, and reports a figure biased up. One prompt has no standard
    error, and keeps the last. None when nothing was served."""
    served = [m for m in history if m.get("served")]
    if not served:
        return None
    last = served[-1]
    best = max(served, key=lambda m: (m["served"]["pooled"], -m["epoch"]))
    earlier = len(served) - 1
    threshold = margin if earlier <= 1 else \
        NormalDist().inv_cdf(1 - (1 - NormalDist().cdf(margin)) / earlier)
    choice = {"last_epoch": last["epoch"], "last_pooled": last["served"]["pooled"], "best_epoch": best["epoch"],
              "best_pooled": best["served"]["pooled"], "margin_se": margin, "threshold_se": threshold,
              "difference": 0.0, "se": 0.0, "epoch": last["epoch"]}
    if best is last:
        return choice
    a, b = best["served"].get("per_request"), last["served"].get("per_request")
    if not a or not b or len(a) != len(b) or len(a) < 2:  # no standard error to judge by
        return choice
    difference, se = paired_difference(a, b)
    choice.update(difference=difference, se=se)
    if difference > threshold * se:
        choice["epoch"] = best["epoch"]
    return choice


def describe_choice(c: dict) -> str:
    if c["best_epoch"] == c["last_epoch"]:
        return f"the last epoch ({c['last_epoch']}) served best: {c['last_pooled']:.3f} accepted per verify step"
    widened = (f" ({c['margin_se']:g} widened for the best of several epochs)"
               if c["threshold_se"] != c["margin_se"] else "")
    verdict = (f"more than {c['threshold_se']:.2f} standard errors{widened}: exported epoch {c['epoch']}"
               if c["epoch"] != c["last_epoch"] else
               f"within {c['threshold_se']:.2f} standard errors{widened} (train.keep_best_margin): exported the last "
               f"epoch's weights")
    return (f"epoch {c['best_epoch']} served {c['best_pooled']:.3f} accepted per verify step, the last epoch "
            f"({c['last_epoch']}) {c['last_pooled']:.3f}: a difference of {c['difference']:+.3f} +- {c['se']:.3f} "
            f"(paired standard error over the same prompts), {verdict}")


def describe_served(m: dict, simulated_key: str) -> str:
    """One served measurement, as a log line beside training's own
    simulation of it (`simulated_key`: the held-out figure of the same
    drafts, tau_exact@serve_steps for an EAGLE-3 chain, tau_exact over the
    whole block for DFlash)."""
    s = m["served"]
    return (f"epoch {m['epoch']} served in SGLang: accept length {s['pooled']:.2f} +- {s.get('pooled_se', 0):.2f} "
            f"pooled, {s['mean_of_means']:.2f} mean of means, per position {[round(p, 3) for p in s['per_position']]} "
            f"over {s['verify_steps']} verify steps ({s['requests']} held-out prompts); held-out {simulated_key} "
            f"{m[simulated_key]:.2f} simulated (+1 for the accept length)")


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

