"""Checkpoints and exports under real faults: a checkpoint that would run
code when unpickled is refused without running it, a damaged one is named,
and a process killed while replacing an export leaves a whole export; a
NaN loss is skipped, or stops the run keeping the last good checkpoint, and
a NaN drafter fails the export check.
Training runs for real on the tiny target, on a store of random hidden
states built with tasks.store."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tasks.train.checkpoint import CHECKPOINT
from tasks.train.eagle3.training import trained_drafter
from tasks.train.config import TrainConfig, TrainingError
from tasks.train.eagle3.export import export_weights, load_exported
from tasks.train.loop import train
from tests.conftest import random_store

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    store = random_store(d, tiny_model, 16)
    cfg = TrainConfig(out_dir=str(d / "train"), draft_vocab_size=64, ttt_steps=2, epochs=1, tokens_per_batch=1024,
                      heldout_fraction=0.25, eval_max_samples=8, checkpoint_every=1)
    return cfg, store, train(cfg, store)


def test_checkpoints_load_as_plain_tensors_and_values(trained, tiny_model):
    cfg, _, result = trained
    ckpt = torch.load(Path(cfg.out_dir) / CHECKPOINT, weights_only=True)
    assert ckpt["step"] == result.steps > 0
    assert not list(Path(cfg.out_dir).glob(".*"))  # no temp files left
    model = trained_drafter(Path(cfg.out_dir), tiny_model)
    exported = load_exported(Path(result.drafter_dir), tiny_model)
    for name, t in export_weights(model).items():
        assert torch.allclose(export_weights(exported)[name].float(), t.float(), rtol=1e-2, atol=1e-2), name


class RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = None


def test_a_checkpoint_that_would_run_code_is_refused_unrun(trained, tmp_path):
    global MARKER
    cfg, store, _ = trained
    MARKER = tmp_path / "code-ran"
    out_dir = tmp_path / "train"
    out_dir.mkdir()
    torch.save({"identity": RunsCode()}, out_dir / CHECKPOINT)
    with pytest.raises(TrainingError, match=f"checkpoint {out_dir / CHECKPOINT} cannot be loaded .*GLOBAL posix.system.*delete it"):
        train(TrainConfig(**{**cfg.model_dump(), "out_dir": str(out_dir)}), store)
    assert not MARKER.exists()
    (out_dir / CHECKPOINT).write_bytes((Path(cfg.out_dir) / CHECKPOINT).read_bytes()[:-100])  # damaged
    with pytest.raises(TrainingError, match="cannot be loaded"):
        train(TrainConfig(**{**cfg.model_dump(), "out_dir": str(out_dir)}), store)


# Export a drafter over an existing export, and die (SIGKILL) the moment an
# export directory is deleted: the old code deleted the old export first.
KILLED_EXPORT = """
import os, shutil, signal, sys
from pathlib import Path
from tasks.target.architectures import LLAMA
from tasks.target.layers import AuxLayers
from tasks.train.eagle3.training import trained_drafter
from tasks.train.eagle3.export import export_drafter

real_rmtree = shutil.rmtree
def rmtree_then_die(path, *a, **kw):
    real_rmtree(path, *a, **kw)
    os.kill(os.getpid(), signal.SIGKILL)
shutil.rmtree = rmtree_then_die
if sys.argv[5] == "no-exchange":  # a filesystem without renameat2's exchange
    import tasks.durable
    tasks.durable._exchange = lambda a, b: False
model = trained_drafter(Path(sys.argv[1]), Path(sys.argv[2]))
with __import__("torch").no_grad():
    model.fc.weight.add_(float(sys.argv[6]))  # a different drafter: the new export
export_drafter(model, AuxLayers(tuple(int(i) for i in sys.argv[4].split(","))), Path(sys.argv[3]), architecture=LLAMA)
"""


@pytest.mark.parametrize("swap", ["exchange", "no-exchange"])
def test_a_kill_while_replacing_an_export_leaves_a_whole_export(trained, tiny_model, swap):
    cfg, _, result = trained
    drafter = Path(result.drafter_dir)
    delta = {"exchange": 1.0, "no-exchange": 2.0}[swap]  # each run's export differs from any before
    trained_fc = trained_drafter(Path(cfg.out_dir), tiny_model).fc.weight.detach()
    layers = json.loads((drafter / "config.json").read_text())["eagle_config"]["layer_output_ids"]
    proc = subprocess.run([sys.executable, "-c", KILLED_EXPORT, cfg.out_dir, str(tiny_model), str(drafter),
                           ",".join(map(str, layers)), swap, str(delta)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr  # it did die mid-replacement
    now = export_weights(load_exported(drafter, tiny_model))  # a whole export is there ...
    assert torch.allclose(now["fc.weight"].float(), trained_fc + delta, atol=0.05)  # ... and it is the new one


def test_training_refuses_a_sample_changed_after_verification(trained, tmp_path):
    """A byte flipped in a shard after its verification passed: the store
    still looks verified (the report is newer than every commit), but
    training reads each sample against its committed checksum and stops,
    naming the sample, before training on it."""
    import shutil

    from tasks.store.reader import CorruptSample, StoreReader
    from tasks.store.verification import require_verified

    cfg, verified, _ = trained
    store = tmp_path / "store"
    shutil.copytree(verified, store)
    reader = StoreReader(store)
    shard = next((store / "shards").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x40  # inside the last tensor's data, past the header
    shard.write_bytes(bytes(data))
    require_verified(store)  # the stale report still says yes
    before = [reader[i] for i in range(len(reader))]  # a plain read does not look
    damaged = [i for i in range(len(reader))
               if isinstance(_read_checked(store, i), CorruptSample)]
    assert len(damaged) == 1, damaged
    with pytest.raises(CorruptSample, match=f"sample {reader.sample_ids[damaged[0]]} in .*flows.verify"):
        train(TrainConfig(**{**cfg.model_dump(), "out_dir": str(tmp_path / "train")}), store)
    assert not (tmp_path / "train" / "drafter").exists()
    assert len(before) == len(reader)


def test_a_training_flow_on_a_corrupt_sample_fails_at_once_without_a_retry(trained, prefect_api, tmp_path):
    """Corrupt data fails the same way on every try: the train task, which
    retries other failures (resuming from its checkpoint), is not retried,
    and the run fails with the sample named."""
    import asyncio
    import shutil

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    from flows.train import train_drafter

    cfg, verified, _ = trained
    store = tmp_path / "store"
    shutil.copytree(verified, store)
    shard = next((store / "shards").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x40
    shard.write_bytes(bytes(data))
    state = train_drafter(store=str(store), train=cfg.model_copy(update={"out_dir": str(tmp_path / "train")}),
                          return_state=True)
    assert state.is_failed() and "no longer match the checksum" in state.message, state.message

    async def train_task_states():
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [state.state_details.flow_run_id]}))
            (run,) = [r for r in runs if r.name.startswith("train-")]
            return [s.name for s in await client.read_task_run_states(run.id)], run.run_count

    names, run_count = asyncio.run(train_task_states())
    assert run_count == 1 and "Retrying" not in names and names[-1] == "Failed", names


def _read_checked(store, i):
    from tasks.store.reader import CorruptSample, StoreReader

    try:
        return StoreReader(store, verify_checksums=True)[i]
    except CorruptSample as e:
        return e


# A NaN loss, injected for real: the TTT forward's loss is multiplied by NaN
# on chosen optimizer steps, so backward gives NaN gradients too.
def _nan_on(monkeypatch, steps, before=None):
    import dataclasses
    import tasks.train.eagle3.ttt as ttt_mod
    real = ttt_mod.ttt_forward
    calls = {"n": 0}

    def poisoned(*a, **kw):
        out = real(*a, **kw)
        if torch.is_grad_enabled():  # a training step, not an evaluation
            calls["n"] += 1
            if before:
                before(calls["n"])
            if calls["n"] in steps:
                return dataclasses.replace(out, loss=out.loss * float("nan"))
        return out

    monkeypatch.setattr(ttt_mod, "ttt_forward", poisoned)
    return calls


def _small_batches(cfg: TrainConfig, out_dir: Path, **kw) -> TrainConfig:
    return TrainConfig(**{**cfg.model_dump(), "out_dir": str(out_dir), "tokens_per_batch": 256, **kw})  # 5+ steps


def _finite(state: dict) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())


def test_a_transient_nan_loss_is_skipped_and_training_ends_finite(trained, tiny_model, tmp_path, monkeypatch, caplog):
    cfg, store, _ = trained
    calls = _nan_on(monkeypatch, {2})
    out_dir = tmp_path / "train"
    with caplog.at_level("WARNING", logger="eagle3.training"):
        result = train(_small_batches(cfg, out_dir), store)
    assert calls["n"] == result.steps >= 4 and result.nonfinite_steps == 1
    assert "step 2: non-finite loss and gradient norm" in caplog.text and "step skipped" in caplog.text
    assert _finite(torch.load(out_dir / CHECKPOINT, weights_only=True)["model"])
    assert _finite(export_weights(load_exported(Path(result.drafter_dir), tiny_model)))
    assert all(math.isfinite(h["loss"]) for h in result.history)


def test_a_persistent_nan_stops_and_keeps_the_last_good_checkpoint(trained, tiny_model, tmp_path, monkeypatch):
    cfg, store, _ = trained
    out_dir = tmp_path / "train"
    good = {}

    def before(n):  # the checkpoint on disk as the first NaN step starts: step 1's
        if n == 2:
            good["bytes"] = (out_dir / CHECKPOINT).read_bytes()

    _nan_on(monkeypatch, set(range(2, 100)), before)
    run_cfg = _small_batches(cfg, out_dir, max_nonfinite_steps=2)
    with pytest.raises(TrainingError, match=r"step 3: 2 optimizer steps in a row had a non-finite loss and "
                                            r"gradient norm .*nothing was exported.*last good checkpoint"):
        train(run_cfg, store)
    assert (out_dir / CHECKPOINT).read_bytes() == good["bytes"]  # not replaced by the NaN steps' state
    ckpt = torch.load(out_dir / CHECKPOINT, weights_only=True)
    assert ckpt["step"] == 1 and _finite(ckpt["model"])
    assert not (out_dir / "drafter").exists() and not (out_dir / "result.json").exists()
    monkeypatch.undo()  # the fault is gone: a resume from the good checkpoint finishes
    result = train(run_cfg, store)
    assert result.resumed_from["step"] == 1 and result.steps >= 4 and result.nonfinite_steps == 0
    assert _finite(export_weights(load_exported(Path(result.drafter_dir), tiny_model)))


def test_the_export_check_refuses_a_nan_drafter(trained, tmp_path, monkeypatch):
    import logging
    from safetensors.torch import load_file, save_file
    import flows.train
    from flows.train import check_export_task
    monkeypatch.setattr(flows.train, "get_run_logger", lambda: logging.getLogger("test"))  # outside a flow run
    cfg, store, _ = trained
    out_dir = tmp_path / "train"  # its own run: the kill tests replace the module run's export
    result = train(_small_batches(cfg, out_dir), store)
    drafter = Path(result.drafter_dir)
    assert check_export_task.fn(result, str(out_dir))["worst_relative_diff"] < 1e-2
    tensors = load_file(drafter / "model.safetensors")
    tensors["fc.weight"][0, 0] = float("nan")
    save_file(tensors, str(drafter / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="exported drafter tensor fc.weight holds NaN"):
        check_export_task.fn(result, str(out_dir))
