"""One real SGLang capture server on the tiny model per test session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tasks.server.config import ServerConfig  # noqa: E402
from tasks.server.launch import CaptureSpec, launch_server  # noqa: E402
from tasks.target.layers import AuxLayers  # noqa: E402
from tasks.train.config import TrainConfig  # noqa: E402
from tests.tiers import pytest_addoption, pytest_collection_modifyitems  # noqa: E402,F401
from tests.tiny_models import TINY, ensure_model  # noqa: E402

# Small enough that a 600-token prompt is split over several forwards.
CHUNKED_PREFILL = 256
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))
# Servers' logs land here for CI to keep; any test may be the first to run.
ARTIFACTS.mkdir(parents=True, exist_ok=True)

_reporting: dict = {}


def pytest_configure(config):
    _reporting["config"] = config


def pytest_runtest_logreport(report):
    """A failure's report the moment it fails, not only in the summary at
    the end: a CI run cut off by its time limit still says why a test
    failed (the summary never comes)."""
    reporter = _reporting["config"].pluginmanager.getplugin("terminalreporter")
    if report.failed and reporter is not None:
        reporter.write_line("")
        reporter.write_sep("!", f"{report.nodeid} failed in its {report.when}; the whole report is in the summary")
        reporter.write_line(report.longreprtext[-6000:])


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_model(TINY)


@pytest.fixture(scope="session")
def tiny_layers(tiny_model) -> AuxLayers:
    import json

    n = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    return AuxLayers.for_model(n)


# Five layers, not the default three: a store of any layer set.
FIVE_LAYER_IDS = (1, 2, 4, 5, 6)


@pytest.fixture(scope="session")
def session_servers(tiny_model, tmp_path_factory) -> dict:
    """The session's two servers of the tiny model, started at once: a
    launch is mostly one process importing on one core at a time, so on two
    cores both serve in about the time of one (the suite needs both)."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import ExitStack

    from tasks.target.architectures import LLAMA

    specs = {
        "capture": CaptureSpec(ServerConfig(model=str(tiny_model), max_total_tokens=16384,
                                            chunked_prefill_size=CHUNKED_PREFILL),
                               dump_dir=tmp_path_factory.mktemp("dumps")),
        "float32": CaptureSpec(ServerConfig(model=str(tiny_model), dtype="float32", max_total_tokens=8192),
                               dump_dir=tmp_path_factory.mktemp("float32-dumps"),
                               aux_layer_ids=LLAMA.sglang_layer_ids(FIVE_LAYER_IDS)),
    }
    with ExitStack() as running, ThreadPoolExecutor(len(specs)) as pool:
        started = {name: pool.submit(launch_server, spec, ARTIFACTS / f"{name}-server.log", timeout_s=600)
                   for name, spec in specs.items()}
        servers, failed = {}, []
        for name, future in started.items():  # each started one is stopped, whichever failed
            try:
                servers[name] = running.enter_context(future.result())
            except Exception as e:  # noqa: BLE001 - raised below, once both are settled
                failed.append(e)
        if failed:
            raise failed[0]
        yield servers


@pytest.fixture(scope="session")
def capture_server(session_servers):
    """The tiny model in its own dtype, capturing the default layers, its
    prefill chunked (CHUNKED_PREFILL)."""
    return session_servers["capture"]


@pytest.fixture(scope="session")
def float32_server(session_servers):
    """The tiny model served in float32, capturing FIVE_LAYER_IDS: for tests
    that compare with HF token for token or to float32's precision (the
    target's greedy answers, the five-layer store), where the capture
    server's bf16 would flip near ties. Requests without its rid prefix
    (regeneration's) are served and not captured."""
    return session_servers["float32"]


@pytest.fixture(scope="session")
def prefect_api():
    """One temporary Prefect server (SQLite) for the session's flow runs."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield os.environ.get("PREFECT_API_URL") or __import__("prefect.settings").settings.PREFECT_API_URL.value()


def attach(server, *, store, **capture) -> dict:
    """extract_hidden_states parameters that attach to the session's server
    (its own random API key and rid prefix, its dump dir), with `capture`
    settings for the capture section and the store at `store`."""
    from tasks.capture.config import CaptureConfig
    from tasks.server.config import ServerConfig
    from tasks.store.config import StoreConfig

    return {"server": ServerConfig(model=server.spec.server.model, url=server.url, api_key=server.api_key,
                                   rid_prefix=server.rid_prefix),
            "capture": CaptureConfig(dump_dir=str(server.spec.dump_dir), **capture),
            "store": StoreConfig(path=str(store))}


def train_beside_capture(params: dict, cfg: TrainConfig, plan, store: Path, on_step, trainer=None):
    """Both sides in this process, as capture_and_train runs them (a
    resumed spool cut back first): the training's result and the capture's
    report. `trainer`: what trains, if not `train` (a flow, say)."""
    import threading

    from flows.stream import capture_task
    from tasks.train.loop import train
    from tasks.stream.parts import trim_spool
    from tasks.stream.state import mark_trainer

    if cfg.spool_bytes is not None:
        trim_spool(store, plan)
    reports, failures = [], []

    def capture():
        try:
            reports.append(capture_task.fn(**params, train=cfg, plan=plan))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            failures.append(e)

    mark_trainer(store, "running")
    thread = threading.Thread(target=capture)
    thread.start()
    try:
        result = trainer() if trainer else train(cfg, store, on_step=on_step)
    finally:
        thread.join()
    assert not failures, failures
    return result, reports[0]


def wait_for(condition, proc, stderr: Path, timeout_s: float = 600, poll_s: float = 0.5):
    """What `condition()` returns once it is truthy (asked every `poll_s`);
    fail, quoting `stderr`'s tail, if the process `proc` exits first or
    `timeout_s` passes."""
    import time

    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert proc.poll() is None, stderr.read_text()[-3000:]
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s: {stderr.read_text()[-3000:]}"
        time.sleep(poll_s)
    return value


def stored_samples(store: Path) -> int:
    """Samples committed to the store so far (0 before it exists)."""
    from tasks.store.handle import Store

    try:
        return Store.open(store).ledger.summary()["samples"]
    except Exception:  # noqa: BLE001 - no manifest or index yet
        return 0


def rerun_completes(server, store: Path, dataset: Path, rows: int) -> None:
    """The rerun of a stopped extraction, on the session's server: what the
    stopped run committed stays as it was (each sample in its shard), the
    rest is captured, every sample once, and the store verifies."""
    from flows.extract import extract_hidden_states
    from tasks.store.handle import Store

    before = Store.open(store).ledger.samples()
    result = extract_hidden_states(**attach(server, store=store, dataset=str(dataset), batch_size=8))
    assert result["samples"] == rows and result["verification"]["ok"], result
    after = Store.open(store).ledger.samples()
    assert len(after) == rows and after["sample_id"].is_unique
    kept = dict(zip(before.sample_id, before.shard))
    assert {s: shard for s, shard in zip(after.sample_id, after.shard) if s in kept} == kept


@pytest.fixture(scope="session")
def tiny_store(capture_server, prefect_api, tmp_path_factory) -> Path:
    """A verified store of 160 demo conversations on the tiny model, for
    training and the pipeline."""
    from flows.extract import extract_hidden_states

    d = tmp_path_factory.mktemp("tiny-store")
    dataset = write_jsonl(d / "data.jsonl", demo_rows(160))
    result = extract_hidden_states(**attach(capture_server, store=d / "store", dataset=str(dataset), batch_size=32,
                                            max_length=512))
    assert result["verification"]["ok"]
    return Path(result["store"])


def tiny_train_config(out_dir, **kw) -> TrainConfig:
    """The tiny store's training: six epochs of small batches, in which the
    drafter learns (tests/test_training.py's thresholds; seen: five epochs
    reach held-out tau 0.59-0.71 with seeds 0-3)."""
    base = dict(out_dir=str(out_dir), draft_vocab_size=512, ttt_steps=3, epochs=6, lr=5e-3, tokens_per_batch=1024,
                heldout_fraction=0.1, checkpoint_every=4, log_every=10, serve_steps=3)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="session")
def tiny_pipeline(capture_server, float32_server, tiny_store, prefect_api) -> tuple[dict, TrainConfig]:
    """The whole pipeline on the tiny store (its extraction finds every
    sample stored), trained with `tiny_train_config`: its summary and that
    config. One training that tests/test_pipeline.py checks as a run and
    tests/test_training.py as a training (a minute's training: it is done
    once). The plain outputs come from the session's float32 server, by
    URL (a launched baseline: tests/test_architectures.py, Qwen3)."""
    from flows.pipeline import eagle3_pipeline
    from tasks.evaluation.config import EvaluateConfig

    run_dir = Path(tiny_store).parent
    # Served in SGLang after epochs 3 and 6, the better one exported (tests/test_training.py).
    cfg = tiny_train_config(run_dir / "train", serve_every=3, serve_prompts=4, serve_max_new_tokens=24,
                            keep_best_served=True, export_formats=["sglang", "speculators"])
    summary = eagle3_pipeline(
        **attach(capture_server, store=tiny_store, dataset=str(run_dir / "data.jsonl"), max_length=512,
                 batch_size=32),
        train=cfg, evaluate=EvaluateConfig(num_prompts=4, max_new_tokens=24, concurrency=[1], min_verify_steps=16,
                                           baseline=float32_server.url, baseline_api_key=float32_server.api_key))
    return summary, cfg


def demo_rows(n: int) -> list[dict]:
    import json

    from tasks.data.dataset import DEMO_DATASET

    return [json.loads(line) for line in DEMO_DATASET.read_text().splitlines()[:n]]


def write_jsonl(path: Path, rows) -> Path:
    import json

    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def random_store(d: Path, model: Path, rows: int, max_length: int = 256, aux_layer_ids=None) -> Path:
    """A verified store of the first `rows` demo conversations with random
    hidden states (seeded), built with tasks.store and no server, for
    training tests; recorded as captured from `aux_layer_ids` (default:
    SGLang's). Called again with more rows on the same d, the store
    grows: the dataset gains the rows and a second shard their samples."""
    import torch
    from transformers import AutoTokenizer

    from tasks.capture.config import CaptureConfig
    from tasks.capture.planning import capture_chat
    from tasks.data.dataset import prepare_samples
    from tasks.store.ledger.open import open_store
    from tasks.store.reader import StoreReader
    from tasks.store.shards import FORMAT, write_shard
    from tasks.store.verification import verify_store
    from tasks.train.layers.sizes import target_sizes

    config = target_sizes(model)  # the text model's sizes, also under a multimodal wrapper (Kimi-K2.5)
    hidden = config["hidden_size"]
    store = d / "store"
    dataset = write_jsonl(d / "data.jsonl", demo_rows(rows))
    layers = AuxLayers.for_model(config["num_hidden_layers"], aux_layer_ids)
    tokenizer = AutoTokenizer.from_pretrained(model)
    chat = capture_chat(CaptureConfig(dataset=str(dataset)), tokenizer, model)  # what a capture records
    manifest = {"format": FORMAT, "target": {"name": "tiny"}, "tokenizer": {"sha256": "t"},
                "aux_layers": layers.as_record(),
                "hidden_size": hidden,
                "dtype": "bfloat16", "max_length": max_length, "max_length_policy": "truncate",
                "chat": chat.record(), "target_path": str(model), "sources": [str(dataset)]}
    ledger = open_store(store, manifest)
    have = set(StoreReader(store).sample_ids) if ledger.shards().shape[0] else set()
    samples, _ = prepare_samples(dataset, tokenizer, max_length=max_length, chat=chat)
    g = torch.Generator().manual_seed(len(have))
    items = [{"sample_id": s.sample_id, "source_row": s.source_row, "input_ids": s.input_ids,
              "loss_mask": s.loss_mask, "aux_hidden_states": torch.randn(s.num_tokens, len(layers.sglang_ids), hidden, generator=g),
              "final_hidden_state": torch.randn(s.num_tokens, hidden, generator=g)}
             for s in samples if s.sample_id not in have]
    ledger.commit_shard(*write_shard(store, items, source=str(dataset)))
    assert verify_store(store).ok
    return store


@pytest.fixture(scope="session")
def postgres_url():
    """One private PostgreSQL server per session (tests/pg_server.py); its
    URL carries the password."""
    import pg_server

    server = pg_server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_url(request, monkeypatch):
    """Run a test on both ledger backends: None (SQLite, the default) or the
    session's PostgreSQL server. The store records the URL without its
    password; later opens take it from EAGLE3_LEDGER_URL, as a deployment
    would."""
    if request.param == "sqlite":
        monkeypatch.delenv("EAGLE3_LEDGER_URL", raising=False)
        return None
    url = request.getfixturevalue("postgres_url")
    monkeypatch.setenv("EAGLE3_LEDGER_URL", url)
    return url


class IndexDB:
    """The store's index read with the database's own driver (sqlite3 or
    psycopg), not through tasks.store: an independent reader. SQL uses `?`
    placeholders for both."""

    def __init__(self, store: Path, url: str | None = None, record: str = "ledger.json",
                 sqlite: str = "ledger.sqlite"):
        """`record`, `sqlite`: the files that name the index (an answers
        directory's: index.json, index.sqlite)."""
        import json
        import sqlite3

        record_path = Path(store) / record
        record = json.loads(record_path.read_text()) if record_path.exists() else {"backend": "sqlite"}
        if record["backend"] == "sqlite":
            self.db, self.marker = sqlite3.connect(Path(store) / sqlite), "?"
        else:
            import psycopg

            self.db = psycopg.connect(url or os.environ["EAGLE3_LEDGER_URL"],
                                      options=f"-c search_path={record['schema']}")
            self.marker = "%s"

    def execute(self, sql: str, args=()):
        return self.db.execute(sql.replace("?", self.marker), args)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.db.commit()
        self.db.close()

    def close(self):
        self.db.close()


@pytest.fixture
def index_db(ledger_url):
    """index_db(store) -> IndexDB on the backend this test runs on."""
    return lambda store: IndexDB(store, ledger_url)
