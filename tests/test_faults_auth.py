"""Other local processes against a capture server (issue #11): the rid prefix
the hook captures was public ("e3-"), so anyone could make it write, and the
server took requests from anyone. Now each server the launcher starts has
its own random rid prefix and API key, kept off the command line and out of
every log line we pass on, and every request of ours carries the key.

The launcher is driven for real against tests/fake_sglang.py, which takes
the launcher's real arguments and options file in place of SGLang; the
clients against an httpx transport that plays SGLang's HTTP side. The last
test starts real SGLang (marked `server`)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch

from tasks.capture.client import capture_many
from tasks.capture.dump import RID_PREFIX, check_rid_prefix, new_rid, write_chunk
from tasks.capture.config import CaptureConfig
from tasks.capture.extraction import Endpoint, extract_batch, reset_dump_dir, warm_up
from tasks.capture.hook import make_capture_hook
from tasks.data.dataset import Sample
from tasks.regeneration.config import RegenerateConfig
from tasks.regeneration.stage import regenerate
from tasks.evaluation.generate import generate_all
from tasks.server.health import wait_healthy
from tasks.server.config import API_KEY_ENV, ServerConfig
from tasks.server.launch import CaptureSpec, LaunchSpec, ServerHandle, check_serves, launch_server
from tasks.server.server_log import LogFollower
from tasks.server.supervisor import ServerSupervisor, attach_api_key, share, unshare
from tasks.sglang_api import ServerError, ServerGone, auth_headers, server_healthy
from tasks.store.ledger.open import open_store
from tasks.store.handle import Store
from tasks.store.shards import BF16, FORMAT
from tests.test_capture_hook import run_hook

FAKE_SGLANG = Path(__file__).with_name("fake_sglang.py")
RANDOM_PREFIX = re.compile(r"^e3-[0-9a-f]{8}-$")


@pytest.fixture
def fake_sglang(monkeypatch):
    """launch_server starts tests/fake_sglang.py with its real arguments in
    place of `python -m sglang.launch_server`; returns the argument lists."""
    real_popen = subprocess.Popen
    launched = []

    def popen(cmd, *a, **kw):
        assert cmd[1:3] == ["-m", "sglang.launch_server"], cmd
        launched.append(list(cmd))
        return real_popen([sys.executable, str(FAKE_SGLANG), *cmd[3:]], *a, **kw)

    monkeypatch.setattr("tasks.server.launch.subprocess.Popen", popen)
    return launched


def capture_config(tmp_path, name="dumps", server: dict | None = None, capture: bool = True, **kw) -> LaunchSpec:
    section = ServerConfig(model="m", **(server or {}))
    if not capture:  # a plain server
        return LaunchSpec(section, cpu=False, **kw)
    return CaptureSpec(section, dump_dir=tmp_path / name, capture_module="model", cpu=False, **kw)


def logged_commands(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("$ ")]


def test_each_launch_draws_its_own_rid_prefix_and_api_key_and_the_hook_gets_them(fake_sglang, tmp_path):
    with launch_server(capture_config(tmp_path, "a"), tmp_path / "a.log", timeout_s=30) as a, \
            launch_server(capture_config(tmp_path, "b"), tmp_path / "b.log", timeout_s=30) as b:
        assert RANDOM_PREFIX.match(a.rid_prefix) and RANDOM_PREFIX.match(b.rid_prefix)
        assert a.rid_prefix != b.rid_prefix and a.api_key != b.api_key and len(a.api_key) >= 32
        # What the server itself was given (its start-up line, as SGLang prints it): the hook
        # captures under that server's prefix, and the server wants that key.
        for server in (a, b):
            printed = server.log_path.read_text()
            assert f"'rid_prefix': '{server.rid_prefix}'" in printed and f"'api_key': '{server.api_key}'" in printed
            assert server_healthy(server.url, api_key=server.api_key)
            assert not server_healthy(server.url)  # the fake, like SGLang's other endpoints, wants the key
    # An explicit prefix and key are kept (a relaunch from the same config reuses them).
    with launch_server(capture_config(tmp_path, "c", rid_prefix="e3-mine-", api_key="k" * 40), tmp_path / "c.log",
                       timeout_s=30) as c:
        assert (c.rid_prefix, c.api_key) == ("e3-mine-", "k" * 40)


def test_the_key_and_prefix_are_off_the_command_line_and_out_of_what_we_log(fake_sglang, tmp_path, caplog):
    log = tmp_path / "logs" / "server.log"
    follower = LogFollower(log)
    with caplog.at_level("INFO", logger="eagle3.server"), \
            launch_server(capture_config(tmp_path), log, timeout_s=30, follower=follower) as server:
        key, prefix = server.api_key, server.rid_prefix
        # Any local user can read a process's command line in /proc.
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode()
        assert "--config" in cmdline and key not in cmdline and prefix not in cmdline
        (command,) = logged_commands(log)
        assert key not in command and prefix not in command and "sglang.launch_server" in command
        options_file = Path(command.split("--config ", 1)[1].split()[0])
        assert not options_file.exists()  # read at start-up, then deleted
        # SGLang prints the key into its log: the log is private, and nothing we pass on shows the key.
        assert key in log.read_text()
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        assert key not in caplog.text and "api_key='<redacted>'" in caplog.text
        assert key not in server.log_tail() and "<redacted>" in server.log_tail()
    assert not list(Path(options_file.parent).glob(f"{options_file.name}*"))


def test_a_failed_start_quotes_the_log_without_the_key(fake_sglang, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_EXIT", "3")
    log = tmp_path / "server.log"
    with pytest.raises(ServerError, match="exited with code 3") as err:
        launch_server(capture_config(tmp_path), log, timeout_s=30)
    key = re.search(r"'api_key': '([^']+)'", log.read_text()).group(1)
    assert key not in str(err.value) and "'api_key': '<redacted>'" in str(err.value)
    (command,) = logged_commands(log)
    assert not Path(command.split("--config ", 1)[1].split()[0]).exists()


def test_a_relaunched_server_keeps_its_prefix_and_key(fake_sglang, tmp_path):
    supervisor = ServerSupervisor(capture_config(tmp_path, server={"max_restarts": 1}), tmp_path / "server.log",
                                  timeout_s=30)
    try:
        supervisor.start()
        key, prefix, url, first = supervisor.api_key, supervisor.rid_prefix, supervisor.url, supervisor.handle
        os.killpg(first.process.pid, signal.SIGKILL)
        first.process.wait()
        supervisor.recover()
        assert supervisor.handle is not first and len(fake_sglang) == 2
        # The batches in flight hold the URL, prefix and key: all three still hold.
        assert (supervisor.url, supervisor.rid_prefix, supervisor.api_key) == (url, prefix, key)
        relaunched = supervisor.handle.log_path.read_text().split("\n$ ")[-1]  # what the second server was given
        assert f"'rid_prefix': '{prefix}'" in relaunched and f"'api_key': '{key}'" in relaunched
        assert supervisor.healthy()  # with the key: the fake refuses health checks without it
    finally:
        supervisor.stop()


def test_the_runs_shared_server_starts_with_its_first_stage_and_is_relaunched_through_it(fake_sglang, tmp_path):
    """The pipeline's regeneration and capture share the server the run
    launches (flows/extract.py one_server), named by a token: nothing starts
    until a stage needs it, a stage that finds it dead has it relaunched at
    once, and past its restarts learns so at once, where an attached
    server's stage would wait for an owner. Its key is in no section."""
    launcher = ServerSupervisor(capture_config(tmp_path, server={"max_restarts": 1}), tmp_path / "server.log",
                                timeout_s=30)
    url = share(launcher)
    try:
        section = ServerConfig(model="m", url=url)
        assert section.api_key is None and section.rid_prefix == RID_PREFIX
        first, second = ServerSupervisor(section), ServerSupervisor(section)
        assert not fake_sglang  # a run with nothing to do loads no model
        assert first.start() == second.start() == launcher.url and len(fake_sglang) == 1
        assert (first.api_key, first.rid_prefix) == (launcher.api_key, launcher.rid_prefix)
        for relaunches in (1, 2):
            dead = launcher.handle
            os.killpg(dead.process.pid, signal.SIGKILL)
            dead.process.wait()
            t0 = time.monotonic()
            if relaunches == 1:
                second.recover()
                assert launcher.handle is not dead and len(fake_sglang) == 2 and first.healthy()
            else:
                with pytest.raises(ServerGone, match=r"died again after 1 relaunches"):
                    first.recover()
                assert time.monotonic() - t0 < 5 and len(fake_sglang) == 2
    finally:
        unshare(url)
        launcher.stop()
    with pytest.raises(ValueError, match="that run is over"):  # a stage rerun from the UI after its run
        ServerSupervisor(ServerConfig(model="m", url=url))


def test_attach_mode_takes_the_key_given_or_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert attach_api_key("given") == "given" and attach_api_key(None) == "from-env"
    monkeypatch.delenv(API_KEY_ENV)
    assert attach_api_key(None) is None
    attached = ServerSupervisor(ServerConfig(url="http://127.0.0.1:1"))
    assert attached.rid_prefix == RID_PREFIX and attached.api_key is None  # a server started without either
    # A launched server draws its own; attach-mode values there are a mistake, not a wish.
    with pytest.raises(ValueError, match="server.api_key and server.rid_prefix"):
        ServerSupervisor(capture_config(tmp_path, server={"api_key": "k"}), tmp_path / "log")
    with pytest.raises(ValueError, match="server.api_key and server.rid_prefix"):
        ServerSupervisor(capture_config(tmp_path, server={"rid_prefix": "mine-"}), tmp_path / "log")


@pytest.mark.parametrize("prefix", ["", ".e3-", "e3/../", "x" * 31, None])
def test_an_unusable_rid_prefix_is_refused(prefix, tmp_path):
    with pytest.raises(ValueError, match="rid prefix"):
        check_rid_prefix(prefix)
    with pytest.raises(ValueError, match="rid prefix"):
        ServerSupervisor(ServerConfig(url="http://127.0.0.1:1", rid_prefix=prefix))
    if prefix is not None:  # None in a hook config means "the default"
        # An empty prefix would capture every request, as capture_all does.
        with pytest.raises(ValueError, match="rid prefix"):
            make_capture_hook({"dump_dir": str(tmp_path), "rid_prefix": prefix})


def test_the_hook_ignores_the_public_prefix_when_the_server_has_its_own(tmp_path):
    own = "e3-0123abcd-"
    ours = new_rid("7", own)
    run_hook(tmp_path, ["e3-xyz", "e3-probe-1", ours, "e3-0123abcd"], [2, 2, 3, 1], rid_prefix=own)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{ours}@0.safetensors"]


def test_reset_removes_this_pipelines_dumps_under_any_prefix_and_nothing_else(tmp_path):
    d = tmp_path / "dumps"
    d.mkdir(mode=0o700)
    names = {"e3-0123abcd-1@0.safetensors": True,          # an earlier run's orphan
             ".tmp-e3-0123abcd-2@0.safetensors.4242": True,  # ...and a write it was killed in
             "mine-3@0.safetensors": True,                   # the attached server's own prefix
             ".tmp-mine-4@0.safetensors.17": True,
             "other-5@0.safetensors": False, ".tmp-other-6@0.safetensors.1": False, "e3-notes.txt": False}
    for name in names:
        (d / name).write_bytes(b"x")
    assert reset_dump_dir(d, rid_prefix="mine-") == sum(names.values())
    assert sorted(p.name for p in d.iterdir()) == sorted(n for n, gone in names.items() if not gone)


class FakeSGLangHTTP:
    """SGLang's HTTP side for every client of ours: /health, /server_info,
    /generate as a capture (max_new_tokens 0: writes the rid's dump as the
    hook would, if the rid carries the server's prefix) or as generation. Refuses a request
    without the key (401, as SGLang does) and records every request."""

    def __init__(self, dump_dir: Path, key: str, prefix: str, drop_first_capture: bool = False):
        self.dump_dir, self.key, self.prefix = dump_dir, key, prefix
        self.requests: list[httpx.Request] = []
        self.drop = drop_first_capture

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return httpx.Response(401, json={"error": "Unauthorized"})
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/server_info":  # what regeneration records its answers under
            return httpx.Response(200, json={"dtype": "bfloat16", "tp_size": 1,
                                             "launch_command": "sglang serve --tp 1"})
        body = json.loads(request.content)
        ids, max_new = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        if max_new == 0:
            if self.drop and "-probe-" not in body["rid"]:
                self.drop = False
                raise httpx.ConnectError("connection refused (injected)")
            if body["rid"].startswith(self.prefix):
                n = len(ids)
                write_chunk(self.dump_dir, body["rid"], 0, torch.tensor(ids), torch.zeros(n, 3, 4), torch.zeros(n, 4),
                            [1, 3, 4], "post-norm")
            return httpx.Response(200, json={"meta_info": {"id": body["rid"], "prompt_tokens": len(ids),
                                                           "cached_tokens": 0}})
        return httpx.Response(200, json={"text": "ok", "output_ids": [7] * max_new,
                                         "meta_info": {"id": body.get("rid"), "completion_tokens": max_new}})


@pytest.fixture
def network(monkeypatch, tmp_path):
    """Every httpx client anything makes (however it was built) talks to a
    FakeSGLangHTTP with key K and prefix P."""
    (tmp_path / "dumps").mkdir(mode=0o700)
    fake = FakeSGLangHTTP(tmp_path / "dumps", key="K-" + "x" * 40, prefix="e3-5ca1ab1e-")
    transport = httpx.MockTransport(fake.handle)
    for cls in (httpx.Client, httpx.AsyncClient):
        def init(self, *a, _real=cls.__init__, **kw):
            kw.pop("verify", None)
            _real(self, *a, **{**kw, "transport": transport})
        monkeypatch.setattr(cls, "__init__", init)
    return fake


def capture_a_batch(fake, tmp_path):
    """Warm-up probes, then a batch whose first capture hits a dropped
    connection, so extract_batch asks the server's health before retrying."""
    fake.drop = True
    url, key, prefix = "http://fake", fake.key, fake.prefix
    endpoint = Endpoint(url, fake.dump_dir, (1, 3, 4), api_key=key, rid_prefix=prefix)
    warm_up(endpoint)
    store = tmp_path / "store"
    open_store(store, {"format": FORMAT, "target": {"name": "m"}, "tokenizer": {"sha256": "t"},
                       "aux_layers": {"sglang_layer_output_ids": [1, 3, 4]}, "hidden_size": 4, "dtype": BF16, "max_length": 64,
                       "max_length_policy": "truncate"})
    samples = [Sample(f"s{k}", k, np.arange(3 + k, dtype=np.int32), np.ones(3 + k, dtype=np.uint8)) for k in range(4)]
    result = extract_batch(endpoint, Store.open(store), "data.jsonl", samples, CaptureConfig(concurrency=1))
    assert result.samples == 4 and result.retried == 1 and not result.quarantined
    paths = [r.url.path for r in fake.requests]
    assert paths.count("/health") == 1 and paths.count("/generate") == 3 + 5
    rids = [json.loads(r.content)["rid"] for r in fake.requests if r.url.path == "/generate"]
    assert all(rid.startswith(prefix) for rid in rids), rids


def check_health(fake, tmp_path):
    url, key = "http://fake", fake.key
    assert server_healthy(url, api_key=key)
    attached = ServerSupervisor(ServerConfig(url=url, api_key=key))
    attached.start()
    attached.recover()  # healthy: nothing to do
    handle = ServerHandle(CaptureSpec(ServerConfig(model="m"), dump_dir=tmp_path, api_key=key),
                          SimpleNamespace(poll=lambda: None), url, tmp_path / "server.log")
    wait_healthy(handle, timeout_s=5)
    assert len(fake.requests) == 4


def serve(fake, tmp_path):
    run = asyncio.run(generate_all("http://fake", [[1, 2], [3]], api_key=fake.key, max_new_tokens=2, ignore_eos=True,
                                   concurrency=2, timeout_s=10, tag="plain"))
    assert run.output_ids == [[7, 7], [7, 7]] and len(fake.requests) == 2


def regenerate_answers(fake, tmp_path):
    source = tmp_path / "data.jsonl"
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    tokenizer = SimpleNamespace(apply_chat_template=lambda messages, tokenize=True, **kw: "prompt",
                                decode=lambda ids, **kw: "ok", encode=lambda text, **kw: [9, 9], chat_template="")
    (tmp_path / "config.json").write_text("{}")
    result = regenerate("http://fake", source, tmp_path / "answers", tokenizer, tmp_path,
                        RegenerateConfig(max_new_tokens=2), api_key=fake.key)
    assert result["rows"] == 1 and [r.url.path for r in fake.requests] == ["/server_info", "/generate"]


@pytest.mark.parametrize("calls", [capture_a_batch, check_health, serve, regenerate_answers],
                         ids=lambda f: f.__name__)
def test_every_request_carries_the_servers_api_key(network, tmp_path, calls):
    calls(network, tmp_path)
    assert network.requests
    assert {r.headers.get("Authorization") for r in network.requests} == {f"Bearer {network.key}"}


def test_a_capture_without_the_key_is_refused_and_named(network, tmp_path):
    (out,) = capture_many("http://fake", network.dump_dir, [[1, 2, 3]], lambda i, c: c, rid_prefix=network.prefix)
    assert "HTTP 401" in str(out)
    assert not server_healthy("http://fake", api_key="wrong")


@pytest.mark.server
def test_a_real_server_wants_its_key_and_captures_only_its_own_prefix(capture_server):
    # The session's capture server: launched by launch_server as a run's
    # server is (a random key of its own, its own rid prefix).
    server, dump_dir = capture_server, capture_server.spec.dump_dir
    assert server.api_key not in Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode()
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0}}
    with httpx.Client(timeout=60) as client:
        url = f"{server.url}/generate"
        assert client.post(url, json={**body, "rid": f"{server.rid_prefix}nokey"}).status_code == 401
        assert client.post(url, json={**body, "rid": f"{server.rid_prefix}bad"},
                           headers=auth_headers("wrong-key")).status_code == 401
        public = client.post(url, json={**body, "rid": "e3-xyz"}, headers=auth_headers(server.api_key))
        assert public.status_code == 200 and public.json()["meta_info"]["prompt_tokens"] == 3
    # Attaching with the wrong key says so, not that the answer lacked a field.
    with pytest.raises(ServerError, match=r"/model_info refused the request \(401\): the server wants another API"):
        check_serves(server.url, Path(server.spec.server.model), api_key="wrong-key")
    check_serves(server.url, Path(server.spec.server.model), api_key=server.api_key)
    (refused,) = capture_many(server.url, dump_dir, [[5, 6, 7]], lambda i, c: c.rid, rid_prefix=server.rid_prefix)
    assert "HTTP 401" in str(refused)
    # The hook's writer works in order: once this capture's dump is read
    # back, one for "e3-xyz" would be on disk already.
    (rid,) = capture_many(server.url, dump_dir, [[5, 6, 7, 8]], lambda i, c: c.rid, api_key=server.api_key,
                          rid_prefix=server.rid_prefix)
    assert isinstance(rid, str) and rid.startswith(server.rid_prefix), rid
    # No dump for e3-xyz or the refused requests; capture_many removed its own.
    left = [p.name for p in dump_dir.iterdir() if "e3-xyz" in p.name or p.name.startswith(server.rid_prefix)]
    assert left == [], left
    assert server.api_key not in server.log_tail(400)


def parsed_by_sglang(cfg):
    """The launch command as SGLang's own parser reads it (prepare_server_args),
    with the options file the launcher writes; and that file's mode."""
    import argparse

    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    from tasks.server.launch import build_command, hook_spec
    from tasks.server.run_secrets import write_options_file

    options_file = write_options_file(cfg.api_key, hook_spec(cfg))
    try:
        argv = build_command(cfg, 1234, cpu=True)[3:] + ["--config", str(options_file)]
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        return parser.parse_args(ConfigArgumentMerger(parser).merge_config_with_args(argv)), \
            stat.S_IMODE(options_file.stat().st_mode)
    finally:
        options_file.unlink()


def test_sglang_reads_the_key_and_the_hooks_from_the_options_file(tmp_path):
    """The options file gives the key and the hooks, the command line the rest."""
    from tasks.server.launch import hook_spec

    name = 'd\u00e9j\u00e0 "q"'  # the hook config must survive the trip through YAML whole
    cfg = capture_config(tmp_path, name).with_secrets()
    args, mode = parsed_by_sglang(cfg)
    assert mode == 0o600
    assert args.api_key == cfg.api_key and args.forward_hooks == hook_spec(cfg)
    assert args.forward_hooks[1]["config"] == {"dump_dir": str(tmp_path / name),
                                               "rid_prefix": cfg.rid_prefix, "capture_all": False}
    assert (args.model_path, args.port, args.enable_return_aux_hidden_states) == ("m", 1234, True)


# Each flag build_command sets (or always owns), as a user might give it in
# extra_args, with the server settings and machine where the launcher sets
# it, and the setting the refusal must name.
OWNED = [
    (["--model-path=other"], {}, "server.model"),
    (["--model", "other"], {}, "server.model"),          # SGLang's alias
    (["--model-pa", "other"], {}, "server.model"),       # an abbreviation argparse expands
    (["--host", "0.0.0.0"], {}, "LaunchSpec.host"),
    (["--port", "1"], {}, "LaunchSpec.port"),
    (["--dtype", "float16"], {}, "server.dtype"),
    (["--tp-size", "2"], {}, "server.tp_size"),
    (["--tensor-parallel-size=2"], {}, "server.tp_size"),
    (["--dp-size", "2"], {}, "server.dp_size"),
    (["--data-parallel-size=2"], {}, "server.dp_size"),
    (["--attn-dp-size", "2"], {}, "server.dp_size with server.dp_attention"),
    (["--enable-dp-attention"], {}, "server.dp_attention"),
    (["--max-total-tokens", "1"], {}, "server.max_total_tokens"),
    (["--disable-radix-cache"], {}, "without the prefix cache"),
    (["--enable-return-aux-hidden-states"], {}, "CaptureSpec"),
    (["--return-aux-hidden-state-layer-ids", "1", "2", "3"], {}, "capture.aux_layer_ids"),
    (["--speculative-algorithm", "NGRAM"], {}, "SpeculativeSpec.draft_model_path"),
    (["--speculative-draft-model-path", "d"], {}, "SpeculativeSpec.draft_model_path"),
    (["--speculative-num-steps", "5"], {}, "evaluate.num_steps"),
    (["--speculative-eagle-topk", "2"], {}, "SpeculativeSpec.speculative_eagle_topk"),
    (["--speculative-num-draft-tokens", "8"], {}, "a top-1 chain verifies"),
    (["--forward-hooks", "[]"], {}, "CaptureSpec.capture_module"),
    (["--api-key", "k"], {}, "server.api_key"),
    (["--config", "x.yaml"], {}, "the launcher passes its own --config"),
    (["--chunked-prefill-size", "64"], {"chunked_prefill_size": 128}, "server.chunked_prefill_size"),
    (["--mem-fraction-static", "0.5"], {"mem_fraction_static": 0.8}, "server.mem_fraction_static"),
    (["--sleep-on-idle"], {}, "LaunchSpec.sleep_on_idle"),
    (["--cuda-graph-backend-prefill", "full"], {"cpu": False}, "would skip the capture hook"),
]


@pytest.mark.parametrize("extra, fields, instead", OWNED, ids=lambda v: v[0] if isinstance(v, list) else None)
def test_a_flag_the_launcher_sets_is_refused_in_extra_args_naming_what_to_use(tmp_path, extra, fields, instead):
    from tasks.server.launch import build_command

    fields = dict(fields)
    cpu = fields.pop("cpu", True)
    cfg = capture_config(tmp_path, server={"extra_args": ["--max-running-requests", "8", *extra], **fields})
    flag = extra[0].split("=")[0]
    with pytest.raises(ValueError, match=f"must not set {re.escape(flag)}\\b") as err:
        build_command(cfg, 1234, cpu=cpu)
    assert instead in str(err.value)


@pytest.mark.parametrize("extra, fields", [
    (["--attention-backend", "torch_native"], {}),
    (["--trust-remote-code"], {}),
    (["--chunked-prefill-size", "64"], {}),         # the launcher sets it only from the config
    (["--mem-fraction-static=0.5"], {}),
    (["--forward-hooks", "[]"], {"capture": False}),  # a plain server's hooks are the user's
    (["--speculative-draft-attention-backend", "triton"], {}),
])
def test_a_flag_the_launcher_leaves_alone_passes_through(tmp_path, extra, fields):
    from tasks.server.launch import build_command

    cmd = build_command(capture_config(tmp_path, server={"extra_args": extra}, **fields), 1234, cpu=True)
    assert cmd[-len(extra):] == extra


def test_a_key_whose_random_part_starts_with_a_dash_still_starts_the_server(tmp_path, monkeypatch):
    """SGLang turns the options file into `--api-key KEY`: a key starting with
    '-' read as an option (exit 2, seen once in 64 launches)."""
    import secrets as secrets_module


    monkeypatch.setattr(secrets_module, "token_urlsafe", lambda n: "-" + "x" * (n - 1))
    cfg = capture_config(tmp_path, "d").with_secrets()
    args, _ = parsed_by_sglang(cfg)
    assert args.api_key == cfg.api_key and "-" + "x" * 31 in cfg.api_key


def test_the_launchers_flag_table_names_each_option_as_sglang_spells_it():
    """The table that makes the command line, the refusals and the log's
    summary names each flag exactly as SGLang's parser does, and its option
    as SGLang's own setting: a flag SGLang renamed would otherwise be passed
    to a server that refuses it, or a repeat of it go unrefused."""
    from tasks.server.flags import FLAGS, SHOWN, _sglang_options

    options = _sglang_options()
    assert {f.flag: options.get(f.flag) for f in FLAGS} == {f.flag: f.option for f in FLAGS}
    assert len({f.option for f in FLAGS}) == len(FLAGS) and "api_key" in SHOWN and "host" not in SHOWN
