"""Flow `evaluate_drafter`: one or several drafters of one target (EAGLE-3
or DFlash, of one store or of several) served speculatively in SGLang on
the same prompt sets and server settings:
greedy output unchanged, acceptance pooled and as a mean of per-request
means, per position, greedy and sampled, and a concurrency sweep of
per-user against total throughput. One table, one plot, beside the run and
as artifacts.

    python -m flows.evaluate --drafter-dirs "runs/a/train/drafter runs/b/train/drafter" --store runs/a/store \\
        --evaluate.prompt-sets "heldout humaneval"
"""
from __future__ import annotations

import base64
import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import Field

from flows.artifacts import artifact_key
from flows.config import described
from flows.retries import unless_permanent
from tasks.evaluation.config import BASELINE_API_KEY_ENV, EvaluateConfig
from tasks.evaluation.prompts import PromptSet, prompt_set
from tasks.evaluation.side_by_side import Drafter, drafter_at, evaluate_drafters, served_text_table
from tasks.server.config import ServerConfig, revealed
from tasks.store.config import StoreConfig
from tasks.target.architectures import load_tokenizer
from tasks.target.models import resolve_model
from tasks.train.config import TrainConfig
from tasks.train.model_card import add_served, training_record
from tasks.train.record import served_target


def baseline_server(server: ServerConfig, evaluate: EvaluateConfig) -> ServerConfig | None:
    """The running server whose outputs are the baseline (evaluate.baseline: attached, or a URL), or None
    for a launched one; refused up front when the run names no server to attach to."""
    if evaluate.baseline == "launch":
        return None
    if evaluate.baseline != "attached":
        return ServerConfig(model=server.model, url=evaluate.baseline,
                            api_key=evaluate.baseline_api_key or os.environ.get(BASELINE_API_KEY_ENV))
    if not server.url:
        raise ValueError("evaluate.baseline is 'attached' but server.url is not set: give the running server of "
                         "the target to compare against, or use evaluate.baseline: launch")
    return server


def trained_for(drafter_dir: Path, server: ServerConfig) -> dict:
    """How the drafter was trained (its config's record, as its family
    names it: eagle3_training, dflash_training), after checking the server section serves the target it
    was trained for: a drafter served on another target would be measured
    against the wrong model."""
    _, trained, _ = training_record(drafter_dir)
    served_as = served_target(trained, resolve_model(server.model))
    if served_as:
        raise ValueError(f"{drafter_dir} was trained for the target {trained['target']}, not server.model "
                         f"{server.model} ({served_as}): set server.model to its target")
    return trained


@task(name="prompt-sets", cache_policy=NO_CACHE)
def prompt_sets_task(names: list[str], count: int, model: str, store: str | None,
                     heldout_fraction: float) -> list[PromptSet]:
    tokenizer = load_tokenizer(model)
    sets = [prompt_set(n, count=count, tokenizer=tokenizer, store=Path(store) if store else None,
                       heldout_fraction=heldout_fraction) for n in names]
    for s in sets:
        get_run_logger().info("prompt set %s: %d prompts, %d-%d tokens", s.name, len(s.prompts),
                              min(map(len, s.prompts)), max(map(len, s.prompts)))
    return sets


@task(name="evaluate-drafters", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=10,
      retry_condition_fn=unless_permanent)
def evaluate_task(server: ServerConfig, drafters: list[Drafter], sets: list[PromptSet], evaluate: EvaluateConfig,
                  out_dir: str, baseline: ServerConfig | None) -> dict:
    log = get_run_logger()
    log.info("evaluating %d drafter(s) on %s; sweep over %s streams", len(drafters),
             ", ".join(s.name for s in sets), evaluate.concurrency)
    report = evaluate_drafters(server, drafters, sets, evaluate, log_dir=out_dir,
                               baseline_url=baseline.url if baseline else None,
                               baseline_api_key=revealed(baseline.api_key) if baseline else None)
    key = artifact_key("evaluation", out_dir)
    create_table_artifact(table=[{k: v for k, v in r.items() if k != "histogram"} for r in report["acceptance"]],
                          key=f"{key}-acceptance", description="acceptance per drafter and prompt set")
    note = f"; {report['speeds_note']}" if report["speeds_note"] else ""
    create_table_artifact(table=report["sweep"], key=f"{key}-sweep",
                          description=f"per-user and total tokens/s against streams, plain and speculative{note}")
    png = base64.b64encode((Path(out_dir) / "sweep.png").read_bytes()).decode()
    create_markdown_artifact(markdown=f"### Throughput against per-user speed\n\n"
                                      f"![sweep](data:image/png;base64,{png})\n\n"
                                      + (f"*{report['speeds_note']}*\n\n" if note else "") + f"`{out_dir}`\n",
                             key=f"{key}-plot", description="the concurrency sweep")
    if report["served_text"]:
        create_table_artifact(table=served_text_table(report["served_text"]), key=f"{key}-served-text",
                              description="per draft position: training's held-out chain, the same chain on the "
                                          "text SGLang verified, its verify steps replayed, SGLang's own count")
    for d in drafters:  # its card (drafter/README.md) says what SGLang served
        add_served(d.path, report, d.name, d.num_steps)
    for said in (report["speeds_note"], report["sampled_note"]):
        if said:
            log.warning(said)
    for r in report["acceptance"]:
        log.info("%s on %s (%s): accept length %.2f pooled, %.2f mean of means; per position %s; held-out tau %s",
                 r["drafter"], r["prompt_set"], r["mode"], r["pooled"], r["mean_of_means"],
                 [round(p, 2) for p in r["per_position"]], r["heldout_tau"])
    return report


@flow(name="evaluate_drafter")
@described
def evaluate_drafter(
    drafter_dirs: Annotated[list[str], Field(min_length=1, description=(
        "exported EAGLE-3 or DFlash drafters of one target (train_drafter's drafter/), compared side by side"))] = [
        f"{TrainConfig().out_dir}/drafter"],
    store: Annotated[Optional[str], Field(description=(
        "the store the first drafter was trained on: its held-out samples are the 'heldout' prompt set"))] = (
        StoreConfig().path),
    out_dir: Annotated[Optional[str], Field(description=(
        "where the report, plot and server logs go (default: evaluation/ beside the first drafter)"))] = None,
    server: ServerConfig = ServerConfig(),
    evaluate: EvaluateConfig = EvaluateConfig(),
) -> dict:
    """Compare drafters as SGLang serves them: acceptance pooled and per request, per position, a concurrency sweep."""
    baseline = baseline_server(server, evaluate)
    trained = [trained_for(Path(d).resolve(), server) for d in drafter_dirs]
    drafters = [drafter_at(d, evaluate.num_steps) for d in drafter_dirs]
    if len({d.name for d in drafters}) != len(drafters):  # two runs' drafters both named train/drafter
        drafters = [replace(d, name=given) for d, given in zip(drafters, drafter_dirs)]
    out = Path(out_dir).resolve() if out_dir else drafters[0].path.parent / "evaluation"
    model = str(resolve_model(server.model))
    # The held-out split of the first drafter's run: prompts it never trained on.
    sets = prompt_sets_task(evaluate.prompt_sets, evaluate.num_prompts, model, store,
                            trained[0]["config"]["heldout_fraction"])
    target = server.model_copy(update={"model": model, "url": None, "api_key": None,
                                       "rid_prefix": ServerConfig().rid_prefix})
    return evaluate_task(target, drafters, sets, evaluate, str(out), baseline=baseline)


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(evaluate_drafter, "python -m flows.evaluate")
