"""Sharded and multi-node training: two "nodes" (two torchrun launches on
loopback, one CPU process each, gloo, c10d rendezvous) train under FSDP2 or
HSDP to the same drafter as one process taking the same batches per step
(gradient accumulation), and an FSDP run resumes a one-process checkpoint.
Training runs for real on the tiny target, on a store of random hidden
states (tests/conftest.py random_store)."""
import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks.train.data import assign_batches
from tasks.train.launch import launch_distributed
from tasks.train.loop import CHECKPOINT, TrainConfig, TrainResult, train
from tests.conftest import random_store

# Rounding apart, the runs compute the same: a gradient averaged by a
# reduce-scatter (or all-reduce) over two ranks instead of summed over two
# half-weighted backward passes in one process, its norm over shards. That
# moves weights by ~1e-7 after ten steps (measured: 1.2e-7 at most, on
# weights up to 1.3), and the held-out loss by ~1e-7 relative. An AdamW step
# moves a weight by up to lr (3e-4 here); a batch lost, repeated or weighed
# wrong moves Adam's moments by a whole share of the gradient. 1e-5 relative
# and 1e-6 absolute (Adam's second moments are ~1e-9: held to 1e-5 of
# themselves) catch both with a wide margin over the rounding.
TOL = dict(rtol=1e-5, atol=1e-6)
SECOND_MOMENT_TOL = dict(rtol=1e-5, atol=1e-12)


class Stop(Exception):
    """Ends an in-process run after a step, as a kill would."""


def config(store: Path, out_dir: Path, **kw) -> TrainConfig:
    # Short samples, two or three per batch: ten batches an epoch, five steps
    # of two batches; a checkpoint every three steps.
    base = dict(store=str(store), out_dir=str(out_dir), draft_vocab_size=64, ttt_steps=1, epochs=2,
                tokens_per_batch=128, heldout_fraction=0.1, eval_max_samples=2, checkpoint_every=3)
    return TrainConfig(**{**base, **kw})


def two_nodes(cfg: TrainConfig, sharding: str) -> TrainResult:
    """cfg on two nodes of one process each: two launches of the very same
    command, meeting at a c10d rendezvous on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = TrainConfig(**{**cfg.__dict__, "sharding": sharding, "nnodes": 2, "devices": 1, "accumulate": 1,
                          "rdzv_endpoint": f"127.0.0.1:{port}"})
    with ThreadPoolExecutor(2) as pool:
        results = [f.result(timeout=300) for f in [pool.submit(launch_distributed, node) for _ in range(2)]]
    assert results[0] == results[1]  # both read the one result.json rank 0 wrote
    return results[0]


@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory):
    return random_store(tmp_path_factory.mktemp("sharded"), tiny_model, 24, max_length=64)


@pytest.fixture(scope="module")
def one_process(store, tmp_path_factory):
    """The reference: one process, two batches per step (as two ranks take them)."""
    cfg = config(store, tmp_path_factory.mktemp("one") / "run", accumulate=2)
    return cfg, train(cfg)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    # Two torchrun processes on two cores: no thread pools fighting over them.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def assert_same_run(a: tuple[TrainConfig, TrainResult], b: tuple[TrainConfig, TrainResult]) -> None:
    """The same training: final weights and Adam state, the held-out loss log,
    the exported files."""
    (cfg_a, res_a), (cfg_b, res_b) = a, b
    assert res_a.steps == res_b.steps == 10
    ckpt_a, ckpt_b = (torch.load(Path(c.out_dir) / CHECKPOINT, weights_only=True) for c in (cfg_a, cfg_b))
    assert ckpt_a["model"].keys() == ckpt_b["model"].keys()
    for name in ckpt_a["model"]:
        torch.testing.assert_close(ckpt_b["model"][name], ckpt_a["model"][name], **TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    state_a, state_b = ckpt_a["optimizer"]["state"], ckpt_b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys() and len(state_a) == len(ckpt_a["model"]) - 2  # all but d2t, t2d
    for i in state_a:
        assert state_a[i]["step"] == state_b[i]["step"] == 10
        torch.testing.assert_close(state_b[i]["exp_avg"], state_a[i]["exp_avg"], **TOL)
        torch.testing.assert_close(state_b[i]["exp_avg_sq"], state_a[i]["exp_avg_sq"], **SECOND_MOMENT_TOL)
    # The loss log: held-out metrics per epoch, as the run wrote them.
    log_a, log_b = (json.loads((Path(c.out_dir) / "metrics.json").read_text()) for c in (cfg_a, cfg_b))
    assert [r["step"] for r in log_a] == [r["step"] for r in log_b] == [0, 5, 10]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in log_b], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in log_a], dtype=torch.float64), **TOL)
    assert [r["acc"] for r in log_a] == [r["acc"] for r in log_b]
    # The export: the same files and config; weights bf16 roundings of
    # nearly equal fp32 values (equal, or one bf16 step apart).
    dir_a, dir_b = Path(res_a.drafter_dir), Path(res_b.drafter_dir)
    assert sorted(p.name for p in dir_a.iterdir()) == sorted(p.name for p in dir_b.iterdir())
    conf_a, conf_b = (json.loads((d / "config.json").read_text()) for d in (dir_a, dir_b))
    for conf in (conf_a, conf_b):
        conf["eagle3_training"]["config"].pop("out_dir")
        conf["eagle3_training"].pop("heldout")
    assert conf_a == conf_b
    w_a, w_b = load_file(str(dir_a / "model.safetensors")), load_file(str(dir_b / "model.safetensors"))
    assert {k: (v.dtype, v.shape) for k, v in w_a.items()} == {k: (v.dtype, v.shape) for k, v in w_b.items()}
    for name in w_a:
        torch.testing.assert_close(w_b[name].float(), w_a[name].float(), rtol=2 ** -7, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_hsdp_on_two_nodes_trains_what_one_process_trains(store, one_process, tmp_path):
    cfg = config(store, tmp_path / "run")
    result = two_nodes(cfg, "hsdp")
    assert result.resumed_from is None
    assert_same_run(one_process, (cfg, result))


def test_fsdp_on_two_nodes_resumes_a_one_process_checkpoint_to_the_same_result(store, one_process, tmp_path):
    """The checkpoint (whole tensors) is cut into each rank's shards of the
    weights and of Adam's moments; the run goes on sharded over the two
    ranks and writes its checkpoints and export whole again."""
    cfg = config(store, tmp_path / "run", accumulate=2)

    def stop_after_step_4(s: dict) -> None:
        if s["step"] == 4:
            raise Stop

    with pytest.raises(Stop):
        train(cfg, on_step=stop_after_step_4)
    ckpt = torch.load(tmp_path / "run" / CHECKPOINT, weights_only=True)
    assert (ckpt["epoch"], ckpt["batches_done"], ckpt["step"]) == (0, 6, 3)  # mid-epoch
    result = two_nodes(cfg, "fsdp")
    assert result.resumed_from == {"epoch": 0, "batches_done": 6, "step": 3}
    assert_same_run(one_process, (cfg, result))


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
        config(tmp_path / "store", tmp_path / "run", nnodes=2)
    with pytest.raises(ValueError, match="sharding 'zero3': use one of ddp, fsdp, hsdp"):
        config(tmp_path / "store", tmp_path / "run", sharding="zero3")
