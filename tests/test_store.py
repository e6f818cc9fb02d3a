"""The store contract, checked with an independent reader: plain sqlite3 and
the safetensors byte layout parsed by hand, not tasks.store's own reader."""
import json
import sqlite3

import numpy as np
import pytest
import torch

from tasks.store.ledger import open_store
from tasks.store.manifest import StoreError
from tasks.store.reader import StoreReader
from tasks.store.shards import FORMAT, write_shard

H = 16
MANIFEST = {"format": FORMAT, "target": {"name": "m"}, "tokenizer": {"sha256": "t"}, "aux_layers": {"ids": [1, 3, 4]},
            "hidden_size": H, "dtype": "bfloat16", "max_length": 64, "max_length_policy": "truncate"}


NUMPY = {"I32": np.int32, "U8": np.uint8, "I64": np.int64, "BF16": np.uint16}  # bf16 kept as raw bits


def load_raw(path):
    """safetensors by its spec: u64 LE header size, JSON header, raw data."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    meta = header.pop("__metadata__", {})
    body = data[8 + size:]
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(body[a:b], dtype=NUMPY[info["dtype"]]).reshape(info["shape"])
    return out, meta


def item(k, n):
    g = torch.Generator().manual_seed(k)
    return {"sample_id": f"s{k:03d}", "source_row": k, "input_ids": np.arange(n, dtype=np.int32) + k,
            "loss_mask": (np.arange(n) % 2).astype(np.uint8),
            "aux_hidden_states": torch.randn(n, 3, H, generator=g), "final_hidden_state": torch.randn(n, H, generator=g)}


@pytest.fixture
def store(tmp_path):
    ledger = open_store(tmp_path / "store", MANIFEST)
    items = [[item(0, 5), item(1, 3)], [item(2, 7)]]
    for batch in items:
        ledger.commit_shard(*write_shard(tmp_path / "store", batch, source="data.jsonl"))
    return tmp_path / "store", [it for batch in items for it in batch]


def test_independent_reader_sees_packed_unpadded_samples(store):
    path, items = store
    db = sqlite3.connect(path / "ledger.sqlite")
    rows = db.execute("SELECT sample_id, shard, token_offset, num_tokens, num_loss_tokens FROM samples "
                      "ORDER BY sample_id").fetchall()
    assert [r[0] for r in rows] == ["s000", "s001", "s002"]
    for (sid, shard, offset, n, n_loss), it in zip(rows, items):
        t, meta = load_raw(path / "shards" / f"{shard}.safetensors")
        assert meta["format"] == FORMAT and sid in json.loads(meta["sample_ids"])
        assert t["offsets"][-1] == len(t["input_ids"]) == t["aux_hidden_states"].shape[0]  # no padding
        assert t["aux_hidden_states"].shape[1:] == (3, H) and t["final_hidden_state"].shape[1:] == (H,)
        assert np.array_equal(t["input_ids"][offset:offset + n], it["input_ids"])
        assert n_loss == int(it["loss_mask"].sum())
        for name in ("aux_hidden_states", "final_hidden_state"):
            expect = it[name].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            assert np.array_equal(t[name][offset:offset + n], expect), name
    assert json.loads((path / "manifest.json").read_text())["format"] == FORMAT


def test_store_reader_matches_what_was_written(store):
    path, items = store
    reader = StoreReader(path)
    assert len(reader) == 3
    by_id = {it["sample_id"]: it for it in items}
    for i in range(len(reader)):
        s = reader[i]
        it = by_id[s["sample_id"]]
        assert s["input_ids"].tolist() == it["input_ids"].tolist()
        assert torch.equal(s["aux_hidden_states"], it["aux_hidden_states"].to(torch.bfloat16))
        assert torch.equal(s["final_hidden_state"], it["final_hidden_state"].to(torch.bfloat16))


def test_a_store_refuses_data_from_another_model(store):
    path, _ = store
    with pytest.raises(StoreError, match="different target"):
        open_store(path, {**MANIFEST, "target": {"name": "other"}})
    open_store(path, {**MANIFEST, "sources": ["more.jsonl"]})  # same identity: more data is fine


def test_no_temp_files_and_shards_named_by_content(store, tmp_path):
    path, items = store
    assert not [p for p in (path / "shards").iterdir() if p.name.startswith(".")]
    (tmp_path / "again" / "shards").mkdir(parents=True)
    shard, rows = write_shard(tmp_path / "again", items[:2], source="x")
    again, rows_again = write_shard(tmp_path / "again", items[:2], source="x")
    # The name and every sample checksum follow from the content. (The file's
    # own sha256 may not: safetensors orders header metadata by a hash map.)
    assert shard.name == again.name and rows == rows_again
