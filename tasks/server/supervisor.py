"""The capture server of one run, kept serving: launched (and relaunched
after a crash) or attached to by URL."""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from pathlib import Path

from pydantic import SecretStr

from tasks.capture.config import CaptureConfig
from tasks.server.config import API_KEY_ENV, ServerConfig, revealed
from tasks.server.launch import LaunchSpec, ServerHandle, launch_server, stop_server
from tasks.server.server_log import LogFollower
from tasks.sglang_api import ServerError, ServerGone, ServerStopped, server_healthy

logger = logging.getLogger("eagle3.server")

# A node's capture server, as its worker's environment describes it
# (tasks/server/node.py sets these): the child runs of a fanned-out
# extraction (flows/extract_nodes.py) are sent to a node's work queue with
# server.url "env", so each finds its own node's server and reads the dumps
# on the node that wrote them.
NODE_ENV = {"url": "EAGLE3_SERVER_URL", "dump_dir": "EAGLE3_DUMP_DIR", "rid_prefix": "EAGLE3_RID_PREFIX",
            "wait_s": "EAGLE3_SERVER_WAIT_S"}
FROM_NODE = "env"

# A server one run launches for several of its stages (the pipeline's
# regeneration and capture: one model load). The stages' sections name it
# by a token, server.url "run:<token>": the first stage that needs it
# starts it (a run with nothing left to do loads no model), and a stage that
# finds it down has it relaunched, or learns at once it is gone. Its URL,
# key and rid prefix stay in this process: no stage's parameters hold them.
RUN_SERVER = "run:"
_SHARED: dict[str, "ServerSupervisor"] = {}


def share(launcher: "ServerSupervisor") -> str:
    """The server.url the run's stages name `launcher` (not started) by."""
    url = f"{RUN_SERVER}{secrets.token_hex(8)}"
    _SHARED[url] = launcher
    return url


def unshare(url: str) -> None:
    _SHARED.pop(url, None)


def node_sections(server: ServerConfig, capture: CaptureConfig) -> tuple[ServerConfig, CaptureConfig]:
    """The sections as given, or for server.url "env" this node's server:
    its URL, rid prefix and API key, and its dump dir, from the
    environment."""
    if server.url != FROM_NODE:
        return server, capture
    return node_server(server), capture.model_copy(update={"dump_dir": os.environ[NODE_ENV["dump_dir"]]})


def node_server(server: ServerConfig) -> ServerConfig:
    """The section as given, or for server.url "env" this node's server
    (its URL, rid prefix and API key) from the environment: a regeneration's
    child asks the node's capture server, which serves requests outside its
    rid prefix without capturing them."""
    if server.url != FROM_NODE:
        return server
    missing = [v for v in NODE_ENV.values() if not os.environ.get(v)]
    if missing:
        raise ValueError(f"server.url is {FROM_NODE!r} but ${', $'.join(missing)} is not set on this node: start "
                         f"the node with `python -m flows.node`, which sets it for its worker")
    return server.model_copy(update={"url": os.environ[NODE_ENV["url"]],
                                     "rid_prefix": os.environ[NODE_ENV["rid_prefix"]],
                                     "api_key": os.environ.get(API_KEY_ENV),
                                     "attach_wait_s": float(os.environ[NODE_ENV["wait_s"]])})


def attach_api_key(given: SecretStr | None) -> str | None:
    """The API key for an attached server: `given`, else $EAGLE3_API_KEY,
    else none (a server started without --api-key)."""
    return revealed(given) or os.environ.get(API_KEY_ENV) or None


class ServerSupervisor:
    """The capture server of one run: launched by the run, or attached by URL.

    Given a LaunchSpec, it launches that server and relaunches it (same port,
    same dump dir, same secrets) after a crash, at most server.max_restarts
    times. Given a server section with a url, it attaches to that server,
    which it only checks, since its owner must restart it. The run hands the
    supervisor to its batch tasks, which call `recover()` when the server
    stops answering.

    `api_key` and `rid_prefix` are what every request to the server carries
    and starts its rid with: a launched server's own (random, kept across
    relaunches), or for an attached server what its owner started it with
    (the section's; the key by default from $EAGLE3_API_KEY).
    """

    def __init__(self, target: LaunchSpec | ServerConfig, log_path: Path | None = None, *,
                 timeout_s: float = 600.0):
        # A stage of a run on the run's shared server: everything through it.
        self._shared = None
        if isinstance(target, ServerConfig) and (target.url or "").startswith(RUN_SERVER):
            self._shared = _SHARED.get(target.url)
            if self._shared is None:
                raise ValueError(f"server.url {target.url!r} names a server the pipeline run that launched it "
                                 f"shares with its stages, and that run is over: leave server.url unset to launch "
                                 f"one, or give the URL of a running server")
        if isinstance(target, ServerConfig):
            if target.url is None:
                raise ValueError("this server section has no url to attach to: give a LaunchSpec of it to launch "
                                 "a server instead")
            self.spec, self.attach_url, self.max_restarts = None, target.url, 0
            self._attach_key, self._attach_prefix = attach_api_key(target.api_key), target.rid_prefix
            self.attach_wait_s = target.attach_wait_s
        else:
            self.spec, self.attach_url, self.max_restarts = target, None, target.server.max_restarts
            self.attach_wait_s = 0.0
        self.log_path, self.timeout_s = log_path, timeout_s
        self.restarts = 0
        self.handle: ServerHandle | None = None
        self.follower = LogFollower(log_path) if log_path else None
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def url(self) -> str:
        if self._shared:
            return self._shared.url
        return self.attach_url or (self.handle.url if self.handle else "(a server not started yet)")

    @property
    def api_key(self) -> str | None:
        if self._shared:
            return self._shared.api_key
        return self._attach_key if self.attach_url else self.handle.api_key

    @property
    def rid_prefix(self) -> str:
        if self._shared:
            return self._shared.rid_prefix
        return self._attach_prefix if self.attach_url else self.handle.rid_prefix

    def start(self) -> str:
        if self._shared:
            return self._shared.start_once()
        if self.attach_url is None:
            self.handle = launch_server(self.spec, self.log_path, timeout_s=self.timeout_s, follower=self.follower)
            # A relaunch reuses the port, rid prefix and API key (the
            # launched spec holds them), so what the batches hold stays valid.
            self.spec = dataclasses.replace(self.handle.spec, port=int(self.handle.url.rsplit(":", 1)[1]))
        elif not self.healthy():
            if not self.attach_wait_s:
                raise ServerError(f"no healthy SGLang server at {self.attach_url}")
            self._wait_attached()  # its owner may be relaunching it
        return self.url

    def start_once(self) -> str:
        """A launched server started by the first of the stages that call
        this; the others find it running."""
        with self._lock:
            self._check_running()
            if self.handle is None:
                self.start()
                if self._stopped:  # stop() came while it started: it found no handle to stop
                    stop_server(self.handle)
                    self._check_running()
                return self.url
        if not self.healthy():  # died between stages: relaunched now, not at the next stage's first batch
            self.recover()
        return self.url

    def healthy(self) -> bool:
        if self._shared:
            return self._shared.healthy()
        if self.handle is not None and not self.handle.alive():
            return False
        return server_healthy(self.url, api_key=self.api_key)

    def recover(self) -> None:
        """Make the server serve again, or raise ServerError saying why not
        (ServerStopped once the run has stopped it)."""
        self._check_running()  # a stage its run stopped relaunches nothing, shared or not
        if self._shared:
            self._shared.recover()
            return
        with self._lock:
            self._check_running()
            if self.healthy():
                return
            if self.attach_url is not None:
                self._wait_attached()
                return
            if self.restarts >= self.max_restarts:
                raise ServerGone(f"the SGLang server at {self.url} died again after {self.restarts} relaunches "
                                 f"(server.max_restarts {self.max_restarts}); the run stops, its committed batches "
                                 f"kept. Last log lines:\n"
                                 + self.handle.log_tail())
            self.restarts += 1
            logger.warning("SGLang server at %s is down (exit code %s); relaunching (%d of at most %d). "
                           "Last log lines:\n%s", self.url, self.handle.process.poll(), self.restarts,
                           self.max_restarts, self.handle.log_tail(15))
            stop_server(self.handle)
            self.handle = launch_server(self.spec, self.log_path, timeout_s=self.timeout_s, follower=self.follower)
            if self._stopped:  # stop() came while it started: it stopped the old one
                stop_server(self.handle)
                self._check_running()
            logger.warning("SGLang server relaunched at %s", self.url)

    def _wait_attached(self) -> None:
        """Up to attach_wait_s for the attached server to answer again (a
        node's supervisor relaunching it), or ServerError."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.attach_wait_s:
            time.sleep(min(2.0, self.attach_wait_s))
            self._check_running()
            if self.healthy():
                logger.warning("the attached SGLang server at %s answers again after %.0f s", self.attach_url,
                               time.monotonic() - t0)
                return
        # Without a wait (attach_wait_s 0) a silence may be a busy moment: the
        # batch's retries ride it out. After a wait, the server is gone.
        gone = ServerGone if self.attach_wait_s else ServerError
        raise gone(f"the attached SGLang server at {self.attach_url} is not answering"
                          + (f" (waited {self.attach_wait_s:.0f} s)" if self.attach_wait_s else "")
                          + "; restart it, then retry the run (stored batches are kept)")

    def _check_running(self) -> None:
        if self._stopped:
            raise ServerStopped(f"the SGLang server at {self.url} was stopped by its run; not relaunched")

    def forward_log(self, log: logging.Logger) -> None:
        if self._shared:
            self._shared.forward_log(log)
        elif self.follower is not None:
            self.follower.forward(log)

    def stop(self) -> None:
        """Stop a launched server for good: the batches still running find
        it gone and end (ServerStopped) instead of relaunching it."""
        if self._stopped:
            return  # once: its pid, reaped, may be another process's by now
        self._stopped = True
        if self.handle is not None:
            stop_server(self.handle)
