"""A command-line run told to stop, as a terminal's Ctrl-C (SIGINT to its
whole process group) or a scheduler's SIGTERM tells it: it exits within
its bounded waits (STOP_WITHIN_S), non-zero, with one line saying what it kept and how to resume; every
process it started is gone (its SGLang server, its temporary Prefect
server, torchrun's ranks); its locks are free; and an extraction's rerun
completes without losing or doubling anything (a training's resume from its checkpoint is
tests/test_training.py's; here it runs long enough that the signal always
lands mid-run)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flows.local_api import API_STOP_S, DRAIN_S
from tasks.server.launch import STOP_GRACE_S
from tasks.server.processes import KILL_WAIT_S
from tasks.store.lock import hold_lock
from tasks.train.launch import RANKS_STOP_S
from tests.conftest import demo_rows, rerun_completes, stored_samples, wait_for, write_jsonl

REPO = Path(__file__).resolve().parent.parent
# Every wait on a run's way out is bounded; the stop takes at most their
# sum (the server's or the ranks' stop, the SIGKILL after it, the log and
# event drains, the temporary Prefect server's stop). Measured: 2-16 s; a
# wait left unbounded (seen: Prefect's log workers, 110 s against a dead
# API) exceeds it.
STOP_WITHIN_S = max(STOP_GRACE_S, RANKS_STOP_S) + KILL_WAIT_S + 2 * DRAIN_S + API_STOP_S
# Batches of 2: a signal sent once 2 are stored lands long before the last
# (seen: 8-12 stored when the run stopped).
ROWS = 64


def start(argv: list[str], tmp_path: Path) -> subprocess.Popen:
    """The command in a session of its own, as a shell runs a foreground job:
    no PREFECT_API_URL, so it starts its own temporary Prefect server."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # its own SQLite database
    return subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, start_new_session=True,
                            stdout=open(tmp_path / "stdout", "w"), stderr=open(tmp_path / "stderr", "w"))


def stop_and_check(proc: subprocess.Popen, signum: int, tmp_path: Path, *, group: bool) -> str:
    """Send the signal; return the command's last stderr line once it has
    exited as it must, with every process it started gone."""
    started = psutil.Process(proc.pid).children(recursive=True)
    assert started, "the run started no process"
    t0 = time.monotonic()
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    rc = proc.wait(timeout=120)
    took = time.monotonic() - t0
    stderr = (tmp_path / "stderr").read_text()
    assert took <= STOP_WITHIN_S, (took, stderr[-3000:])
    assert rc == 128 + signum, (rc, stderr[-3000:])
    gone, alive = psutil.wait_procs(started, timeout=5)
    assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
    return stderr.strip().splitlines()[-1]


@pytest.mark.server
def test_ctrl_c_stops_a_command_line_extraction_and_the_rerun_completes(capture_server, prefect_api, tiny_model,
                                                                          tmp_path):
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(ROWS))
    store = tmp_path / "store"
    proc = start(["-m", "flows.extract", "--server.model", str(tiny_model), "--server.max-total-tokens", "4096",
                  "--capture.dataset", str(dataset), "--capture.batch-size", "2", "--store.path", str(store)],
                 tmp_path)

    wait_for(lambda: stored_samples(store) >= 2, proc, tmp_path / "stderr")
    line = stop_and_check(proc, signal.SIGINT, tmp_path, group=True)
    kept = stored_samples(store)
    assert 2 <= kept < ROWS, "stopped too late to test anything"
    assert re.fullmatch(rf"python -m flows.extract: stopped by SIGINT; {kept:,} samples \(\S+ tokens\) in "
                        rf"{re.escape(str(store.resolve()))} kept; run the same command again to resume", line), line
    with hold_lock(store, "the test"):
        pass  # free

    rerun_completes(capture_server, store, dataset, ROWS)


def test_sigterm_stops_a_command_line_training_on_two_ranks(tiny_model, tmp_path):
    from tests.conftest import random_store

    (tmp_path / "data").mkdir()
    store = random_store(tmp_path / "data", tiny_model, rows=40, max_length=64)
    out = tmp_path / "train"
    argv = ["-m", "flows.train", "--store", str(store), "--train.out-dir", str(out), "--train.devices", "2",
            "--train.draft-vocab-size", "64", "--train.ttt-steps", "1", "--train.epochs", "50",
            "--train.tokens-per-batch", "128", "--train.checkpoint-every", "1", "--train.heldout-fraction", "0.1",
            "--train.eval-max-samples", "2"]
    proc = start(argv, tmp_path)
    wait_for(lambda: (out / "checkpoint.pt").exists(), proc, tmp_path / "stderr")
    line = stop_and_check(proc, signal.SIGTERM, tmp_path, group=False)  # to the run alone, as a scheduler does
    assert line == (f"python -m flows.train: stopped by SIGTERM; training checkpoints in {out} kept; run the "
                    "same command again to resume"), line
    with hold_lock(out, "the test"):
        pass


@pytest.mark.server
def test_sigterm_stops_a_command_line_pipeline_mid_extraction(tiny_model, tmp_path):
    """The pipeline (extraction as a subflow, its server launched there) told
    to stop by a scheduler's SIGTERM to it alone. Its rerun is its
    extraction stage's, the same flow on the same kind of store as the
    Ctrl-C test's rerun above, so it is not run twice; the training and
    evaluation after it are tests/test_pipeline.py's."""
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(ROWS))
    store, out = tmp_path / "store", tmp_path / "train"
    proc = start(["-m", "flows.pipeline", "--server.model", str(tiny_model), "--server.max-total-tokens", "4096",
                  "--capture.dataset", str(dataset), "--capture.batch-size", "2", "--store.path", str(store),
                  "--train.out-dir", str(out)], tmp_path)

    wait_for(lambda: stored_samples(store) >= 2, proc, tmp_path / "stderr")
    line = stop_and_check(proc, signal.SIGTERM, tmp_path, group=False)
    kept = stored_samples(store)
    assert 2 <= kept < ROWS, "stopped too late to test anything"
    assert re.fullmatch(rf"python -m flows.pipeline: stopped by SIGTERM; {kept:,} samples \(\S+ tokens\) in "
                        rf"{re.escape(str(store.resolve()))} kept; training checkpoints in "
                        rf"{re.escape(str(out.resolve()))} kept; run the same command again to resume", line), line
    for held in (store, out):
        with hold_lock(held, "the test"):
            pass  # free
