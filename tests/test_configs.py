"""The example run files in configs/: each is loaded by the flow its own
usage line names and validated, with nothing in it ignored; and the
extraction one runs for real from the command line, on a tiny MoE served
with tensor parallelism and data-parallel attention (tp 2 x dp 2)."""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from prefect import Flow

from flows.cli import config_from_argv
from flows.config import as_record
from tests.conftest import ARTIFACTS, demo_rows, write_jsonl

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def flow_of(path: Path) -> Flow:
    """The flow of the usage line in the file's header."""
    usage = re.search(rf"python -m (flows\.\w+) --config configs/{re.escape(path.name)}", path.read_text())
    assert usage, f"{path.name} names no `python -m flows.X --config configs/{path.name}` usage line"
    module = importlib.import_module(usage.group(1))
    (flow,) = [v for v in vars(module).values() if isinstance(v, Flow) and v.fn.__module__ == module.__name__]
    return flow


def leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def test_there_is_a_run_file_for_each_kind_of_run():
    assert {p.stem for p in CONFIGS} >= {"demo", "extract", "train", "pipeline", "nodes", "kimi-k2.5", "regenerate",
                                        "regenerate-nodes"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_run_file_loads_and_every_key_in_it_is_used(path):
    flow = flow_of(path)
    values, _ = config_from_argv(flow, ["--config", str(path)])
    resolved = leaves(as_record(values))
    for key, given in leaves(yaml.safe_load(path.read_text())).items():
        assert resolved[key] == given, (path.name, key)


def test_the_kimi_run_file_is_shaped_like_the_served_model():
    values, _ = config_from_argv(flow_of(REPO / "configs" / "kimi-k2.5.yaml"), ["--config", str(REPO / "configs" / "kimi-k2.5.yaml")])
    server, store, train = values["server"], values["store"], values["train"]
    assert (server.tp_size, server.dp_size, server.dp_attention) == (8, 8, True)
    assert store.dtype == "float8_e4m3fn" and (train.devices, train.sharding) == (8, "fsdp")


def test_a_run_file_with_data_parallel_attention_reaches_sglangs_command_line(tmp_path):
    """From a YAML file to SGLang's own parser: the groups it serves."""
    import argparse

    from flows.extract import extract_hidden_states
    from sglang.srt.server_args import ServerArgs
    from tasks.server.launch import CaptureSpec, build_command

    run = tmp_path / "run.yaml"
    run.write_text("server: {model: /models/m, tp_size: 2, dp_size: 2}\n")
    values, _ = config_from_argv(extract_hidden_states, ["--config", str(run), "--server.dp-attention"])
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    cmd = build_command(CaptureSpec(values["server"], dump_dir=tmp_path, capture_module="model"), 1234, cpu=True)
    args = parser.parse_args(cmd[3:])
    assert (args.tp_size, args.attn_dp_size) == (2, 2)


@pytest.mark.server
def test_the_extraction_run_file_captures_every_dp_group_from_the_command_line(prefect_api, tmp_path):
    # tp 2, dp 2 with data-parallel attention: two schedulers, each with its
    # own requests and only their tokens at the decoder stack's output. A
    # hook writing on TP rank 0 alone would lose every request DP group 1
    # serves; the first rank of each attention-TP group must write.
    from tasks.store.reader import StoreReader
    from tasks.target.layers import AuxLayers
    from tasks.target.reference import load_reference_model, per_token_cosine, reference_states
    from tests.tiny_models import TINY_QWEN3_MOE, ensure_model

    model = ensure_model(TINY_QWEN3_MOE)
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(8))
    store = tmp_path / "store"
    argv = [sys.executable, "-m", "flows.extract", "--config", "configs/extract.yaml",
            "--server.model", str(model), "--server.tp-size", "2", "--server.dp-size", "2", "--server.dp-attention",
            "--server.dtype", "float32", "--server.max-total-tokens", "4096", "--capture.dataset", str(dataset),
            "--capture.aux-layer-ids", "2,4,5", "--capture.batch-size", "4", "--capture.max-length", "256",
            "--store.path", str(store)]
    done = subprocess.run(argv, cwd=REPO, env={**os.environ, "PREFECT_API_URL": prefect_api}, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{"):])
    assert result["samples"] == 8 and result["verification"]["ok"]
    log = (store / "logs" / "sglang-server.log").read_text()
    (ARTIFACTS / "dp-attention-server.log").write_text(log)
    assert "DP0 TP0] Prefill batch" in log and "DP1 TP1] Prefill batch" in log  # both groups served some
    kept = yaml.safe_load(next((store / "runs").glob("*-extract_hidden_states-config.yaml")).read_text())
    assert kept["server"]["dp_attention"] is True and kept["server"]["tp_size"] == 2
    assert kept["capture"]["max_length_policy"] == "truncate"  # from the run file
    # Every stored sample is the target's, whichever group served it.
    reader = StoreReader(store)
    layers = AuxLayers((2, 4, 5))
    reference = load_reference_model(str(model), torch.float32)
    for i in range(len(reader)):
        s = reader[i]
        aux, final = reference_states(reference, s["input_ids"].tolist(), layers)
        assert per_token_cosine(s["aux_hidden_states"], aux).min() >= 0.999, i
        assert per_token_cosine(s["final_hidden_state"], final).min() >= 0.999, i
