"""Flow `train_drafter`: check the store is verified -> train (resumable) ->
export the drafter SGLang serves -> read it back -> metrics artifacts.

    python -m flows.train --store runs/demo/store --out-dir runs/demo/train
"""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Annotated, Optional

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import Field

from flows.cli import described
from tasks import training
from tasks.drafter import export_weights, load_exported
from tasks.verification import require_verified


@task(name="check-store-verified", cache_policy=NO_CACHE)
def check_verified_task(store: str) -> dict:
    summary = require_verified(Path(store))
    get_run_logger().info("store %s: verified %d samples, %s tokens, %d files", store, summary["samples"],
                          f"{summary['tokens']:,}", summary["files"])
    return summary


# A retry resumes from the last checkpoint (weights, optimizer, data position).
@task(name="train", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=10)
def train_task(cfg: training.TrainConfig) -> training.TrainResult:
    if cfg.devices > 1:
        return training.launch_distributed(cfg, get_run_logger())
    return training.train(cfg)


@task(name="check-export", cache_policy=NO_CACHE)
def check_export_task(drafter_dir: str, out_dir: str, target: str) -> dict:
    """Read the exported directory back and compare it with what was trained:
    a silently dropped or renamed tensor would otherwise surface only as a
    drafter SGLang accepts at ~0."""
    import torch

    loaded = export_weights(load_exported(Path(drafter_dir), Path(target)))
    trained = export_weights(training.trained_drafter(Path(out_dir), Path(target)))
    worst = 0.0
    for name, tensor in trained.items():
        if name not in loaded:
            raise RuntimeError(f"exported drafter {drafter_dir} lacks {name}")
        diff = (loaded[name].float() - tensor.float()).abs().max().item()
        scale = tensor.float().abs().max().item() or 1.0
        worst = max(worst, diff / scale)
    if worst > 1e-2:  # bf16 export of fp32 weights: ~4e-3 relative at most
        raise RuntimeError(f"exported drafter {drafter_dir} differs from the trained one (relative {worst:.2e})")
    get_run_logger().info("export %s reads back: %d tensors, worst relative difference %.1e (bf16)",
                          drafter_dir, len(loaded), worst)
    return {"tensors": len(loaded), "worst_relative_diff": worst, "dtype": str(torch.bfloat16)}


@task(name="metrics-artifacts", cache_policy=NO_CACHE)
def metrics_artifacts_task(result: training.TrainResult, out_dir: str) -> None:
    table = training.metrics_table(result.history)
    create_table_artifact(table=table, key=None, description=f"held-out metrics per epoch ({out_dir})")
    png = Path(out_dir) / "metrics.png"
    encoded = base64.b64encode(png.read_bytes()).decode()
    final = result.final
    tau_s = next(k for k in final if k.startswith("tau@"))
    create_markdown_artifact(
        markdown=(f"### Drafter training\n\nheld-out tau **{final['tau']:.2f}** ({tau_s} {final[tau_s]:.2f}) "
                  f"after {result.steps} steps; untrained: {result.history[0]['tau']:.2f}\n\n"
                  f"![loss and tau](data:image/png;base64,{encoded})\n\n`{result.drafter_dir}`\n"),
        description="training loss and held-out tau")


@flow(name="train_drafter")
@described
def train_drafter(
    store: Annotated[str, Field(description="a verified store (from extract_hidden_states)")] = "runs/demo/store",
    out_dir: Annotated[str, Field(description="checkpoints, metrics and the exported drafter/ go here; a rerun resumes")] = "runs/demo/train",
    target: Annotated[Optional[str], Field(description="target checkpoint (default: the one the store was captured from)")] = None,
    draft_vocab_size: Annotated[int, Field(description="draft vocabulary: the N most frequent target tokens", ge=16)] = 8192,
    ttt_steps: Annotated[int, Field(description="training-time-test unroll depth K (loss weights decay^k)", ge=1)] = 7,
    step_decay: Annotated[float, Field(description="loss weight decay per TTT step", gt=0, le=1)] = 0.8,
    epochs: Annotated[int, Field(description="passes over the training split", ge=1)] = 2,
    lr: Annotated[float, Field(description="peak learning rate (AdamW, warm-up then cosine)", gt=0)] = 3e-4,
    tokens_per_batch: Annotated[int, Field(description="padded tokens per step and device", ge=64)] = 4096,
    heldout_fraction: Annotated[float, Field(description="share of samples held out (by sample-id hash)", gt=0, lt=1)] = 0.05,
    serve_steps: Annotated[int, Field(description="speculative steps the drafter will be served with (for tau@S)", ge=1)] = 3,
    devices: Annotated[int, Field(description="GPUs to train on; >1 runs torchrun (DDP)", ge=1)] = 1,
    checkpoint_every: Annotated[int, Field(description="steps between checkpoints", ge=1)] = 50,
    seed: Annotated[int, Field(description="initialisation and data-order seed")] = 0,
) -> dict:
    """Train an EAGLE-3 drafter on a verified store and export it for SGLang."""
    cfg = training.TrainConfig(
        store=str(Path(store).resolve()), out_dir=str(Path(out_dir).resolve()), target=target,
        draft_vocab_size=draft_vocab_size, ttt_steps=ttt_steps, step_decay=step_decay, epochs=epochs, lr=lr,
        tokens_per_batch=tokens_per_batch, heldout_fraction=heldout_fraction, serve_steps=serve_steps,
        devices=devices, checkpoint_every=checkpoint_every, seed=seed)
    check_verified_task(cfg.store)
    result = train_task(cfg)
    check_export_task(result.drafter_dir, cfg.out_dir, result.target)
    metrics_artifacts_task(result, cfg.out_dir)
    return {"drafter_dir": result.drafter_dir, "target": result.target, "steps": result.steps,
            "heldout": result.final, "untrained": result.history[0], "out_dir": cfg.out_dir}


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(train_drafter, "python -m flows.train")
