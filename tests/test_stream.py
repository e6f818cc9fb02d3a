"""Stream mode: the trainer trains while the capture runs, on the batches an
offline run over the finished store forms, and ends with its weights."""
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from flows.extract import extract_hidden_states
from flows.stream import TrainerStopped, capture_task
from tasks.data.dataset import prepare_samples
from tasks.store.verification import verify_store
from tasks.target.architectures import load_tokenizer
from tasks.train.config import TrainConfig, TrainingError
from tasks.train.data import heldout_prompts
from tasks.train.loop import train
from tasks.store.handle import Store
from tasks.store.reader import CorruptSample
from tasks.train.stream import (SpoolTooSmall, mark_capture, mark_trainer, plan_stream, read_position,
                                spool_bytes)
from tests.conftest import attach, demo_rows, random_store, stored_samples, write_jsonl

ROWS = 40
CRASH = 25


class Stop(Exception):
    """Ends an in-process training after a step, as a crash would."""


def config(out_dir, **kw) -> TrainConfig:
    base = dict(out_dir=str(out_dir), draft_vocab_size=64, ttt_steps=1, epochs=2, tokens_per_batch=512,
                heldout_fraction=0.1, eval_max_samples=2, vocab_positions=300, stream=True)
    return TrainConfig(**{**base, **kw})


@pytest.mark.server
def test_a_stream_run_trains_while_capturing_and_ends_with_the_offline_weights(capture_server, prefect_api,
                                                                                tiny_model, tmp_path):
    bad = ["{broken json", {"messages": []}, {"messages": [{"role": "wizard", "content": "hi"}]}]
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(ROWS) + bad)
    params = attach(capture_server, store=tmp_path / "store", dataset=str(dataset), batch_size=4, max_length=256)
    cfg = config(tmp_path / "stream")
    plan = plan_stream(str(tiny_model), params["capture"], cfg)
    assert plan.rejected == [ROWS, ROWS + 1, ROWS + 2]
    rows = plan.heldout + [r for b in plan.epochs[0] for r in b]
    # The capture stops after the first third, as back-pressure would stop
    # it, until the trainer has taken a step: a trainer that needed a sample
    # later in the order would wait out the timeout, and the test fail.
    first_step, seen = threading.Event(), []
    failure = []

    def capture():
        try:
            extract_hidden_states(**params, verify=False, rows=rows[:len(rows) // 3])
            assert first_step.wait(timeout=300), "no step with a third of the samples captured"
            capture_task.fn(**params, train=cfg, plan=plan)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            failure.append(e)

    thread = threading.Thread(target=capture)
    thread.start()

    def on_step(s):
        seen.append((s["step"], stored_samples(tmp_path / "store")))
        first_step.set()

    try:
        streamed = train(cfg, tmp_path / "store", on_step=on_step)
    finally:
        first_step.set()
        thread.join()
    assert not failure, failure
    assert seen[0][0] == 1 and seen[0][1] <= len(rows) // 3, seen  # a step with a third captured, at most
    assert stored_samples(tmp_path / "store") == ROWS and verify_store(tmp_path / "store").ok
    # The bad rows quarantined with the reasons an offline run's plan gives them.
    offline_reasons = {r.source_row: r.reason for r in prepare_samples(dataset, load_tokenizer(tiny_model),
                                                                       max_length=256)[1]}
    quarantined = Store.open(tmp_path / "store").ledger.quarantined()
    assert dict(zip(quarantined.source_row, quarantined.reason)) == offline_reasons and len(offline_reasons) == 3
    offline = train(cfg.model_copy(update={"stream": False, "out_dir": str(tmp_path / "offline")}),
                    tmp_path / "store")
    assert streamed.history == offline.history and streamed.steps == offline.steps
    weights = [load_file(tmp_path / d / "drafter" / "model.safetensors") for d in ("stream", "offline")]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


def test_a_capture_that_ended_without_a_sample_stops_the_trainer_naming_it(tiny_model, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    store = random_store(d, tiny_model, 16, max_length=64)
    write_jsonl(d / "data.jsonl", demo_rows(20))  # four rows the capture never stored
    missing = {s.sample_id for s in prepare_samples(d / "data.jsonl", load_tokenizer(tiny_model), max_length=64,
                                                     rows=range(16, 20))[0]}
    mark_capture(store, "failed", "RuntimeError: 1 batches failed after their retries")
    with pytest.raises(TrainingError, match=r"capture into .* ended \(failed: RuntimeError: 1 batches failed.*"
                                            r"without storing sample (\w+) \(row (1[6-9])\)") as e:
        train(config(tmp_path / "run", tokens_per_batch=128, vocab_positions=20), store)
    assert e.match("|".join(missing))


@pytest.mark.server
def test_a_spooled_run_stays_within_its_disk_budget_and_trains_the_offline_batches(capture_server, prefect_api,
                                                                                   tiny_model, tmp_path):
    """Each epoch captured again into the spool, each shard removed once
    trained, the capture paused while the spool is full: the spool never
    holds more than its budget, measured from the trainer's side after every
    step, and well under one epoch of data; the trainer takes exactly the
    batches, step by step, an offline run over a store of the same data
    takes, also across a trainer that crashes in the second epoch (a step
    after its checkpoint, whose shards were already removed) and a capture
    started again with it from the checkpointed position. (Not the same
    weights: each epoch is a capture of its own, and a request's states
    change in their last bits with the requests it shares a forward with; on
    the same bytes, the weights are equal: the test above.)"""
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(ROWS))
    offline = attach(capture_server, store=tmp_path / "offline-store", dataset=str(dataset), batch_size=4,
                     max_length=256)
    extract_hidden_states(**offline)
    epoch_bytes = Store.open(tmp_path / "offline-store").ledger.summary()["bytes"]
    params = attach(capture_server, store=tmp_path / "store", dataset=str(dataset), batch_size=4, max_length=256)
    budget = epoch_bytes * 7 // 10  # under one epoch: the data the run trains on is two
    cfg = config(tmp_path / "stream", spool_bytes=budget, checkpoint_every=2)
    plan = plan_stream(str(tiny_model), params["capture"], cfg)
    assert len(plan.epochs) == 2
    with pytest.raises(SpoolTooSmall, match=r"train.spool_bytes 1,000 cannot hold .* bytes"):
        plan_stream(str(tiny_model), params["capture"], cfg.model_copy(update={"spool_bytes": 1000}))
    held, failures, reports, crashed, resumed, offline_batches = [], [], [], [], [], []

    def start_capture() -> threading.Thread:
        def capture():
            try:
                reports.append(capture_task.fn(**params, train=cfg, plan=plan))
            except BaseException as e:  # noqa: BLE001 - surfaced below
                failures.append(e)
        thread = threading.Thread(target=capture)
        thread.start()
        return thread

    def slow_start_then_crash(s):
        held.append(spool_bytes(tmp_path / "store"))
        crashed.append(s)
        if s["step"] == 1:  # the capture runs ahead; without back-pressure it would take a whole epoch
            time.sleep(8)
        if s["step"] == CRASH:  # in the second epoch, a step after a checkpoint: its shards are gone already
            raise Stop

    mark_trainer(tmp_path / "store", "running")
    thread = start_capture()
    try:
        with pytest.raises(Stop):
            train(cfg, tmp_path / "store", on_step=slow_start_then_crash)
    finally:
        mark_trainer(tmp_path / "store", "stopped")  # as capture_and_train does when its trainer fails
        thread.join()
    # The capture either had stored all it could or stopped waiting for room.
    assert all(isinstance(e, TrainerStopped) for e in failures), failures
    first_epoch = sum(1 for r in crashed if r["epoch"] == 0)
    assert first_epoch < CRASH - 1
    kept = CRASH - 1 - first_epoch  # batches of the second epoch in the last checkpoint (every 2 steps)
    assert read_position(tmp_path / "store") == (1, kept)
    mark_trainer(tmp_path / "store", "running")
    thread = start_capture()
    try:
        streamed = train(cfg, tmp_path / "store", on_step=lambda s: (held.append(spool_bytes(tmp_path / "store")),
                                                                      resumed.append(s)))
    finally:
        thread.join()
    assert streamed.resumed_from == {"epoch": 1, "batches_done": kept, "step": CRASH - 1}
    assert not failures[1:] and len(reports) >= 1, failures
    peak = max(r["spool_peak_bytes"] for r in reports)
    assert 0 < max(held) <= budget and peak <= budget, (held, reports, budget)
    assert sum(r["paused_s"] for r in reports) > 0, reports  # it did fill
    assert not list((tmp_path / "store" / "spool").glob("epoch-*"))  # every epoch trained and gone
    assert stored_samples(tmp_path / "store") == len(plan.heldout)  # the held-out samples stay
    # and serve the evaluation the prompts an offline store gives (not the one a tiny store's split keeps)
    prompts = heldout_prompts(tmp_path / "store", cfg.heldout_fraction, 100)
    assert len(prompts) == len(plan.heldout) > 1
    assert prompts == heldout_prompts(tmp_path / "offline-store", cfg.heldout_fraction, 100)
    # What the crashed run checkpointed, then what the resumed one trained.
    streamed_batches = [r for r in crashed if r["step"] < CRASH] + resumed
    reference = train(cfg.model_copy(update={"stream": False, "spool_bytes": None,
                                             "out_dir": str(tmp_path / "offline")}), tmp_path / "offline-store",
                      on_step=offline_batches.append)
    assert streamed.steps == reference.steps == len(streamed_batches) > CRASH
    plan_of = [(s["epoch"], s["step"], s["batch"], s["sample_ids"], s["weight"]) for s in streamed_batches]
    assert plan_of == [(s["epoch"], s["step"], s["batch"], s["sample_ids"], s["weight"]) for s in offline_batches]
    assert streamed.history[0]["heldout_tokens"] == reference.history[0]["heldout_tokens"]  # the same held-out set


def test_a_byte_flipped_in_a_shard_stops_stream_training_naming_it(tiny_model, tmp_path):
    store = random_store(tmp_path, tiny_model, 16, max_length=64)
    shard = next((store / "shards").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # inside the hidden states
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptSample, match=rf"in {shard}: its bytes no longer match"):
        train(config(tmp_path / "run", tokens_per_batch=128, vocab_positions=20), store)
