import importlib.util
import re
import subprocess
from pathlib import Path

from tasks.server.cpu.shim import build_libcuda_stub, server_environment
from tasks.server.processes import group_members


def defined_symbols(lib: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines()}


def test_stub_defines_every_driver_symbol_sgl_kernel_needs():
    pkg = Path(importlib.util.find_spec("sgl_kernel").origin).parent
    needed = set()
    for so in pkg.rglob("*.so"):
        out = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True).stdout
        needed |= {m.group(1) for m in re.finditer(r"\b(cu[A-Z]\w*?)(?:@\S*)?$", out, re.M)}
    assert needed, "found no libcuda symbols in sgl_kernel: has its layout changed?"
    stub = build_libcuda_stub() / "libcuda.so.1"
    missing = needed - defined_symbols(stub)
    assert not missing, f"add these to csrc/libcuda_stub.c: {sorted(missing)}"


def test_cpu_environment_puts_stub_first_and_enables_cpu_engine():
    env = server_environment({"LD_LIBRARY_PATH": "/opt/x", "PATH": "/bin"}, cpu=True)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "TORCHDYNAMO_DISABLE" not in env
    # torch.compile off in float32 only: in bf16 it changes what is computed.
    assert server_environment({}, cpu=True, dtype="float32")["TORCHDYNAMO_DISABLE"] == "1"
    assert "TORCHDYNAMO_DISABLE" not in server_environment({}, cpu=True, dtype="bfloat16")
    # No crash diagnostics (and no 5-s wait for them) on a CPU, unless asked for.
    assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    assert server_environment({"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1"}, cpu=True)["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"
    first, rest = env["LD_LIBRARY_PATH"].split(":", 1)
    assert (Path(first) / "libcuda.so.1").is_file() and rest == "/opt/x"


def test_gpu_environment_is_left_alone():
    base = {"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64", "PATH": "/bin"}
    assert server_environment(base, cpu=False) == base
    assert server_environment(base, cpu=False, classes=["LlamaForCausalLM"]) == base


def test_a_cpu_servers_model_registry_holds_the_modules_of_its_classes():
    """SGLang's registry skips every model module that names none of the
    served classes (the target's and the drafter's); it is left whole where
    a class is in no module, for SGLang's own fallback or refusal."""
    from tasks.server.cpu.shim import _model_modules, registry_skips

    modules = _model_modules()
    assert len(modules) > 200 and {"llama", "llama_eagle3", "kimi_k25", "deepseek_v2", "qwen3_moe"} <= set(modules)
    skips = set(registry_skips(["KimiK25ForConditionalGeneration", "Eagle3DeepseekV2ForCausalLM"]).split(","))
    kept = set(modules) - skips
    assert {"kimi_k25", "kimi_k25_eagle3"} <= kept and {"llama", "qwen3_moe", "gpt_oss"} <= skips
    assert all("KimiK25ForConditionalGeneration" in modules[m] or "Eagle3DeepseekV2ForCausalLM" in modules[m]
               for m in kept)
    assert registry_skips(["LlamaForCausalLM", "NoSuchModelForCausalLM"]) is None
    assert registry_skips([]) is None
    env = server_environment({}, cpu=True, classes=["LlamaForCausalLM"])
    assert "llama" not in env["SGLANG_DISABLED_MODEL_ARCHS"].split(",")
    assert "SGLANG_DISABLED_MODEL_ARCHS" not in server_environment({}, cpu=True)
    own = {"SGLANG_DISABLED_MODEL_ARCHS": "grok"}  # the user's setting stands
    assert server_environment(own, cpu=True, classes=["LlamaForCausalLM"])["SGLANG_DISABLED_MODEL_ARCHS"] == "grok"


def test_cpu_ranks_get_their_own_cores_or_share_them_in_turn():
    from tasks.server.cpu.shim import cpu_thread_binding

    assert cpu_thread_binding(2, list(range(16))) == "0-7|8-15"
    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(4, [0, 1]) == "0|1|0|1"
    env = server_environment({}, cpu=True, ranks=2)
    assert len(env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert server_environment({"SGLANG_CPU_OMP_THREADS_BIND": "3|5"}, cpu=True, ranks=2)[
        "SGLANG_CPU_OMP_THREADS_BIND"] == "3|5"  # the user's binding stands


def test_a_cpu_server_reads_its_sigterm_at_once_then_runs_sglangs_own_stop():
    import asyncio

    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from tasks.server.cpu import shutdown

    assert shutdown.is_server_process(["/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "m"])
    assert not shutdown.is_server_process(["/venv/bin/python", "-c", "from multiprocessing.spawn import spawn_main"])
    seen = []

    async def sglangs(self):  # stands for SGLang's watchdog: drain, ShutdownReq, kill
        seen.append(self.gracefully_exit)

    class Manager:
        gracefully_exit = False

    original = TokenizerManager.sigterm_watchdog
    TokenizerManager.sigterm_watchdog = sglangs
    try:
        shutdown.poll_sigterm_quickly()
        shutdown.poll_sigterm_quickly()  # once only: never a wrapper around the wrapper

        async def stop_after_a_while(manager):
            watchdog = asyncio.create_task(TokenizerManager.sigterm_watchdog(manager))
            await asyncio.sleep(3 * shutdown.POLL_S)
            assert not seen  # still watching
            manager.gracefully_exit = True
            await watchdog

        asyncio.run(stop_after_a_while(Manager()))
    finally:
        TokenizerManager.sigterm_watchdog = original
    # SGLang's own stop ran once, with the flag already set: its 5 s poll loop is skipped.
    assert seen == [True]


def test_a_cpu_servers_workers_are_forked_from_its_launcher(capture_server):
    def auxv(pid: int) -> bytes:
        return Path(f"/proc/{pid}/auxv").read_bytes()

    launcher = capture_server.process.pid  # the leader of the server's process group
    workers = [p for p in group_members(launcher) if p != launcher]
    assert len(workers) >= 2, workers  # a scheduler and the detokenizer
    # SGLang renames its workers' command lines, so the proof is the kernel's
    # auxiliary vector: copied by fork, made anew (stack and vDSO addresses
    # randomised, randomize_va_space > 0) by the exec of a spawned worker.
    assert Path("/proc/sys/kernel/randomize_va_space").read_text().strip() != "0"
    assert all(auxv(w) == auxv(launcher) for w in workers)
    # and the session's captures come from these forked schedulers.
    assert capture_server.alive()
