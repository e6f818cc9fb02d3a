"""A forward hook loaded into a real SGLang capture server (`--forward-hooks`)
that kills the scheduler process whenever a forward's token ids contain the
poison sequence: the server dies as it would on a request that crashes it
(SGLang then takes down its whole process tree). With `poison_once` and
`once` (a file), that sequence crashes it the first time only: a crash that
was no request's doing. Used by tests/test_faults_crash_loop.py."""
from __future__ import annotations

import os
import signal

import torch


def make_crash_hook(config: dict):
    poison = torch.tensor(config["poison"])
    once = torch.tensor(config.get("poison_once", config["poison"]))
    flag = config.get("once")

    def holds(ids, sequence) -> bool:
        if ids is None or ids.numel() < len(sequence):
            return False
        return bool((ids.reshape(-1).unfold(0, len(sequence), 1).cpu() == sequence).all(dim=1).any())

    def hook(module, args, output):
        ids = args[0]  # the embedding's input: this forward's token ids, every request in the batch
        if holds(ids, poison):
            os.kill(os.getpid(), signal.SIGKILL)
        if flag and holds(ids, once) and not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    return hook
