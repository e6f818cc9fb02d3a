"""The hook's request filtering, driven the way SGLang's LlamaModel calls it.

The real server tests (test_capture_server.py) cover the hook end to end; the
cases here are the ones a shared server cannot show: capture_all, decode
passes, and a rid that is unsafe yet carries the pipeline's prefix.
"""
import enum
from types import SimpleNamespace

import torch

from tasks.capture.dump import read_capture
from tasks.capture.hook import make_capture_hook


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
                            extend_seq_lens_cpu=lens)
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
