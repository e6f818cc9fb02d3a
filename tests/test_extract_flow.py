"""The extraction DAG on the real server and the tiny model."""
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from flows.config import to_yaml
from flows.extract import extract_hidden_states
from tasks.capture import client as capture_client
from tasks.capture.config import CaptureConfig
from tasks.capture.dump import TMP_PREFIX, read_capture as real_read_capture, write_chunk
from tasks.capture.bookkeeping import FailureGuard
from tasks.capture.extraction import Endpoint, extract_batch
from tasks.data.dataset import prepare_samples
from tasks.server.config import ServerConfig
from tasks.store.config import StoreConfig
from tasks.store.handle import Store
from tasks.store.ledger.open import open_ledger
from tasks.store.lock import LOCK_NAME
from tasks.store.manifest import read_manifest
from tasks.store.reader import StoreReader
from tasks.store.verification import verify_store
from tasks.target.layers import AuxLayers
from tasks.target.reference import load_reference_model, per_token_cosine, reference_states
from tests.conftest import attach, demo_rows, write_jsonl

pytestmark = pytest.mark.server
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ledger_rows(store, sql):
    with sqlite3.connect(os.path.join(store, "ledger.sqlite")) as db:
        return db.execute(sql).fetchall()


@pytest.fixture(scope="module")
def small_store(capture_server, prefect_api, tmp_path_factory):
    """24 demo conversations plus four bad rows, extracted by the flow."""
    d = tmp_path_factory.mktemp("small")
    long_chat = {"messages": [{"role": "user", "content": "word " * 2000}, {"role": "assistant", "content": "ok"}]}
    dataset = write_jsonl(d / "data.jsonl", demo_rows(24) + [
        "{broken json", {"messages": []}, {"messages": [{"role": "wizard", "content": "hi"}]}, long_chat])
    result = extract_hidden_states(**attach(capture_server, store=d / "store", dataset=str(dataset), batch_size=8,
                                            max_length=1024, max_length_policy="skip"))
    return d, dataset, result


def test_flow_stores_every_sample_and_quarantines_bad_rows(small_store):
    d, dataset, result = small_store
    assert result["samples"] == 24 and result["quarantined"] == 4
    assert result["verification"]["ok"] is True
    reasons = dict(ledger_rows(d / "store", "SELECT source_row, reason FROM quarantine"))
    assert "bad JSON" in reasons[24] and reasons[25] == "empty conversation"
    assert "unknown role 'wizard'" in reasons[26] and "max_length 1024" in reasons[27]
    assert sorted(r[0] for r in ledger_rows(d / "store", "SELECT source_row FROM samples")) == list(range(24))
    manifest = read_manifest(d / "store")
    assert manifest["aux_layers"] == {"sglang_layer_output_ids": [1, 3, 4], "hf_hidden_states_indices": [2, 4, 5],
                                      "final_state": "post-norm"}


def test_stored_states_equal_an_hf_forward(small_store, tiny_model):
    d, _, _ = small_store
    manifest = read_manifest(d / "store")
    layers = AuxLayers(tuple(manifest["aux_layers"]["sglang_layer_output_ids"]))
    model = load_reference_model(str(tiny_model), torch.float32)
    reader = StoreReader(d / "store")
    for i in range(0, len(reader), 5):
        s = reader[i]
        aux, final = reference_states(model, s["input_ids"].tolist(), layers)
        assert per_token_cosine(s["aux_hidden_states"], aux).min() >= 0.999
        assert per_token_cosine(s["final_hidden_state"], final).min() >= 0.999


def corrupted(small_store, tmp_path):
    d, dataset, _ = small_store
    store = tmp_path / "store"
    shutil.copytree(d / "store", store)
    shard = ledger_rows(store, "SELECT name FROM shards ORDER BY name")[0][0]
    return store, store / "shards" / f"{shard}.safetensors", shard


def test_verification_names_a_flipped_byte(small_store, tmp_path):
    store, path, shard = corrupted(small_store, tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    report = verify_store(store)
    assert not report.ok
    assert f"{shard}: " in report.failures() and "sha256 differs" in report.failures()
    assert "checksum differs" in report.failures()  # and which sample holds the byte


def test_verification_names_a_truncated_shard(small_store, tmp_path):
    store, path, shard = corrupted(small_store, tmp_path)
    path.write_bytes(path.read_bytes()[:-1000])
    report = verify_store(store)
    assert not report.ok and f"{shard}: size" in report.failures() and "unreadable" in report.failures()


def test_verification_names_an_index_row_that_disagrees(small_store, tmp_path):
    store, _, shard = corrupted(small_store, tmp_path)
    (sid,) = ledger_rows(store, f"SELECT sample_id FROM samples WHERE shard='{shard}' AND position=1")[0]
    with sqlite3.connect(store / "ledger.sqlite") as db:
        db.execute("UPDATE samples SET num_tokens = num_tokens + 1 WHERE sample_id=?", (sid,))
    report = verify_store(store)
    assert not report.ok and f"sample {sid}" in report.failures() and "recounted" in report.failures()


def test_verification_names_a_sample_whose_source_changed(small_store, tmp_path):
    store, _, _ = corrupted(small_store, tmp_path)
    _, dataset, _ = small_store
    rows = dataset.read_text().splitlines()
    row = json.loads(rows[3])
    row["messages"][-1]["content"] += " (edited)"
    rows[3] = json.dumps(row)
    edited = write_jsonl(tmp_path / "edited.jsonl", rows)
    with sqlite3.connect(store / "ledger.sqlite") as db:
        db.execute("UPDATE samples SET source=?", (str(edited),))
    # The edited copy is the store's only source (samples are found by
    # content in any of them, and the original still holds row 3 as stored).
    manifest = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").write_text(json.dumps({**manifest, "sources": [str(edited)]}))
    report = verify_store(store)
    failing = report.samples[report.samples.status != "OK"]
    assert not report.ok and list(failing.status) == ["GONE"]
    assert list(failing.source_row) == [3] and "source changed" in failing.problems.iloc[0]


def test_killed_run_resumes_and_another_batch_size_redoes_nothing(capture_server, prefect_api, tmp_path):
    rows = 40  # 20 batches of 2, one at a time: the kill lands after the third
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(rows))
    store = tmp_path / "store"
    args = attach(capture_server, store=store, dataset=str(dataset), batch_size=2, concurrency=1)
    # From the command line: a run file (the key stays in the environment,
    # as the README advises), then an override.
    run_file = tmp_path / "run.yaml"
    run_file.write_text(to_yaml(args))  # the record leaves the key out
    cli = [sys.executable, "-m", "flows.extract", "--config", str(run_file), "--no-verify"]
    proc = subprocess.Popen(cli, cwd=REPO, env={**os.environ, "PREFECT_API_URL": prefect_api,
                                                "EAGLE3_API_KEY": capture_server.api_key},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (store / "ledger.sqlite").exists() and ledger_rows(store, "SELECT COUNT(*) FROM shards")[0][0] >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stored_at_kill = ledger_rows(store, "SELECT COUNT(*) FROM samples")[0][0]
    assert 0 < stored_at_kill < rows, "the run was not killed midway"

    result = extract_hidden_states(**args)
    assert result["samples"] == rows and result["verification"]["ok"]
    counts = ledger_rows(store, "SELECT COUNT(*), COUNT(DISTINCT sample_id), (SELECT SUM(num_samples) FROM shards) FROM samples")
    assert counts == [(rows, rows, rows)]
    shards = ledger_rows(store, "SELECT name, sha256 FROM shards ORDER BY name")

    again = extract_hidden_states(**{**args, "capture": args["capture"].model_copy(update={"batch_size": 7})})
    assert again["samples"] == rows
    assert ledger_rows(store, "SELECT name, sha256 FROM shards ORDER BY name") == shards


def test_bad_dumps_are_retried_then_quarantined(capture_server, tiny_model, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from tasks.store.ledger.open import open_store
    from tasks.store.manifest import build_manifest
    from tasks.target.architectures import LLAMA

    server = capture_server
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(6))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    samples, _ = prepare_samples(dataset, tok, max_length=512)
    layers = AuxLayers.for_model(8)
    open_store(tmp_path / "store", build_manifest(tiny_model, tok, layers, LLAMA, max_length=512,
                                                  policy="truncate", sources=[str(dataset)]))
    foreign_once, short_always = samples[1].input_ids.tolist(), samples[4].input_ids.tolist()
    calls = {"foreign": 0}

    def tampering_read(dump_dir, rid, sent_ids, **kw):
        ids = list(sent_ids)
        if ids in (foreign_once, short_always):
            cap = real_read_capture(dump_dir, rid, ids, **kw)  # the real dump, then rewrite it
            if ids == foreign_once and calls["foreign"] == 0:
                calls["foreign"] += 1
                other = "e3-someone-else"
                write_chunk(dump_dir, other, 0, cap.input_ids, cap.aux_hidden_states, cap.final_hidden_state,
                            cap.aux_layer_ids, "post-norm")
                os.replace(dump_dir / f"{other}@0.safetensors", dump_dir / f"{rid}@0.safetensors")
            elif ids == short_always:
                write_chunk(dump_dir, rid, 0, cap.input_ids[:-1], cap.aux_hidden_states[:-1],
                            cap.final_hidden_state[:-1], cap.aux_layer_ids, "post-norm")
        return real_read_capture(dump_dir, rid, ids, **kw)

    monkeypatch.setattr(capture_client, "read_capture", tampering_read)
    # The short dump never completes: don't wait the default for it.
    endpoint = Endpoint(server.url, server.spec.dump_dir, layers.sglang_ids, api_key=server.api_key,
                        rid_prefix=server.rid_prefix, dump_wait_s=0.5)
    result = extract_batch(endpoint, Store.open(tmp_path / "store"), str(dataset), samples,
                           CaptureConfig(sample_attempts=3))
    assert calls["foreign"] == 1
    assert result.samples == 5 and result.quarantined == [samples[4].sample_id]
    assert result.retried == 2 + 1  # attempt 2: both; attempt 3: the short one
    ((row, reason, attempts),) = ledger_rows(tmp_path / "store", "SELECT source_row, reason, attempts FROM quarantine")
    assert row == 4 and attempts == 3 and "stops at token" in reason
    stored = {r[0] for r in ledger_rows(tmp_path / "store", "SELECT sample_id FROM samples")}
    assert stored == {s.sample_id for s in samples} - {samples[4].sample_id}
    # Nothing left but the lock file that the session's extraction runs hold on the dump dir.
    assert [p.name for p in server.spec.dump_dir.iterdir()] in ([], [LOCK_NAME])


def test_requests_timed_out_on_a_real_server_leave_no_dump(capture_server, tiny_model, tmp_path):
    """A request the client gave up on (its timeout) still runs on the server
    and its dump lands late, after the sample was discarded: the run's next
    batch sweeps it (in a RAM-backed dump dir, late dumps would pile up)."""
    from transformers import AutoTokenizer

    from tasks.store.ledger.open import open_store
    from tasks.store.manifest import build_manifest
    from tasks.target.architectures import LLAMA

    server = capture_server
    dump_dir = server.spec.dump_dir
    # Long enough (12 prefill chunks) that a forward outlasts the batch that gave up on it.
    long = [{"id": f"long-{k}", "messages": [{"role": "user", "content": f"{k} " + "word " * 3000},
                                              {"role": "assistant", "content": "ok"}]} for k in range(3)]
    dataset = write_jsonl(tmp_path / "data.jsonl", long + demo_rows(3))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    samples, _ = prepare_samples(dataset, tok, max_length=3072)
    assert all(len(s.input_ids) > 3000 for s in samples[:3])
    layers = AuxLayers.for_model(8)
    open_store(tmp_path / "store", build_manifest(tiny_model, tok, layers, LLAMA, max_length=3072,
                                                  policy="truncate", sources=[str(dataset)]))
    endpoint = Endpoint(server.url, dump_dir, layers.sglang_ids, api_key=server.api_key,
                        rid_prefix=server.rid_prefix)
    guard = FailureGuard(max_ratio=1.0, max_consecutive=100)
    first = extract_batch(endpoint, Store.open(tmp_path / "store"), str(dataset), samples[:3],
                          CaptureConfig(sample_attempts=1, request_timeout_s=0.2, concurrency=3), guard=guard)
    assert first.samples == 0 and sorted(first.quarantined) == sorted(s.sample_id for s in samples[:3])
    assert all("Timeout" in r for r in open_ledger(tmp_path / "store").quarantined().reason)
    timed_out = set(guard.failed_rids)
    assert len(timed_out) == 3

    def late() -> list[str]:
        return sorted(p.name for p in dump_dir.iterdir() if p.name.removeprefix(TMP_PREFIX).split("@")[0] in timed_out)

    # The server finishes what the client gave up on: wait until its dumps stop changing.
    seen, since, deadline = late(), time.monotonic(), time.monotonic() + 60
    while time.monotonic() < deadline and (not seen or time.monotonic() - since < 3):
        time.sleep(0.1)
        if (now := late()) != seen:
            seen, since = now, time.monotonic()
    assert seen, "no timed-out request left a late dump: the test proves nothing"

    second = extract_batch(endpoint, Store.open(tmp_path / "store"), str(dataset), samples[3:], CaptureConfig(),
                           guard=guard)
    assert second.samples == 3
    assert late() == []
    assert [p.name for p in dump_dir.iterdir()] in ([], [LOCK_NAME])


def test_a_transient_request_failure_is_retried(capture_server, prefect_api, tmp_path, monkeypatch):
    real_post = httpx.AsyncClient.post
    failed = []

    async def flaky_post(self, url, *a, **kw):
        if url.endswith("/generate") and not failed and "-probe-" not in kw.get("json", {}).get("rid", ""):
            failed.append(url)
            raise httpx.ReadError("connection reset by peer (injected)")
        return await real_post(self, url, *a, **kw)

    monkeypatch.setattr(httpx.AsyncClient, "post", flaky_post)
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(10))
    result = extract_hidden_states(**attach(capture_server, store=tmp_path / "store", dataset=str(dataset),
                                            batch_size=5))
    assert failed and result["samples"] == 10 and result["quarantined"] == 0 and result["verification"]["ok"]


def servers_logging_to(log_path) -> list[int]:
    """Pids of SGLang server leaders writing their output to `log_path` (the
    dump dir is not on their command line: it is in their private options file)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            leader = entry.isdigit() and os.getpgid(int(entry)) == int(entry)
            stdout = os.readlink(f"/proc/{entry}/fd/1")
        except OSError:
            continue
        if leader and b"sglang.launch_server" in cmd and stdout == os.path.realpath(log_path):
            pids.append(int(entry))
    return pids


def test_a_crashed_server_is_relaunched_and_nothing_is_lost(tiny_model, prefect_api, tmp_path):
    rows = 48  # 12 batches of 4: the kill lands after the second
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(rows))
    store = tmp_path / "store"
    killed = []

    def kill_server_midway():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            launched = servers_logging_to(store / "logs" / "sglang-server.log")
            if launched and (store / "ledger.sqlite").exists() and open_ledger(store).summary()["shards"] >= 2:
                os.killpg(launched[0], signal.SIGKILL)
                killed.append(open_ledger(store).summary()["samples"])
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_server_midway, daemon=True)
    watcher.start()
    result = extract_hidden_states(server=ServerConfig(model=str(tiny_model), max_total_tokens=16384),
                                   capture=CaptureConfig(dataset=str(dataset), dump_dir=str(tmp_path / "dumps"),
                                                         batch_size=4, concurrency=2),
                                   store=StoreConfig(path=str(store)))
    watcher.join(timeout=5)
    assert killed and killed[0] < rows, "the server was not killed midway"
    assert result["samples"] == rows and result["quarantined"] == 0 and result["verification"]["ok"]
    log = (store / "logs" / "sglang-server.log").read_text()
    assert log.count("$ ") == 2  # launched once, relaunched once
    assert not servers_logging_to(store / "logs" / "sglang-server.log")  # the run stopped its server


def test_a_batch_task_that_fails_once_shows_its_retry_and_completes(capture_server, prefect_api, tmp_path,
                                                                    monkeypatch):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    from tasks.capture import extraction

    real = extraction.extract_batch
    calls = []

    def fails_once(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise extraction.ServerUnavailable("injected: server stopped answering")
        return real(*a, **kw)

    monkeypatch.setattr(extraction, "extract_batch", fails_once)
    dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(8))
    state = extract_hidden_states(**attach(capture_server, store=tmp_path / "store", dataset=str(dataset),
                                           batch_size=4, batch_retries=2, batch_retry_delay_s=0), return_state=True)
    assert state.is_completed() and state.result()["samples"] == 8

    async def batch_histories():
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [state.state_details.flow_run_id]}))
            return {r.id: ([s.name for s in await client.read_task_run_states(r.id)], r.run_count)
                    for r in runs if r.name.startswith("extract-batch")}

    histories = asyncio.run(batch_histories())
    retried = [(h, count) for h, count in histories.values() if "Retrying" in h]
    assert len(histories) == 2 and len(retried) == 1, histories
    assert retried[0] == (["Pending", "Running", "Retrying", "Completed"], 2)
