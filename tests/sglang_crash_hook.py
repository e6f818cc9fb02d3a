"""A forward hook loaded into a real SGLang capture server (`--forward-hooks`)
that kills the scheduler process whenever a forward's token ids contain the
poison sequence: the server dies as it would on a request that crashes it
(SGLang then takes down its whole process tree). Used by
tests/test_faults_crash_loop.py."""
from __future__ import annotations

import os
import signal

import torch


def make_crash_hook(config: dict):
    poison = torch.tensor(config["poison"])

    def hook(module, args, output):
        ids = args[0]  # the embedding's input: this forward's token ids, every request in the batch
        if ids is None or ids.numel() < len(poison):
            return
        windows = ids.reshape(-1).unfold(0, len(poison), 1).cpu()
        if bool((windows == poison).all(dim=1).any()):
            os.kill(os.getpid(), signal.SIGKILL)

    return hook
