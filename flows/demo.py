"""The embedded default, end to end: `eagle3_pipeline` on configs/demo.yaml
(SmolLM2-135M-Instruct and the bundled demo conversations, answered by
SmolLM2 itself), then a check of stored samples against an independent HF
forward, and a table of held-out tau, SGLang's accept length and the
speed-up.

    python -m flows.demo [--samples-checked N] [--config FILE] [--train.epochs 3 ...]

Any key of the pipeline's config can be given after the run file, as for
`python -m flows.pipeline` (`--help` lists them).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from flows.cli import config_from_argv, help_text
from flows.config import ConfigError
from flows.pipeline import eagle3_pipeline
from tasks.paths import REPO_ROOT
from tasks.server.cpu.shim import gpu_present
from tasks.store.ledger.open import open_ledger
from tasks.store.reader import StoreReader
from tasks.target.layers import AuxLayers
from tasks.target.models import resolve_model
from tasks.target.reference import load_reference_model, per_token_cosine, reference_states
from tasks.train.launch import result_from_dir

DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"
CPU_NOTE = (" — on this CPU the drafter's attention runs as plain-PyTorch stand-ins for SGLang's CPU "
            "kernels, so this is not the GPU figure")


def run_dir_and_values(flow, argv: list[str], default_config: Path, default_run_dir: Path, usage: str,
                       prog: str) -> tuple[Path, dict] | None:
    """A bench's command line on the demo's pipeline (bench/variants.py,
    fp8_quality.py): `--run-dir DIR`, then the flow's own (run file
    `default_config` unless --config is given). None after printing
    `usage` and the flow's options for --help."""
    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(usage + "\n\n" + help_text(flow, prog).split("\n", 1)[1])
        return None
    run_dir = default_run_dir
    if "--run-dir" in argv:
        i = argv.index("--run-dir")
        run_dir = Path(argv[i + 1])
        del argv[i:i + 2]
    if "--config" not in argv:
        argv = ["--config", str(default_config), *argv]
    return run_dir, config_from_argv(flow, argv)[0]


def check_against_reference(store, model_path, count: int) -> dict:
    """Worst per-token cosine between stored (bf16) states and an fp32 HF
    forward, over `count` samples spread across the store."""
    reader = StoreReader(store)
    layers = AuxLayers(tuple(reader.manifest["aux_layers"]["sglang_layer_output_ids"]))
    model = load_reference_model(str(model_path), torch.float32)
    worst = {"aux": 1.0, "final": 1.0, "mean": []}
    for i in range(0, len(reader), max(1, len(reader) // count))[:count]:
        s = reader[i]
        aux, final = reference_states(model, s["input_ids"].tolist(), layers)
        cos_aux, cos_final = per_token_cosine(s["aux_hidden_states"], aux), per_token_cosine(s["final_hidden_state"], final)
        worst["aux"] = min(worst["aux"], cos_aux.min().item())
        worst["final"] = min(worst["final"], cos_final.min().item())
        worst["mean"].append(torch.cat([cos_aux.flatten(), cos_final]).mean().item())
    worst["mean"] = sum(worst["mean"]) / len(worst["mean"])
    return worst


SIMULATION_COLUMNS = (("heldout_training", "training, held-out answers"),
                      ("served_text_all_positions", "training's chain on the served text"),
                      ("served_text_verify_steps", "its verify steps replayed"),
                      ("sglang", "SGLang"))


def served_text_lines(simulated: dict, prompt_set: str) -> str:
    """Acceptance per draft position: training's simulation on its held-out
    answers and on the very text SGLang verified (all positions, then only
    where SGLang's verify steps start), beside SGLang's count."""
    pp = simulated["per_position"]
    width = max(len(label) for _, label in SIMULATION_COLUMNS)
    lines = [f"acceptance per draft position on {prompt_set} (share of chains whose drafts 1..k all hit):"]
    for key, label in SIMULATION_COLUMNS:
        values = pp.get(key)
        lines.append(f"  {label:<{width}}  " + ("  ".join(f"{v:.3f}" for v in values) if values else "n/a"))
    beyond = [f"{name} at draft {k + 1}" for name, gaps in simulated["gaps"].items()
              for k, g in enumerate(gaps) if g and g["beyond_noise"]]
    lines.append(f"  replay equals SGLang on {simulated['replay_equals_sglang']} of {simulated['requests']} requests; "
                 f"gaps beyond 3 standard errors: {', '.join(beyond) or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "python -m flows.demo"
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__ + "\n  --samples-checked N  stored samples checked against an HF forward (default: 4)\n\n"
              + help_text(eagle3_pipeline, prog).split("\n", 1)[1])
        return
    samples_checked = 4
    if "--samples-checked" in argv:
        i = argv.index("--samples-checked")
        samples_checked = int(argv[i + 1])
        del argv[i:i + 2]
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        argv = ["--config", str(DEMO_CONFIG), *argv]
    try:
        values, print_config = config_from_argv(eagle3_pipeline, argv)
    except ConfigError as e:
        raise SystemExit(f"{prog}: config error:\n{e}") from None
    if print_config:
        from flows.config import to_yaml

        print(to_yaml(values), end="")
        return

    t0 = time.perf_counter()
    result = eagle3_pipeline(**values)
    elapsed = time.perf_counter() - t0
    train = values["train"]
    check = check_against_reference(result["store"], resolve_model(values["server"].model), samples_checked)
    summary = open_ledger(Path(result["store"])).summary()
    steps = train.serve_steps
    held_out = result_from_dir(Path(train.out_dir)).heldout_samples
    rows = [
        ("store", f"{result['store']}: {summary['samples']} samples, {summary['tokens']:,} tokens, verified"),
        ("stored vs HF forward", f"{samples_checked} samples: min cosine aux {check['aux']:.4f}, "
                                 f"final {check['final']:.4f}, mean {check['mean']:.5f}"),
        *([("regenerated", "{rows} conversations answered by the target ({answer_tokens:,} tokens), {cut} with "
                           "their last answer cut at max_new_tokens, {dropped} dropped for one, {quarantined} "
                           "quarantined".format(**result["regenerated"]))] if result.get("regenerated") else []),
        ("drafter", result["drafter_dir"]),
        ("held-out tau", f"{held_out} samples: {result['heldout_tau']:.2f} over {train.ttt_steps} "
                         f"TTT steps, tau@{steps} {result[f'heldout_tau@{steps}']:.2f}, exact (chained) "
                         f"{result[f'heldout_tau_exact@{steps}']:.2f} (untrained {result['untrained_tau']:.2f})"),
        ("SGLang accept length", f"{result['prompt_set']} ({result['sglang_prompts']} prompts): "
                                 f"{result['sglang_accept_length']:.3f} ± {result['sglang_accept_length_se']:.3f} "
                                 f"tokens per verify step pooled (± its standard error, requests as clusters), "
                                 f"{result['sglang_accept_length_mean_of_means']:.2f} mean of "
                                 f"per-request means, at {steps} steps (accept rate "
                                 f"{result['sglang_accept_rate']:.2f}); greedy output identical: "
                                 f"{result['outputs_equal']}"),
        ("speed-up", f"{result['speedup']:.2f}x per user at {result['streams']} stream(s) "
                     f"({result['spec_tokens_per_s']:.1f} vs {result['plain_tokens_per_s']:.1f} tok/s)"
                     f"{CPU_NOTE if not gpu_present() else ''}"),
        ("evaluation", f"{result['evaluation']} (every prompt set, the sweep, sweep.png)"),
        ("run time", f"{elapsed / 60:.1f} min (whole pipeline, server start-ups included)"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    if result.get("served_text"):
        print("\n" + served_text_lines(result["served_text"], result["prompt_set"]))
    # Stored bf16 against an fp32 forward: rounding alone keeps this near 1.
    if check["mean"] < 0.999 or check["aux"] < 0.99 or check["final"] < 0.99:
        raise SystemExit("stored states deviate from the independent forward")


if __name__ == "__main__":
    main()
