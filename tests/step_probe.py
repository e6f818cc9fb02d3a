"""What every optimizer step of a training run was given and left, whole
(gathered from FSDP's shards), in the optimizer's order: the gradients as
the ranks' reduction left them and their total norm (what the loop clips),
the gradients AdamW stepped with (clipped), and its moments after the step;
one file per step and rank, `<directory>/rank-<r>/step-<n>.pt`.

For tests that compare runs by what a step computed from the same state,
never by weights after AdamW steps: Adam's first steps, lr * g / (|g| + eps),
turn a last-bit difference in a near-zero gradient (two processes, other
thread counts) into a difference of 2 lr in a weight; and clipping and Adam
would both hide a gradient of the wrong scale. In training processes a test
starts (torchrun ranks), tests/step_probe_site/sitecustomize.py records where
the environment names a directory (`ENV`)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

ENV = "EAGLE3_TEST_STEPS"


def _whole(t: torch.Tensor) -> torch.Tensor:
    # full_tensor is a collective: every rank's hook makes the same calls.
    # A copy: it may return the very tensor a replicated DTensor holds, which
    # clipping and the step then change.
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def record_steps(directory: Path) -> Callable[[], None]:
    """Start recording every optimizer step into `directory`; returns what stops it."""
    step: dict = {}
    clip = torch.nn.utils.clip_grad_norm_

    def clipping(parameters, *args, **kwargs):
        parameters = list(parameters)
        step["reduced"] = [_whole(p.grad) for p in parameters]
        norm = clip(parameters, *args, **kwargs)
        step["grad_norm"] = float(_whole(norm))
        return norm

    def params(optimizer) -> list[torch.nn.Parameter]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def before(optimizer, args, kwargs) -> None:
        step["grads"] = [_whole(p.grad) for p in params(optimizer)]

    def after(optimizer, args, kwargs) -> None:
        state = [optimizer.state[p] for p in params(optimizer)]
        record = {**step, "exp_avg": [_whole(s["exp_avg"]) for s in state],
                  "exp_avg_sq": [_whole(s["exp_avg_sq"]) for s in state]}
        step.clear()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        mine = Path(directory) / f"rank-{rank}"
        mine.mkdir(parents=True, exist_ok=True)
        torch.save(record, mine / f"step-{int(state[0]['step'])}.pt")

    # The loop looks clip_grad_norm_ up in torch.nn.utils at every step.
    torch.nn.utils.clip_grad_norm_ = clipping
    handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]

    def stop() -> None:
        torch.nn.utils.clip_grad_norm_ = clip
        for handle in handles:
            handle.remove()

    return stop


@contextlib.contextmanager
def recording_steps(directory: Path):
    """Record this process's optimizer steps into `directory` while inside."""
    stop = record_steps(directory)
    try:
        yield Path(directory)
    finally:
        stop()


def recorded(directory: Path, step: int, rank: int = 0) -> dict:
    return torch.load(Path(directory) / f"rank-{rank}" / f"step-{step}.pt", weights_only=True)


def recorded_steps(directory: Path, rank: int = 0) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in (Path(directory) / f"rank-{rank}").glob("step-*.pt"))


def probed(env: dict, directory: Path) -> dict:
    """`env` for training processes a test starts that record their steps into `directory`."""
    path = [str(Path(__file__).resolve().parent / "step_probe_site"), env.get("PYTHONPATH", "")]
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in path if p), ENV: str(directory)}
