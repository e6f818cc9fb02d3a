"""The dump contract, on tensors written through the same function the hook uses."""
import json

import pytest
import torch
from safetensors import safe_open

from tasks.capture.dump import (
    CaptureError, CaptureMissing, chunk_path, is_safe_rid, new_rid, read_capture,
    remove_capture, write_chunk,
)

H = 8
LAYERS = (1, 3, 4)


def write(dump_dir, rid, start, ids, aux=None, final=None):
    n = len(ids)
    g = torch.Generator().manual_seed(start)
    aux = torch.randn(n, 3, H, generator=g).to(torch.bfloat16) if aux is None else aux
    final = torch.randn(n, H, generator=g).to(torch.bfloat16) if final is None else final
    write_chunk(dump_dir, rid, start, torch.tensor(ids), aux, final, LAYERS, "post-norm")
    return aux, final


def test_round_trip_over_chunks(tmp_path):
    rid = new_rid("7")
    ids = list(range(100, 130))
    a0, f0 = write(tmp_path, rid, 0, ids[:10])
    a1, f1 = write(tmp_path, rid, 10, ids[10:])
    cap = read_capture(tmp_path, rid, ids, aux_layer_ids=LAYERS)
    assert cap.input_ids.tolist() == ids
    assert torch.equal(cap.aux_hidden_states, torch.cat([a0, a1]))
    assert torch.equal(cap.final_hidden_state, torch.cat([f0, f1]))
    assert cap.aux_layer_ids == LAYERS and len(cap.files) == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    with safe_open(str(cap.files[0]), "pt") as f:
        assert json.loads(f.metadata()["aux_layer_ids"]) == list(LAYERS)
        assert json.loads(f.metadata()["hf_hidden_states_indices"]) == [i + 1 for i in LAYERS]
    remove_capture(cap)
    assert list(tmp_path.iterdir()) == []


def test_missing_and_incomplete(tmp_path):
    rid = new_rid()
    with pytest.raises(CaptureMissing, match="no capture"):
        read_capture(tmp_path, rid, [1, 2, 3])
    write(tmp_path, rid, 0, [1, 2])
    with pytest.raises(CaptureMissing, match="stops at token 2 of 3"):
        read_capture(tmp_path, rid, [1, 2, 3])


def test_shorter_than_sent_and_other_ids(tmp_path):
    rid = new_rid()
    write(tmp_path, rid, 0, [1, 2, 3])
    with pytest.raises(CaptureError, match="3 tokens, 2 were sent"):
        read_capture(tmp_path, rid, [1, 2])
    with pytest.raises(CaptureError, match="differ from those sent"):
        read_capture(tmp_path, rid, [1, 2, 4])
    with pytest.raises(CaptureError, match="expected"):
        read_capture(tmp_path, rid, [1, 2, 3], aux_layer_ids=(2, 3, 4))


def test_a_file_renamed_to_another_rid_is_rejected(tmp_path):
    a, b = new_rid(), new_rid()
    write(tmp_path, a, 0, [5, 6])
    chunk_path(tmp_path, a, 0).rename(chunk_path(tmp_path, b, 0))
    with pytest.raises(CaptureError, match="written for rid"):
        read_capture(tmp_path, b, [5, 6])


def test_non_finite_values_are_rejected(tmp_path):
    rid = new_rid()
    final = torch.zeros(2, H, dtype=torch.bfloat16)
    final[1, 3] = float("nan")
    write(tmp_path, rid, 0, [1, 2], final=final)
    with pytest.raises(CaptureError, match="1 non-finite values in final_hidden_state"):
        read_capture(tmp_path, rid, [1, 2])


@pytest.mark.parametrize("rid", ["../x", "a/b", ".hidden", "", "x" * 129, "a b", "é", "..", "a\x00b"])
def test_unsafe_rids(tmp_path, rid):
    assert not is_safe_rid(rid)
    with pytest.raises(ValueError, match="unsafe rid"):
        chunk_path(tmp_path, rid, 0)


def test_new_rids_are_safe_unique_and_tagged():
    rids = {new_rid("sample/../7") for _ in range(100)}
    assert len(rids) == 100
    assert all(is_safe_rid(r) and r.startswith("e3-sample7-") for r in rids)


def test_discarding_many_rids_takes_their_chunks_and_temps_and_nothing_else(tmp_path):
    from tasks.capture.dump import TMP_PREFIX, discard_rids

    names = ["e3-a-1@0.safetensors", "e3-a-1@256.safetensors", f"{TMP_PREFIX}e3-a-1@512.safetensors.77",
             "e3-b-2@0.safetensors", "e3-a-10@0.safetensors", "run.lock", "notes.txt"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert discard_rids(tmp_path, {"e3-a-1", "e3-gone"}) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e3-a-10@0.safetensors", "e3-b-2@0.safetensors",
                                                         "notes.txt", "run.lock"]
    assert discard_rids(tmp_path, set()) == 0
