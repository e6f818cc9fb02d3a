"""Running stock SGLang on a machine without a GPU.

SGLang's CPU engine only engages with `SGLANG_USE_CPU_ENGINE=1`, and the PyPI
sgl_kernel it imports links `libcuda.so.1`, so the server also needs a stub
driver on its library path (csrc/libcuda_stub.c). On a machine with a GPU
neither is applied: the stub must never shadow a real driver.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

from tasks.paths import REPO_ROOT, cache_root

STUB_SOURCE = REPO_ROOT / "csrc" / "libcuda_stub.c"
# Holds the sitecustomize.py that server processes import at start-up.
SGLANG_SITE_DIR = Path(__file__).resolve().parent / "sglang_site"
CPU_OPS_SWITCH = "EAGLE3_CPU_OPS"


def gpu_present() -> bool:
    """True when an NVIDIA or AMD GPU device node exists.

    Checked from device nodes, not by importing torch, so the launcher decides
    before any CUDA library is loaded into this process.
    """
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are fast only with AVX512-BF16 or AMX; without them, torch
    emulates bf16 and runs it ~50x slower than fp32 (measured here: 1.8 vs
    113 GFLOP/s)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(requested: str, *, cpu: bool) -> str:
    """The server's compute dtype. "auto" keeps the checkpoint's dtype, except
    on a CPU without fast bf16, where float32 is many times faster. The store
    keeps bf16 either way."""
    if requested == "auto" and cpu and not cpu_has_fast_bf16():
        return "float32"
    return requested


def build_libcuda_stub() -> Path:
    """Compile the stub once per source version; returns the folder holding
    `libcuda.so.1` (the folder goes on LD_LIBRARY_PATH)."""
    source = STUB_SOURCE.read_bytes()
    out_dir = cache_root() / "libcuda-stub" / hashlib.sha256(source).hexdigest()[:12]
    lib = out_dir / "libcuda.so.1"
    if lib.exists():
        return out_dir
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError(
            "No C compiler found to build the libcuda stub that SGLang needs on a "
            "machine without a GPU: install gcc (apt-get install gcc)."
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".libcuda.so.1.{os.getpid()}"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1",
         "-o", str(tmp), str(STUB_SOURCE)],
        check=True, capture_output=True, text=True,
    )
    os.replace(tmp, lib)
    return out_dir


def cpu_thread_binding(ranks: int, cores: list[int] | None = None) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` ranks on this process's cores:
    contiguous shares, or one core each in turn when there are fewer cores
    than ranks. SGLang refuses to start more CPU ranks than NUMA nodes
    without it."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if len(cores) < ranks:
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    share = len(cores) // ranks
    spans = [(cores[r * share], cores[r * share + share - 1]) for r in range(ranks)]
    return "|".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def checkpoint_classes(*folders: str | Path) -> list[str]:
    """The model classes the checkpoints in `folders` name (config.json's
    "architectures"); [] where one is unreadable: nothing to go by."""
    classes = []
    for folder in folders:
        try:
            classes += json.loads((Path(folder) / "config.json").read_text())["architectures"]
        except (OSError, ValueError, KeyError, TypeError):
            return []
    return classes


@lru_cache(maxsize=None)
def _model_modules() -> dict[str, str]:
    """SGLang's model modules, name -> source, read from disk (importing
    sglang here would cost the launcher seconds)."""
    found = importlib.util.find_spec("sglang")
    if found is None or not found.submodule_search_locations:
        return {}
    models = Path(found.submodule_search_locations[0]) / "srt" / "models"
    return {p.stem: p.read_text(errors="replace") for p in models.glob("*.py") if p.stem != "__init__"}


def registry_skips(classes: list[str]) -> str | None:
    """SGLANG_DISABLED_MODEL_ARCHS for a server of `classes`: every SGLang
    model module that names none of them. SGLang's model registry imports
    all of its ~250 modules in every server (1.8 s a launch on this CPU, of
    ~16); a CPU server (the tests, the demo) imports those it serves.
    None, for SGLang's own registry, where a class is in no module (its
    Transformers fallback, or its own refusal, then) or none is known."""
    modules = _model_modules()
    if not classes or not modules or not all(any(c in src for src in modules.values()) for c in classes):
        return None
    return ",".join(sorted(m for m, src in modules.items() if not any(c in src for c in classes)))


def server_environment(base: dict[str, str] | None = None, *, cpu: bool | None = None,
                       cpu_ops: bool = False, ranks: int = 1, dtype: str = "auto",
                       classes: list[str] = ()) -> dict[str, str]:
    """The environment for an SGLang server process.

    `cpu=None` decides from the hardware. On a CPU-only machine: the CPU engine
    switch, the stub driver, torch.compile off for a float32 server, no
    crash diagnostics (SGLang's 5-s wait before them), and the sitecustomize
    (tasks/server/cpu/sglang_site; it needs the repository root on PYTHONPATH
    too, which the launcher adds) that makes a SIGTERM stop prompt
    (tasks/server/cpu/shutdown.py) and, with `cpu_ops=True`, supplies the
    operators SGLang's intel_amx attention backend calls
    (tasks/server/cpu/spec_ops.py): speculative decoding and MLA targets need
    that backend, and servers of `ranks` > 1 its fix for CPU tensor-parallel
    groups, and SGLang's model registry limited to the modules of `classes`
    (the target's and the drafter's: registry_skips). On a GPU machine: `base`
    unchanged, since SGLang's own kernels serve all of that there.
    """
    env = dict(os.environ if base is None else base)
    if cpu is None:
        cpu = not gpu_present()
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        stub_dir = str(build_libcuda_stub())
        paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([stub_dir, *paths])
        if ranks > 1:
            env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_thread_binding(ranks))
        # SGLang torch.compile's a few small helpers (sampler, speculative
        # path, rotary, MoE top-k); on a CPU inductor builds each with g++ at
        # its first call (97 s at the first speculative request on 2 cores)
        # and every new server process traces them again (20-25 s a
        # speculative server, seen), for helpers that take microseconds
        # eagerly. Only in float32, where eager and compiled agree to
        # float32's rounding: in bf16 inductor keeps fp32 inside its fused
        # kernels where eager rounds every op, and eager moved a greedy
        # near-tie of tiny gpt-oss between its plain and speculative servers.
        if dtype == "float32":
            env.setdefault("TORCHDYNAMO_DISABLE", "1")
        # After a scheduler crash SGLang sleeps 5 s "to let GPU activity
        # settle" before a py-spy dump and a CUDA coredump; on a CPU there is
        # no GPU to settle and no coredump to take, and a crashed scheduler
        # leaves nothing to py-spy: the relaunch waits for nothing.
        env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
        env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
        if cpu_ops:
            env[CPU_OPS_SWITCH] = "1"
        skips = registry_skips(list(classes))
        if skips is not None:
            env.setdefault("SGLANG_DISABLED_MODEL_ARCHS", skips)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([str(SGLANG_SITE_DIR), *paths])
    return env
