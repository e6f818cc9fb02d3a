"""Resumes that used to be silently wrong: a run resumed on another device
count trains every batch of the epoch's order exactly once (it used to skip
or repeat some), a remainder batch under DDP is averaged as one device would,
and a store that changed since the checkpoint is refused (or re-planned on
request).
Training runs for real on the tiny target, on stores of random hidden states
(tests/conftest.py random_store); two devices are two CPU processes on gloo
under torchrun."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks.store.reader import StoreReader
from tasks.train.checkpoint import CHECKPOINT
from tasks.train.config import TrainConfig, TrainingError
from tasks.train.data import split
from tasks.train.launch import write_launch_config
from tasks.train.loop import train
from tests.conftest import random_store
from tests.step_probe import probed, recorded, recording_steps

ROOT = Path(__file__).resolve().parent.parent


def config(out_dir: Path, **kw) -> TrainConfig:
    # Short samples, two or three per batch: ~10 batches an epoch, cheap steps.
    base = dict(out_dir=str(out_dir), draft_vocab_size=64, ttt_steps=1, epochs=2, tokens_per_batch=128,
                heldout_fraction=0.1, eval_max_samples=2, checkpoint_every=3)
    return TrainConfig(**{**base, **kw})


class Stop(Exception):
    """Ends an in-process run after a step, as a kill would (the checkpoint
    on disk is whatever was written before)."""


def recording(records: list, stop_after: int | None = None):
    def on_step(s: dict) -> None:
        records.append(s)
        if s["step"] == stop_after:
            raise Stop
    return on_step


# The same `train` under torchrun with a recording on_step; rank 0 SIGKILLs
# itself after a chosen step (after that step's checkpoint, if one was due),
# and torchrun ends the other rank.
RECORDING_RUN = """
import json, os, signal, sys
from tasks.train.launch import read_launch_config
from tasks.train.loop import train
cfg, store, _ = read_launch_config(sys.argv[1])
records, kill_after = sys.argv[2], int(sys.argv[3])
def on_step(s):
    with open(f"{records}.{s['rank']}", "a") as f:
        f.write(json.dumps(s) + "\\n")
    if s["step"] == kill_after and s["rank"] == 0:
        os.kill(os.getpid(), signal.SIGKILL)
train(cfg, store, on_step=on_step)
"""


def torchrun(cfg: TrainConfig, store: Path, tmp: Path, kill_after: int = -1,
             steps: Path | None = None) -> tuple[int, list[dict], str]:
    """Run cfg on two CPU processes: the exit code, every rank's step
    records, the output; with `steps`, what every optimizer step was given
    and left is recorded there (tests/step_probe.py)."""
    tmp.mkdir(parents=True, exist_ok=True)
    write_launch_config(tmp / "cfg.json", cfg, store)
    (tmp / "run.py").write_text(RECORDING_RUN)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(tmp / "run.py"), str(tmp / "cfg.json"), str(tmp / "records"), str(kill_after)],
                          cwd=ROOT, env=probed(env, steps) if steps else env, capture_output=True, text=True,
                          timeout=300)
    records = [json.loads(line) for f in sorted(tmp.glob("records.*")) for line in f.read_text().splitlines()]
    return proc.returncode, records, proc.stdout + proc.stderr


def trained_batches(records: list[dict], up_to_step: int | None = None) -> list[tuple]:
    """(epoch, sample ids) of every batch trained, in the order of the
    epoch's batches (step, then rank), leaving out steps after `up_to_step`
    (lost with the kill: not in the checkpoint) and weight-0 repeats."""
    kept = [r for r in records if r["weight"] > 0 and (up_to_step is None or r["step"] <= up_to_step)]
    return [(r["epoch"], tuple(r["sample_ids"])) for r in sorted(kept, key=lambda r: (r["step"], r["rank"]))]


@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory):
    return random_store(tmp_path_factory.mktemp("resume"), tiny_model, 24, max_length=64)


@pytest.fixture(scope="module")
def uninterrupted(store, tmp_path_factory):
    """One device, start to end: the batches each epoch's order holds."""
    records: list[dict] = []
    train(config(tmp_path_factory.mktemp("ref") / "run"), store, on_step=recording(records))
    batches = trained_batches(records)
    reader = StoreReader(store)
    train_ids = sorted(reader.sample_ids[i] for i in split(reader.sample_ids, 0.1)[0])
    for epoch in (0, 1):  # the reference itself: every training sample once an epoch
        assert sorted(s for e, b in batches if e == epoch for s in b) == train_ids
    return batches


def test_a_two_device_run_resumed_on_one_device_trains_every_batch_once(store, uninterrupted, tmp_path):
    cfg = config(tmp_path / "run", devices=2)
    rc, killed, log = torchrun(cfg, store, tmp_path / "ddp", kill_after=4)
    assert rc != 0 and max(r["step"] for r in killed) == 4, log
    ckpt = torch.load(tmp_path / "run" / CHECKPOINT, weights_only=True)
    assert (ckpt["epoch"], ckpt["step"]) == (0, 3)  # steps 1-3 (six batches) kept, step 4 lost with the kill
    records: list[dict] = []
    resumed = train(config(tmp_path / "run", devices=1), store, on_step=recording(records))
    assert trained_batches(killed, up_to_step=3) + trained_batches(records) == uninterrupted
    assert resumed.resumed_from == {"epoch": 0, "batches_done": 6, "step": 3}


def test_a_one_device_run_resumed_on_two_devices_trains_every_batch_once(store, uninterrupted, tmp_path):
    first: list[dict] = []
    with pytest.raises(Stop):
        train(config(tmp_path / "run"), store, on_step=recording(first, stop_after=5))
    ckpt = torch.load(tmp_path / "run" / CHECKPOINT, weights_only=True)
    assert (ckpt["epoch"], ckpt["step"]) == (0, 3)
    rc, resumed, log = torchrun(config(tmp_path / "run", devices=2), store, tmp_path / "ddp")
    assert rc == 0, log
    assert trained_batches(first, up_to_step=3) + trained_batches(resumed) == uninterrupted
    # Both ranks ran every step; where an odd number of an epoch's batches
    # was left, its last step had one batch, and rank 1 ran it again at weight 0.
    for epoch in (0, 1):
        left = sum(1 for e, _ in uninterrupted if e == epoch) - (3 if epoch == 0 else 0)
        mine = [r for r in resumed if r["epoch"] == epoch]
        assert len(mine) == 2 * -(-left // 2)
        assert [r["rank"] for r in mine if r["weight"] == 0] == [1] * (left % 2)
    assert any(r["weight"] == 0 for r in resumed)  # (7 batches were left of epoch 1: the case did arise)
    assert json.loads((tmp_path / "run" / "result.json").read_text())["resumed_from"]["batches_done"] == 3


# Two computations of one batch's gradient from the same weights, in two
# processes with other thread counts: the same sums in other orders. A sum of
# n fp32 terms rounds differently by about sqrt(n) * 2**-24 of its terms'
# size; the longest sums here run over the batch's 1,216 positions: ~2e-6.
# Measured: 3.3e-7 at most (per tensor, the norm of the difference over the
# norm). 1e-5 is 5 times the estimate and 30 times the measure; a gradient
# halved, doubled or of another batch is off by 0.5 or more.
GRADIENT_RTOL = 1e-5


def test_a_two_device_step_over_one_batch_equals_the_one_device_step(store, tmp_path):
    """An epoch of one batch: under two devices rank 1 has none of its own,
    and the step's gradient must still be that batch's, not half of it (nor
    no step at all). Compared: what AdamW is given, not the weights it
    returns: its first step is lr * g / (|g| + eps), which turns a last-bit
    difference in a near-zero gradient into one of 2 lr in a weight; and
    the gradient as reduced, before clipping, whose scale clipping and Adam
    would both hide."""
    kw = dict(epochs=1, tokens_per_batch=4096)
    one_step: list[dict] = []
    with recording_steps(tmp_path / "one-steps"):
        result = train(config(tmp_path / "one", **kw), store, on_step=recording(one_step))
    assert result.steps == 1 and len(one_step) == 1
    rc, records, log = torchrun(config(tmp_path / "two", **kw), store, tmp_path / "ddp", steps=tmp_path / "two-steps")
    assert rc == 0, log
    # The batch assignment and loss weights: exact.
    assert sorted((r["rank"], r["weight"]) for r in records) == [(0, 2.0), (1, 0.0)]
    assert [r["sample_ids"] for r in records] == [one_step[0]["sample_ids"]] * 2  # rank 1 repeats it at weight 0
    # Both ranks step with one gradient, bit for bit: the all-reduce's.
    one = recorded(tmp_path / "one-steps", 1)
    two, two_rank_1 = (recorded(tmp_path / "two-steps", 1, rank) for rank in (0, 1))
    for key in ("reduced", "grads"):
        assert all(torch.equal(a, b) for a, b in zip(two[key], two_rank_1[key])), key
    # Rank 0's 2 g and rank 1's 0 g average to g exactly (a power of two): the
    # one-device gradient but for the order of the sums (GRADIENT_RTOL).
    assert records[0]["loss"] == pytest.approx(one_step[0]["loss"], rel=GRADIENT_RTOL)
    assert records[0]["grad_norm"] == two["grad_norm"] == pytest.approx(one_step[0]["grad_norm"], rel=GRADIENT_RTOL)
    assert len(two["reduced"]) == len(one["reduced"])
    for i, (a, b) in enumerate(zip(one["reduced"], two["reduced"])):
        assert a.shape == b.shape and (b - a).norm() <= GRADIENT_RTOL * a.norm(), i


def test_a_store_grown_since_the_checkpoint_is_refused_or_replanned(tiny_model, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    store = random_store(d, tiny_model, 16, max_length=64)
    with pytest.raises(Stop):
        train(config(tmp_path / "run", checkpoint_every=2), store, on_step=recording([], stop_after=2))
    before = StoreReader(store)
    n_train, n_held = (len(x) for x in split(before.sample_ids, 0.1))
    random_store(d, tiny_model, 24, max_length=64)  # 8 more conversations, verified
    now = StoreReader(store)
    n_train_now, n_held_now = (len(x) for x in split(now.sample_ids, 0.1))
    assert n_train_now > n_train
    with pytest.raises(TrainingError, match=(
            rf"changed since .*{CHECKPOINT}.*training split: {n_train} samples .* then, {n_train_now} .* now.*"
            r"new out_dir.*train\.on_store_change=replan")):
        train(config(tmp_path / "run"), store)
    records: list[dict] = []
    result = train(config(tmp_path / "run", on_store_change="replan"), store, on_step=recording(records))
    assert result.resumed_from == {"epoch": 0, "batches_done": 0, "step": 2}
    # The epoch starts again over the split as it is now: each of its samples once, the new ones included.
    train_ids = sorted(now.sample_ids[i] for i in split(now.sample_ids, 0.1)[0])
    for epoch in (0, 1):
        assert sorted(s for r in records if r["epoch"] == epoch for s in r["sample_ids"]) == train_ids
    assert result.train_samples == n_train_now and result.heldout_samples == n_held_now


def test_a_store_committed_in_another_order_trains_to_the_same_weights(store, tmp_path):
    """The order shards were committed in (nodes, batch sizes, retries,
    reruns) is not the training order: the same samples, committed in the
    opposite order as two shards, train to the same weights bit for bit."""
    from tasks.store.handle import Store
    from tasks.store.ledger.open import open_store
    from tasks.store.shards import write_shard
    from tasks.store.verification import verify_store

    opened, reader = Store.open(store), StoreReader(store)
    rows = dict(zip(opened.ledger.samples().sample_id, opened.ledger.samples().source_row))
    source = opened.manifest["sources"][0]
    again = tmp_path / "reversed"
    ledger = open_store(again, opened.manifest)
    backwards = [{**reader[i], "source_row": int(rows[reader.sample_ids[i]])} for i in reversed(range(len(reader)))]
    half = len(backwards) // 2
    for part in (backwards[:half], backwards[half:]):
        ledger.commit_shard(*write_shard(again, part, source=source, stored=True))
    assert verify_store(again).ok
    assert StoreReader(again).sample_ids == reader.sample_ids[::-1]
    results = [train(config(tmp_path / name), s) for name, s in (("as-stored", store), ("reversed", again))]
    assert results[0].history == results[1].history
    weights = [load_file(tmp_path / name / "drafter" / "model.safetensors") for name in ("as-stored", "reversed")]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
