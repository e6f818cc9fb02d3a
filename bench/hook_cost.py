"""What the capture hook costs a forward, before (it wrote the dump inside the
forward) and after (it hands the states to tasks/capture/writer.py), in one run.

    .venv/bin/python bench/hook_cost.py     # CPU: float32, 2 layers, 3 batches of 128 tokens (~15 s)
                                            # CUDA: bf16, 4 layers, 20 batches of 8192 tokens

A stack of Llama-like decoder layers in plain PyTorch (H=4096, 32 heads,
SwiGLU MLP 11008, RMSNorm, causal SDPA), run the way SGLang's LlamaModel
runs in capture mode: one flat token axis per batch, several requests in it,
output `(final after the norm, [aux states])`. The real hook
(`tasks.capture.hook.make_capture_hook`) is registered on it as
`--forward-hooks` registers it and sees a forward_batch with the requests'
rids and lengths. Variants, on the same inputs:

  (0) no hook: the forward alone;
  (1) before: the hook copies each request's states to the host and writes its
      dump file inside the forward (the previous hook, reproduced by a
      synchronous stand-in for the writer);
  (2) after: the hook hands the states to the background writer.

Per variant: the hook's time per batch (measured around the hook call) as a
fraction of the forward's own time (variant 0), and the wall time of all
batches until every dump is on disk against variant 0's. A stack of a few
layers is the hard case: a real target has 30-60 layers per forward for the
same bytes captured, so its fraction is smaller. On a CPU the model runs in
float32 (this CPU has no fast bf16 matmul), on CUDA in bf16; dumps are in the
model's dtype either way.
"""
from __future__ import annotations

import argparse
import enum
import shutil
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

import tasks.capture.hook as hook_module
from tasks.capture.dump import write_chunk
from tasks.paths import default_dump_root


class RMSNorm(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


class Layer(nn.Module):
    def __init__(self, h, heads, inter):
        super().__init__()
        self.heads = heads
        self.qkv, self.o = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
        self.gate_up, self.down = nn.Linear(h, 2 * inter, bias=False), nn.Linear(inter, h, bias=False)
        self.n1, self.n2 = RMSNorm(h), RMSNorm(h)

    def forward(self, x, lens):
        # Attention within each request only, as a prefill batch does.
        q, k, v = self.qkv(self.n1(x)).chunk(3, dim=-1)
        out, at = [], 0
        for n in lens:
            def heads(t):
                return t[at:at + n].unflatten(-1, (self.heads, -1)).transpose(0, 1)
            out.append(F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
                       .transpose(0, 1).flatten(1))
            at += n
        x = x + self.o(torch.cat(out))
        g, u = self.gate_up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class Stack(nn.Module):
    """forward(input_ids, positions, forward_batch) -> (final, [aux]) like
    SGLang's LlamaModel with --enable-return-aux-hidden-states."""

    def __init__(self, h, heads, inter, layers, vocab=1024):
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(Layer(h, heads, inter) for _ in range(layers))
        self.norm = RMSNorm(h)
        # Three capture points, as SGLang's layers_to_capture (the input of
        # layer i; i = len(layers) is the last layer's output): the last three.
        assert layers >= 2, "needs two layers for three capture points"
        self.layers_to_capture = [layers - 2, layers - 1, layers]

    def forward(self, input_ids, positions, forward_batch):
        x = self.embed(input_ids)
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux.append(x)
            x = layer(x, forward_batch.extend_seq_lens_cpu)
        if len(self.layers) in self.layers_to_capture:
            aux.append(x)
        return self.norm(x), aux


class Mode(enum.Enum):
    EXTEND = 1


class SyncWriter:
    """The hook before the background writer: copy and write inside the forward."""

    def __init__(self, dump_dir, **_):
        self.dump_dir = dump_dir

    def submit(self, rid, start, ids, aux, final, aux_layer_ids, final_state):
        write_chunk(self.dump_dir, rid, start, ids.detach().to("cpu"), aux.detach().to("cpu").clone(),
                    final.detach().to("cpu").clone(), aux_layer_ids, final_state)

    def flush(self, timeout=None):
        return True

    def close(self, timeout=None):
        pass


def run(model, batches, dump_dir, variant: str, device) -> dict:
    handle, timer = None, {"hook_s": 0.0}
    hook = None
    if variant != "none":
        hook_module.DumpWriter = SyncWriter if variant == "sync" else real_writer
        hook = hook_module.make_capture_hook({"dump_dir": str(dump_dir)})

        def timed(module, args, output):
            sync(device)  # the hook's own time, not the forward's queued kernels
            t0 = time.perf_counter()
            hook(module, args, output)
            sync(device)
            timer["hook_s"] += time.perf_counter() - t0

        handle = model.register_forward_hook(timed)
    forward_s = []
    t_all = time.perf_counter()
    with torch.inference_mode():
        for ids, batch in batches:
            sync(device)
            t0 = time.perf_counter()
            model(ids, None, batch)
            sync(device)
            forward_s.append(time.perf_counter() - t0)
    if hook is not None:
        hook.writer.close()
    wall = time.perf_counter() - t_all
    if handle is not None:
        handle.remove()
    written = sum(1 for _ in dump_dir.iterdir())
    for p in dump_dir.iterdir():
        p.unlink()
    return {"forward_s": sum(forward_s), "hook_s": timer["hook_s"], "wall_s": wall, "files": written}


def sync(device):
    # The forward's stream only: the writer's copies on its side stream are
    # meant to overlap what follows, so they are not waited for here.
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


real_writer = hook_module.DumpWriter


def measure(*, hidden: int, heads: int, intermediate: int, layers: int, tokens: int, requests: int, batches: int,
            device: str) -> dict:
    """The three variants on the same batches, in this process; figures per
    batch and as fractions of the forward alone (bench/gpu_pack.py keeps them)."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Stack(hidden, heads, intermediate, layers).to(device, dtype).eval()
    per = tokens // requests
    inputs = []
    for b in range(batches + 1):  # the first one warms up
        ids = torch.randint(0, 1024, (per * requests,), device=device)
        fb = SimpleNamespace(forward_mode=Mode.EXTEND, rids=[f"e3-b{b}-r{r}" for r in range(requests)], input_ids=ids,
                             extend_prefix_lens_cpu=[0] * requests, extend_seq_lens_cpu=[per] * requests)
        inputs.append((ids, fb))
    dump_dir = default_dump_root() / f"bench-hook-{next(tempfile._get_candidate_names())}"
    dump_dir.mkdir(parents=True)
    try:
        run(model, inputs[:1], dump_dir, "sync", device)  # warm-up: kernels, allocator, page cache
        out = {v: run(model, inputs[1:], dump_dir, v, device) for v in ("none", "sync", "writer")}
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)
    base = out["none"]["forward_s"]
    result = {"device": device.type, "layers": layers, "hidden": hidden, "tokens": tokens, "batches": batches,
              "requests": requests, "dtype": str(dtype).removeprefix("torch."),
              "captured_mb_per_batch": tokens * 4 * hidden * torch.finfo(dtype).bits // 8 / 1e6,
              "forward_ms_per_batch": 1000 * base / batches}
    for v in ("sync", "writer"):
        r = out[v]
        assert r["files"] == batches * requests, r
        result[v] = {"hook_ms_per_batch": 1000 * r["hook_s"] / batches, "hook_fraction": r["hook_s"] / base,
                     "wall_ratio": r["wall_s"] / base}
    result["after_over_before"] = out["writer"]["hook_s"] / out["sync"]["hook_s"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--layers", type=int, default=None, help="default: 2 on a CPU, 4 on CUDA")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per forward batch (default: 128 CPU, 8192 CUDA)")
    ap.add_argument("--requests", type=int, default=4, help="requests per batch")
    ap.add_argument("--batches", type=int, default=None, help="default: 3 on a CPU, 20 on CUDA")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    gpu = torch.device(args.device).type == "cuda"
    r = measure(hidden=args.hidden, heads=args.heads, intermediate=args.intermediate,
                layers=args.layers or (4 if gpu else 2), tokens=args.tokens or (8192 if gpu else 128), requests=args.requests,
                batches=args.batches or (20 if gpu else 3), device=args.device)
    print(f"{r['device']}: {r['layers']} layers, H={r['hidden']}, {r['tokens']} tokens x {r['batches']} batches "
          f"({r['requests']} requests each), {r['dtype']}; {r['captured_mb_per_batch']:.0f} MB captured per batch")
    print(f"forward alone: {r['forward_ms_per_batch']:.1f} ms per batch")
    for v, label in (("sync", "(1) before: write in the forward"), ("writer", "(2) after: background writer")):
        print(f"{label:34s} hook {r[v]['hook_ms_per_batch']:8.1f} ms per batch = {r[v]['hook_fraction']:6.3f} of the "
              f"forward; all batches until on disk {r[v]['wall_ratio']:.3f}x the forwards alone")
    print(f"hook cost after / before: {r['after_over_before']:.3f}")


if __name__ == "__main__":
    main()
