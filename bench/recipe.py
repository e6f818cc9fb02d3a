"""The drafter's recipe, lever by lever, as SGLang serves it: drafters
trained on one store that differ from a base recipe (the demo's run file)
in one setting each, every one served in SGLang on the same held-out
prompts, all in one run.

    .venv/bin/python bench/recipe.py                                  # every lever on the demo's store
    .venv/bin/python bench/recipe.py --arms base,lr=5e-3,draft_vocab_size=8192 --epochs 4
    .venv/bin/python bench/recipe.py --greedy-store runs/demo-regen/store  # and the answers lever

An arm is a name in ARMS or settings joined by '+' (`lr=5e-3+loss=tv`).
Prompts: data/heldout_prompts.jsonl, 96 prompts no demo conversation asks
or rewords (some share a form, as a user's next prompts would). The store's
own held-out split is 5% of 300 conversations: 11 prompts, a standard
error of about 0.05 on accept length; 96 prompts bring it under 0.03. Each generation is 48 tokens, greedy, EOS ignored, as the demo's
evaluation.

Prints per arm: training tokens/s (and against the base), held-out tau at
the served depth, the share of positions the draft vocabulary cannot
propose, SGLang's accept length pooled with its standard error (requests as
clusters), per draft position, and the difference from the base with its
paired standard error; whether greedy output was unchanged. An arm already
trained under --run-dir with the same settings is served again, not
retrained (a rerun adds arms cheaply).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

from tasks.evaluation.acceptance import paired_difference
from tasks.evaluation.config import EvaluateConfig
from tasks.evaluation.prompts import prompt_set
from tasks.evaluation.side_by_side import drafter_at, evaluate_drafters
from tasks.paths import DATA_DIR, REPO_ROOT
from tasks.server.config import ServerConfig
from tasks.server.cpu.shim import gpu_present
from tasks.target.architectures import load_tokenizer
from tasks.target.models import resolve_model
from tasks.train.checkpoint import identity_changes
from tasks.train.config import TrainConfig
from tasks.train.launch import result_from_dir
from tasks.train.loop import train

DEMO = REPO_ROOT / "configs" / "demo.yaml"
PROMPTS = DATA_DIR / "heldout_prompts.jsonl"
# One lever each, against the base: the draft vocabulary's size (and so the
# share of positions it covers), TTT depth, the loss, the learning rate at
# the base's epochs (the same time budget).
ARMS = {
    "base": {},
    "vocab-8k": {"draft_vocab_size": 8192},
    "vocab-16k": {"draft_vocab_size": 16384},
    "ttt-5": {"ttt_steps": 5},
    "loss-tv": {"loss": "tv"},
    "loss-kl+tv": {"loss": "kl_tv"},
    "lr-5e-3": {"lr": 5e-3},
    "lr-1e-2": {"lr": 1e-2},
}
GREEDY = "answers-greedy"  # the base recipe on the target's greedy answers (--greedy-store)


def arm_settings(arm: str) -> dict:
    if arm in ARMS:
        return ARMS[arm]
    settings = {}
    for part in arm.split("+"):
        key, sep, value = part.partition("=")
        if not sep or key not in TrainConfig.model_fields:
            raise SystemExit(f"arm {arm!r}: {part!r} is neither an arm ({', '.join(ARMS)}) nor setting=value of "
                             f"the train section")
        settings[key] = yaml.safe_load(value)
    return settings


def trained(cfg: TrainConfig, store: Path) -> dict:
    """The arm's training: run, or found under its out_dir made with the same settings."""
    out = Path(cfg.out_dir)
    config = out / "drafter" / "config.json"
    if config.is_file() and (out / "result.json").is_file():
        made = json.loads(config.read_text()).get("eagle3_training", {}).get("config")
        # Where it was trained does not change the weights (a run dir linked in).
        _, changed = identity_changes(made, cfg, store) if made else (None, {"config": 0})
        if set(changed) <= {"out_dir"}:
            print(f"  {out}: trained before with these settings, served again", flush=True)
            # Its tokens/s are that run's, on that run's code and machine load.
            return {**json.loads((out / "result.json").read_text()), "reused": True}
    t0 = time.perf_counter()
    train(cfg, store)
    print(f"  {out}: trained in {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads((out / "result.json").read_text())


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default="runs/demo/store", help="the store every arm trains on")
    parser.add_argument("--greedy-store", help="a store of the same prompts answered greedily by the target "
                                               "(the demo with --regenerate.enabled true): adds the answers lever")
    parser.add_argument("--run-dir", default="runs/recipe", help="each arm trains into RUN_DIR/<arm>")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated; the first is the base")
    parser.add_argument("--epochs", type=int, help="every arm's epochs (default: the run file's)")
    parser.add_argument("--prompts", type=int, default=96, help="held-out prompts served")
    parser.add_argument("--config", default=str(DEMO), help="the run file whose server and train sections are "
                                                            "the base")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    run_dir = Path(args.run_dir).resolve()
    values = yaml.safe_load(Path(args.config).read_text())
    base = {**values.get("train", {}), **({"epochs": args.epochs} if args.epochs else {})}
    server = ServerConfig(**values.get("server", {}))
    arms = [a for a in args.arms.split(",") if a]
    stores = {a: Path(args.store).resolve() for a in arms}
    if args.greedy_store:
        arms.append(GREEDY)
        stores[GREEDY] = Path(args.greedy_store).resolve()

    results, drafters = {}, []
    for arm in arms:
        settings = {} if arm == GREEDY else arm_settings(arm)
        cfg = TrainConfig(**{**base, **settings, "out_dir": str(run_dir / arm.replace("/", "_") / "train")})
        print(f"{arm}: {settings or 'the base recipe'} on {stores[arm]}", flush=True)
        results[arm] = trained(cfg, stores[arm])
        drafters.append(replace(drafter_at(Path(cfg.out_dir) / "drafter"), name=arm))

    model = resolve_model(server.model)
    prompts = prompt_set(str(PROMPTS), count=args.prompts, tokenizer=load_tokenizer(str(model)), store=None,
                         heldout_fraction=0.05)
    evaluate = EvaluateConfig(prompt_sets=[str(PROMPTS)], num_prompts=args.prompts, max_new_tokens=48,
                              concurrency=[4], temperature=0.0, min_verify_steps=16)
    report = evaluate_drafters(server.model_copy(update={"model": str(model)}), drafters, [prompts], evaluate,
                               log_dir=run_dir / "evaluation")
    served = {r["drafter"]: r for r in report["acceptance"] if r["mode"] == "greedy"}

    first = arms[0]
    base_rate = results[first]["tokens"] / results[first]["compute_s"]
    steps = drafters[0].num_steps
    print(f"\n{len(prompts.prompts)} held-out prompts ({PROMPTS.name}), 48 greedy tokens each, served at "
          f"{steps} steps; base: {first}, {base}\n")
    print(f"{'arm':34s} {'tok/s':>7s} {'x':>5s} {'tau@' + str(steps):>7s} {'unprop':>6s} {'accept':>6s} "
          f"{'se':>5s} {'- base':>7s} {'se':>5s}  per position        equal")
    for arm in arms:
        r, s = results[arm], served[arm]
        held = r["history"][-1]
        rate = r["tokens"] / r["compute_s"]
        diff, se = paired_difference(s["per_request"], served[first]["per_request"])
        positions = " ".join(f"{p:.3f}" for p in s["per_position"])
        mark = "*" if r.get("reused") else " "
        # A ratio across runs is not one measured in this run.
        ratio = "    -" if r.get("reused") or results[first].get("reused") else f"{rate / base_rate:5.2f}"
        print(f"{arm:33s}{mark} {rate:7.0f} {ratio} {held.get(f'tau@{steps}', float('nan')):7.3f} "
              f"{held.get('unproposable', 0):6.3f} {s['pooled']:6.3f} {s['pooled_se']:5.3f} {diff:+7.3f} "
              f"{se:5.3f}  {positions:18s}  {s['outputs_equal']}")
    if any(r.get("reused") for r in results.values()):
        print("\n* trained by an earlier run: its tokens/s are that run's (other code or machine load)")
    print(f"\naccept length of each against {first}: "
          + ", ".join(f"{a} {served[a]['pooled'] / served[first]['pooled']:.3f}x" for a in arms[1:]))
    if not gpu_present():
        print("(on a CPU the training tokens/s are this CPU's; accept lengths are SGLang's count, the same on a GPU "
              "up to the numerics of its kernels)")


if __name__ == "__main__":
    main()
