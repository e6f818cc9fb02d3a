"""Sharded and multi-node training: two "nodes" (two torchrun launches on
loopback, one CPU process each, gloo, c10d rendezvous) train under FSDP2 or
HSDP as one process taking the same batches per step (gradient
accumulation) trains, and an FSDP run resumes a one-process checkpoint.
Training runs for real on the tiny target, on a store of random hidden
states (tests/conftest.py random_store). The runs are compared by what a
step computes from the same state (tests/step_probe.py), never by weights
after AdamW steps, which the rounding of other processes and thread counts
can move by 2 lr (see STEP_RTOL)."""
import json
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks.train.checkpoint import CHECKPOINT
from tasks.train.config import TrainConfig, TrainResult
from tasks.train.data import assign_batches
from tasks.train.launch import launch_distributed
from tasks.train.loop import train
from tests.conftest import random_store
from tests.step_probe import probed, recorded, recorded_steps, recording_steps

# A step from the same weights and Adam state, in one process and on two
# ranks: the same arithmetic but for the order of fp32 sums (other processes,
# thread counts, a reduce-scatter or all-reduce instead of summing two
# half-weighted backward passes: 0.5 a + 0.5 b and (a + b) / 2 round alike,
# and a norm over shards). A sum of n terms rounds differently by about
# sqrt(n) * 2**-24 of its terms' size; the longest sums here run over a
# batch's ~130 positions and the drafter's hidden sizes (a few hundred):
# ~1e-6. Measured: 4.7e-7 at most (per tensor, the norm of the difference
# over the norm, for the gradient and both moments after the step), all of
# it from the norm taken over FSDP's shards (the reduced gradient was equal
# to the last bit); 0 under HSDP here. A batch lost, repeated or weighed
# wrong moves the gradient by a whole share of it (0.5 here).
STEP_RTOL = 1e-5
# The steps after it start from weights that differ as AdamW made them
# differ: by rounding (measured: the steps' gradients still within 7.6e-7),
# or, where a near-zero gradient's last bits flipped the sign of its update
# (Adam's first steps are lr * g / (|g| + eps)), by 2 lr (6e-4) in one
# weight, which moves the next gradients by about 6e-4 over the size of
# the weight's output (0.1 x sqrt(384) x sqrt(128) for the fc here), ~3e-5.
# 1e-3 admits that thirty times over, and is still 500 times below a batch
# lost or weighed wrong. The weights themselves are never compared: such a
# flip is the very difference no tolerance derived from rounding admits.
DRIFT_RTOL = 1e-3


class Stop(Exception):
    """Ends an in-process run after a step, as a kill would."""


def config(out_dir: Path, **kw) -> TrainConfig:
    # Short samples, two or three per batch: ten batches an epoch, five steps
    # of two batches; a checkpoint every three steps.
    base = dict(out_dir=str(out_dir), draft_vocab_size=64, ttt_steps=1, epochs=2, tokens_per_batch=128,
                heldout_fraction=0.1, eval_max_samples=2, checkpoint_every=3)
    return TrainConfig(**{**base, **kw})


def two_nodes(cfg: TrainConfig, store: Path, sharding: str, steps: Path, monkeypatch) -> TrainResult:
    """cfg on two nodes of one process each: two launches of the very same
    command, meeting at a c10d rendezvous on a free loopback port; every
    rank's optimizer steps are recorded into `steps`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = TrainConfig(**{**cfg.model_dump(), "sharding": sharding, "nnodes": 2, "devices": 1, "accumulate": 1,
                          "rdzv_endpoint": f"127.0.0.1:{port}"})
    for name, value in probed({}, steps).items():
        monkeypatch.setenv(name, value)
    with ThreadPoolExecutor(2) as pool:
        results = [f.result(timeout=300) for f in [pool.submit(launch_distributed, node, store) for _ in range(2)]]
    assert results[0] == results[1]  # both read the one result.json rank 0 wrote
    return results[0]


@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory):
    return random_store(tmp_path_factory.mktemp("sharded"), tiny_model, 24, max_length=64)


def in_one_process(store: Path, d: Path, make=config) -> tuple[TrainConfig, TrainResult, Path]:
    """The reference: one process, two batches per step (as two ranks take
    them), its steps recorded."""
    cfg = make(d / "run", accumulate=2)
    with recording_steps(d / "steps"):
        return cfg, train(cfg, store), d / "steps"


@pytest.fixture(scope="module")
def one_process(store, tmp_path_factory):
    return in_one_process(store, tmp_path_factory.mktemp("one"))


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    # Two torchrun processes on two cores: no thread pools fighting over them.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def assert_close_per_tensor(want: list[torch.Tensor], got: list[torch.Tensor], rtol: float, what: str) -> None:
    assert len(want) == len(got), what
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.shape == b.shape and (b - a).norm() <= rtol * a.norm(), f"{what} {i}: " \
            f"{float((b - a).norm() / a.norm()):.2e} relative"


def assert_same_run(reference: tuple[TrainConfig, TrainResult, Path], run: tuple[TrainConfig, TrainResult, Path],
                    first: int, first_from: Path) -> None:
    """The same training, where that is exact or its rounding is known: both
    ran all ten steps; the run's first step (`first`), from the state a
    step recorded in `first_from` started from, computed its gradient (as
    reduced, its norm, as clipped) and left Adam's moments as that step did,
    to STEP_RTOL, and each later step
    as the reference's, to DRIFT_RTOL; every step of the run stepped all its
    ranks with one gradient, bit for bit; its checkpoint and export hold
    whole tensors of the reference's names, shapes and dtypes, and the
    checkpoint's moments are the ones its last step left, exactly; the
    held-out log has the same rows and the untrained row the same loss, and
    the exports the same config."""
    (cfg_a, res_a, steps_a), (cfg_b, res_b, steps_b) = reference, run
    assert res_a.steps == res_b.steps == 10
    assert recorded_steps(steps_b) == recorded_steps(steps_b, rank=1) == list(range(first, 11))
    for step in range(first, 11):
        rank_0, rank_1 = (recorded(steps_b, step, rank) for rank in (0, 1))
        for key in ("reduced", "grads"):
            assert all(torch.equal(a, b) for a, b in zip(rank_0[key], rank_1[key])), (step, key)
        want = recorded(first_from if step == first else steps_a, step)
        rtol = STEP_RTOL if step == first else DRIFT_RTOL
        assert rank_0["grad_norm"] == pytest.approx(want["grad_norm"], rel=rtol), step
        for key in ("reduced", "grads", "exp_avg", "exp_avg_sq"):
            assert_close_per_tensor(want[key], rank_0[key], rtol, f"step {step} {key}")
    ckpt_a, ckpt_b = (torch.load(Path(c.out_dir) / CHECKPOINT, weights_only=True) for c in (cfg_a, cfg_b))
    assert {k: (v.dtype, v.shape) for k, v in ckpt_a["model"].items()} == \
        {k: (v.dtype, v.shape) for k, v in ckpt_b["model"].items()}
    state_a, state_b = ckpt_a["optimizer"]["state"], ckpt_b["optimizer"]["state"]
    dflash = cfg_a.method == "dflash"
    # All the checkpoint's tensors but an EAGLE-3 drafter's vocabulary maps (d2t, t2d).
    assert state_a.keys() == state_b.keys() and len(state_a) == len(ckpt_a["model"]) - (0 if dflash else 2)
    last = recorded(steps_b, 10)
    for i in state_a:
        assert state_a[i]["step"] == state_b[i]["step"] == 10
        for key in ("exp_avg", "exp_avg_sq"):  # gathered whole from the shards, as the probe gathered them
            assert state_a[i][key].shape == state_b[i][key].shape and torch.equal(state_b[i][key], last[key][i])
    # The loss log: held-out metrics per epoch, as the run wrote them.
    log_a, log_b = (json.loads((Path(c.out_dir) / "metrics.json").read_text()) for c in (cfg_a, cfg_b))
    assert [r["step"] for r in log_a] == [r["step"] for r in log_b] == [0, 5, 10]
    assert log_b[0]["loss"] == pytest.approx(log_a[0]["loss"], rel=STEP_RTOL)  # untrained: the same weights
    # The export: the same files, config, tensor names, dtypes and shapes.
    dir_a, dir_b = Path(res_a.drafter_dir), Path(res_b.drafter_dir)
    assert sorted(p.name for p in dir_a.iterdir()) == sorted(p.name for p in dir_b.iterdir())
    conf_a, conf_b = (json.loads((d / "config.json").read_text()) for d in (dir_a, dir_b))
    training = "dflash_training" if dflash else "eagle3_training"
    for conf in (conf_a, conf_b):
        conf[training]["config"].pop("out_dir")
        conf[training].pop("heldout")
    assert conf_a == conf_b
    w_a, w_b = load_file(str(dir_a / "model.safetensors")), load_file(str(dir_b / "model.safetensors"))
    assert {k: (v.dtype, v.shape) for k, v in w_a.items()} == {k: (v.dtype, v.shape) for k, v in w_b.items()}


def test_hsdp_on_two_nodes_trains_what_one_process_trains(store, one_process, tmp_path, monkeypatch):
    cfg = config(tmp_path / "run")
    result = two_nodes(cfg, store, "hsdp", tmp_path / "steps", monkeypatch)
    assert result.resumed_from is None
    # Step 1 starts from the seeded initialisation in both.
    assert_same_run(one_process, (cfg, result, tmp_path / "steps"), first=1, first_from=one_process[2])


def test_fsdp_on_two_nodes_resumes_a_one_process_checkpoint_to_the_same_result(store, one_process, tmp_path,
                                                                               monkeypatch):
    """The checkpoint (whole tensors) is cut into each rank's shards of the
    weights and of Adam's moments; the run goes on sharded over the two
    ranks and writes its checkpoints and export whole again."""
    cfg = config(tmp_path / "run", accumulate=2)

    def stop_after_step_4(s: dict) -> None:
        if s["step"] == 4:
            raise Stop

    with recording_steps(tmp_path / "one-process-steps"), pytest.raises(Stop):
        train(cfg, store, on_step=stop_after_step_4)
    ckpt = torch.load(tmp_path / "run" / CHECKPOINT, weights_only=True)
    assert (ckpt["epoch"], ckpt["batches_done"], ckpt["step"]) == (0, 6, 3)  # mid-epoch
    result = two_nodes(cfg, store, "fsdp", tmp_path / "steps", monkeypatch)
    assert result.resumed_from == {"epoch": 0, "batches_done": 6, "step": 3}
    # Step 4 starts from the checkpoint in both: the one process's own state
    # after step 3, which it went on from; a moment cut into the wrong shards
    # moves step 4's by a whole share of it.
    assert_same_run(one_process, (cfg, result, tmp_path / "steps"), first=4, first_from=tmp_path / "one-process-steps")


def dflash(out_dir: Path, **kw) -> TrainConfig:
    """A DFlash drafter (blocks of 4, a few anchors a sample) on the same batches."""
    return config(out_dir, method="dflash", block_size=4, max_anchors=8, **kw)


@pytest.fixture(scope="module")
def one_process_dflash(store, tmp_path_factory):
    return in_one_process(store, tmp_path_factory.mktemp("one-dflash"), dflash)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_a_dflash_drafter_on_two_ranks_steps_as_one_process_does(store, one_process_dflash, tmp_path, monkeypatch,
                                                                 sharding):
    """Each rank draws its batches' anchors from (seed, epoch, batch), as the
    one process drawing them for both batches of a step: the same blocks,
    the same loss, its gradient reduced (DDP) or sharded (FSDP2) across the
    ranks, within the rounding STEP_RTOL admits."""
    cfg = dflash(tmp_path / "run")
    result = two_nodes(cfg, store, sharding, tmp_path / "steps", monkeypatch)
    assert_same_run(one_process_dflash, (cfg, result, tmp_path / "steps"), first=1,
                    first_from=one_process_dflash[2])


@pytest.mark.parametrize("world,accumulate", [(1, 1), (2, 1), (1, 3), (2, 2), (3, 2)])
def test_each_batch_is_trained_once_and_each_step_is_the_mean_over_its_batches(world, accumulate):
    for n, start in ((10, 0), (10, 3), (7, 0), (1, 0)):
        steps = [assign_batches(n, start, rank, world, accumulate) for rank in range(world)]
        assert len({len(s) for s in steps}) == 1  # every rank takes part in every step
        trained = []
        for per_rank in zip(*steps):
            assert len({first for first, _ in per_rank}) == 1
            assert all(len(mine) == accumulate for _, mine in per_rank)  # the same backward passes on each rank
            slots = [(b, w) for _, mine in per_rank for b, w in mine]
            real = sorted(b for b, w in slots if w > 0)
            # The gradient, averaged over ranks, weighs each real batch 1/m.
            assert sum(w for _, w in slots) / world == pytest.approx(1.0)
            assert len({w for _, w in slots if w > 0}) == 1
            trained += real
        assert trained == list(range(start, n))  # in order: a prefix after any step


def test_several_nodes_need_a_rendezvous_endpoint(tmp_path):
    with pytest.raises(ValueError, match="nnodes 2 needs rdzv_endpoint host:port"):
        config(tmp_path / "run", nnodes=2)
    with pytest.raises(ValueError, match="sharding 'zero3': use one of ddp, fsdp, hsdp"):
        config(tmp_path / "run", sharding="zero3")
