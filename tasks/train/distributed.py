"""The ranks of a run under torchrun (tasks/train/launch.py): the process
group, each rank's device, the TTT module wrapped as they train it (DDP, or
FSDP2 over all ranks, or HSDP: sharded within a node, replicated across
nodes), and states moved between whole tensors (what a checkpoint holds, in
every mode) and this rank's shards. Without torchrun: one rank, nothing
wrapped, sharded or reduced."""
from __future__ import annotations

import contextlib
import datetime
import os

import torch
from torch.distributed.tensor import DTensor, distribute_tensor



def process_group() -> tuple[int, int]:
    """(rank, world), joining the process group torchrun set up the
    environment for."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        # The other ranks wait in a collective while rank 0 alone counts the
        # draft vocabulary and evaluates: minutes on a large store, past
        # NCCL's default 10.
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                             timeout=datetime.timedelta(hours=2))
    return (torch.distributed.get_rank(), world) if world > 1 else (0, 1)


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def on_any_rank(flags: torch.Tensor, world: int) -> torch.Tensor:
    """Each flag (1.0 or 0.0) set where it is set on any rank, so that every
    rank makes the same decision and none is left waiting in a collective
    the others skipped."""
    if world > 1:
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return flags


def parallel(ttt: torch.nn.Module, sharding: str, device: torch.device, world: int) -> torch.nn.Module:
    """The training module (TTT, or DFlashStep) as the ranks train it: DDP,
    or FSDP2 over all ranks ("fsdp") or a (nodes, ranks per node) mesh
    ("hsdp": replicated across nodes, sharded within one). Under FSDP2 the
    whole drafter is one group (gathering it whole costs little next to
    the target, and every method the forward calls sees whole weights), the
    frozen target matrices left out (replicated, as under DDP: sharding them
    would gather them every step and save nothing at the step's peak).
    FSDP2 does not broadcast: each rank keeps its slice of its own copy,
    which is rank 0's (the same seeded initialisation, the same broadcast
    vocabulary, the same checkpoint)."""
    if world == 1:
        return ttt
    if sharding == "ddp":
        return torch.nn.parallel.DistributedDataParallel(ttt, broadcast_buffers=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if sharding == "hsdp":
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        mesh = init_device_mesh(device.type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    # Frozen: the target's embedding (and a DFlash drafter's head, the target's too).
    return fully_shard(ttt, mesh=mesh, ignored_params={p for p in ttt.drafter.parameters() if not p.requires_grad})


def gradient_sync(ttt: torch.nn.Module, last: bool):
    """Gradients are reduced across the ranks in a step's last backward only:
    the ones before it accumulate locally (accumulate > 1)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(ttt, FSDPModule):
        ttt.set_requires_gradient_sync(last)
    elif isinstance(ttt, torch.nn.parallel.DistributedDataParallel) and not last:
        return ttt.no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def whole_weights(ttt: torch.nn.Module):
    """Under FSDP2 the drafter's weights are shards between steps; rank 0's
    evaluation and export call it outside the wrapped forward, so every rank
    gathers them (a collective) and frees them after."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(ttt, FSDPModule):
        yield
        return
    ttt.unshard()
    try:
        yield
    finally:
        ttt.reshard()


def whole(state, keep: bool):
    """A state (nested dicts and lists) with every sharded tensor gathered
    whole, onto the CPU where `keep` (rank 0, which writes it) and dropped on
    the others: one tensor at a time, so no device holds more than one whole.
    Every rank must call it, on the same structure (the gathers are
    collectives made in order). A checkpoint is then the same under every
    sharding."""
    if isinstance(state, DTensor):
        gathered = state.detach().full_tensor()
        return gathered.cpu() if keep else None
    if isinstance(state, dict):
        return {k: whole(v, keep) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(whole(v, keep) for v in state)
    return state


def sharded_like(optimizer_state: dict, params: list[torch.nn.Parameter]) -> dict:
    """A checkpoint's (whole) optimizer state cut into this rank's shards of
    `params` (the optimizer's, in its order), where they are sharded."""
    state = {}
    for i, entry in optimizer_state["state"].items():
        p = params[int(i)]
        state[i] = {k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                    if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.shape else v
                    for k, v in entry.items()}
    return {**optimizer_state, "state": state}
