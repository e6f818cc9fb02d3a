"""Imported by every Python process whose PYTHONPATH holds this folder (the
SGLang server and the Python processes it starts); see tasks/server/cpu/shim.py,
which puts it there on a machine without a GPU only.

In the server's main process it makes a SIGTERM stop start at once
(tasks/server/cpu/shutdown.py) and its workers start by fork
(tasks/server/cpu/workers.py). With EAGLE3_CPU_OPS=1 it adds the CPU
operators SGLang's intel_amx backend calls, keeps that backend, and lets
tensor-parallel groups start on a CPU (tasks/server/cpu/spec_ops.py).
"""
import os
import sys
import traceback


def _fail(what: str) -> None:
    # site.py would print one line and carry on, and the server would then
    # die far from the cause; stop here with the whole story instead.
    traceback.print_exc()
    sys.stderr.write(f"{what} failed (above); the repository root must be on PYTHONPATH\n")
    raise SystemExit(1)


try:
    from tasks.server.cpu.shim import gpu_present
except Exception:
    _fail("importing tasks.server.cpu.shim")

if not gpu_present():
    # flashinfer holds CUDA kernels only, and importing it costs every server
    # process 2.6 s of its ~16-s start on this CPU; sgl_kernel and SGLang
    # import it where it is installed and go without where it is not, as
    # here (find_spec gives None, an import raises ModuleNotFoundError).
    sys.modules.setdefault("flashinfer", None)
    if os.environ.get("EAGLE3_CPU_OPS") == "1":
        try:
            from tasks.server.cpu.spec_ops import install

            install()
        except Exception:
            _fail("EAGLE3_CPU_OPS=1 but tasks.server.cpu.spec_ops.install()")
    try:
        from tasks.server.cpu.shutdown import is_server_process, poll_sigterm_quickly
        from tasks.server.cpu.workers import WORKERS_SWITCH, start_workers_by_fork

        if is_server_process(sys.orig_argv):
            poll_sigterm_quickly()
            if os.environ.get(WORKERS_SWITCH) != "spawn":
                start_workers_by_fork()
    except Exception:
        _fail("tasks.server.cpu: the server process's stop and workers")
