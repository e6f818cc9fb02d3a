"""Stream mode: the trainer trains while the capture runs, on the batches an
offline run over the finished store forms, and ends with its weights."""
import threading

import pytest
import torch
from safetensors.torch import load_file

from flows.extract import extract_hidden_states
from flows.stream import capture_task
from tasks.data.dataset import prepare_samples
from tasks.store.config import StoreConfig
from tasks.store.verification import verify_store
from tasks.target.architectures import load_tokenizer
from tasks.train.config import TrainConfig, TrainingError
from tasks.train.loop import train
from tasks.train.stream import mark_capture, planned_samples, stream_order
from tests.conftest import attach, demo_rows, random_store, stored_samples, write_jsonl

ROWS = 40


def config(out_dir, **kw) -> TrainConfig:
    base = dict(out_dir=str(out_dir), draft_vocab_size=64, ttt_steps=1, epochs=2, tokens_per_batch=512,
                heldout_fraction=0.1, eval_max_samples=2, vocab_positions=300, stream=True)
    return TrainConfig(**{**base, **kw})


@pytest.mark.server
def test_a_stream_run_trains_while_capturing_and_ends_with_the_offline_weights(capture_server, prefect_api,
                                                                                tiny_model, tmp_path):
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(ROWS))
    params = attach(capture_server, store=tmp_path / "store", dataset=str(dataset), batch_size=4, max_length=256)
    cfg = config(tmp_path / "stream")
    samples = planned_samples([str(dataset)], load_tokenizer(tiny_model), max_length=256, policy="truncate")
    rows = [s.source_row for s in stream_order(samples, cfg)]
    # The capture stops after the first third, as back-pressure would stop
    # it, until the trainer has taken a step: a trainer that needed a sample
    # later in the order would wait out the timeout, and the test fail.
    first_step, seen = threading.Event(), []
    failure = []

    def capture():
        try:
            extract_hidden_states(**params, verify=False, rows=rows[:len(rows) // 3])
            assert first_step.wait(timeout=300), "no step with a third of the samples captured"
            capture_task.fn(**params, rows=rows)
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
