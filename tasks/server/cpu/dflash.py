"""DFlash in stock SGLang 0.5.23 on a CPU: what the platform must say and
the worker must be spared for a DFLASH server to start and draft there,
with intel_amx and the operators of tasks/server/cpu/spec_ops.py (whose
install() calls this in every server process, only without a GPU)."""
from __future__ import annotations

import torch


def dflash_on_cpu() -> None:
    """SGLang 0.5.23 starts a DFLASH server on CUDA, NPU and XPU only
    (arg_groups/speculative_hook.py:291), and picks its draft attention
    backend among GPU ones (:886-940), unless the platform is out of tree
    and says what it supports. For the duration of that check the CPU
    platform says so: DFLASH, drafting with intel_amx (the operators
    here). A block verify is one chain of drafts, which intel_amx reads as
    tree_topk 1 (causal, no tree mask; intel_amx_backend.py:115), an
    attribute DFlashVerifyInput lacks."""
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES, add_draft_attention_backend_choices
    from sglang.srt.platforms import current_platform
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    sglangs = speculative_hook._handle_dflash
    says = {"is_out_of_tree": lambda: True,
            "supports_speculative_algorithm": lambda algorithm: algorithm == "DFLASH",
            "supports_speculative_draft_attention_backend": lambda algorithm, backend: backend == "intel_amx",
            "get_default_speculative_draft_attention_backend": lambda algorithm: "intel_amx"}

    def handle_dflash(server_args) -> None:
        for name, answer in says.items():
            setattr(current_platform, name, answer)
        try:
            sglangs(server_args)
        finally:
            for name in says:
                delattr(current_platform, name)

    speculative_hook._handle_dflash = handle_dflash
    if "intel_amx" not in DRAFT_ATTENTION_BACKEND_CHOICES:  # the draft worker's own check (out of tree's way)
        add_draft_attention_backend_choices(["intel_amx"])
    DFlashVerifyInput.tree_topk = 1
    # The worker marks a tensor used on the current stream
    # (dflash_worker_v2.py:2481); a CPU has no streams, and torch refuses
    # record_stream for a CPU one.
    record_stream = torch.Tensor.record_stream

    def record_stream_on_a_device(tensor, stream):
        if tensor.device.type != "cpu":
            record_stream(tensor, stream)

    torch.Tensor.record_stream = record_stream_on_a_device
    # SGLang casts every forward's input_embeds to bf16 (model_runner.py:1772):
    # the draft block's embeddings then meet a float32 server's weights. In
    # the runner's own dtype here (a DFlash server runs in float32 on a CPU:
    # in bf16 its table_qk_norm_rope_ launches Triton, models/dflash.py:383).
    from sglang.srt.model_executor.model_runner import ModelRunner

    extend_kwargs = ModelRunner._extend_forward_kwargs

    def in_the_runners_dtype(self, forward_batch, pp_proxy_tensors):
        kwargs = extend_kwargs(self, forward_batch, pp_proxy_tensors)
        if forward_batch.input_embeds is not None and forward_batch.replace_embeds is None:
            kwargs["input_embeds"] = forward_batch.input_embeds.to(self.dtype)
        return kwargs

    ModelRunner._extend_forward_kwargs = in_the_runners_dtype
