"""The store contract, checked with an independent reader: the index through
its database's own driver (sqlite3, psycopg: conftest.IndexDB) and the
safetensors byte layout parsed by hand (FP8 decoded by hand too), not
tasks.store's own reader. Every test that touches the ledger runs on both
backends (the `ledger_url` fixture)."""
import hashlib
import json
import re

import numpy as np
import pytest
import torch
import xxhash

from tasks.store.handle import Store
from tasks.store.ledger.open import open_store
from tasks.store.manifest import StoreError
from tasks.target.layers import AuxLayers
from tasks.store.reader import StoreReader
from tasks.store.shards import FORMAT, FP8, write_shard
from tasks.store.verification import verify_store

H = 16
MANIFEST = {"format": FORMAT, "target": {"name": "m"}, "tokenizer": {"sha256": "t"}, "aux_layers": {"sglang_layer_output_ids": [1, 3, 4]},
            "hidden_size": H, "dtype": "bfloat16", "max_length": 64, "max_length_policy": "truncate"}


NUMPY = {"I32": np.int32, "U8": np.uint8, "I64": np.int64, "BF16": np.uint16,  # bf16 kept as raw bits
         "F8_E4M3": np.uint8, "F32": np.float32}  # e4m3 kept as raw bits: decode_e4m3


def decode_e4m3(bits):
    """OCP e4m3 ("fn"): sign, 4 exponent bits (bias 7), 3 mantissa bits; no
    infinities, S.1111.111 is NaN."""
    bits = bits.astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7))
    return np.where((exp == 15) & (man == 7), np.nan, sign * value)


def bf16_to_float(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


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
def store(tmp_path, ledger_url):
    ledger = open_store(tmp_path / "store", MANIFEST, ledger_url)
    items = [[item(0, 5), item(1, 3)], [item(2, 7)]]
    for batch in items:
        ledger.commit_shard(*write_shard(tmp_path / "store", batch, source="data.jsonl"))
    return tmp_path / "store", [it for batch in items for it in batch]


def test_independent_reader_sees_packed_unpadded_samples(store, index_db):
    path, items = store
    db = index_db(path)
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


def test_a_store_refuses_data_from_another_model(store, ledger_url):
    path, _ = store
    with pytest.raises(StoreError, match="different target"):
        open_store(path, {**MANIFEST, "target": {"name": "other"}}, ledger_url)
    open_store(path, {**MANIFEST, "sources": ["more.jsonl"]}, ledger_url)  # same identity: more data is fine
    # Another layer set: refused naming the setting, the store's layers and the run's.
    other_layers = {**MANIFEST, "aux_layers": {"sglang_layer_output_ids": [1, 2, 3, 4]}}
    with pytest.raises(StoreError, match=r"different aux_layers: aux_layers \(capture\.aux_layer_ids\): store has "
                                         r"\{'sglang_layer_output_ids': \[1, 3, 4\]\}, this run "
                                         r"\{'sglang_layer_output_ids': \[1, 2, 3, 4\]\}"):
        open_store(path, other_layers, ledger_url)


def test_no_temp_files_and_shards_named_by_content(store, tmp_path):
    path, items = store
    assert not [p for p in (path / "shards").iterdir() if p.name.startswith(".")]
    (tmp_path / "again" / "shards").mkdir(parents=True)
    shard, rows = write_shard(tmp_path / "again", items[:2], source="x")
    again, rows_again = write_shard(tmp_path / "again", items[:2], source="x")
    # The name and every sample checksum follow from the content. (The file's
    # own sha256 may not: safetensors orders header metadata by a hash map.)
    assert shard.name == again.name and rows == rows_again


def sample_bytes(t, a, b, names):
    return b"".join(t[n][a:b].tobytes() for n in names if n in t)


def test_sample_checksums_and_shard_sha256_match_an_independent_hash(store, index_db):
    """Format /2: per-sample xxh3_128 over ids, mask, aux, final as stored;
    the ledger's sha256 is the whole file's."""
    path, _ = store
    db = index_db(path)
    for name, sha, size in db.execute("SELECT name, sha256, bytes FROM shards").fetchall():
        data = (path / "shards" / f"{name}.safetensors").read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha and len(data) == size
        t, _ = load_raw(path / "shards" / f"{name}.safetensors")
        rows = db.execute("SELECT token_offset, num_tokens, checksum FROM samples WHERE shard=?", (name,)).fetchall()
        for offset, n, checksum in rows:
            raw = sample_bytes(t, offset, offset + n, ("input_ids", "loss_mask", "aux_hidden_states",
                                                       "final_hidden_state"))
            assert xxhash.xxh3_128(raw).hexdigest() == checksum


def test_many_samples_over_many_workers_keep_batch_order(tmp_path, ledger_url):
    ledger = open_store(tmp_path / "s", MANIFEST, ledger_url)
    items = [item(k, 1 + (k * 7) % 23) for k in range(40)]
    shard, rows = write_shard(tmp_path / "s", items, source="x", workers=4)
    ledger.commit_shard(shard, rows)
    t, meta = load_raw(tmp_path / "s" / "shards" / f"{shard.name}.safetensors")
    assert json.loads(meta["sample_ids"]) == [it["sample_id"] for it in items]
    assert [r["position"] for r in rows] == list(range(40))
    for k, it in enumerate(items):
        a, b = t["offsets"][k], t["offsets"][k + 1]
        assert np.array_equal(t["input_ids"][a:b], it["input_ids"])
        expect = it["aux_hidden_states"].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(t["aux_hidden_states"][a:b], expect), k
    assert verify_store(tmp_path / "s", recheck_source=False, write_report=False).ok


def test_a_sample_that_does_not_fit_the_shard_is_refused_and_nothing_is_left(tmp_path):
    open_store(tmp_path / "s", MANIFEST)
    bad = item(1, 4)
    bad["final_hidden_state"] = bad["final_hidden_state"][:3]
    with pytest.raises(ValueError, match="sample s001: shapes do not fit"):
        write_shard(tmp_path / "s", [item(0, 5), bad], source="x")
    assert list((tmp_path / "s" / "shards").iterdir()) == []


def flip_byte(path, offset_from_end):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_verification_names_a_flipped_byte(store):
    path, _ = store
    assert verify_store(path, recheck_source=False, write_report=False).ok
    shard = sorted((path / "shards").iterdir())[0]
    flip_byte(shard, 5)  # inside the last sample's final state
    report = verify_store(path, recheck_source=False, write_report=False)
    assert not report.ok
    bad = report.samples[report.samples.status == "FAIL"]
    assert len(bad) == 1 and "checksum differs" in bad.problems.iloc[0]
    assert "sha256 differs" in report.files[report.files.status == "FAIL"].problems.iloc[0]


def test_a_store_opened_is_its_manifest_and_its_ledger(tmp_path, ledger_url):
    created = Store.create(tmp_path / "s", {**MANIFEST, "dtype": FP8, "sources": ["a.jsonl"]}, ledger_url)
    created.ledger.commit_shard(*write_shard(created.path, [item(0, 5)], source="a.jsonl", dtype=created.dtype))
    again = Store.create(tmp_path / "s", {**MANIFEST, "dtype": FP8, "sources": ["b.jsonl"]}, ledger_url)
    assert again.manifest["sources"] == ["a.jsonl", "b.jsonl"]  # what the store holds now, not what was passed
    opened = Store.open(tmp_path / "s")
    assert opened.manifest == again.manifest and opened.dtype == FP8
    assert opened.ledger.stored_ids() == {"s000"}


def test_opening_a_directory_that_is_not_a_store_names_it_and_creates_nothing(tmp_path):
    with pytest.raises(StoreError, match=re.escape(f"{tmp_path} is not a store: no manifest.json")):
        Store.open(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_store_of_another_format_is_neither_read_nor_added_to(store, ledger_url):
    path, _ = store
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "format": "eagle3-capture-store/1"}))
    refused = re.escape(f"store {path} is format 'eagle3-capture-store/1'; this version reads only {FORMAT}")
    with pytest.raises(StoreError, match=refused):
        StoreReader(path)
    with pytest.raises(StoreError, match=refused):
        verify_store(path, recheck_source=False, write_report=False)
    with pytest.raises(StoreError, match="different format"):
        open_store(path, MANIFEST, ledger_url)


# --- FP8 storage ---

@pytest.fixture
def fp8_store(tmp_path, ledger_url):
    ledger = open_store(tmp_path / "fp8", {**MANIFEST, "dtype": FP8}, ledger_url)
    items = [item(0, 5), item(1, 3)]
    items[1]["aux_hidden_states"][1] *= 1e-3  # rows of very different magnitude
    items[1]["final_hidden_state"][2] = 0  # an all-zero row
    ledger.commit_shard(*write_shard(tmp_path / "fp8", items, source="data.jsonl", dtype=FP8))
    return tmp_path / "fp8", items


def test_fp8_shard_decoded_by_hand_is_within_the_bound(fp8_store, index_db):
    path, items = fp8_store
    shard = next((path / "shards").iterdir())
    t, meta = load_raw(shard)
    assert meta["format"] == FORMAT
    assert t["aux_hidden_states"].dtype == np.uint8 and t["aux_scale"].shape == (8, 3)
    assert t["final_scale"].shape == (8,)
    for k, it in enumerate(items):
        a, b = t["offsets"][k], t["offsets"][k + 1]
        for name, scale in (("aux_hidden_states", "aux_scale"), ("final_hidden_state", "final_scale")):
            x = it[name].double().numpy()
            got = decode_e4m3(t[name][a:b]) * t[scale][a:b][..., None]
            amax = np.abs(x).max(axis=-1, keepdims=True)
            assert np.allclose(t[scale][a:b][..., None], np.where(amax > 0, amax / 448, 1), rtol=1e-6)
            assert (np.abs(got - x) <= 2.0 ** -4 * np.abs(x) + 2.0 ** -10 * amax / 448 + 1e-12).all(), name
    db = index_db(path)
    for offset, n, checksum in db.execute("SELECT token_offset, num_tokens, checksum FROM samples").fetchall():
        raw = sample_bytes(t, offset, offset + n, ("input_ids", "loss_mask", "aux_hidden_states",
                                                   "final_hidden_state", "aux_scale", "final_scale"))
        assert xxhash.xxh3_128(raw).hexdigest() == checksum


def test_fp8_store_reads_back_as_bf16_and_verifies(fp8_store):
    path, items = fp8_store
    reader = StoreReader(path)
    t, _ = load_raw(next((path / "shards").iterdir()))
    for i, it in enumerate(items):
        s = reader[i]
        assert s["aux_hidden_states"].dtype == torch.bfloat16 and s["aux_hidden_states"].shape == (len(it["input_ids"]), 3, H)
        a, b = t["offsets"][i], t["offsets"][i + 1]
        by_hand = decode_e4m3(t["final_hidden_state"][a:b]) * t["final_scale"][a:b][..., None]
        assert torch.equal(s["final_hidden_state"], torch.from_numpy(by_hand).float().to(torch.bfloat16))
        x, y = it["aux_hidden_states"], s["aux_hidden_states"].float()
        assert ((y - x).abs() <= 0.07 * x.abs() + 2.0 ** -9 * x.abs().amax(-1, keepdim=True)).all()
    assert float(reader[1]["final_hidden_state"][2].abs().max()) == 0.0
    assert verify_store(path, recheck_source=False, write_report=False).ok
    shard = next((path / "shards").iterdir())
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x01  # inside the last token's final_scale
    shard.write_bytes(bytes(data))
    report = verify_store(path, recheck_source=False, write_report=False)
    assert "checksum differs" in " ".join(report.samples.problems)


def test_fp8_is_part_of_the_store_identity(fp8_store):
    path, _ = fp8_store
    with pytest.raises(StoreError, match="different dtype"):
        open_store(path, MANIFEST)


def test_verification_refuses_a_negative_fp8_scale_even_with_matching_hashes(fp8_store, index_db):
    """A writer bug, not corruption: the hashes agree with the bytes, the
    scales do not make sense."""
    path, _ = fp8_store
    shard = next((path / "shards").iterdir())
    data = bytearray(shard.read_bytes())
    data[-4:] = np.array([-1.0], dtype=np.float32).tobytes()  # the last token's final_scale
    shard.write_bytes(bytes(data))
    t, _ = load_raw(shard)
    db = index_db(path)
    offset, n, sid = db.execute("SELECT token_offset, num_tokens, sample_id FROM samples ORDER BY token_offset DESC").fetchone()
    raw = sample_bytes(t, offset, offset + n, ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_state",
                                               "aux_scale", "final_scale"))
    with db:
        db.execute("UPDATE samples SET checksum=? WHERE sample_id=?", (xxhash.xxh3_128(raw).hexdigest(), sid))
        db.execute("UPDATE shards SET sha256=?", (hashlib.sha256(bytes(data)).hexdigest(),))
    report = verify_store(path, recheck_source=False, write_report=False)
    assert not report.ok
    bad = report.samples[report.samples.status == "FAIL"]
    assert list(bad.sample_id) == [sid] and bad.problems.iloc[0] == "FP8 scales not all finite and positive"


def test_a_write_that_fails_midway_leaves_no_file_and_nothing_committed(tmp_path, monkeypatch, ledger_url):
    import tasks.store.shards as shards

    ledger = open_store(tmp_path / "s", MANIFEST, ledger_url)
    real, calls = shards._pwrite, []

    def disk_full_on_the_sixth_write(fd, data, offset):
        calls.append(offset)
        if len(calls) == 6:
            raise OSError(28, "No space left on device (injected)")
        return real(fd, data, offset)

    monkeypatch.setattr(shards, "_pwrite", disk_full_on_the_sixth_write)
    with pytest.raises(OSError, match="No space left"):
        write_shard(tmp_path / "s", [item(k, 4 + k) for k in range(8)], source="x", workers=3)
    assert len(calls) >= 6
    assert list((tmp_path / "s" / "shards").iterdir()) == []
    assert ledger.summary()["samples"] == 0


# --- pruning and re-linking keep the stored bytes (FP8) ---

def _stored_samples(path, index_db):
    """sample_id -> (checksum, each tensor's raw bytes), from the files by hand."""
    db = index_db(path)
    rows = db.execute("SELECT sample_id, shard, token_offset, num_tokens, checksum FROM samples").fetchall()
    db.close()
    out = {}
    for sid, shard, a, n, checksum in rows:
        t, meta = load_raw(path / "shards" / f"{shard}.safetensors")
        out[sid] = (meta["format"], checksum,
                    {k: v[a:a + n].tobytes() for k, v in t.items() if k != "offsets"})
    return out


def test_pruning_copies_the_kept_samples_stored_bytes(fp8_store, index_db):
    from tasks.store.prune import prune_samples

    path, items = fp8_store
    before = _stored_samples(path, index_db)
    result = prune_samples(path, [items[0]["sample_id"]])
    assert result["pruned"] == 1 and result["rewritten"] == 1
    after = _stored_samples(path, index_db)
    assert after == {k: v for k, v in before.items() if k != items[0]["sample_id"]}
    report = verify_store(path, recheck_source=False, write_report=False)
    assert report.ok, report.failures()


def test_an_fp8_shard_written_again_is_kept_not_refused(fp8_store, tmp_path):
    path, items = fp8_store
    shard = next((path / "shards").iterdir())
    before = shard.read_bytes()
    info, _ = write_shard(path, items, source="data.jsonl", dtype=FP8)  # same samples, same name
    assert shard.read_bytes() == before and info.sha256 == hashlib.sha256(before).hexdigest()
    assert [p.name for p in (path / "shards").iterdir()] == [shard.name]


def test_an_fp8_shard_with_other_header_bytes_but_equal_tensors_is_kept_and_other_tensors_refused(fp8_store):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tasks.store.shards import ShardExists

    path, items = fp8_store
    shard = next((path / "shards").iterdir())
    with safe_open(str(shard), framework="pt") as f:
        meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(t, str(shard), metadata=meta)  # safetensors' own layout: other bytes, same content
    same = shard.read_bytes()
    info, _ = write_shard(path, items, source="data.jsonl", dtype=FP8)
    assert shard.read_bytes() == same and info.sha256 == hashlib.sha256(same).hexdigest()
    t["aux_scale"] = t["aux_scale"] * 2
    save_file(t, str(shard), metadata=meta)
    changed = shard.read_bytes()
    with pytest.raises(ShardExists):
        write_shard(path, items, source="data.jsonl", dtype=FP8)
    assert shard.read_bytes() == changed
    assert [p.name for p in (path / "shards").iterdir()] == [shard.name]  # no temp file left


@pytest.mark.parametrize("dtype", ["bfloat16", FP8])
def test_a_five_layer_store_reads_verifies_prunes_and_seals_and_a_three_layer_shard_in_it_does_not(
        tmp_path, ledger_url, dtype, index_db):
    from tasks.store.prune import prune_samples
    from tasks.store.seal import seal

    layers = AuxLayers((1, 2, 4, 5, 6))
    path = tmp_path / "five"
    ledger = open_store(path, {**MANIFEST, "aux_layers": layers.as_record(), "dtype": dtype}, ledger_url)
    items = [item(k, n) for k, n in ((0, 5), (1, 3), (9, 2))]
    for it in items:
        it["aux_hidden_states"] = torch.cat([it["aux_hidden_states"], -it["aux_hidden_states"][:, :2]], dim=1)
    ledger.commit_shard(*write_shard(path, items, source="data.jsonl", dtype=dtype))
    reader = StoreReader(path)
    for i, it in enumerate(items):
        got = reader[i]["aux_hidden_states"].float()
        assert got.shape == (len(it["input_ids"]), 5, H)
        # Each layer where it was written (fp8: within e4m3's step and the bf16 it is read back as).
        tol = 0.07 if dtype == FP8 else 2.0 ** -8
        assert ((got - it["aux_hidden_states"]).abs() <= tol * it["aux_hidden_states"].abs() + 1e-3).all()
    assert verify_store(path, recheck_source=False, write_report=False).ok
    # Pruning rewrites the shard with the others' five layers byte for byte; sealing exports what is left.
    before = _stored_samples(path, index_db)
    assert prune_samples(path, [items[2]["sample_id"]]) == {"pruned": 1, "rewritten": 1, "removed": 0}
    assert _stored_samples(path, index_db) == {k: v for k, v in before.items() if k != items[2]["sample_id"]}
    assert verify_store(path, recheck_source=False, write_report=False).ok
    assert seal(path)["summary"]["samples"] == 2
    ledger.commit_shard(*write_shard(path, [item(2, 4)], source="data.jsonl", dtype=dtype))  # three layers
    report = verify_store(path, recheck_source=False, write_report=False)
    assert not report.ok
    assert "aux_hidden_states shape (4, 3, 16), expected (4, 5, 16)" in " ".join(report.files.problems)
    bad = report.samples[report.samples.problems != ""]
    assert bad.sample_id.tolist() == ["s002"] and bad.problems.tolist() == ["its shard's layout is inconsistent"]
