"""Drafters compared the way users compare them: each served speculatively
in SGLang beside the plain target, on the same prompt sets and server
settings, in one run.

The plain target runs once (launched, or the attached server): its greedy
outputs per set and its sweep. Then each drafter's speculative server runs
in turn, one server at a time: greedy outputs per set (which must equal the
plain ones), acceptance greedy and, on a GPU, sampled (tasks/evaluation/acceptance.py), and
the same sweep (tasks/evaluation/sweep.py). Every server the launcher starts has
the prefix cache off, so a repeated prompt costs what a new one does.

EAGLE-3 and DFlash drafters of one target compare in the same run and the
same figures: a verify step checks a chain of num_steps drafts (EAGLE-3) or
a block of block_size - 1 (DFlash), and SGLang counts both the same way
(verify steps, drafts accepted per step), so the accept length and the
share of steps accepting their k-th draft mean the same for both.
"""
from __future__ import annotations

import asyncio
import csv
import json
import logging
import shlex
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Sequence

import httpx

from tasks.failures import Permanent
from tasks.evaluation.acceptance import acceptance, raw_counts
from tasks.evaluation.generate import GenerationRun, generate_all, serving_dtype
from tasks.evaluation.config import EvaluateConfig
from tasks.evaluation.prompts import PromptSet
from tasks.evaluation.served_text import capture_texts, drafter_layers, load_drafter, served_texts, simulate
from tasks.evaluation.sweep import SweepPoint, sweep
from tasks.server.config import ServerConfig
from tasks.server.cpu.shim import gpu_present
from tasks.server.launch import CaptureSpec, LaunchSpec, ServerHandle, SpeculativeSpec, check_serves, launch_server
from tasks.sglang_api import ServerError, server_says
from tasks.target.embeddings import load_target_embeddings
from tasks.train.families import FAMILIES, exported_family
from tasks.train.launch import result_from_dir
from tasks.train.loop import RESULT

logger = logging.getLogger("eagle3.serving")

# On a CPU the speculative path runs plain-PyTorch stand-ins for SGLang's kernels (tasks/server/cpu/).
CPU_SPEEDS = ("speeds measured on a CPU: not GPU figures (the drafter's attention runs as plain-PyTorch "
              "stand-ins for SGLang's kernels); the acceptance counts are real")
# SGLang 0.5.23 verifies every request greedily on a CPU (EAGLE: speculative/eagle_utils.py:500,
# _verify_uses_greedy; DFlash: no sampling-verify kernel, dflash_utils.py:46): a sampled request's
# drafts are checked against the target's argmax, so its counts would be a greedy figure under a
# sampled name.
CPU_SAMPLED = ("acceptance measured greedy only: on a CPU SGLang verifies sampled requests against the target's "
               "argmax, so a sampled figure would be a greedy one (evaluate.temperature applies on a GPU)")


@dataclass(frozen=True)
class Drafter:
    """A drafter under evaluation: its exported directory, the drafts a
    verify step checks (EAGLE-3: the steps it is served with; DFlash: its
    block_size - 1) and, when its training run is beside it, its held-out
    tau."""
    name: str
    path: Path
    num_steps: int
    heldout_tau: float | None = None
    heldout: dict | None = None  # its run's last held-out metrics (per-step chain and counts)
    hooks: tuple[dict, ...] = ()  # forward hooks for its server (`--forward-hooks`): probes, injected faults
    method: str = "eagle3"  # or "dflash": how SGLang serves it

    def served_as(self, server: ServerConfig) -> SpeculativeSpec:
        return FAMILIES[self.method].served_spec(server, self.path, self.num_steps, extra_hooks=self.hooks)


def drafter_at(path: str | Path, num_steps: int | None = None) -> Drafter:
    """The drafter exported at `path` (train_drafter's <out_dir>/drafter):
    an EAGLE-3 drafter with its serve_steps unless `num_steps` is given, a
    DFlash drafter with its block; its run's held-out tau."""
    path = Path(path).resolve()
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no drafter at {path}: expected an exported EAGLE-3 or DFlash drafter, a "
                                f"directory with config.json")
    config = json.loads(config_path.read_text())
    family = exported_family(config, path)
    method, steps = family.name, family.exported_drafts(config, num_steps)
    if not steps:
        raise ValueError(f"{path}/config.json does not say the steps it serves with: give num_steps")
    final = result_from_dir(path.parent).final if (path.parent / RESULT).is_file() else None
    return Drafter(f"{path.parent.name}/{path.name}", path, int(steps), final["tau"] if final else None, final,
                   method=method)


class SpeculationChangedOutput(Permanent, RuntimeError):
    """Greedy output with a drafter differs from greedy output without it."""


def evaluate_drafters(server: ServerConfig, drafters: Sequence[Drafter], sets: Sequence[PromptSet],
                      cfg: EvaluateConfig, *, log_dir: str | Path, baseline_url: str | None = None,
                      baseline_api_key: str | None = None, startup_timeout_s: float = 600.0,
                      request_timeout_s: float = 600.0, capture_server: ServerHandle | None = None) -> dict:
    """The comparison, written to `log_dir` (evaluation.json, acceptance.csv,
    sweep.csv, sweep.png, requests.jsonl, the servers' logs: plain-server.log,
    drafter<j>-server.log in the drafters' order; with cfg.simulate,
    served_text.csv and capture-server.log) and returned. With cfg.simulate
    the served text is captured on `capture_server` (a running capture
    server of the target, in the same dtype) or on one launched last. Raises
    SpeculationChangedOutput, after writing it all, when a drafter changed
    any greedy output."""
    if not drafters:
        raise ValueError("no drafter to evaluate")
    if len({d.name for d in drafters}) != len(drafters):
        raise ValueError(f"drafter names repeat: {[d.name for d in drafters]}; give each its own name")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if baseline_url is not None:
        check_serves(baseline_url, Path(server.model), api_key=baseline_api_key)
    dtype = serving_dtype(server.model, cfg.dtype, baseline_url, baseline_api_key)
    dflash = [d.name for d in drafters if d.method == "dflash"]
    if dflash and dtype != "float32" and not gpu_present():
        raise ValueError(f"{dflash}: a DFlash drafter is served on a CPU in float32 only, not {dtype} (in bf16 "
                         f"SGLang's DFlash attention calls a Triton kernel, table_qk_norm_rope_, models/dflash.py:"
                         f"383): set evaluate.dtype float32, and serve an attached baseline in float32")
    plain = LaunchSpec(server.model_copy(update={"dtype": dtype}))
    commands: dict[str, str] = {}

    def generate(url, api_key, prompts, tag, temperature=0.0) -> GenerationRun:
        return asyncio.run(generate_all(url, prompts, api_key=api_key, max_new_tokens=cfg.max_new_tokens,
                                        ignore_eos=True, concurrency=max(cfg.concurrency), tag=tag,
                                        timeout_s=request_timeout_s, temperature=temperature))

    def measure(name: str, tag: str, url: str, api_key: str | None, speculative: bool, log_tail):
        # Request ids carry `tag`, not the names: a file path or a drafter's path is no part of an id.
        started = time.monotonic()
        try:
            greedy = {s.name: generate(url, api_key, s.prompts, f"{tag}-set{k}") for k, s in enumerate(sets)}
            sampled = ({s.name: generate(url, api_key, s.prompts, f"{tag}-set{k}-t", cfg.temperature)
                        for k, s in enumerate(sets)} if speculative and cfg.temperature > 0 and gpu_present() else {})
            points = sweep(url, [p for s in sets for p in s.prompts], cfg.concurrency,
                           max_new_tokens=cfg.max_new_tokens, speculative=speculative,
                           min_verify_steps=cfg.min_verify_steps, timeout_s=request_timeout_s, tag=tag, api_key=api_key)
        except (httpx.HTTPError, ServerError) as e:
            raise ServerError(f"generation on the {name} server failed: {e}\n{log_tail()}") from e
        logger.info("%s measured in %.0f s", name, time.monotonic() - started)
        return greedy, sampled, points

    def launched(name: str, tag: str, spec: LaunchSpec, speculative: bool):
        log_path = log_dir / f"{tag}-server.log"
        logger.info("starting the %s server (log: %s)", name, log_path)
        with launch_server(spec, log_path, timeout_s=startup_timeout_s) as live:
            commands[name] = shlex.join(map(str, live.process.args))
            return measure(name, tag, live.url, live.api_key, speculative,
                           lambda: f"last lines of {log_path}:\n{live.log_tail()}")

    if baseline_url is None:
        plain_greedy, _, plain_points = launched("plain", "plain", plain, False)
    else:
        logger.info("plain outputs from the running server at %s, in %s", baseline_url, dtype)
        commands["plain"] = f"(attached: {baseline_url}, prefix cache " + (
            "off)" if server_says(baseline_url, "/server_info", "disable_radix_cache", "its prefix cache setting",
                                  api_key=baseline_api_key) else "on: its sweep may be optimistic)")
        plain_greedy, _, plain_points = measure("plain", "plain", baseline_url, baseline_api_key, False,
                                                lambda: f"(the server at {baseline_url})")

    rows, sweep_rows, changed, raw, served, differs = [], [], {}, [], {}, {}
    for j, d in enumerate(drafters):
        greedy, sampled, points = launched(d.name, f"drafter{j}", d.served_as(plain.server), True)
        served[d.name] = greedy
        differ = differs[d.name] = greedy_changes(plain_greedy, greedy)
        changed.update({f"{d.name} on {name}": prompts for name, prompts in differ.items()})
        for s in sets:
            differing = differ.get(s.name)
            for mode, run in (("greedy", greedy[s.name]), (f"temperature {cfg.temperature}", sampled.get(s.name))):
                if run is None:
                    continue
                rows.append({"drafter": d.name, "prompt_set": s.name, "mode": mode, "heldout_tau": d.heldout_tau,
                             "outputs_equal": not differing if mode == "greedy" else None,
                             **acceptance(run.meta_infos, d.num_steps).to_dict()})
                raw += [{"drafter": d.name, "prompt_set": s.name, "mode": mode, "prompt": i,
                         **raw_counts(m)} for i, m in enumerate(run.meta_infos)]
        for p, q in zip(plain_points, points):
            sweep_rows.append(sweep_row(d.name, p, q))

    simulated, texts = [], []
    # The simulation replays EAGLE-3's chain; a DFlash drafter's acceptance is SGLang's count alone.
    chains = [d for d in drafters if d.method == "eagle3"]
    if cfg.simulate and not chains:
        logger.warning("evaluate.simulate: no EAGLE-3 drafter among these, nothing to simulate")
    elif cfg.simulate:
        def on_served_text(handle: ServerHandle) -> tuple[list[dict], list[dict]]:
            return simulate_served_text(handle, Path(server.model), chains, sets, cfg, plain_greedy, served,
                                        differs, request_timeout_s)

        if capture_server is not None:
            simulated, texts = on_served_text(capture_server)
        else:
            layers = sorted({i for d in chains for i in drafter_layers(d.path)})
            capture = CaptureSpec(plain.server, dump_dir=log_dir / "served-text-dumps", aux_layer_ids=layers)
            logger.info("starting a capture server for the served text (log: %s)", log_dir / "capture-server.log")
            with launch_server(capture, log_dir / "capture-server.log", timeout_s=startup_timeout_s) as live:
                simulated, texts = on_served_text(live)

    report = {
        "out_dir": str(log_dir),
        "baseline": baseline_url or "launched",
        "drafters": [{"name": d.name, "path": str(d.path), "method": d.method, "num_steps": d.num_steps,
                      "heldout_tau": d.heldout_tau} for d in drafters],
        "prompt_sets": {s.name: len(s.prompts) for s in sets},
        "settings": {**cfg.model_dump(exclude={"baseline_api_key"}), "dtype": dtype, "sglang": version("sglang"),
                     "commands": commands, "device": "gpu" if gpu_present() else "cpu"},
        "speeds_note": None if gpu_present() else CPU_SPEEDS,
        "sampled_note": None if gpu_present() or not cfg.temperature else CPU_SAMPLED,
        "acceptance": rows, "sweep": sweep_rows, "greedy_changed": changed, "served_text": simulated,
    }
    write_report(report, log_dir)
    # SGLang's own per-request counts, from which every acceptance figure above can be recomputed.
    (log_dir / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw))
    if texts:  # the target's greedy continuations the simulation scored, as token ids
        (log_dir / "served_text.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts))
    if changed:
        raise SpeculationChangedOutput(
            f"greedy output with a drafter differs from plain greedy output: {changed} (prompt indices per set; "
            f"dtype {dtype}). Server logs and the report: {log_dir}")
    return report


def simulate_served_text(capture: ServerHandle, target: Path, drafters: Sequence[Drafter], sets: Sequence[PromptSet],
                         cfg: EvaluateConfig, plain: dict[str, GenerationRun], served: dict[str, dict],
                         differs: dict[str, dict[str, list[int]]], timeout_s: float) -> tuple[list[dict], list[dict]]:
    """Each drafter scored as training scores it on the text SGLang
    verified (tasks/evaluation/served_text.py), per prompt set: the capture
    server continues each prompt greedily num_steps past max_new_tokens and
    captures prompt and continuation. A prompt is left out for every
    drafter where that continuation is not the plain server's output, and
    for a drafter that changed its output (`differs`: greedy_changes per
    drafter). Returns the rows and the texts (token ids, per prompt set and
    prompt)."""
    extra = max(d.num_steps for d in drafters)
    concurrency = max(cfg.concurrency)
    rows, kept, by_set = [], [], []
    for k, s in enumerate(sets):
        texts = served_texts(capture.url, s.prompts, max_new_tokens=cfg.max_new_tokens + extra,
                             api_key=capture.api_key, concurrency=concurrency, timeout_s=timeout_s,
                             tag=f"served-text-set{k}")
        as_served = [t.continuation[:cfg.max_new_tokens] == out
                     for t, out in zip(texts, plain[s.name].output_ids, strict=True)]
        kept += [{"prompt_set": s.name, "prompt": i, "prompt_ids": t.prompt, "continuation": t.continuation,
                  "as_served": same} for i, (t, same) in enumerate(zip(texts, as_served))]
        texts = [t if same else None for t, same in zip(texts, as_served)]
        captured = iter(capture_texts(capture.url, capture.spec.dump_dir, [t for t in texts if t],
                                      api_key=capture.api_key, rid_prefix=capture.rid_prefix,
                                      concurrency=concurrency, timeout_s=timeout_s))
        by_set.append((s, texts, [next(captured) if t else None for t in texts]))
    full_head = load_target_embeddings(target)[1].float()
    for d in drafters:
        drafter = load_drafter(d.path, target)
        for s, texts, captures in by_set:
            mine = [None if i in differs[d.name].get(s.name, ()) else t for i, t in enumerate(texts)]
            row = simulate(drafter, full_head, d.num_steps, d.heldout, mine, captures,
                           served[d.name][s.name].meta_infos, cfg.max_new_tokens)
            rows.append({"drafter": d.name, "prompt_set": s.name, **row})
            logger.info("%s on %s, per draft position: held-out %s, served text %s, its verify steps replayed %s, "
                        "SGLang %s; replay equals SGLang on %d of %d requests", d.name, s.name,
                        *(_rounded(row.get("per_position", {}).get(key)) for key in
                          ("heldout_training", "served_text_all_positions", "served_text_verify_steps", "sglang")),
                        row.get("replay_equals_sglang", 0), row["requests"])
    return rows, kept


def _rounded(values: list[float] | None) -> list[float] | None:
    return None if values is None else [round(v, 3) for v in values]


def served_text_table(rows: list[dict]) -> list[dict]:
    """The simulation per draft position, one row each: what the report's
    CSV and the UI's table show."""
    table = []
    for r in rows:
        pp, gaps = r.get("per_position"), r.get("gaps", {})
        for k in range(len(pp["sglang"]) if pp else 0):
            table.append({"drafter": r["drafter"], "prompt_set": r["prompt_set"], "draft": k + 1,
                          "heldout_training": (pp["heldout_training"] or [None] * (k + 1))[k],
                          "served_text_all_positions": pp["served_text_all_positions"][k],
                          "served_text_verify_steps": pp["served_text_verify_steps"][k], "sglang": pp["sglang"][k],
                          "text_gap_beyond_noise": (gaps["text"][k] or {}).get("beyond_noise"),
                          "start_gap_beyond_noise": gaps["where_chains_start"][k]["beyond_noise"],
                          "replay_equals_sglang": f"{r['replay_equals_sglang']}/{r['requests']}"})
    return table


def greedy_changes(plain: dict[str, GenerationRun], spec: dict[str, GenerationRun]) -> dict[str, list[int]]:
    """Per prompt set, the prompts whose greedy output the drafter changed."""
    changed = {}
    for name, run in plain.items():
        differing = [i for i, (a, b) in enumerate(zip(run.output_ids, spec[name].output_ids, strict=True)) if a != b]
        if differing:
            changed[name] = differing
    return changed


def sweep_row(drafter: str, plain: SweepPoint, spec: SweepPoint) -> dict:
    def ratio(a, b):
        return a / b if b else None

    return {"drafter": drafter, "concurrency": spec.concurrency, "requests": spec.requests,
            "verify_steps": spec.verify_steps,
            "plain_per_user_tokens_per_s": plain.per_user_tokens_per_s,
            "spec_per_user_tokens_per_s": spec.per_user_tokens_per_s,
            "per_user_speedup": ratio(spec.per_user_tokens_per_s, plain.per_user_tokens_per_s),
            "plain_total_tokens_per_s": plain.total_tokens_per_s,
            "spec_total_tokens_per_s": spec.total_tokens_per_s,
            "total_speedup": ratio(spec.total_tokens_per_s, plain.total_tokens_per_s)}


def write_report(report: dict, log_dir: Path) -> None:
    (log_dir / "evaluation.json").write_text(json.dumps(report, indent=1) + "\n")
    for name, rows in (("acceptance", report["acceptance"]), ("sweep", report["sweep"]),
                       ("served_text", served_text_table(report.get("served_text") or []))):
        if rows:
            with open(log_dir / f"{name}.csv", "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()}
                                 for r in rows)
    plot_sweep(report["sweep"], log_dir / "sweep.png", note=report.get("speeds_note"))


def plot_sweep(rows: list[dict], path: Path, note: str | None = None) -> None:
    """Total throughput against per-user speed, a line per server through
    its concurrency points (labelled), the plain target's included."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    lines = {"plain": [(r["concurrency"], r["plain_per_user_tokens_per_s"], r["plain_total_tokens_per_s"])
                       for r in rows if r["drafter"] == rows[0]["drafter"]]} if rows else {}
    for r in rows:
        lines.setdefault(r["drafter"], []).append(
            (r["concurrency"], r["spec_per_user_tokens_per_s"], r["spec_total_tokens_per_s"]))
    for name, points in lines.items():
        ax.plot([p[1] for p in points], [p[2] for p in points], marker="o", label=name)
        for c, x, y in points:
            ax.annotate(str(c), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set_xlabel("tokens/s per user")
    ax.set_ylabel("tokens/s in all")
    ax.set_title("throughput against per-user speed (labels: streams)" + ("\non a CPU: not GPU figures" if note else ""))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
