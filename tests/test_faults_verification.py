"""Verification against a changed world: rows inserted or moved, a source
file moved, a row removed (and pruned), a corrupt shard header, offsets out
of range, a missing shard, an unloadable tokenizer. Each is done for real to
a store built with tasks.store from a real dataset and tokenizer (hidden
states are random: verification checks the store, not the model)."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoTokenizer

from tasks.data.dataset import prepare_samples
from tasks.store.ledger.open import open_ledger, open_store
from tasks.store.manifest import StoreError, create_or_check, read_manifest
from tasks.store.prune import prune_gone, prune_samples
from tasks.store.reader import StoreReader
from tasks.store.shards import FORMAT, shard_path, write_shard
from tasks.store.verification import StoreNotVerified, require_verified, verify_store
from tests.conftest import demo_rows, write_jsonl

H = 16
MAX_LENGTH = 256


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def built(tmp_path, tiny_model, tokenizer, ledger_url):
    """A store of 6 demo conversations in 2 shards, its ledger in each backend;
    returns (store, dataset, rows)."""
    rows = demo_rows(6)
    (tmp_path / "data").mkdir()
    dataset = write_jsonl(tmp_path / "data" / "data.jsonl", rows)
    manifest = {"format": FORMAT, "target": {"name": "tiny"}, "tokenizer": {"sha256": "t"},
                "aux_layers": {"sglang_layer_output_ids": [1, 3, 4]},
                "hidden_size": H, "dtype": "bfloat16", "max_length": MAX_LENGTH, "max_length_policy": "truncate",
                "target_path": str(tiny_model), "sources": [str(dataset)]}
    store = tmp_path / "store"
    ledger = open_store(store, manifest, ledger_url)
    samples, rejected = prepare_samples(dataset, tokenizer, max_length=MAX_LENGTH)
    assert len(samples) == 6 and not rejected
    g = torch.Generator().manual_seed(0)
    items = [{"sample_id": s.sample_id, "source_row": s.source_row, "input_ids": s.input_ids,
              "loss_mask": s.loss_mask, "aux_hidden_states": torch.randn(s.num_tokens, 3, H, generator=g),
              "final_hidden_state": torch.randn(s.num_tokens, H, generator=g)} for s in samples]
    for batch in (items[:3], items[3:]):
        ledger.commit_shard(*write_shard(store, batch, source=str(dataset)))
    report = verify_store(store)
    assert report.ok and (report.samples.status == "OK").all(), report.failures()
    return store, dataset, rows


def contents(store):
    reader = StoreReader(store)
    out = {}
    for i in range(len(reader)):
        s = reader[i]
        out[s["sample_id"]] = (s["input_ids"].tolist(), s["aux_hidden_states"].view(torch.int16).sum().item())
    return out


def test_a_line_inserted_at_the_top_moves_rows_but_fails_nothing(built):
    store, dataset, rows = built
    write_jsonl(dataset, [{"messages": [{"role": "user", "content": "new"}, {"role": "assistant", "content": "row"}]}]
                + rows)
    report = verify_store(store)
    assert report.ok, report.failures()
    assert (report.samples.status == "OK").all()
    assert report.samples.problems.str.contains(r"moved: source row \d is now row \d").all()


def test_a_moved_source_file_is_reported_as_missing_not_as_failed_samples(built):
    store, dataset, rows = built
    moved = dataset.with_name("elsewhere.jsonl")
    shutil.move(dataset, moved)
    report = verify_store(store)
    assert report.ok and (report.samples.status == "SOURCE_MISSING").all()
    assert report.samples.problems.str.contains("missing or unreadable \\(moved\\?\\)").all()
    # Extracting from the new place registers it as a source: found there.
    create_or_check(store, {**read_manifest(store), "sources": [str(moved)]})
    report = verify_store(store)
    assert report.ok and (report.samples.status == "OK").all()
    assert report.samples.problems.str.contains("elsewhere.jsonl row").all()


def test_a_removed_row_is_gone_and_pruning_keeps_every_other_sample_intact(built):
    store, dataset, rows = built
    before = contents(store)
    write_jsonl(dataset, rows[:1] + rows[2:])  # row 1 deleted
    report = verify_store(store)
    assert not report.ok
    gone = report.samples[report.samples.status == "GONE"]
    assert list(gone.source_row) == [1] and "--prune-gone" in report.failures()
    with pytest.raises(StoreNotVerified, match="1 samples whose source rows are gone.*--prune-gone"):
        require_verified(store)
    result = prune_gone(store)
    assert result["pruned"] == 1 and result["rewritten"] == 1 and result["sample_ids"] == list(gone.sample_id)
    after = contents(store)
    assert after == {k: v for k, v in before.items() if k not in set(gone.sample_id)}
    report = verify_store(store)
    assert report.ok and len(report.samples) == 5, report.failures()
    assert not [p for p in (store / "shards").iterdir() if p.name.startswith(".")]
    assert len(list((store / "shards").glob("shard-*.safetensors"))) == 2  # the old file is gone


def test_an_edited_row_is_gone_and_says_what_the_row_gives_now(built):
    store, dataset, rows = built
    edited = json.loads(json.dumps(rows[3]))
    edited["messages"][-1]["content"] += " (edited)"
    write_jsonl(dataset, rows[:3] + [edited] + rows[4:])
    report = verify_store(store)
    bad = report.samples[report.samples.status != "OK"]
    assert not report.ok and list(bad.status) == ["GONE"] and list(bad.source_row) == [3]
    assert "source changed: row 3 now gives sample" in bad.problems.iloc[0]


def test_pruning_refuses_to_copy_a_corrupt_sample_into_a_new_shard(built, index_db):
    store, dataset, rows = built
    db = index_db(store)
    (shard, victim), (keeper,) = db.execute(
        "SELECT shard, sample_id FROM samples WHERE position=0 ORDER BY shard LIMIT 1").fetchone(), \
        db.execute("SELECT sample_id FROM samples WHERE position=1 AND shard=(SELECT shard FROM samples "
                   "WHERE position=0 ORDER BY shard LIMIT 1)").fetchone()
    db.close()
    path = shard_path(store, shard)
    data = bytearray(path.read_bytes())
    data[-4] ^= 0x40  # inside the last tensor, of a sample that is kept
    path.write_bytes(bytes(data))
    ledger_before = open_ledger(store).samples()
    with pytest.raises(StoreError, match="no longer match their checksums"):
        prune_samples(store, [victim])
    assert open_ledger(store).samples().equals(ledger_before)
    assert path.read_bytes() == bytes(data)
    assert keeper  # still in the ledger, still pointing at the (corrupt, reported) file


def rewrite(path, change_tensors=None, metadata=None):
    with safe_open(str(path), framework="pt") as f:
        meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    if change_tensors:
        change_tensors(t)
    save_file(t, str(path), metadata={**meta, **(metadata or {})})


@pytest.mark.parametrize("fault", ["sample_ids not JSON", "sample_ids not a list", "offsets out of range",
                                   "shard missing"])
def test_a_broken_shard_is_reported_and_its_samples_fail(built, fault):
    store, _, _ = built
    name = open_ledger(store).shards().name.iloc[0]
    path = shard_path(store, name)
    if fault == "sample_ids not JSON":
        rewrite(path, metadata={"sample_ids": "[\"abc\", \xff"})
    elif fault == "sample_ids not a list":
        rewrite(path, metadata={"sample_ids": json.dumps({"a": 1})})
    elif fault == "offsets out of range":
        rewrite(path, lambda t: t.__setitem__("offsets", torch.tensor([0, 5, 10**6, 10**7])))
    else:
        path.unlink()
    report = verify_store(store)  # reports, never raises
    assert not report.ok
    mine = report.samples[report.samples.shard == name]
    assert len(mine) == 3 and (mine.status == "FAIL").all()
    assert (report.samples[report.samples.shard != name].status == "OK").all()
    assert report.files.set_index("shard").loc[name, "status"] == "FAIL"


def test_an_unloadable_tokenizer_is_reported_per_sample(built, tmp_path):
    store, _, _ = built
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    manifest = read_manifest(store)
    (store / "manifest.json").write_text(json.dumps({**manifest, "target_path": str(broken)}))
    report = verify_store(store)
    assert not report.ok and (report.samples.status == "FAIL").all()
    assert report.samples.problems.str.contains("tokenizer at .*broken-model does not load").all()
    assert "recheck_source=False" in report.failures()
    assert verify_store(store, recheck_source=False).ok  # the shards alone are fine
