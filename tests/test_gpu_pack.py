"""The GPU pack's plumbing (bench/gpu_pack.py), run on this CPU at toy sizes
the way the device machine runs it: with SGLang, Prefect and pydantic not
importable (that machine has torch, not them)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Loaded at start-up by every Python process with this folder on PYTHONPATH,
# the pack's children included.
NOT_ON_THE_GPU_MACHINE = '''
import sys
from importlib.abc import MetaPathFinder


class Missing(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"sglang", "prefect", "pydantic"}:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU machine)")


sys.meta_path.insert(0, Missing())
'''


def test_the_gpu_pack_runs_every_part_without_sglang_prefect_or_pydantic(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NOT_ON_THE_GPU_MACHINE)
    env = {**os.environ, "PYTHONPATH": str(site)}
    blocked = subprocess.run([sys.executable, "-c", "import pydantic"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "not on the GPU machine" in blocked.stderr

    out = subprocess.run([sys.executable, "bench/gpu_pack.py", "--quick", "--out", str(tmp_path / "pack.json")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    pack = json.loads((tmp_path / "pack.json").read_text())
    failed = {k: pack[k].get("error") for k in ("hook", "writer", "train", "fsdp2") if not pack[k]["ok"]}
    assert not failed, {k: pack[k].get("trace") for k in failed}
    assert pack["environment"]["device"] == "cpu" and pack["size"] == "quick"

    (hook,) = pack["hook"]["result"]
    assert hook["writer"]["hook_fraction"] > 0 and hook["sync"]["hook_fraction"] > 0
    writer = pack["writer"]["result"]
    assert writer["returncode"] == 0, writer
    assert writer["cuda_test"] == "skipped"  # no GPU here; on the device machine: "passed"
    assert len(writer["tests"]) >= 5 and sum(v == "passed" for v in writer["tests"].values()) == len(writer["tests"]) - 1
    (step,) = pack["train"]["result"]
    assert "error" not in step and step["peak_gib"] > 0 and step["tokens_per_s"] > 0, step
    fsdp2 = pack["fsdp2"]["result"]
    # One rank: the sharded step computes what the unsharded one does.
    assert fsdp2["ok"] and fsdp2["sharded_params"] > 0, fsdp2
