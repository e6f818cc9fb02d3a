"""States from other weights never mix into a store: the manifest
fingerprints the target's weights (tasks/target/fingerprint.py), so a
fine-tune with its base model's config.json byte for byte is refused."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tasks.store.ledger.open import open_store
from tasks.store.manifest import StoreError, build_manifest, manifest_path
from tasks.target.architectures import architecture_at, load_tokenizer
from tasks.target.fingerprint import weights_fingerprint
from tasks.target.layers import AuxLayers


def manifest_for(model):
    return build_manifest(model, load_tokenizer(model), AuxLayers.for_model(8), architecture_at(model),
                          max_length=512, policy="truncate", sources=["d.jsonl"])


@pytest.fixture
def fine_tune(tiny_model, tmp_path):
    """The tiny model with every weight nudged: config.json byte for byte the same."""
    out = tmp_path / "fine-tune" / tiny_model.name  # same folder name: only the weights differ
    shutil.copytree(tiny_model, out)
    weights = load_file(out / "model.safetensors")
    save_file({k: (v.float() + 1e-2).to(v.dtype) for k, v in weights.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    return out


def test_the_fingerprint_sees_weights_not_paths(tiny_model, fine_tune, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    assert weights_fingerprint(copy) == weights_fingerprint(tiny_model)
    assert weights_fingerprint(fine_tune) != weights_fingerprint(tiny_model)
    data = bytearray((copy / "model.safetensors").read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header] ^= 0x01  # one bit of the first tensor, a sampled block
    (copy / "model.safetensors").write_bytes(bytes(data))
    assert weights_fingerprint(copy) != weights_fingerprint(tiny_model)


def test_a_fine_tune_with_the_same_config_is_refused(tiny_model, fine_tune, tmp_path):
    assert (fine_tune / "config.json").read_bytes() == (tiny_model / "config.json").read_bytes()
    store = tmp_path / "store"
    open_store(store, manifest_for(tiny_model))
    before = manifest_path(store).read_bytes()
    with pytest.raises(StoreError, match="captured from other weights"):
        open_store(store, manifest_for(fine_tune))
    assert manifest_path(store).read_bytes() == before
    open_store(store, manifest_for(tiny_model))  # the same weights again: fine


def model_info_server(model_path: str):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"model_path": model_path}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def test_a_server_that_serves_another_model_is_refused(tiny_model, fine_tune, tmp_path):
    from tasks.server.launch import check_serves
    from tasks.sglang_api import ServerError

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    for served, ok in ((tiny_model, True), (copy, True), (fine_tune, False), (tmp_path / "nothing", False)):
        url, server = model_info_server(str(served))
        try:
            if ok:
                check_serves(url, tiny_model)
            else:
                with pytest.raises(ServerError, match=f"serves {served}, not the target"):
                    check_serves(url, tiny_model)
        finally:
            server.shutdown()
