"""Imported by every Python process whose PYTHONPATH holds this folder (the
SGLang server and the workers it spawns); see tasks/server/cpu/shim.py.

It does nothing unless EAGLE3_CPU_OPS=1 is set, and never on a machine
with a GPU. Then it adds the CPU operators SGLang's intel_amx backend calls,
keeps that backend, and lets tensor-parallel groups start on a CPU
(tasks/server/cpu/spec_ops.py).
"""
import os

if os.environ.get("EAGLE3_CPU_OPS") == "1":
    import sys
    import traceback

    try:
        from tasks.server.cpu.shim import gpu_present

        if not gpu_present():
            from tasks.server.cpu.spec_ops import install

            install()
    except Exception:
        # site.py would print one line and carry on, and the server would then
        # die far from the cause; stop here with the whole story instead.
        traceback.print_exc()
        sys.stderr.write("EAGLE3_CPU_OPS=1 but tasks.server.cpu.spec_ops.install() failed (above); "
                         "the repository root must be on PYTHONPATH\n")
        raise SystemExit(1)
