"""The extraction deployment operated the way a user does: a real Prefect
server, the `eagle3` process pool, `prefect.yaml` deployed with the CLI, a
worker, and the Prefect UI driven by a real browser (Playwright on Debian's
Chromium). Also: a flow run that ended Failed, retried from the API exactly
as the UI's Retry button does, redoes only the samples the ledger lacks.

Runs attach to the session's capture server (`server_url`, `dump_dir`), so
no second SGLang server is launched.
"""
from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

from flows.config import as_record
from tests.conftest import ARTIFACTS, attach, demo_rows, rerun_completes, stored_samples, write_jsonl
from tests.prefect_stack import PREFECT, REPO, Api, cli, log_tail, prefect_server, run_processes, start, stop

pytestmark = pytest.mark.server
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = ARTIFACTS / "prefect-ui"


# ------------------------------------------------------------------ the stack

@pytest.fixture(scope="module")
def prefect_stack(tmp_path_factory, capture_server):
    """A Prefect server (temporary home, SQLite, free port, telemetry off),
    the `eagle3` process pool and a worker whose runs reach the session's
    capture server with its key from the environment; stopped worker first."""
    logs = ARTIFACTS / "prefect-ui-logs"
    server, api, env = prefect_server(tmp_path_factory.mktemp("prefect-home"), logs / "prefect-server.log")
    env["EAGLE3_API_KEY"] = capture_server.api_key
    worker = None
    try:
        cli(["work-pool", "create", "eagle3", "--type", "process"], env)
        worker = start([PREFECT, "worker", "start", "--pool", "eagle3"], env, logs / "prefect-worker.log")
        yield {"api": api, "env": env, "url": api.url.removesuffix("/api"), "logs": logs,
               "worker": worker, "log_files": [logs / "prefect-worker.log", logs / "prefect-server.log"]}
    finally:
        if worker is not None:
            # First: it still needs the API to report its runs. Each test
            # waits for its runs to end, so 5 s is plenty; in full suite runs
            # the worker has sat out the whole 20-s default on SIGINT without
            # printing its "stopped!" (alone: 0.4 s), cause not found.
            stop(worker, grace_s=5.0)
        stop(server)


def deploy_extract(stack, params: dict) -> dict:
    """prefect.yaml's `extract` deployment with the tests' parameters as its
    defaults, set as the UI's "Edit" of a deployment sets them (a PATCH of
    the deployment: no second `prefect deploy`, which re-imports the flows)."""
    api = stack["api"]
    api.call("PATCH", f"/deployments/{api.deployment('extract_hidden_states/extract')['id']}", {"parameters": params})
    return api.deployment("extract_hidden_states/extract")


@pytest.fixture(scope="module")
def deployment(prefect_stack, capture_server, tmp_path_factory):
    d = tmp_path_factory.mktemp("ui-run")
    dataset = write_jsonl(d / "data.jsonl", demo_rows(8))
    params = as_record(attach(capture_server, store=d / "store", dataset=str(dataset), batch_size=4))
    # The attached server's key reaches the runs the way the README advises,
    # in the worker's environment, not as a parameter kept with every run.
    assert params["server"]["api_key"] is None
    # All of prefect.yaml, as scripts/prefect-ui.sh deploys it, then the
    # tests' parameters as `extract`'s defaults.
    cli(["--no-prompt", "deploy", "--all"], prefect_stack["env"])
    return deploy_extract(prefect_stack, params)


def test_prefect_yaml_deploys_every_flow(prefect_stack, deployment):
    import yaml

    wanted = {(d["entrypoint"].rsplit(":", 1)[1], d["name"])
              for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    deployed = prefect_stack["api"].call("POST", "/deployments/filter", {})
    flows = {f["id"]: f["name"] for f in prefect_stack["api"].call("POST", "/flows/filter", {})}
    # (each flow is named after its function)
    assert {(flows[d["flow_id"]], d["name"]) for d in deployed} == wanted
    assert {"extract", "extract-across-nodes", "extract-node", "regenerate", "regenerate-across-nodes",
            "regenerate-node", "verify", "train", "evaluate", "publish",
            "pipeline"} <= {name for _, name in wanted}


def ledger(store: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(store / "ledger.sqlite") as db:
        return db.execute(sql).fetchall()


# ------------------------------------------------------------------ the UI

@pytest.fixture
def browser_page():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"{CHROMIUM} is missing: apt-get install -y chromium (scripts/test.sh does)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(30_000)
            yield page
        finally:
            browser.close()


def shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def new_run(api: Api, deployment_id: str, before: set[str], timeout_s: float, page, logs: list[Path],
            fail: bool = True) -> dict | None:
    """The one flow run of the deployment that is not in `before`, once the
    server has it (None after `timeout_s` unless `fail`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = [r for r in api.runs_of(deployment_id) if r["id"] not in before]
        if runs:
            assert len(runs) == 1, [r["name"] for r in runs]
            return runs[0]
        time.sleep(1.0)
    if not fail:
        return None
    shot(page, "2-run-form-no-run")
    tails = "\n".join(f"--- {p}:\n{log_tail(p)}" for p in logs)
    raise AssertionError(f"the run form created no flow run in {timeout_s:.0f} s "
                         f"(page: {SHOTS / '2-run-form-no-run.png'})\n{tails}")


def test_a_run_started_from_the_ui_shows_its_tasks_logs_and_verification(prefect_stack, deployment, browser_page):
    import re

    from playwright.sync_api import expect

    page, api, base = browser_page, prefect_stack["api"], prefect_stack["url"]
    store = Path(deployment["parameters"]["store"]["path"])

    # The address the README gives opens the (default, v2) UI.
    page.goto(base + "/")
    page.get_by_role("link", name="Deployments", exact=True).click()
    page.get_by_role("link", name="extract", exact=True).first.click()
    expect(page.get_by_text("flows/extract.py:extract_hidden_states")).to_be_visible()
    shot(page, "1-deployment")

    before = {r["id"] for r in api.runs_of(deployment["id"])}
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Custom run", exact=True).click()
    # The run form groups each section's settings; one nested setting,
    # capture.batch_size, is changed from the deployment's 4 to 2.
    expect(page.get_by_text("What is captured and how", exact=False)).to_be_visible()
    batch_size = page.get_by_label("Batch Size (Optional)")
    expect(batch_size).to_have_value("4")
    batch_size.fill("2")
    shot(page, "2-custom-run-form")
    # The form mirrors its state into the page's URL; a click while it
    # re-renders for that was once lost (the page stayed on the form, no run
    # was made, no error shown): let it settle, and click again only if the
    # page is still the form and the server has no run.
    try:
        page.wait_for_url(re.compile(r"batch_size%22%3A2\b"), timeout=10_000)
    except Exception:  # noqa: BLE001 - a UI that does not mirror it: nothing to wait for
        pass
    page.get_by_role("button", name="Submit").click()
    # The server's record, not the "Flow run created" toast, says a run
    # exists: the toast lasts seconds and CI once missed it under load.
    run = new_run(api, deployment["id"], before, 45, page, prefect_stack["log_files"], fail=False)
    if run is None and "/run?" in page.url:
        page.get_by_role("button", name="Submit").click()
        run = new_run(api, deployment["id"], before, 90, page, prefect_stack["log_files"])
    assert run["parameters"]["capture"]["batch_size"] == 2, run["parameters"]
    shot(page, "2-custom-run")
    # Open it the way a user does without the toast: the deployment's runs.
    page.reload()
    page.get_by_role("link", name=run["name"], exact=True).first.click()
    page.wait_for_url(re.compile(r"/runs/flow-run/[0-9a-f-]{36}"))
    run_id = re.search(r"/runs/flow-run/([0-9a-f-]{36})", page.url).group(1)
    assert run_id == run["id"]

    run = api.wait_terminal(run_id, 300, logs=prefect_stack["log_files"])
    assert run["state_type"] == "COMPLETED", (run["state"], log_tail(prefect_stack["log_files"][0]))
    assert run["deployment_id"] == deployment["id"]
    # The page polls the API: it shows the end state without a reload.
    expect(page.get_by_text("Completed", exact=True).first).to_be_visible(timeout=60_000)
    # Its logs as a user finds them once the run has ended: the run's
    # process ships logs in batches, some after its end state, and the page
    # shows what it had loaded by then (seen: up to "Beginning flow run").
    # So the server's record first, then the page opened again.
    plan_line = re.compile(r"plan: 8 samples -> 8 to capture")
    assert any(plan_line.search(m) for m in api.logs_once(run_id, lambda logs: any(map(plan_line.search, logs))))
    page.reload()
    expect(page.get_by_text(plan_line)).to_be_visible(timeout=30_000)
    shot(page, "3-flow-run-logs")

    page.get_by_role("tab", name="Task Runs").click()
    for name in ("plan", "storage-preflight", "launch-server", "warm-up", "stop-server", "verify"):
        expect(page.get_by_role("link", name=re.compile(rf"^{name}-[0-9a-f]+$"))).to_have_count(1)
    # Before the preflight (a killed run's dumps), and after the warm-up's probes.
    expect(page.get_by_role("link", name=re.compile(r"^reset-dump-dir-[0-9a-f]+$"))).to_have_count(2)
    batches = page.get_by_role("link", name=re.compile(r"^extract-batch-[0-9a-f]+$"))
    expect(batches).to_have_count(4)  # 8 rows in batches of 2: the form's setting reached the run
    shot(page, "4-task-runs")

    batches.first.click()
    page.wait_for_url(re.compile(r"/runs/task-run/"))
    expect(page.get_by_text(re.compile(r"batch of 2: stored 2 samples, \d+ tokens"))).to_be_visible()
    shot(page, "5-batch-task-logs")

    page.go_back()
    page.get_by_role("tab", name="Artifacts").click()
    artifact = page.get_by_text(f"verification of {store}")
    expect(artifact).to_be_visible()
    shot(page, "6-artifacts")
    artifact.click()
    page.wait_for_url(re.compile(r"/artifacts/artifact/"))
    shards = [name for (name,) in ledger(store, "SELECT name FROM shards ORDER BY name")]
    assert len(shards) == 4
    for name in shards:  # one row per shard of the store, each OK
        expect(page.get_by_role("row").filter(has_text=name).filter(has_text="OK")).to_have_count(1)
    shot(page, "7-verification-artifact")


# ------------------------------------------------------------------ retry

def file_stats(store: Path) -> dict:
    """Identity and content stamp of every shard file (not the fault's directory)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted((store / "shards").glob("shard-*.safetensors")) if p.is_file()}


def test_a_failed_run_retried_like_the_ui_redoes_only_what_is_missing(prefect_stack, deployment, capture_server,
                                                                      tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from tasks.data.dataset import prepare_samples
    from tasks.store.shards import shard_name

    api = prefect_stack["api"]
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(12))
    store = tmp_path / "store"
    samples, _ = prepare_samples(dataset, AutoTokenizer.from_pretrained(tiny_model), max_length=2048)
    blocked = [s.sample_id for s in samples[4:8]]  # the second of three batches of 4
    # The fault: a directory where that batch's shard file must go, so its
    # write fails every time (as a full or read-only store would) and its
    # retries cannot help. Nothing else of the run is affected.
    fault = store / "shards" / f"{shard_name(blocked)}.safetensors"
    fault.mkdir(parents=True)

    defaults = deployment["parameters"]
    params = {**defaults, "store": {**defaults["store"], "path": str(store)},
              "capture": {**defaults["capture"], "dataset": str(dataset), "batch_retries": 1,
                          "batch_retry_delay_s": 0}}
    # prefect.yaml gives the deployment one flow-level retry (after 60 s):
    # keep the retry, drop the wait, the way a user would for one run.
    run = api.create_flow_run(deployment["id"], {
        "parameters": params, "job_variables": {"env": {"PREFECT_FLOWS_DEFAULT_RETRY_DELAY_SECONDS": "0"}}})
    run = api.wait_terminal(run["id"], 300, logs=prefect_stack["log_files"])
    states = api.flow_run_states(run["id"])
    logs = api.logs_once(run["id"], lambda logs: any(
        m.startswith("Finished in state Failed") and "Flow run encountered" in m for m in logs))
    assert run["state_type"] == "FAILED", (run["state"], states)
    assert "1 batches failed after their retries" in run["state"]["message"]
    # The flow-level retry happened, in the same process, and resumed from
    # the ledger: it planned only the blocked batch.
    assert "AwaitingRetry" in states, states
    assert [m.split(" (")[0] for m in logs if m.startswith("plan: ")] == [
        "plan: 12 samples -> 12 to capture", "plan: 12 samples -> 4 to capture"], logs
    assert sum(m.startswith("batch of 4: stored 4 samples") for m in logs) == 2
    stored = {sid for (sid,) in ledger(store, "SELECT sample_id FROM samples")}
    assert stored == {s.sample_id for s in samples} - set(blocked)
    assert ledger(store, "SELECT COUNT(*) FROM quarantine") == [(0,)]
    shards_before = ledger(store, "SELECT * FROM shards ORDER BY name")
    samples_before = ledger(store, "SELECT * FROM samples ORDER BY sample_id")
    files_before = file_stats(store)
    assert len(shards_before) == 2 and len(files_before) == 2

    fault.rmdir()
    failed_state = run["state_id"]
    api.retry_like_the_ui(run["id"])
    run = api.wait_terminal(run["id"], 300, after=failed_state, logs=prefect_stack["log_files"])
    logs = api.logs_once(run["id"], lambda logs: any(m.startswith("verification ") for m in logs))
    assert run["state_type"] == "COMPLETED", (run["state"], api.flow_run_states(run["id"]))
    assert [m.split(" (")[0] for m in logs if m.startswith("plan: ")][2:] == ["plan: 12 samples -> 4 to capture"]
    assert sum(m.startswith("batch of 4: stored 4 samples") for m in logs) == 3  # one more, the blocked one
    assert any(m.startswith("verification passed: 3 files, 12 samples") for m in logs), logs[-10:]
    # What was stored before the retry is untouched: same ledger rows (with
    # their created times), same files (inode, mtime, size).
    shards_after = ledger(store, "SELECT * FROM shards ORDER BY name")
    assert [r for r in shards_after if r[0] != shard_name(blocked)] == shards_before
    assert ledger(store, f"SELECT * FROM samples WHERE shard != '{shard_name(blocked)}' ORDER BY sample_id") == samples_before
    files_after = file_stats(store)
    assert {k: v for k, v in files_after.items() if k in files_before} == files_before
    # ...and the one new shard holds exactly the samples that were missing.
    assert set(files_after) - set(files_before) == {f"{shard_name(blocked)}.safetensors"}
    assert sorted(sid for (sid,) in ledger(store, f"SELECT sample_id FROM samples WHERE shard = '{shard_name(blocked)}'")) == sorted(blocked)


# ------------------------------------------------------------------ cancel

def test_a_run_cancelled_like_the_ui_stops_its_server_and_keeps_what_it_stored(prefect_stack, deployment, prefect_api,
                                                                             capture_server, tiny_model, tmp_path):
    from tasks.server.processes import group_members
    from tasks.store.lock import hold_lock

    # 160 batches of one: the cancel (the worker's poll, then its SIGTERM) lands long before the last.
    api, rows = prefect_stack["api"], 160
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(rows))
    store = tmp_path / "store"
    defaults = deployment["parameters"]
    # This run launches its own server (no url), to show the cancel stops it.
    params = {**defaults, "server": {"model": str(tiny_model), "max_total_tokens": 4096},
              "store": {**defaults["store"], "path": str(store)},
              "capture": {**defaults["capture"], "dataset": str(dataset), "batch_size": 1, "dump_dir": None}}
    run = api.create_flow_run(deployment["id"], {"parameters": params})

    deadline = time.monotonic() + 600
    while stored_samples(store) < 1:
        assert api.flow_run(run["id"])["state_type"] in ("SCHEDULED", "PENDING", "RUNNING"), api.flow_run(run["id"])
        assert time.monotonic() < deadline, "no batch stored in 600 s"
        time.sleep(0.5)
    server_pid = json.loads((store / "logs" / "sglang-server.pid").read_text())["pid"]
    api.cancel_like_the_ui(run["id"])
    run = api.wait_terminal(run["id"], 120, logs=prefect_stack["log_files"])
    assert run["state_type"] == "CANCELLED", (run["state"], api.flow_run_states(run["id"]))
    assert not group_members(server_pid), "the cancelled run left its SGLang server running"
    assert 1 <= stored_samples(store) < rows, "cancelled too late to test anything"
    with hold_lock(store, "the test"):
        pass  # free

    rerun_completes(capture_server, store, dataset, rows)


def test_a_stream_pipeline_cancelled_like_the_ui_stops_both_sides_and_resumes(prefect_stack, deployment, capture_server,
                                                                             tiny_model, tmp_path):
    """The pipeline deployment in mode stream, spooled, cancelled from the
    UI once the trainer has checkpointed: the run ends Cancelled with no
    process of it left (the trainer and the capture ran in it), the
    trainer is marked stopped (what a capture node's loop stops on), and
    both sides started again resume: the trainer from its checkpoint, on
    the planned batches from there, the capture from the checkpoint's
    position."""
    import pandas as pd

    from tasks.train.config import TrainConfig
    from tasks.stream.plan import PLANNED, plan_stream
    from tasks.stream.spool import read_position
    from tasks.stream.state import trainer_state
    from tests.conftest import train_beside_capture

    api, store = prefect_stack["api"], tmp_path / "store"
    params = attach(capture_server, store=store, dataset=str(write_jsonl(tmp_path / "data.jsonl", demo_rows(40))),
                    batch_size=4, max_length=256)
    cfg = TrainConfig(out_dir=str(tmp_path / "train"), draft_vocab_size=64, ttt_steps=1, epochs=2,
                      tokens_per_batch=512, heldout_fraction=0.1, eval_max_samples=2, vocab_positions=300,
                      checkpoint_every=2, stream=True)
    whole = plan_stream(str(tiny_model), params["capture"], cfg)
    cfg = cfg.model_copy(update={"spool_bytes": whole.shard_bytes([r for b in whole.epochs[0] for r in b], 4)})
    pipeline = api.deployment("eagle3_pipeline/pipeline")
    run = api.create_flow_run(pipeline["id"], {"parameters": {
        **as_record(params), "train": as_record({"t": cfg})["t"], "mode": "stream"}})
    deadline = time.monotonic() + 600
    while read_position(store) == (0, 0):
        assert api.flow_run(run["id"])["state_type"] in ("SCHEDULED", "PENDING", "RUNNING"), api.flow_run(run["id"])
        assert time.monotonic() < deadline, "no checkpoint in 600 s"
        time.sleep(0.5)
    api.cancel_like_the_ui(run["id"])
    run = api.wait_terminal(run["id"], 120, logs=prefect_stack["log_files"])
    assert run["state_type"] == "CANCELLED", (run["state"], api.flow_run_states(run["id"]))
    assert not run_processes(run["id"]), "the cancelled run left a process"
    assert trainer_state(store) == "stopped"
    position = read_position(store)

    steps = []
    plan = plan_stream(str(tiny_model), params["capture"], cfg, store)
    streamed, _ = train_beside_capture(params, cfg, plan, store, steps.append)
    assert streamed.resumed_from is not None and streamed.resumed_from["epoch"] == position[0]
    ids = dict(zip(*pd.read_parquet(store / PLANNED, columns=["source_row", "sample_id"]).to_dict("list").values()))
    planned = [[ids[r] for r in b] for epoch in plan.epochs for b in epoch]
    assert [s["sample_ids"] for s in steps] == planned[streamed.resumed_from["step"]:]

