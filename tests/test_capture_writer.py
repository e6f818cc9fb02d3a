"""The hook's background writer, driven as the forward drives it: many
requests, a writer that falls behind, a writer that fails."""
import logging
import threading
import time

import pytest
import torch

from tasks.capture.dump import read_capture, write_chunk
from tasks.capture.writer import DumpWriter

H = 8
LAYERS = (1, 3, 4)


def states(n, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.arange(n) + seed, torch.randn(n, 3, H, generator=g).to(dtype), torch.randn(n, H, generator=g).to(dtype)


def test_many_requests_each_file_right_in_the_models_dtype(tmp_path):
    writer = DumpWriter(tmp_path, max_pending_bytes=64 << 10)
    sent = {}
    for k in range(120):
        dtype = torch.float32 if k % 3 == 0 else torch.bfloat16
        ids, aux, final = states(1 + k % 17, k, dtype)
        rid = f"e3-{k}"
        sent[rid] = (ids.clone(), aux.clone(), final.clone())
        writer.submit(rid, 0, ids, aux, final, LAYERS, "post-norm")
        # The server reuses its buffers for the next forward: the dump must
        # hold what the hook saw, not what is there later.
        aux.fill_(7)
        final.fill_(7)
    assert writer.flush(timeout=60)
    for rid, (ids, aux, final) in sent.items():
        cap = read_capture(tmp_path, rid, ids.tolist(), aux_layer_ids=LAYERS)
        assert cap.aux_hidden_states.dtype == aux.dtype  # never upcast
        assert torch.equal(cap.aux_hidden_states, aux) and torch.equal(cap.final_hidden_state, final), rid
    writer.close(timeout=10)
    assert writer.errors == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_chunks_of_one_request_are_written_in_order(tmp_path):
    writer = DumpWriter(tmp_path)
    ids, aux, final = states(30, 1)
    for a, b in ((0, 10), (10, 25), (25, 30)):
        writer.submit("e3-x", a, ids[a:b], aux[a:b], final[a:b], LAYERS, "post-norm")
    writer.close(timeout=30)
    cap = read_capture(tmp_path, "e3-x", ids.tolist())
    assert torch.equal(cap.final_hidden_state, final) and len(cap.files) == 3


def test_a_writer_that_falls_behind_blocks_the_producer_and_loses_nothing(tmp_path, caplog):
    gate = threading.Event()
    peak = []

    def slow_write(*args):
        gate.wait(30)
        peak.append(writer._pending_bytes)
        return write_chunk(*args)

    one = sum(t.numel() * t.element_size() for t in states(10, 0))
    writer = DumpWriter(tmp_path, max_pending_bytes=2 * one, write=slow_write)
    done = []

    def forward():
        for k in range(6):
            writer.submit(f"e3-{k}", 0, *states(10, k), LAYERS, "post-norm")
            done.append(k)

    producer = threading.Thread(target=forward)
    with caplog.at_level(logging.WARNING, logger="eagle3.capture_writer"):
        producer.start()
        time.sleep(0.5)
        # Two hand-offs fit; the third waits for the stuck writer.
        assert producer.is_alive() and done == [0, 1]
        assert writer._pending_bytes <= 2 * one
        gate.set()
        producer.join(30)
    assert not producer.is_alive() and done == list(range(6))
    assert writer.flush(timeout=30) and writer.blocked_s > 0.3
    assert "dump writer is behind" in caplog.text
    assert max(peak) <= 2 * one
    for k in range(6):
        ids, aux, final = states(10, k)
        assert torch.equal(read_capture(tmp_path, f"e3-{k}", ids.tolist()).final_hidden_state, final)
    writer.close(timeout=10)


def test_a_write_error_costs_only_that_request(tmp_path, caplog):
    def failing_write(dump_dir, rid, *args):
        if rid == "e3-bad":
            raise OSError("disk full (injected)")
        return write_chunk(dump_dir, rid, *args)

    writer = DumpWriter(tmp_path, write=failing_write)
    with caplog.at_level(logging.ERROR, logger="eagle3.capture_writer"):
        for rid in ("e3-a", "e3-bad", "e3-b"):
            writer.submit(rid, 0, *states(4, 1), LAYERS, "post-norm")
        assert writer.flush(timeout=30)
    assert writer.errors == 1 and "writing rid e3-bad" in caplog.text and "disk full" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e3-a@0.safetensors", "e3-b@0.safetensors"]
    writer.submit("e3-after", 0, *states(4, 1), LAYERS, "post-norm")  # the writer keeps going
    writer.close(timeout=30)
    assert (tmp_path / "e3-after@0.safetensors").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_states_are_copied_after_the_forward_on_a_side_stream(tmp_path):
    writer = DumpWriter(tmp_path)
    ids, aux, final = (t.cuda() for t in states(64, 3))
    aux = aux * 1  # produced by a kernel on the forward's stream
    expect = aux.cpu()
    writer.submit("e3-gpu", 0, ids, aux, final, LAYERS, "post-norm")
    aux.fill_(7)  # a later kernel on the forward's stream
    writer.close(timeout=30)
    cap = read_capture(tmp_path, "e3-gpu", ids.tolist())
    assert torch.equal(cap.aux_hidden_states, expect)


def test_a_full_dump_dir_mid_file_leaves_no_partial_dump(tmp_path, caplog, monkeypatch):
    # The disk fills while the hook's writer is inside a dump file: safetensors'
    # write stops with ENOSPC after part of the file. That request gets no
    # dump (its capture is retried by the client), nothing partial stays
    # behind to be read or to hold space, and the writer goes on once there
    # is room again.
    import errno

    from tasks.capture import dump

    real_save, full = dump.save_file, [True]

    def fills_up(tensors, path, metadata=None):
        if full[0]:
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(dump, "save_file", fills_up)
    writer = DumpWriter(tmp_path)
    with caplog.at_level(logging.ERROR, logger="eagle3.capture_writer"):
        writer.submit("e3-full", 0, *states(4, 1), LAYERS, "post-norm")
        assert writer.flush(timeout=30)
    assert writer.errors == 1 and "No space left on device" in caplog.text
    assert list(tmp_path.iterdir()) == []  # the partial temp file is gone
    full[0] = False
    writer.submit("e3-later", 0, *states(4, 1), LAYERS, "post-norm")
    writer.close(timeout=30)
    assert [p.name for p in tmp_path.iterdir()] == ["e3-later@0.safetensors"]
