"""Stream mode: the trainer trains while the capture runs, on the batches an
offline run over the finished store forms, and ends with its weights."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from flows.artifacts import artifact_key
from flows.extract import extract_hidden_states
from tasks.capture.config import CaptureConfig
from tasks.evaluation.config import EvaluateConfig
from tasks.server.config import API_KEY_ENV
from flows.stream import capture_task
from tasks.data.dataset import prepare_samples
from tasks.store.verification import verify_store
from tasks.target.architectures import load_tokenizer
from tasks.train.config import TrainConfig, TrainingError
from tasks.train.data import heldout_prompts, split
from tasks.train.loop import train
from tasks.store.handle import Store
from tasks.store.reader import CorruptSample
from tasks.stream.plan import PLANNED, SpoolTooSmall, plan_stream
from tasks.stream.reader import StreamReader
from tasks.stream.spool import SpoolBudget, SpoolDeadlock, TrainerStopped, epoch_store, read_position, spooled_bytes
from tasks.stream.state import mark_capture, mark_trainer, trainer_waiting
from tests.prefect_stack import Api, secrets_found
from tests.conftest import (attach, demo_rows, random_store, stored_samples, train_beside_capture, wait_for,
                            write_jsonl)

REPO = Path(__file__).resolve().parent.parent
ROWS = 40


def config(out_dir, **kw) -> TrainConfig:
    base = dict(out_dir=str(out_dir), draft_vocab_size=64, ttt_steps=1, epochs=2, tokens_per_batch=512,
                heldout_fraction=0.1, eval_max_samples=2, vocab_positions=300, stream=True)
    return TrainConfig(**{**base, **kw})


@dataclass
class Offline:
    """The spool tests' reference: a store of the data, captured offline,
    and the steps an offline training over it takes."""
    dataset: Path
    store: Path
    epoch_bytes: int
    steps: list[dict]
    result: object


@pytest.fixture(scope="module")
def offline(capture_server, prefect_api, tmp_path_factory) -> Offline:
    d = tmp_path_factory.mktemp("offline")
    dataset = write_jsonl(d / "data.jsonl", demo_rows(ROWS))
    extract_hidden_states(**attach(capture_server, store=d / "store", dataset=str(dataset), batch_size=4,
                                   max_length=256))
    steps = []
    result = train(config(d / "train", stream=False), d / "store", on_step=steps.append)
    return Offline(dataset, d / "store", Store.open(d / "store").ledger.summary()["bytes"], steps, result)


def batches(steps: list[dict]) -> list[tuple]:
    return [(s["epoch"], s["step"], s["batch"], s["sample_ids"], s["weight"]) for s in steps]


@pytest.mark.server
def test_a_stream_run_trains_while_capturing_and_ends_with_the_offline_weights(capture_server, prefect_api,
                                                                               tiny_model, tmp_path):
    bad = ["{broken json", {"messages": []}, {"messages": [{"role": "wizard", "content": "hi"}]}]
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(ROWS) + bad)
    params = attach(capture_server, store=tmp_path / "store", dataset=str(dataset), batch_size=4, max_length=256)
    cfg = config(tmp_path / "stream")
    plan = plan_stream(str(tiny_model), params["capture"], cfg, tmp_path / "store")
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
    # The trainer read the plan's samples instead of tokenising again; they
    # are what a tokenisation gives, and a source changed since is tokenised.
    readers = [StreamReader(tmp_path / "store", cfg)]
    os.utime(dataset, ns=(dataset.stat().st_atime_ns, dataset.stat().st_mtime_ns + 1))
    readers.append(StreamReader(tmp_path / "store", cfg))
    assert [r.planned_from for r in readers] == ["file", "tokenised"]
    assert readers[0].sample_ids == readers[1].sample_ids and readers[0]._rows == readers[1]._rows
    for counts in ("num_tokens", "num_loss_tokens"):
        assert getattr(readers[0], counts).tolist() == getattr(readers[1], counts).tolist()
    # Every part's extract subflow took the attached server's key as a
    # parameter: Prefect holds it masked; the kept configs hold none.
    assert not secrets_found(Api(prefect_api), [capture_server.api_key], tmp_path)


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


def test_a_sample_the_running_capture_quarantined_stops_the_trainer_naming_it(tiny_model, tmp_path):
    """Quarantined while the capture still runs (it crashed the server): the
    trainer stops within seconds with the reason, not at the capture's end
    (here 60 s away, which would fail the match)."""
    d = tmp_path / "data"
    d.mkdir()
    store = random_store(d, tiny_model, 16, max_length=64)
    write_jsonl(d / "data.jsonl", demo_rows(20))  # rows 16-19 not stored yet
    bad = prepare_samples(d / "data.jsonl", load_tokenizer(tiny_model), max_length=64, rows=range(16, 20))[0]

    def quarantine_once_the_trainer_waits() -> None:  # it has planned them by then
        while not trainer_waiting(store):
            time.sleep(0.1)
        Store.open(store).ledger.quarantine([{"source": str(d / "data.jsonl"), "source_row": s.source_row,
                                              "sample_id": s.sample_id, "reason": "crashed the server 2 times"}
                                             for s in bad])

    mark_capture(store, "running")
    ending = threading.Timer(60.0, mark_capture, (store, "completed"))
    ending.start()
    threading.Thread(target=quarantine_once_the_trainer_waits, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(TrainingError, match=r"the capture quarantined sample (\w+) \(row (1[6-9])\) in .* "
                                                r"\(crashed the server 2 times\)") as e:
            train(config(tmp_path / "run", tokens_per_batch=128, vocab_positions=20), store)
    finally:
        ending.cancel()
    assert e.match("|".join(s.sample_id for s in bad)) and time.monotonic() - started < 60

    # Run again (the capture stored the rest and ended): the plan and the
    # trainer leave the quarantined samples out, as offline, and the run
    # takes the offline batches over the same bytes, to the same weights.
    capture = CaptureConfig(dataset=str(d / "data.jsonl"), max_length=64)
    cfg = config(tmp_path / "again", tokens_per_batch=128, vocab_positions=20)
    plan = plan_stream(str(tiny_model), capture, cfg, store)
    planned = set(plan.heldout) | {r for b in plan.epochs[0] for r in b}
    assert planned == set(Store.open(store).ledger.samples().source_row) and not planned & {s.source_row for s in bad}
    readers = [StreamReader(store, cfg)]
    (store / PLANNED).unlink()  # a rank without the plan's file tokenises, and leaves them out too
    readers.append(StreamReader(store, cfg))
    assert [r.planned_from for r in readers] == ["file", "tokenised"] and readers[0].sample_ids == readers[1].sample_ids
    mark_capture(store, "completed")
    streamed, offline = [], []
    train(cfg, store, on_step=streamed.append)
    train(cfg.model_copy(update={"stream": False, "out_dir": str(tmp_path / "offline")}), store,
          on_step=offline.append)
    assert batches(streamed) == batches(offline) and len(streamed) > 0
    weights = [load_file(tmp_path / run / "drafter" / "model.safetensors") for run in ("again", "offline")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])


def test_a_capture_waiting_for_room_stops_when_the_trainer_stops(tiny_model, tmp_path):
    """A trainer that stops (an error, a cancel) will not empty the spool:
    the capture waiting for room stops too, instead of waiting for ever."""
    root = tmp_path / "root"
    epoch_store(root, 0).parent.mkdir(parents=True)
    epoch_store(root, 0).symlink_to(random_store(tmp_path, tiny_model, 4, max_length=64))  # a full spool
    held = spooled_bytes(root)
    mark_trainer(root, "running")
    stopping = threading.Timer(1.0, mark_trainer, (root, "stopped"))
    stopping.start()
    started = time.monotonic()
    with pytest.raises(TrainerStopped, match=rf"the spool of {root} will not empty; the capture stops too"):
        SpoolBudget(root, held).wait_for_room(1, epoch=0)
    assert 1.0 <= time.monotonic() - started < 10  # it waited for room, then saw the trainer stop


def test_a_trainer_and_a_capture_waiting_on_each_other_stop_naming_the_sample(tiny_model, tmp_path):
    """A spool too small for what the trainer holds at once: the trainer
    waits for a sample the capture would store next, the capture waits for
    room only a step would free. Past the deadlock time both stop, the
    capture naming the sample and what to change, instead of waiting for
    ever."""
    for d in ("run", "full"):
        (tmp_path / d).mkdir()
    root = random_store(tmp_path / "run", tiny_model, 4, max_length=64)  # the held-out samples' store
    write_jsonl(tmp_path / "run" / "data.jsonl", demo_rows(8))  # four rows still to capture
    epoch_store(root, 0).parent.mkdir(parents=True)
    epoch_store(root, 0).symlink_to(random_store(tmp_path / "full", tiny_model, 4, max_length=64))  # a full spool
    mark_trainer(root, "running")
    cfg = config(tmp_path / "train", spool_bytes=spooled_bytes(root))
    reader = StreamReader(root, cfg)
    held = set(split(reader.sample_ids, cfg.heldout_fraction)[1])
    waited = next(i for i in range(4, 8) if i not in held)  # a training sample: read from the spool
    errors = []

    def read():
        try:
            reader[waited]
        except TrainingError as e:
            errors.append(e)

    trainer = threading.Thread(target=read)
    trainer.start()
    try:
        with pytest.raises(SpoolDeadlock, match=rf"the stream trainer has waited \d+ s for sample "
                                                rf"{reader.sample_ids[waited]} \(row \d\) in "
                                                rf"{epoch_store(root, 0)} while the capture waits for room .* larger "
                                                rf"train.spool_bytes"):
            SpoolBudget(root, spooled_bytes(root), deadlock_s=1.0).wait_for_room(1, epoch=0)
    finally:
        mark_capture(root, "failed", "SpoolDeadlock")  # as capture_task records it: the trainer stops too
        trainer.join(timeout=30)
    assert errors and "ended (failed: SpoolDeadlock)" in str(errors[0])
    assert not list(root.glob("stream-waiting-*.json"))  # it stopped waiting


@pytest.mark.server
def test_a_spooled_run_killed_mid_epoch_resumes_within_its_budget_on_the_offline_batches(capture_server, prefect_api,
                                                                                         tiny_model, offline, tmp_path):
    """Each epoch captured again into the spool, each shard removed once
    trained, the capture paused while the spool is full. The pipeline,
    started from the command line, is SIGKILLed in the second epoch after a
    checkpoint (trainer and capture at once, nothing marked, whatever it was
    writing left half done); started again, both resume: the trainer from
    its checkpoint, the capture from the checkpointed position (what was
    trained since is captured again). The spool never holds more than its
    budget, measured from the trainer's side after every step and well
    under one epoch of data; the resumed trainer takes exactly the batches,
    step by step, an offline run over a store of the same data takes. (Not
    the same weights: each epoch is a capture of its own, and a request's
    states change in their last bits with the requests it shares a forward
    with; on the same bytes the weights are equal: the first test.)"""
    params = attach(capture_server, store=tmp_path / "store", dataset=str(offline.dataset), batch_size=4,
                    max_length=256)
    # The spool's room under one epoch (the data the run trains on is two),
    # beside the held-out samples the pipeline's evaluation serves prompts of.
    served = EvaluateConfig().num_prompts
    heldout_bytes = plan_stream(str(tiny_model), params["capture"], config(tmp_path, spool_bytes=10**12),
                                served_prompts=served).heldout_bytes
    budget = offline.epoch_bytes * 7 // 10 + heldout_bytes
    cfg = config(tmp_path / "stream", spool_bytes=budget, checkpoint_every=2)
    plan = plan_stream(str(tiny_model), params["capture"], cfg, served_prompts=served)
    room = plan.spool_room(budget)
    assert len(plan.epochs) == 2
    with pytest.raises(SpoolTooSmall, match=r"train.spool_bytes 1,000 cannot hold .* bytes"):
        plan_stream(str(tiny_model), params["capture"], cfg.model_copy(update={"spool_bytes": 1000}))

    # The key as a user keeps it out of a config file: in the environment
    # (a dumped config has the mask in its place, which is refused).
    run = {"mode": "stream", **{k: v.model_dump(mode="json", exclude={"api_key"}) for k, v in params.items()},
           "train": cfg.model_dump(mode="json")}
    (tmp_path / "run.json").write_text(json.dumps(run))
    env = {**os.environ, "PREFECT_API_URL": prefect_api, API_KEY_ENV: capture_server.api_key}
    proc = subprocess.Popen([sys.executable, "-m", "flows.pipeline", "--config", str(tmp_path / "run.json")],
                            cwd=REPO, env=env, start_new_session=True,
                            stdout=open(tmp_path / "stdout", "w"), stderr=open(tmp_path / "stderr", "w"))
    try:
        wait_for(lambda: read_position(tmp_path / "store")[0] == 1 and read_position(tmp_path / "store")[1] > 0,
                 proc, tmp_path / "stderr")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    epoch, kept = read_position(tmp_path / "store")  # the checkpoint's: a step or two may have come after it
    assert epoch == 1 and kept > 0
    # The run showed both sides in its progress artifact until it died.
    artifact, = httpx.post(f"{prefect_api}/artifacts/filter", json={"artifacts": {"key": {"any_": [
        artifact_key("stream-progress", tmp_path / "store")]}}}).raise_for_status().json()
    training = ROWS - len(plan.heldout)
    shown = re.fullmatch(rf"capture (?:running|completed): epoch [12]/2, \d+ of {training} samples, [\d,]+ tokens at "
                         rf"[\d,]+ tok/s(?:, paused [\d,]+ s for room)?; trainer running: epoch [12]/2, step (\d+) of "
                         rf"(\d+), [\d,]+ tokens at [\d,]+ tok/s, ETA \d+ min \d\d s; spool ([\d.]+) MiB of "
                         rf"{room / 2**20:.1f} MiB", artifact["description"])
    assert shown, artifact["description"]
    step, steps = int(shown[1]), int(shown[2])
    assert 0 < step < steps and artifact["data"] == pytest.approx(100 * step / steps)
    assert float(shown[3]) <= round(room / 2**20, 1)
    first_epoch = len(plan.epochs[0])  # one batch a step (one process, no accumulation)

    held, resumed = [], []

    def slow_start(s):
        held.append(spooled_bytes(tmp_path / "store"))
        resumed.append(s)
        if len(resumed) == 1:  # the capture runs ahead; without back-pressure it would take the whole epoch
            time.sleep(8)

    # Started again, with an eye on each step.
    streamed, report = train_beside_capture(params, cfg, plan, tmp_path / "store", slow_start)
    assert streamed.resumed_from == {"epoch": 1, "batches_done": kept, "step": first_epoch + kept}
    assert 0 < max(held) <= room and report["spool_peak_bytes"] <= room, (held, report, room)
    assert report["paused_s"] > 0, report  # it did fill
    assert not list((tmp_path / "store" / "spool").glob("epoch-*"))  # every epoch trained and gone
    assert stored_samples(tmp_path / "store") == len(plan.heldout)  # the held-out samples stay
    # and serve the evaluation the prompts an offline store gives (not the one a tiny store's split keeps)
    prompts = heldout_prompts(tmp_path / "store", cfg.heldout_fraction, 100)
    assert len(prompts) == len(plan.heldout) > 1
    assert prompts == heldout_prompts(offline.store, cfg.heldout_fraction, 100)
    assert streamed.steps == offline.result.steps == first_epoch + kept + len(resumed)
    assert batches(resumed) == batches(offline.steps[first_epoch + kept:])
    assert streamed.history[0]["heldout_tokens"] == offline.result.history[0]["heldout_tokens"]  # the same held-out set


@pytest.mark.server
def test_cached_epochs_capture_again_only_what_the_budget_could_not_keep(capture_server, prefect_api, tiny_model,
                                                                         offline, tmp_path):
    """train.cache_epochs with a budget of one epoch: the first epoch's
    first samples, as many as fit beside the spool's working set, are kept
    in the store and read there in the second epoch, which captures only
    the others; the disk never holds more than the budget (the kept samples
    and the spool, after every step); the trainer takes the offline run's
    batches."""
    store = tmp_path / "store"
    params = attach(capture_server, store=store, dataset=str(offline.dataset), batch_size=4, max_length=256)
    cfg = config(tmp_path / "stream", spool_bytes=offline.epoch_bytes, cache_epochs=True)
    plan = plan_stream(str(tiny_model), params["capture"], cfg)
    first, second = ([r for b in epoch for r in b] for epoch in plan.epochs)
    assert 0 < len(plan.cached) < len(first) and plan.cached == first[:len(plan.cached)]
    assert sorted(second) == sorted(set(first) - set(plan.cached))  # the second epoch captures only the others
    held, steps, removed_but_mapped = [], [], []

    def kept_bytes() -> int:
        """The store's training samples (not the held-out ones): the cache."""
        ledger = Store.open(store).ledger
        samples = ledger.samples()
        cache = set(samples.shard[~samples.source_row.isin(plan.heldout)])
        return int(ledger.shards().query("name in @cache").bytes.sum())

    def on_step(s):
        held.append(spooled_bytes(store) + kept_bytes())
        steps.append(s)
        # A removed shard still mapped keeps its blocks: the budget would not hold.
        removed_but_mapped.extend(line for line in Path("/proc/self/maps").read_text().splitlines()
                                  if str(store) in line and line.endswith("(deleted)"))

    streamed, report = train_beside_capture(params, cfg, plan, store, on_step)
    assert 0 < max(held) <= offline.epoch_bytes, (held, offline.epoch_bytes)
    assert not removed_but_mapped, removed_but_mapped[:3]
    assert kept_bytes() <= report["cached_bytes"] == plan.cached_bytes  # the plan's bound holds
    assert report["tokens"] == sum(plan.tokens[r] for r in first + second)  # a kept sample captured once
    assert sorted(Store.open(store).ledger.samples().source_row) == sorted(plan.heldout + plan.cached)
    assert not list((store / "spool").glob("epoch-*"))
    assert batches(steps) == batches(offline.steps) and streamed.steps == offline.result.steps


def test_a_byte_flipped_in_a_shard_stops_stream_training_naming_it(tiny_model, tmp_path):
    store = random_store(tmp_path, tiny_model, 16, max_length=64)
    shard = next((store / "shards").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # inside the hidden states
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptSample, match=rf"in {shard}: its bytes no longer match"):
        train(config(tmp_path / "run", tokens_per_batch=128, vocab_positions=20), store)


@pytest.mark.server
def test_a_trainer_retried_by_prefect_after_a_failure_completes_as_the_spooled_capture_rewinds(
        capture_server, prefect_api, tiny_model, offline, tmp_path, monkeypatch):
    """The trainer task fails after a step past its checkpoint (a rank died,
    an OOM, a database blink: here an exception injected in its step)
    while the spooled capture runs on; Prefect's retry resumes it from the
    checkpoint, whose batches since were trained and removed. The capture
    sees the trainer start again and rewinds to the checkpoint: the retry
    completes on exactly the offline run's batches (it used to wait for
    the removed batches until the deadlock check blamed train.spool_bytes)."""
    import flows.train
    from prefect import flow

    store = tmp_path / "store"
    params = attach(capture_server, store=store, dataset=str(offline.dataset), batch_size=4, max_length=256)
    cfg = config(tmp_path / "stream", spool_bytes=offline.epoch_bytes * 7 // 10, checkpoint_every=2)
    plan = plan_stream(str(tiny_model), params["capture"], cfg, store)
    monkeypatch.setattr(SpoolBudget, "DEADLOCK_S", 30.0)  # without the rewind: refused after 30 s, not 600
    real_train, attempts, retried = flows.train.train, [], []

    def failing_once(cfg, store, **kw):
        attempts.append(len(attempts) + 1)
        if len(attempts) > 1:
            return real_train(cfg, store, on_step=retried.append)

        def crash(step):
            if step["step"] == 5:  # trained (its shards removed), past the checkpoint of step 4
                raise RuntimeError("rank 0 died (injected)")
        return real_train(cfg, store, on_step=crash)

    monkeypatch.setattr(flows.train, "train", failing_once)

    @flow(name="trainer-with-retries")
    def trainer():
        return flows.train.train_task(cfg, str(store))

    result, report = train_beside_capture(params, cfg, plan, store, None, trainer=trainer)
    assert attempts == [1, 2]
    assert result.resumed_from == {"epoch": 0, "batches_done": 4, "step": 4}
    assert batches(retried) == batches(offline.steps[4:]) and result.steps == offline.result.steps
    assert report["spool_peak_bytes"] <= cfg.spool_bytes
    assert not list((store / "spool").glob("epoch-*"))
