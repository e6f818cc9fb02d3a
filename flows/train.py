"""Flow `train_drafter`: check the store is verified -> train (resumable) ->
export the drafter SGLang serves -> read it back -> metrics artifacts.

    python -m flows.train --store runs/demo/store --train.out-dir runs/demo/train
    python -m flows.train --config configs/train.yaml --train.devices 8 --train.sharding fsdp
"""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import Field

from flows.artifacts import artifact_key
from flows.config import described
from flows.retries import unless_permanent
from flows.run_record import keep_run_config
from tasks.server.config import ServerConfig
from tasks.store.lock import hold_lock
from tasks.store.config import StoreConfig
from tasks.store.verification import require_verified
from tasks.train.config import TrainConfig, TrainResult
from tasks.train.export_check import compare_export
from tasks.train.launch import launch_distributed
from tasks.train.loop import train
from tasks.train.metrics import metrics_table
from tasks.train.served import export_checked_against_checkpoint, same_files, served_dir


@task(name="check-store-verified", cache_policy=NO_CACHE)
def check_verified_task(store: str) -> dict:
    summary = require_verified(Path(store))
    get_run_logger().info("store %s: verified %d samples, %s tokens, %d files", store, summary["samples"],
                          f"{summary['tokens']:,}", summary["files"])
    return summary


# A retry resumes from the last checkpoint (weights, optimizer, data
# position); data found corrupt, or a checkpoint of other settings, fails
# the same way again and is not retried.
@task(name="train", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=10, retry_condition_fn=unless_permanent)
def train_task(cfg: TrainConfig, store: str, server: ServerConfig | None = None) -> TrainResult:
    if cfg.devices > 1 or cfg.nnodes > 1:
        return launch_distributed(cfg, store, get_run_logger(), server)
    return train(cfg, store, server=server)


@task(name="check-export", cache_policy=NO_CACHE)
def check_export_task(result: TrainResult, out_dir: str) -> dict:
    """Read the exported directory back and compare it with what was trained:
    a silently dropped or renamed tensor would otherwise surface only as a
    drafter SGLang accepts at ~0. An earlier epoch's weights kept as the best
    served are its served export, byte for byte, and the last epoch's served
    export is the one compared."""
    drafter_dir = export_checked_against_checkpoint(Path(result.drafter_dir), Path(out_dir), result.history,
                                                    result.exported_epoch)
    if result.exported_epoch is not None:
        same_files(Path(result.drafter_dir), served_dir(Path(out_dir), result.exported_epoch) / "drafter")
    checked = compare_export(drafter_dir, Path(out_dir), Path(result.target))
    get_run_logger().info("export %s reads back: %d tensors, worst relative difference %.1e (bf16)",
                          drafter_dir, checked["tensors"], checked["worst_relative_diff"])
    return checked


@task(name="metrics-artifacts", cache_policy=NO_CACHE)
def metrics_artifacts_task(result: TrainResult, out_dir: str) -> None:
    table = metrics_table(result.history)
    create_table_artifact(table=table, key=artifact_key("training-metrics", out_dir),
                          description=f"held-out metrics per epoch ({out_dir})")
    png = Path(out_dir) / "metrics.png"
    encoded = base64.b64encode(png.read_bytes()).decode()
    final = result.final
    tau_s = next(k for k in final if k.startswith("tau@"))
    exact_s = tau_s.replace("tau@", "tau_exact@")
    create_markdown_artifact(
        markdown=(f"### Drafter training\n\nheld-out tau **{final['tau']:.2f}** ({tau_s} {final[tau_s]:.2f}), "
                  f"exact (chained) tau {final['tau_exact']:.2f} ({exact_s} {final[exact_s]:.2f}) "
                  f"after {result.steps} steps; untrained: {result.history[0]['tau']:.2f}\n\n"
                  + (f"served in SGLang after epoch {final['epoch']}: accept length "
                     f"**{final['served']['pooled']:.2f}** pooled\n\n" if final.get("served") else "")
                  + (f"exported: the weights after epoch {result.exported_epoch}, the best served\n\n"
                     if result.exported_epoch is not None else "") +
                  f"![loss and tau](data:image/png;base64,{encoded})\n\n`{result.drafter_dir}`\n"),
        key=artifact_key("training-plot", out_dir), description="training loss and held-out tau")


@flow(name="train_drafter")
@described
def train_drafter(
    store: Annotated[str, Field(description="a verified store (from extract_hidden_states)")] = StoreConfig().path,
    train: TrainConfig = TrainConfig(),
    server: ServerConfig = ServerConfig(),
) -> dict:
    """Train an EAGLE-3 drafter on a verified store and export it for SGLang. The server section is how the
    drafter will be served (tensor and data parallelism, memory, dtype, extra_args): train.serve_every launches
    the store's target with it, and the drafter's heads must split over its tensor parallelism; its model is
    always the store's target."""
    store = str(Path(store).resolve())
    out_dir = Path(train.out_dir).resolve()
    # Absolute, as out_dir: torchrun's processes start elsewhere, and a resume
    # compares the path as recorded.
    cfg = train.model_copy(update={"out_dir": str(out_dir), **(
        {"init_from": str(Path(train.init_from).resolve())} if train.init_from else {})})
    # One run per out_dir: two would interleave checkpoints and exports. On
    # several nodes every node's run trains (torchrun on each meets the
    # others) and node 0's holds the out_dir they share and does the rest;
    # the others hold a lock of their node's, so no second run joins as it.
    node = cfg.node_rank
    lock_dir = out_dir if node == 0 else out_dir / f"node-{node}"
    with hold_lock(lock_dir, f"train_drafter on {store}" + (f", node {node}" if node else "")):
        keep_run_config(lock_dir / "config.yaml", "train_drafter", lock_dir)
        if not cfg.stream:  # a stream run reads each shard as the capture commits it
            check_verified_task(store)
        result = train_task(cfg, store, server)
        if node == 0:
            check_export_task(result, cfg.out_dir)
            metrics_artifacts_task(result, cfg.out_dir)
    return {"drafter_dir": result.drafter_dir, "target": result.target, "steps": result.steps,
            "heldout": result.final, "untrained": result.history[0], "out_dir": cfg.out_dir}


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(train_drafter, "python -m flows.train")
