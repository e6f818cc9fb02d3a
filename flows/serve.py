"""Flow `serve_check`: serve the exported drafter in SGLang next to the plain
target, on held-out prompts, and report SGLang's own acceptance figures.

    python -m flows.serve --drafter-dir runs/demo/train/drafter --store runs/demo/store
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import Field

from flows.artifacts import artifact_key
from flows.cli import described
from tasks.serve import check
from tasks.train.data import heldout_prompts


class SpeculationChangedOutput(RuntimeError):
    """Greedy output with the drafter differs from greedy output without it."""


@task(name="heldout-prompts", cache_policy=NO_CACHE)
def prompts_task(store: str, heldout_fraction: float, count: int) -> list[list[int]]:
    prompts = heldout_prompts(Path(store), heldout_fraction, count)
    if not prompts:
        raise ValueError(f"store {store} has no held-out sample with a prompt before its answer")
    get_run_logger().info("%d held-out prompts, %d-%d tokens", len(prompts), min(map(len, prompts)),
                          max(map(len, prompts)))
    return prompts


@task(name="serve-check", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=10)
def serve_task(target: str, drafter_dir: str, prompts: list[list[int]], log_dir: str, max_new_tokens: int,
               dtype: Optional[str], num_steps: int, num_draft_tokens: int) -> dict:
    log = get_run_logger()
    report = check.serve_check(target, drafter_dir, prompts, log_dir=log_dir, max_new_tokens=max_new_tokens,
                               dtype=dtype, num_steps=num_steps, num_draft_tokens=num_draft_tokens)
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
            f"{report.differing_prompts} of {report.num_prompts} (dtype {dtype or 'float32'}; compare in float32: bf16 "
            f"rounding flips near-tied tokens even between two plain servers). Server logs: {log_dir}")
    return result


@flow(name="serve_check")
@described
def serve_check(
    drafter_dir: Annotated[str, Field(description="an exported EAGLE-3 drafter (train_drafter's drafter/)")] = "runs/demo/train/drafter",
    store: Annotated[str, Field(description="the store it was trained on: its held-out samples give the prompts")] = "runs/demo/store",
    target: Annotated[Optional[str], Field(description="target checkpoint (default: the one the drafter was trained for)")] = None,
    num_prompts: Annotated[int, Field(description="held-out prompts to generate for", ge=1)] = 8,
    max_new_tokens: Annotated[int, Field(description="greedy tokens per prompt", ge=1)] = 48,
    heldout_fraction: Annotated[Optional[float], Field(description="held-out share (default: the training run's, from the drafter's config)", gt=0, lt=1)] = None,
    dtype: Annotated[Optional[str], Field(description="compute dtype of both servers (default float32, which makes greedy comparable; bf16 for a target SGLang runs in bf16 only)")] = None,
    num_steps: Annotated[int, Field(description="--speculative-num-steps", ge=1)] = 3,
    num_draft_tokens: Annotated[int, Field(description="--speculative-num-draft-tokens (top-1 chain: steps + 1)", ge=2)] = 4,
) -> dict:
    """Serve the drafter in SGLang: identical greedy output, accept length, speed-up."""
    trained = json.loads((Path(drafter_dir) / "config.json").read_text()).get("eagle3_training", {})
    if target is None or heldout_fraction is None:
        if not trained:
            raise ValueError(f"{drafter_dir}/config.json does not say how it was trained: pass target and "
                             f"heldout_fraction")
        target = target or trained["target"]
        # The training run's own split: prompts it never trained on.
        heldout_fraction = heldout_fraction or trained["config"]["heldout_fraction"]
    prompts = prompts_task(store, heldout_fraction, num_prompts)
    return serve_task(target, drafter_dir, prompts, str(Path(drafter_dir).parent / "serve-logs"), max_new_tokens,
                      dtype, num_steps, num_draft_tokens)


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(serve_check, "python -m flows.serve")
