"""Stream mode at the size it exists for (#39): the faults of many ranks,
many nodes and long runs, each injected for real. (Across hosts, and the
capture nodes' part queue: tests/test_stream_nodes.py.)"""
import time
from pathlib import Path

import pytest


def spooled_store(d: Path, model: Path, rows: int, cfg, shard_rows: int = 4, held_back=None):
    """A stream run's store as a capture that ran ahead would leave it,
    built with tasks.store and no server: the held-out samples in the store,
    each epoch's training samples in its spool store, in training order,
    `shard_rows` a shard, with random hidden states (seeded); the capture
    marked completed. With `held_back` (the plan -> rows of epoch 0), those
    rows are not stored yet, and the capture is still running. The plan,
    the store, and a function that stores what was held back, as a shard."""
    import torch

    from tasks.capture.config import CaptureConfig
    from tasks.data.dataset import prepare_samples
    from tasks.store.ledger.open import open_store
    from tasks.store.shards import FORMAT, write_shard
    from tasks.stream.plan import plan_stream
    from tasks.stream.spool import epoch_store
    from tasks.stream.state import mark_capture
    from tasks.target.architectures import load_tokenizer
    from tasks.target.layers import AuxLayers
    from tasks.train.layers.sizes import target_sizes
    from tests.conftest import demo_rows, write_jsonl

    sizes = target_sizes(model)
    dataset = write_jsonl(d / "data.jsonl", demo_rows(rows))
    store = d / "store"
    plan = plan_stream(str(model), CaptureConfig(dataset=str(dataset), batch_size=shard_rows, max_length=128), cfg,
                       store)
    layers = AuxLayers.for_model(sizes["num_hidden_layers"])
    manifest = {"format": FORMAT, "target": {"name": "tiny"}, "tokenizer": {"sha256": "t"},
                "aux_layers": layers.as_record(), "hidden_size": sizes["hidden_size"], "dtype": "bfloat16",
                "max_length": 128, "max_length_policy": "truncate", "target_path": str(model),
                "sources": [str(dataset.resolve())]}
    samples = {s.source_row: s for s in prepare_samples(dataset, load_tokenizer(model), max_length=128)[0]}
    g = torch.Generator().manual_seed(0)

    def commit(home: Path, chunk: list[int]) -> None:
        items = [{"sample_id": samples[r].sample_id, "source_row": r, "input_ids": samples[r].input_ids,
                  "loss_mask": samples[r].loss_mask,
                  "aux_hidden_states": torch.randn(samples[r].num_tokens, 3, sizes["hidden_size"], generator=g),
                  "final_hidden_state": torch.randn(samples[r].num_tokens, sizes["hidden_size"], generator=g)}
                 for r in chunk]
        open_store(home, manifest).commit_shard(*write_shard(home, items, source=str(dataset)))

    commit(store, plan.heldout)
    later = sorted(held_back(plan)) if held_back else []
    for e, epoch in enumerate(plan.epochs):
        order = [r for b in epoch for r in b if not (e == 0 and r in later)]
        for k in range(0, len(order), shard_rows):
            commit(epoch_store(store, e), order[k:k + shard_rows])
    mark_capture(store, "running" if held_back else "completed")
    return plan, store, lambda: commit(epoch_store(store, 0), later)


def deleted_but_mapped(pids: list[int], under: Path) -> list[str]:
    """Files under `under` that one of these processes maps although they
    were removed: their blocks stay allocated on the disk until unmapped."""
    out = []
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        out += [f"{pid}: {line.split(None, 5)[-1]}" for line in maps.splitlines()
                if str(under) in line and line.endswith("(deleted)")]
    return out


def test_two_trainer_ranks_keep_no_removed_spool_shard_mapped(tiny_model, tmp_path):
    """Two trainer ranks (torchrun, gloo) train a spooled stream run; a
    checker outside them reads every rank's /proc/<pid>/maps all along: no
    spool shard removed is still mapped by any rank at any time (rank 1's
    maps of trained shards used to stay until the epoch ended, the
    removed files' blocks held beside the budget), and the spool ends
    empty, on disk as in the index."""
    import threading

    from tasks.stream.spool import SPOOL, spooled_bytes
    from tasks.stream.state import mark_trainer
    from tasks.train.config import TrainConfig
    from tasks.train.launch import launch_distributed

    cfg = TrainConfig(out_dir=str(tmp_path / "run"), draft_vocab_size=64, ttt_steps=1, epochs=2, tokens_per_batch=256,
                      heldout_fraction=0.1, eval_max_samples=2, vocab_positions=100, stream=True, devices=2,
                      spool_bytes=10**9, checkpoint_every=1000)
    plan, store, _ = spooled_store(tmp_path, tiny_model, 48, cfg)
    spool = store / SPOOL
    shards = len(list(spool.glob("epoch-*/shards/*.safetensors")))
    assert shards >= 16 and spooled_bytes(store) > 0
    mark_trainer(store, "running")
    config_file = str(Path(cfg.out_dir) / "train-config.json")
    seen, ranks, done = set(), {}, threading.Event()

    def check() -> None:
        while not done.is_set():
            for pid in (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if config_file.encode() in cmd and b"torch.distributed.run" not in cmd:
                    try:  # (a process a rank forks has its command line and its RANK too)
                        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    except OSError:
                        continue
                    ranks[pid] = next((v[5:].decode() for v in env if v.startswith(b"RANK=")), "?")
            seen.update(deleted_but_mapped(sorted(ranks), spool))
            time.sleep(0.02)

    checker = threading.Thread(target=check)
    checker.start()
    try:
        result = launch_distributed(cfg, store)
    finally:
        done.set()
        checker.join()
    assert set(ranks.values()) == {"0", "1"} and result.final
    assert not seen, list(seen)[:5]
    assert not list(spool.glob("epoch-*/shards/*.safetensors")) and spooled_bytes(store) == 0


def test_a_reader_waiting_for_a_sample_lets_the_step_free_what_it_trained(tiny_model, tmp_path):
    """The loader waits for a sample the capture has not stored yet (it
    waits for room); meanwhile the step's thread frees the shard it
    trained, which is that room. The wait must not hold the reader (it used
    to: both waited on each other): the step's release and removal finish
    while the loader waits, and the wait ends once the sample is stored."""
    import threading

    from tasks.store.handle import Store
    from tasks.stream.reader import StreamReader
    from tasks.stream.spool import epoch_store
    from tasks.train.config import TrainConfig

    cfg = TrainConfig(out_dir=str(tmp_path / "run"), draft_vocab_size=64, ttt_steps=1, epochs=1, tokens_per_batch=256,
                      heldout_fraction=0.1, eval_max_samples=2, vocab_positions=100, stream=True, spool_bytes=10**9)
    plan, store, store_the_rest = spooled_store(tmp_path, tiny_model, 24, cfg,
                                                held_back=lambda plan: {plan.epochs[0][-1][-1]})
    home = epoch_store(store, 0)
    order = [r for b in plan.epochs[0] for r in b]
    reader = StreamReader(store, cfg, poll_s=0.05)
    reader.start_epoch(0)
    row_of = {r: i for i, r in enumerate(reader._rows.values())}
    trained = [reader.sample_ids[row_of[r]] for r in order[:4]]  # the first shard: the step's samples
    for sid in trained:
        reader[reader.sample_ids.index(sid)]
    got = []
    waiter = threading.Thread(target=lambda: got.append(reader[row_of[order[-1]]]), daemon=True)
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive()  # it waits for the sample held back
    freeing = threading.Thread(target=lambda: (reader.release(trained), reader.remove_consumed(trained)),
                               daemon=True)
    freeing.start()
    freeing.join(timeout=10)
    freed = not freeing.is_alive()
    store_the_rest()  # the capture stores it, as it would once the step freed the room
    waiter.join(timeout=30)
    assert freed, "the step's release waited for the loader's wait to end"
    assert got and got[0]["sample_id"] == reader.sample_ids[row_of[order[-1]]]
    remaining = set(Store.open(home).ledger.samples().sample_id)
    assert not remaining & set(trained) and reader.sample_ids[row_of[order[-1]]] in remaining


def test_an_fp8_store_is_planned_with_the_bytes_its_shards_take(tiny_model, tmp_path):
    """An FP8 stream store: the spool is sized, and its minimum refused, by
    what FP8 shards take (half of bf16's), measured on a shard the store's
    own writer makes of the first part's samples: its tensors are exactly
    the plan's bytes per token but for alignment (bf16's sizes refused a
    budget 2x too early and left half of it unused)."""
    import struct

    import torch

    from tasks.capture.config import CaptureConfig
    from tasks.data.dataset import prepare_samples
    from tasks.store.shards import BF16, FP8, write_shard
    from tasks.stream.plan import SpoolTooSmall, plan_stream
    from tasks.target.architectures import load_tokenizer
    from tasks.train.config import TrainConfig
    from tasks.train.layers.sizes import target_sizes
    from tests.conftest import demo_rows, write_jsonl

    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(24))
    capture = CaptureConfig(dataset=str(dataset), batch_size=4, max_length=128)
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), draft_vocab_size=64, ttt_steps=1, epochs=2, tokens_per_batch=256,
                      heldout_fraction=0.1, eval_max_samples=2, vocab_positions=100, stream=True, spool_bytes=10**9)
    bf16, fp8 = (plan_stream(str(tiny_model), capture, cfg, dtype=d) for d in (BF16, FP8))
    rows = list(bf16.epochs[0][0])
    samples = {s.source_row: s for s in prepare_samples(dataset, load_tokenizer(tiny_model), max_length=128)[0]}
    hidden = target_sizes(tiny_model)["hidden_size"]
    items = [{"sample_id": samples[r].sample_id, "source_row": r, "input_ids": samples[r].input_ids,
              "loss_mask": samples[r].loss_mask, "aux_hidden_states": torch.randn(samples[r].num_tokens, 3, hidden),
              "final_hidden_state": torch.randn(samples[r].num_tokens, hidden)} for r in rows]
    (tmp_path / "fp8" / "shards").mkdir(parents=True)
    info, _ = write_shard(tmp_path / "fp8", items, source=str(dataset), dtype=FP8)
    path = next((tmp_path / "fp8").glob(f"shards/{info.name}.safetensors"))
    header = struct.unpack("<Q", path.read_bytes()[:8])[0]
    tensors = path.stat().st_size - 8 - header
    # The plan's bytes per token are the tensors' (safetensors pads a few
    # bytes to keep them aligned: 24 here, 8 at most for each of the 6).
    assert 0 <= tensors - info.num_tokens * fp8.bytes_per_token <= 48
    assert fp8.shard_bytes(rows, 4) >= path.stat().st_size  # the plan's bound holds
    assert 2 * fp8.bytes_per_token < bf16.bytes_per_token + 64 and fp8.minimum < bf16.minimum
    # A budget between the two minimums: enough for FP8, refused for bf16.
    between = cfg.model_copy(update={"spool_bytes": (fp8.minimum + bf16.minimum) // 2})
    assert plan_stream(str(tiny_model), capture, between, dtype=FP8).minimum == fp8.minimum
    with pytest.raises(SpoolTooSmall):
        plan_stream(str(tiny_model), capture, between, dtype=BF16)


def test_a_training_sample_quarantined_in_a_spooled_run_is_left_out_of_the_rerun(tiny_model, tmp_path):
    """A spooled part quarantines a training sample (it crashed the server):
    its quarantine row lands in the epoch's spool store. The trainer stops
    naming it; the rerun's plan keeps the row in the store's own index and
    leaves the sample out, and the rerun trains every other sample, every
    epoch, to the end (it used to stop again at once on the spool's stale
    row, on every rerun)."""
    from tasks.store.handle import Store
    from tasks.stream.plan import plan_stream
    from tasks.stream.spool import epoch_store
    from tasks.stream.state import mark_capture, mark_trainer
    from tasks.train.config import TrainConfig, TrainingError
    from tasks.train.loop import train
    from tasks.capture.config import CaptureConfig

    cfg = TrainConfig(out_dir=str(tmp_path / "run"), draft_vocab_size=64, ttt_steps=1, epochs=2, tokens_per_batch=256,
                      heldout_fraction=0.1, eval_max_samples=2, vocab_positions=100, stream=True, spool_bytes=10**9)
    # The first training sample: the trainer stops on it before any step
    # (a later one would have its trained shards removed, for the rerun's
    # capture to store again).
    plan, store, _ = spooled_store(tmp_path, tiny_model, 24, cfg, held_back=lambda plan: {plan.epochs[0][0][0]})
    bad = plan.epochs[0][0][0]
    planned = __import__("pandas").read_parquet(store / "stream-samples.parquet")
    bad_id = planned.sample_id[planned.source_row == bad].item()
    Store.open(epoch_store(store, 0)).ledger.quarantine([{"source": str(tmp_path / "data.jsonl"), "source_row": bad,
                                                          "sample_id": bad_id, "reason": "crashed the server 2 times",
                                                          "attempts": 2}])
    mark_trainer(store, "running")
    with pytest.raises(TrainingError, match=rf"the capture quarantined sample {bad_id} .*crashed the server"):
        train(cfg, store)
    mark_capture(store, "completed")

    again = plan_stream(str(tiny_model), CaptureConfig(dataset=str(tmp_path / "data.jsonl"), batch_size=4,
                                                       max_length=128), cfg, store)
    assert bad not in {r for e in again.epochs for b in e for r in b} | set(again.heldout)
    assert bad_id in set(Store.open(store).ledger.quarantined().sample_id)
    steps = []
    result = train(cfg.model_copy(update={"out_dir": str(tmp_path / "again")}), store, on_step=steps.append)
    trained = [s for step in steps for s in step["sample_ids"] if step["weight"]]
    assert result.final and bad_id not in trained
    assert {e: len(ids) for e, ids in ((e, [s for st in steps if st["epoch"] == e for s in st["sample_ids"]])
                                       for e in (0, 1))} == {e: sum(map(len, again.epochs[e])) for e in (0, 1)}


def test_a_cached_run_resumed_on_fewer_devices_captures_every_row_of_later_epochs(tiny_model, tmp_path):
    """train.cache_epochs on two devices, resumed at epoch 2 on one (a node
    lost): the rows kept for every epoch are those the first plan chose
    (the store holds them), and every training row of epoch 2 is kept or
    captured by a part of the resumed capture. Chosen again, the room one
    device leaves would keep more rows, which no part of epoch 2 captured
    and the store lacked (they went through the spool in epoch 1)."""
    from tasks.capture.config import CaptureConfig
    from tasks.stream.parts import capture_parts
    from tasks.stream.plan import plan_stream
    from tasks.stream.spool import write_position
    from tasks.train.config import TrainConfig
    from tests.conftest import demo_rows, write_jsonl

    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(48))
    capture = CaptureConfig(dataset=str(dataset), batch_size=4, max_length=128)
    two = TrainConfig(out_dir=str(tmp_path / "run"), draft_vocab_size=64, ttt_steps=1, epochs=2, tokens_per_batch=256,
                      heldout_fraction=0.1, eval_max_samples=2, vocab_positions=100, stream=True, devices=2,
                      cache_epochs=True, spool_bytes=10**12)
    probe = plan_stream(str(tiny_model), capture, two)  # (no store: the minimum on two devices)
    budget = probe.minimum + 1500 * probe.bytes_per_token  # room to keep ~1,500 of the epoch's ~4,000 tokens
    two = two.model_copy(update={"spool_bytes": budget})
    first = plan_stream(str(tiny_model), capture, two, tmp_path / "store")
    epoch_rows = {r for b in first.epochs[0] for r in b}
    assert 0 < len(first.cached) < len(epoch_rows)
    (tmp_path / "store" / "spool").mkdir()
    write_position(tmp_path / "store", 1, 0)  # epoch 1 trained and checkpointed
    one = two.model_copy(update={"devices": 1})
    resumed = plan_stream(str(tiny_model), capture, one, tmp_path / "store")
    assert resumed.minimum < first.minimum  # one device leaves more room than two...
    assert resumed.cached == first.cached  # ...but the rows kept are the run's
    parts = capture_parts(resumed, capture.batch_size, tmp_path / "store", budget)
    captured = {r for p in parts if p.epoch == 1 for r in p.rows}
    assert epoch_rows - set(first.cached) == captured


def test_a_dead_nodes_part_taken_over_skips_what_the_trainer_already_consumed(tiny_model, tmp_path):
    """node-a committed half of its part (a shard of 4 samples) and died;
    the trainer trained those 4 and removed their shard. node-b, taking the
    part over, plans only the 4 never stored: those trained are retired in
    the spool store's index, not just deleted (it used to capture them
    again, into shards nothing freed until the epoch ended). A trainer that
    starts again from its checkpoint needs them again: the resume's trim
    forgets what was retired."""
    from tasks.capture.config import CaptureConfig
    from tasks.capture.planning import plan_extraction
    from tasks.store.handle import Store
    from tasks.stream.reader import StreamReader
    from tasks.stream.parts import trim_spool
    from tasks.stream.spool import epoch_store
    from tasks.target.architectures import load_tokenizer
    from tasks.train.config import TrainConfig

    cfg = TrainConfig(out_dir=str(tmp_path / "run"), draft_vocab_size=64, ttt_steps=1, epochs=1, tokens_per_batch=256,
                      heldout_fraction=0.1, eval_max_samples=2, vocab_positions=100, stream=True, spool_bytes=10**9)
    plan, store, _ = spooled_store(tmp_path, tiny_model, 24, cfg,
                                   held_back=lambda plan: set([r for b in plan.epochs[0] for r in b][4:8]))
    part = [r for b in plan.epochs[0] for r in b][:8]  # the dead node's: its first shard (4) committed
    home = epoch_store(store, 0)
    assert set(Store.open(home).ledger.samples().source_row) >= set(part[:4])
    reader = StreamReader(store, cfg, poll_s=0.05)
    reader.start_epoch(0)
    trained = list(Store.open(home).ledger.samples().query("source_row in @part").sample_id)
    assert len(trained) == 4
    for sid in trained:
        reader[reader.sample_ids.index(sid)]
    reader.release(trained)
    reader.remove_consumed(trained)
    ledger = Store.open(home).ledger
    assert not set(trained) & ledger.stored_ids() and set(trained) <= ledger.retired_ids()

    capture = CaptureConfig(dataset=str(tmp_path / "data.jsonl"), batch_size=4, max_length=128)
    todo = plan_extraction(capture, load_tokenizer(tiny_model), ledger, rows=part).todo
    assert [s.source_row for s in todo] == part[4:]  # node-b's plan: the rest, nothing trained again
    trim_spool(store, plan)  # a resume from the checkpoint (position 0): the trained ones are needed again
    assert [s.source_row for s in plan_extraction(capture, load_tokenizer(tiny_model), Store.open(home).ledger,
                                                  rows=part).todo] == part


def test_a_retired_shard_leaves_the_index_and_its_ids_are_skipped_until_forgotten(tmp_path, ledger_url, monkeypatch):
    """retire_shard on both backends: the shard, its samples and canaries
    leave the index in one transaction, its ids are retired (skipped by a
    capture), and forget_retired takes them back."""
    from tasks.store.ledger.open import open_store
    from tasks.store.shards import write_shard
    from test_store import MANIFEST, item

    store = tmp_path / "store"
    ledger = open_store(store, MANIFEST, ledger_url)
    a = write_shard(store, [item(k, 4) for k in range(3)], source="s.jsonl")
    b = write_shard(store, [item(k, 4) for k in range(3, 5)], source="s.jsonl")
    ledger.commit_shard(*a)
    ledger.commit_shard(*b)
    ledger.retire_shard(a[0].name)
    assert ledger.stored_ids() == {"s003", "s004"} and ledger.retired_ids() == {"s000", "s001", "s002"}
    assert ledger.captured_ids() == {"s000", "s001", "s002", "s003", "s004"}
    # A batch's own question, stored and retired alike; SQLite's in statements of IDS_PER_QUERY ids.
    monkeypatch.setattr("tasks.store.ledger.sqlite.IDS_PER_QUERY", 2)
    assert ledger.captured_among(["s004", "s009", "s001", "s002", "s003"]) == {"s001", "s002", "s003", "s004"}
    assert ledger.captured_among([]) == set()
    assert list(ledger.shards().name) == [b[0].name]
    with pytest.raises(Exception, match="not committed"):
        ledger.retire_shard(a[0].name)
    ledger.forget_retired()
    assert ledger.captured_ids() == {"s003", "s004"} == ledger.captured_among(["s000", "s003", "s004"])


def test_an_epoch_store_removed_while_the_spool_is_counted_is_not_counted_and_fails_nothing(tmp_path, ledger_url,
                                                                                            monkeypatch):
    """The trainer removes a trained epoch store (its files, then its index:
    reader.py remove_earlier_epochs) between a counter's opening it and
    reading its index, on both backends: the spool holds what is left, and
    the count does not fail (it did with PostgreSQL: 'relation "samples"
    does not exist', seen in the many-nodes stream test)."""
    import shutil

    from tasks.store.handle import Store
    from tasks.store.ledger.open import open_store
    from tasks.store.shards import write_shard
    from tasks.stream import spool
    from test_store import MANIFEST, item

    root = tmp_path / "store"
    homes = [spool.epoch_store(root, e) for e in (0, 1)]
    for k, home in enumerate(homes):
        open_store(home, MANIFEST, ledger_url).commit_shard(*write_shard(home, [item(k, 4)], source="s.jsonl"))
    kept = Store.open(homes[1]).ledger.summary()["bytes"]
    assert spool.spooled_bytes(root) == kept + Store.open(homes[0]).ledger.summary()["bytes"]
    real_open = Store.open

    def removed_once_opened(path, *a, **kw):
        opened = real_open(path, *a, **kw)
        if Path(path) == homes[0] and homes[0].exists():
            shutil.rmtree(homes[0])  # as the trainer removes it: the files, then the index
            opened.ledger.drop()
        return opened

    monkeypatch.setattr(spool.Store, "open", removed_once_opened)
    assert spool.spooled_bytes(root) == kept
    assert spool.spooled_bytes(root) == kept  # and once it is gone


def test_a_spooled_run_captures_only_the_heldout_samples_evaluation_reads_within_its_budget(tiny_model, tmp_path):
    """Half the samples held out (as 5% of 600k are ~4 TB at Kimi-K2.5's
    size): a spooled run captures only those evaluation reads, the first in
    split order (eval_max_samples, and twice the served prompts), before
    the first step, and counts them in the budget: the spool's room is what
    is left, and a budget that holds the trainer's minimum but not them
    beside it is refused. (It captured and kept every held-out sample,
    outside the budget.)"""
    from tasks.capture.config import CaptureConfig
    from tasks.data.dataset import prepare_samples
    from tasks.stream.plan import SpoolTooSmall, plan_stream
    from tasks.target.architectures import load_tokenizer
    from tasks.train.config import TrainConfig
    from tasks.train.data import split
    from tests.conftest import demo_rows, write_jsonl

    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(48))
    capture = CaptureConfig(dataset=str(dataset), batch_size=4, max_length=128)
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), draft_vocab_size=64, ttt_steps=1, epochs=2, tokens_per_batch=256,
                      heldout_fraction=0.5, eval_max_samples=2, vocab_positions=100, stream=True, spool_bytes=10**9)
    samples = prepare_samples(dataset, load_tokenizer(tiny_model), max_length=128)[0]
    held = [samples[i].source_row for i in split([s.sample_id for s in samples], 0.5)[1]]
    assert len(held) > 12
    for prompts, read in ((0, 2), (3, 6)):
        plan = plan_stream(str(tiny_model), capture, cfg, served_prompts=prompts)
        assert plan.heldout == held[:read]
        assert plan.heldout_bytes == plan.shard_bytes(held[:read], 4)
        assert plan.spool_room(cfg.spool_bytes) == cfg.spool_bytes - plan.heldout_bytes
    offline = plan_stream(str(tiny_model), capture, cfg.model_copy(update={"spool_bytes": None}))
    assert offline.heldout == held  # the store keeps them all where it keeps everything
    tight = cfg.model_copy(update={"spool_bytes": plan.minimum + plan.heldout_bytes - 1})
    with pytest.raises(SpoolTooSmall, match=r"beside the 6 held-out samples evaluation reads"):
        plan_stream(str(tiny_model), capture, tight, served_prompts=3)
