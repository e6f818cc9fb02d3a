"""A forward hook loaded into a real speculative SGLang server
(`--forward-hooks`) that negates the target's final norm output, so its
logits are negated and greedy decoding picks another token: a serving-side
fault that changes greedy output, which the evaluation must catch. Used by
tests/test_serving.py."""
from __future__ import annotations


def make_negating_hook(config: dict):
    def hook(module, args, output):
        # SGLang's fused norm returns (normed, residual) when given a residual.
        if isinstance(output, tuple):
            return (-output[0], *output[1:])
        return -output

    return hook
