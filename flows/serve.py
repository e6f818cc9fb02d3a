"""Flow `serve_check`: serve the exported drafter in SGLang next to the plain
target (launched, or the attached server with serve.baseline: attached), on
held-out prompts, and report SGLang's own acceptance figures.

    python -m flows.serve --drafter-dir runs/demo/train/drafter --store runs/demo/store
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import Field

from flows.artifacts import artifact_key
from flows.cli import described
from flows.retries import unless_permanent
from tasks.failures import Permanent
from tasks.serve import check
from tasks.serve.config import ServeConfig
from tasks.server.config import ServerConfig
from tasks.store.config import StoreConfig
from tasks.train.config import TrainConfig
from tasks.target.models import resolve_model
from tasks.train.data import heldout_prompts


class SpeculationChangedOutput(Permanent, RuntimeError):
    """Greedy output with the drafter differs from greedy output without it."""


@task(name="heldout-prompts", cache_policy=NO_CACHE)
def prompts_task(store: str, heldout_fraction: float, count: int) -> list[list[int]]:
    prompts = heldout_prompts(Path(store), heldout_fraction, count)
    if not prompts:
        raise ValueError(f"store {store} has no held-out sample with a prompt before its answer")
    get_run_logger().info("%d held-out prompts, %d-%d tokens", len(prompts), min(map(len, prompts)),
                          max(map(len, prompts)))
    return prompts


@task(name="serve-check", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=10,
      retry_condition_fn=unless_permanent)
def serve_task(server: ServerConfig, drafter_dir: str, prompts: list[list[int]], serve: ServeConfig,
               log_dir: str, baseline: ServerConfig | None = None) -> dict:
    log = get_run_logger()
    report = check.serve_check(server, drafter_dir, prompts, serve, log_dir=log_dir,
                               baseline_url=baseline.url if baseline else None,
                               baseline_api_key=baseline.api_key if baseline else None)
    result = report.to_dict()
    create_table_artifact(table=[{k: v for k, v in result.items() if not isinstance(v, (list, dict))}],
                          key=artifact_key("serving", drafter_dir),
                          description=f"SGLang serving {drafter_dir}")
    log.info("SGLang: accept length %s, accept rate %s, %d verify steps; %.1f vs %.1f tokens/s (speed-up %.2fx)",
             result["spec_accept_length"], result["spec_accept_rate"], result["spec_verify_ct"],
             result["spec_tokens_per_s"], result["plain_tokens_per_s"], result["speedup"])
    if not report.outputs_equal:
        raise SpeculationChangedOutput(
            f"greedy output with the drafter differs from plain greedy output for prompts "
            f"{report.differing_prompts} of {report.num_prompts} (dtype {serve.dtype or 'float32'}; compare in "
            f"float32: bf16 rounding flips near-tied tokens even between two plain servers). Server logs: {log_dir}")
    return result


def baseline_server(server: ServerConfig, serve: ServeConfig) -> ServerConfig | None:
    """The running server whose greedy outputs are the baseline (serve.baseline: attached), or None for a
    launched one; refused up front when the run names no server to attach to."""
    if serve.baseline == "launch":
        return None
    if not server.url:
        raise ValueError("serve.baseline is 'attached' but server.url is not set: give the running server of the "
                         "target to compare against, or use serve.baseline: launch")
    return server


def trained_for(drafter_dir: Path, server: ServerConfig) -> dict:
    """How the drafter was trained (its config's eagle3_training), after
    checking the server section serves the target it was trained for: a
    drafter served on another target would be measured against the wrong
    model."""
    trained = json.loads((drafter_dir / "config.json").read_text()).get("eagle3_training")
    if not trained:
        raise ValueError(f"{drafter_dir}/config.json does not say how it was trained (no eagle3_training): "
                         f"export it with train_drafter")
    ours, theirs = resolve_model(server.model), Path(trained["target"])
    if ours.resolve() != theirs.resolve() and (not (theirs / "config.json").exists() or
                                               (ours / "config.json").read_bytes()
                                               != (theirs / "config.json").read_bytes()):
        raise ValueError(f"{drafter_dir} was trained for the target {theirs}, not server.model {server.model}: "
                         f"set server.model to its target")
    return trained


@flow(name="serve_check")
@described
def serve_check(
    drafter_dir: Annotated[str, Field(description="an exported EAGLE-3 drafter (train_drafter's drafter/)")] = f"{TrainConfig().out_dir}/drafter",
    store: Annotated[str, Field(description="the store it was trained on: its held-out samples give the prompts")] = StoreConfig().path,
    server: ServerConfig = ServerConfig(),
    serve: ServeConfig = ServeConfig(),
) -> dict:
    """Serve the drafter in SGLang: identical greedy output, accept length, speed-up."""
    drafter = Path(drafter_dir).resolve()
    baseline = baseline_server(server, serve)
    trained = trained_for(drafter, server)
    config = trained["config"]
    steps = serve.num_steps or config["serve_steps"]
    serve = serve.model_copy(update={"num_steps": steps, "num_draft_tokens": serve.num_draft_tokens or steps + 1})
    # The training run's own split: prompts it never trained on.
    prompts = prompts_task(store, config["heldout_fraction"], serve.num_prompts)
    target = server.model_copy(update={"model": str(resolve_model(server.model)), "url": None, "api_key": None,
                                       "rid_prefix": ServerConfig().rid_prefix})
    return serve_task(target, str(drafter), prompts, serve, str(drafter.parent / "serve-logs"),
                      baseline=baseline)


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(serve_check, "python -m flows.serve")
