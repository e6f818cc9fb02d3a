"""The hook's request filtering, driven the way SGLang's LlamaModel calls it.

The real server tests (test_capture_server.py) cover the hook end to end; the
cases here are the ones a shared server cannot show: capture_all, decode
passes, and a rid that is unsafe yet carries the pipeline's prefix.
"""
import enum
from types import SimpleNamespace

import pytest
import torch

from tasks.capture.dump import read_capture
from tasks.capture.hook import make_batch_hook, make_capture_hook, writes_on_this_rank


class Mode(enum.Enum):
    EXTEND = 1
    DECODE = 2


def run_hook(tmp_path, rids, lens, mode=Mode.EXTEND, **config):
    hook = make_capture_hook({"dump_dir": str(tmp_path), **config})
    total = sum(lens)
    module = SimpleNamespace(layers_to_capture=[2, 4, 5])
    ids = torch.arange(total)
    final = torch.arange(total * 4, dtype=torch.float32).reshape(total, 4)
    aux = [final + 1000 * k for k in range(1, 4)]
    batch = SimpleNamespace(forward_mode=mode, rids=rids, extend_prefix_lens_cpu=[0] * len(rids),
                            extend_seq_lens_cpu=lens, input_ids=ids)
    hook(module, (ids, None, batch), (final, aux))
    hook.writer.close(timeout=30)  # the files are written by the hook's background writer
    return final, aux


def test_slices_each_request_and_skips_foreign_rids(tmp_path):
    final, aux = run_hook(tmp_path, ["HEALTH_CHECK_1", "e3-a", "e3-b"], [1, 3, 2])
    a = read_capture(tmp_path, "e3-a", [1, 2, 3], aux_layer_ids=(1, 3, 4))
    assert torch.equal(a.final_hidden_state, final[1:4])
    assert torch.equal(a.aux_hidden_states[:, 2], aux[2][1:4])
    b = read_capture(tmp_path, "e3-b", [4, 5])
    assert torch.equal(b.final_hidden_state, final[4:6])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e3-a@0.safetensors", "e3-b@0.safetensors"]


def test_capture_all_takes_foreign_rids_but_never_unsafe_ones(tmp_path):
    run_hook(tmp_path, ["HEALTH_CHECK_1", "e3-../../x", "e3-ok"], [1, 2, 2], capture_all=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["HEALTH_CHECK_1@0.safetensors", "e3-ok@0.safetensors"]
    assert not (tmp_path.parent / "x@0.safetensors").exists()


def test_decode_passes_write_nothing(tmp_path):
    run_hook(tmp_path, ["e3-a"], [1], mode=Mode.DECODE)
    assert list(tmp_path.iterdir()) == []


def test_a_failing_write_does_not_raise_into_the_server(tmp_path):
    (tmp_path / "e3-a@0.safetensors").mkdir()  # the rename onto it fails
    final, _ = run_hook(tmp_path, ["e3-a", "e3-b"], [2, 2])
    assert (tmp_path / "e3-a@0.safetensors").is_dir()
    # One request's failure costs only that request, and leaves no temp file.
    assert torch.equal(read_capture(tmp_path, "e3-b", [2, 3]).final_hidden_state, final[2:4])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e3-a@0.safetensors", "e3-b@0.safetensors"]


def fake_forward(tmp_path, *, keyword_call=False, packed=False, input_ids_arg="ids", padded_rows=0):
    """One prefill of two requests through both hooks, called as SGLang's
    classes call them: the first decoder layer positionally (positions,
    hidden, forward_batch), the stack positionally or by keyword only."""
    hook = make_capture_hook({"dump_dir": str(tmp_path)})
    layer_hook = make_batch_hook({})
    lens = [3, 2]
    total = sum(lens) + padded_rows
    ids = torch.arange(10, 10 + sum(lens))
    final = torch.randn(total, 4)
    aux = [torch.randn(total, 4) for _ in range(3)]
    batch = SimpleNamespace(forward_mode=Mode.EXTEND, rids=["e3-a", "e3-b"], extend_prefix_lens_cpu=[0, 0],
                            extend_seq_lens_cpu=lens, input_ids=ids)
    module = SimpleNamespace(layers_to_capture=[2, 4, 5])
    layer_hook(SimpleNamespace(), (torch.arange(total), final, batch, None), None)
    out_aux = torch.cat(aux, dim=-1) if packed else aux
    args = () if keyword_call else ({"ids": ids, "none": None}[input_ids_arg], None, batch)
    hook(module, args, (final, out_aux))
    hook.writer.close(timeout=30)
    return final, aux, ids


@pytest.mark.parametrize("keyword_call,packed,input_ids_arg", [
    (False, False, "ids"),   # Llama, Qwen3: positional, list of aux states
    (False, True, "none"),   # Kimi-K2.5's language model: input_ids=None, DeepSeek's packed [T, 3H]
    (True, False, "ids"),    # Qwen3-VL: the stack called by keyword only
])
def test_every_calling_convention_and_aux_form_gives_the_same_dumps(tmp_path, keyword_call, packed, input_ids_arg):
    final, aux, ids = fake_forward(tmp_path, keyword_call=keyword_call, packed=packed, input_ids_arg=input_ids_arg)
    b = read_capture(tmp_path, "e3-b", ids[3:5].tolist(), aux_layer_ids=(1, 3, 4))
    assert torch.equal(b.final_hidden_state, final[3:5])
    for k in range(3):
        assert torch.equal(b.aux_hidden_states[:, k], aux[k][3:5])


def test_padded_rows_after_the_requests_are_ignored(tmp_path):
    final, _, ids = fake_forward(tmp_path, padded_rows=3)
    assert torch.equal(read_capture(tmp_path, "e3-a", ids[:3].tolist()).final_hidden_state, final[:3])


def test_an_output_shorter_than_the_batch_writes_nothing(tmp_path):
    hook = make_capture_hook({"dump_dir": str(tmp_path)})
    batch = SimpleNamespace(forward_mode=Mode.EXTEND, rids=["e3-a"], extend_prefix_lens_cpu=[0],
                            extend_seq_lens_cpu=[5], input_ids=torch.arange(5))
    final = torch.randn(4, 4)  # one token short
    hook(SimpleNamespace(layers_to_capture=[2, 4, 5]), (None, None, batch), (final, [final] * 3))
    hook.writer.close(timeout=30)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ranks,writes", [
    ({"attn_tp_rank": 0, "attn_cp_rank": 0, "attn_cp_size": 1}, True),   # first rank of an attention-TP group
    ({"attn_tp_rank": 1, "attn_cp_rank": 0, "attn_cp_size": 1}, False),  # a replica of the same tokens
])
def test_the_first_rank_of_each_attention_tp_group_writes(ranks, writes):
    # Under --enable-dp-attention at tp 4, dp 2 the ranks with attn_tp_rank 0
    # are tp ranks 0 and 2: each writes its own DP group's requests.
    assert writes_on_this_rank(ranks) is writes


def test_attention_context_parallelism_is_refused():
    with pytest.raises(RuntimeError, match="context parallelism"):
        writes_on_this_rank({"attn_tp_rank": 0, "attn_cp_rank": 0, "attn_cp_size": 2})
