"""SGLang's worker processes started by fork on a CPU.

SGLang 0.5.23 sets the spawn start method (engine._set_envs_and_config)
because a CUDA context cannot cross a fork. Spawned, every scheduler and the
detokenizer imports SGLang, torch and transformers again before it loads a
weight: 9-10 s a launch on 2 cores, for every server the project starts
(each test, relaunch and evaluation). A CPU server has no CUDA context, so
there its launcher forks them instead (tiny model, launch to ready:
29.5-30.7 s spawned, 17.9-18.5 s forked; bench/launch.py).

Fork is safe here because the launcher process runs no torch kernel before
it starts its workers: an OpenMP region run in a parent leaves GNU libgomp's
thread pool half-copied in a forked child, whose first parallel op then hangs
(seen with a matmul before a fork). The only threads it holds then are
OpenBLAS's (numpy's and scipy's), which re-create themselves after a fork.
Every launch in the test suite passes through this path;
`EAGLE3_CPU_WORKERS=spawn` in the launching environment keeps SGLang's spawn.
"""
from __future__ import annotations

import multiprocessing

WORKERS_SWITCH = "EAGLE3_CPU_WORKERS"


def start_workers_by_fork() -> None:
    """Turn SGLang's `multiprocessing.set_start_method("spawn")` into fork in
    this process. Only the launcher calls it: its children are forked, so
    they never run it again."""
    sglangs = multiprocessing.set_start_method
    if getattr(sglangs, "forks", False):
        return

    def set_start_method(method, force=False):
        sglangs("fork" if method == "spawn" else method, force=force)

    set_start_method.forks = True
    multiprocessing.set_start_method = set_start_method
