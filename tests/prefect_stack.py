"""A real Prefect stack for tests, driven as a user drives it: processes
started in their own process groups, the CLI, and the few REST calls the
tests need."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).with_name("prefect"))
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}

# ------------------------------------------------------------------ processes

def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    """Start a process in its own process group (so teardown reaches its
    children too: the worker's flow-run processes, the server's services)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "ab")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGINT to the group (the worker and the server shut down cleanly on
    it), then SIGKILL to whatever is left of the group."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def stop_node(node: dict) -> None:
    """A node: SIGINT (its worker, then its server, stop cleanly; the worker
    waits up to 30 s for its runs), then its server's own group, which a
    SIGKILL of the node's group does not reach (the server has its own
    session): a node killed hard must not leave its server running."""
    record = Path(node.get("logs", "")) / "sglang-server.pid"  # a relaunched server's, if the node left it
    relaunched = json.loads(record.read_text())["pid"] if node.get("logs") and record.exists() else None
    stop(node["proc"], grace_s=60.0)
    for pid in {node.get("server_pid"), relaunched} - {None}:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_processes(run_id: str) -> list[int]:
    """The processes running flow run `run_id` (a worker starts each flow
    run in a process of its own, with the run's id in its environment)."""
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"PREFECT__FLOW_RUN_ID={run_id}".encode() in environ.read_bytes().split(b"\0"):
                pids.append(int(environ.parent.name))
        except (OSError, ProcessLookupError):
            continue
    return pids


def cli(args: list[str], env: dict, timeout_s: float = 180.0) -> str:
    done = subprocess.run([PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"prefect {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def log_tail(path: Path, n: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


# ------------------------------------------------------------------ REST API

class Api:
    """The few Prefect REST calls the tests need, against one server (never
    the session's harness, whose settings may be active in this process)."""

    def __init__(self, url: str):
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=30.0)

    def call(self, method: str, path: str, body=None):
        # 429/502/503 are Prefect's "retry me" answers (a busy SQLite answers
        # 503 while locked); Prefect's own client retries them with backoff,
        # and so must anything that drives the API as a user's tools do.
        for attempt in range(6):
            if attempt:
                time.sleep(0.5 * 2 ** (attempt - 1))
            r = self.http.request(method, path, json=body)
            if r.status_code not in (429, 502, 503):
                break
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path} -> {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None

    def create_flow_run(self, deployment_id: str, body: dict) -> dict:
        """A run of the deployment, exactly one even if a retried POST had
        reached the server: the idempotency key makes a repeat return it."""
        key = {"idempotency_key": str(uuid.uuid4())}
        return self.call("POST", f"/deployments/{deployment_id}/create_flow_run", {**body, **key})

    def deployment(self, name: str) -> dict:
        return self.call("GET", f"/deployments/name/{name}")

    def flow_run(self, run_id: str) -> dict:
        return self.call("GET", f"/flow_runs/{run_id}")

    def flow_run_states(self, run_id: str) -> list[str]:
        return [s["name"] for s in self.call("GET", f"/flow_run_states/?flow_run_id={run_id}")]

    def task_runs(self, run_id: str) -> list[dict]:
        return self.call("POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}, "sort": "EXPECTED_START_TIME_ASC"})

    def logs(self, run_id: str) -> list[str]:
        out, offset = [], 0
        while True:
            page = self.call("POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}},
                                                      "sort": "TIMESTAMP_ASC", "offset": offset, "limit": 200})
            out += [entry["message"] for entry in page]
            if len(page) < 200:
                return out
            offset += 200

    def logs_once(self, run_id: str, ready, timeout_s: float = 60.0) -> list[str]:
        """The run's logs once `ready(logs)` holds. A flow-run process ships
        its logs in batches and may still send some after the run's state
        turned terminal; a last read 3 s later takes in any stragglers."""
        deadline = time.monotonic() + timeout_s
        while not ready(self.logs(run_id)) and time.monotonic() < deadline:
            time.sleep(1.0)
        time.sleep(3.0)
        return self.logs(run_id)

    def artifacts(self, run_id: str) -> list[dict]:
        return self.call("POST", "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})

    def runs_of(self, deployment_id: str) -> list[dict]:
        return self.call("POST", "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment_id]}}})

    def retry_like_the_ui(self, run_id: str) -> dict:
        """What the Retry button of Prefect 3.9's UI sends (ui-v2 bundle,
        flow-run page: setFlowRunState({type: SCHEDULED, name: AwaitingRetry,
        message: "Retry from the UI"}, force: true)). The worker then picks
        the scheduled run up again."""
        return self.call("POST", f"/flow_runs/{run_id}/set_state", {
            "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}, "force": True})

    def cancel_like_the_ui(self, run_id: str) -> dict:
        """What the Cancel button of Prefect 3.9's UI sends (ui-v2 bundle,
        cancel dialog: setFlowRunState({type: CANCELLING, name: Cancelling},
        force: true)). The worker then stops the run's process."""
        return self.call("POST", f"/flow_runs/{run_id}/set_state", {
            "state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True})

    def wait_terminal(self, run_id: str, timeout_s: float, after: str | None = None, logs: list[Path] = ()) -> dict:
        """Poll until the run is terminal (and, with `after`, has left the
        state with that id: a retried run is terminal until the worker takes it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = self.flow_run(run_id)
            if run["state_type"] in TERMINAL and (after is None or run["state_id"] != after):
                return run
            time.sleep(1.0)
        tails = "\n".join(f"--- {p}:\n{log_tail(p)}" for p in logs)
        raise AssertionError(f"flow run {run_id} still {run['state_name']} after {timeout_s:.0f} s\n{tails}")


def prefect_server(home: Path, log: Path, database_url: str | None = None) -> tuple[subprocess.Popen, Api, dict]:
    """A Prefect server on a free loopback port (temporary home, telemetry
    off; its database SQLite in `home`, or `database_url`), once healthy:
    the process, an Api on it, and the environment that reaches it."""
    from tasks.server.launch import free_port

    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({
        "PREFECT_HOME": str(home), "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1",
        "EAGLE3_REPO": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
    })
    if database_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
    return start_prefect_server(env, log), Api(api_url), env


def start_prefect_server(env: dict, log: Path) -> subprocess.Popen:
    """The Prefect server `env` names (its port and database), once healthy:
    prefect_server's, or the same one again after it was stopped."""
    api_url = env["PREFECT_API_URL"]
    server = start([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", env["PREFECT_SERVER_API_PORT"]],
                   env, log)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            stop(server)
            raise RuntimeError(f"Prefect server did not start:\n{log_tail(log)}")
        time.sleep(0.5)
    return server


def prefect_database(postgres_url: str) -> str:
    """A database `prefect` beside `postgres_url`'s, for Prefect's server:
    its asyncpg URL."""
    import psycopg

    with psycopg.connect(postgres_url, autocommit=True) as db:
        db.execute("CREATE DATABASE prefect")
    return postgres_url.replace("postgresql://", "postgresql+asyncpg://").rsplit("/", 1)[0] + "/prefect"


def start_node(queue: str, model: str, env: dict, root: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """`python -m flows.node` for `queue` (dump dir and logs under `root`;
    `args` more of its keys, e.g. server settings); wait_node() says when
    it is up."""
    out = root / f"{queue}.out"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    proc = start([sys.executable, "-m", "flows.node", "--queue", queue, "--server.model", model,
                  "--dump-dir", str(root / f"dumps-{queue}"), "--log-dir", str(root / queue), *args], env, out)
    return proc, out


def wait_node(proc: subprocess.Popen, out: Path, timeout_s: float = 600) -> dict:
    """The node's record (queue, server_url, server_pid, worker_pid, logs)
    once it has printed it."""
    def record() -> dict | None:  # its one JSON line, among its log lines
        lines = [line for line in out.read_text().splitlines() if line.startswith('{"queue"')]
        return json.loads(lines[0]) if lines else None

    deadline = time.monotonic() + timeout_s
    while record() is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"node did not start:\n{log_tail(out)}")
        time.sleep(1)
    return {"proc": proc, **record()}


def secrets_found(api: Api, secrets: list[str], *dirs: Path) -> list[str]:
    """Where any of `secrets` appears: in a flow run's parameters, an
    artifact, a log line or a deployment Prefect holds (read back through
    its API, every page), or in a file under `dirs` (kept configs, logs,
    the store's records). Empty when it appears nowhere."""
    assert secrets and all(len(s) >= 8 for s in secrets), "a secret to look for, long enough not to match by chance"
    found = []
    for kind, path in (("flow run", "/flow_runs/filter"), ("artifact", "/artifacts/filter"),
                       ("log", "/logs/filter"), ("deployment", "/deployments/filter")):
        offset = 0
        while True:
            page = api.call("POST", path, {"limit": 200, "offset": offset})
            for record in page:
                text = json.dumps(record)
                found += [f"{kind} {record.get('name') or record.get('key') or record.get('id')}: holds secret {i}"
                          for i, s in enumerate(secrets) if s in text]
            if len(page) < 200:
                break
            offset += 200
    for d in dirs:
        for f in Path(d).rglob("*"):
            if f.is_file() and not f.is_symlink():
                data = f.read_bytes()
                found += [f"{f}: holds secret {i}" for i, s in enumerate(secrets) if s.encode() in data]
    return found
