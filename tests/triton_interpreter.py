"""SGLang's Triton kernels, run on CPU tensors under Triton's interpreter,
in a child process of their own.

TRITON_INTERPRET=1 must be set before triton is first imported, and the
suite's process has imported it long before (SGLang's modules do): so a
test hands a module of check functions to `run`, which starts
`python -m tests.triton_interpreter MODULE NAME...` with the variable set
and reads back one JSON object, each check's returned value (JSON) or
{"error": "<type>: <message>"} for one that raised, e.g. a kernel's
compile-time rule (`arange's range must be a power of 2`).

The child leaves SGLANG_USE_CPU_ENGINE unset: with it SGLang's kernel
modules import sgl_kernel (a CUDA build) at import time; without it they
import cleanly, and the checks launch the @triton.jit kernels themselves
rather than SGLang's device-dispatching wrappers.

Triton 3.8's interpreter computes bf16 wrongly (it keeps bf16 as raw uint16
and runs dot products and float arithmetic on the bits, and truncates where
a GPU rounds to nearest even); `fix_bf16` upcasts those operations to fp32
and rounds back as a GPU does, so bf16 kernels can be compared bit for bit.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARK = "TRITON-CHECKS "


def run(module: str, checks: list[str], timeout_s: float = 900.0, *, interpret: bool = True) -> dict:
    """Each of `module`'s functions named in `checks`, run in one child
    process under the interpreter: name -> its result or {"error": ...}.
    `interpret` False: no interpreter, SGLang's CPU engine on instead (its
    plain-torch classes, e.g. the rotary embeddings, import only so)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET")}
    env.update({"TRITON_INTERPRET": "1"} if interpret else {"SGLANG_USE_CPU_ENGINE": "1"}, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "tests.triton_interpreter", module, *checks], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode or not lines:
        raise RuntimeError(f"the interpreter's child exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-6000:]}")
    return json.loads(lines[-1][len(MARK):])


def fix_bf16() -> None:
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter as ti

    def to_f32(bits):
        return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)

    def to_bf16(x):
        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)
        return t.view(torch.int16).numpy().view(np.uint16).reshape(np.shape(x))

    def f32(h):
        return ti.TensorHandle(to_f32(h.data), tl.float32) if h.dtype.scalar == tl.bfloat16 else h

    dot, binary, cast = ti.InterpreterBuilder.create_dot, ti.InterpreterBuilder.binary_op, ti.InterpreterBuilder.cast_impl
    floats = {np.add, np.multiply, np.divide, np.subtract, np.fmod, np.minimum, np.maximum, np.fmin, np.fmax}

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, f32(a), f32(b), d, input_precision, max_num_imprecise_acc)

    def binary_op(self, lhs, rhs, op):
        if op in floats and lhs.dtype.scalar == tl.bfloat16:
            return ti.TensorHandle(to_bf16(op(f32(lhs).data, f32(rhs).data)), tl.bfloat16)
        return binary(self, lhs, rhs, op)

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s == tl.bfloat16 and d == tl.float32:
            return ti.TensorHandle(to_f32(src.data), tl.float32)
        if d == tl.bfloat16 and s in (tl.float32, tl.float16, tl.float64):
            return ti.TensorHandle(to_bf16(np.asarray(src.data, dtype=np.float32)), tl.bfloat16)
        return cast(self, src, dst_type)

    ti.InterpreterBuilder.create_dot = create_dot
    ti.InterpreterBuilder.binary_op = binary_op
    ti.InterpreterBuilder.cast_impl = cast_impl
    ti.InterpreterBuilder.create_fp_trunc = lambda self, src, dst_type: cast_impl(self, src, dst_type)
    ti.InterpreterBuilder.create_fp_ext = lambda self, src, dst_type: cast_impl(self, src, dst_type)


def _main(module: str, names: list[str]) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        fix_bf16()
    checks = importlib.import_module(module)
    results = {}
    for name in names:
        try:
            results[name] = getattr(checks, name)()
        except Exception as e:  # a kernel's refusal is a result the test reads
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print(MARK + json.dumps(results), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2:])
