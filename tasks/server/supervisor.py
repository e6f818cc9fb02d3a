"""The capture server of one run, kept serving: launched (and relaunched
after a crash) or attached to by URL."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from tasks.capture.dump import RID_PREFIX, check_rid_prefix
from tasks.server.launch import LogFollower, ServerConfig, ServerError, ServerHandle, launch_server, \
    server_healthy, stop_server

logger = logging.getLogger("eagle3.server")

# Where the key of a server the user started with --api-key comes from when
# no key is given: unlike a flow parameter, it is not stored with the run.
API_KEY_ENV = "EAGLE3_API_KEY"


# A node's capture server, as its worker's environment describes it: the
# child runs of a fanned-out extraction (flows/extract_nodes.py) are sent to
# a node's work queue with "env" for these, so each finds its own node's
# server and reads the dumps on the node that wrote them.
NODE_ENV = {"server_url": "EAGLE3_SERVER_URL", "dump_dir": "EAGLE3_DUMP_DIR", "server_rid_prefix": "EAGLE3_RID_PREFIX"}


def from_node_env(parameter: str, value: str | None) -> str | None:
    """`value`, or for "env" the node's setting in its environment."""
    if value != "env":
        return value
    found = os.environ.get(NODE_ENV[parameter])
    if not found:
        raise ValueError(f"{parameter} is 'env' but ${NODE_ENV[parameter]} is not set on this node: start the "
                         f"node with `python -m tasks.server.node`, which sets it for its worker")
    return found


def attach_api_key(given: str | None) -> str | None:
    """The API key for an attached server: `given`, else $EAGLE3_API_KEY,
    else none (a server started without --api-key)."""
    return given or os.environ.get(API_KEY_ENV) or None


class ServerSupervisor:
    """The capture server of one run: launched by the run, or attached by URL.

    A server the run launched is relaunched (same port, same dump dir) after a
    crash, at most `max_restarts` times; an attached server is only checked,
    since its owner must restart it. The run hands the supervisor to its
    batch tasks, which call `recover()` when the server stops answering.

    `api_key` and `rid_prefix` are what every request to the server carries
    and starts its rid with: a launched server's own (random, kept across
    relaunches), or for an attached server what its owner started it with.
    """

    def __init__(self, cfg: ServerConfig | None = None, log_path: Path | None = None, *,
                 attach_url: str | None = None, api_key: str | None = None, rid_prefix: str = RID_PREFIX,
                 max_restarts: int = 2, timeout_s: float = 600.0):
        if (cfg is None) == (attach_url is None):
            raise ValueError("give either a server config to launch or a URL to attach to")
        if cfg is not None and (api_key is not None or rid_prefix != RID_PREFIX):
            raise ValueError("api_key and rid_prefix (flow parameters server_api_key, server_rid_prefix) are for "
                             "attaching to a server you started (server_url); a launched server draws its own")
        self.cfg, self.log_path, self.attach_url = cfg, log_path, attach_url
        self._attach_key, self._attach_prefix = api_key, check_rid_prefix(rid_prefix)
        self.max_restarts, self.timeout_s = max_restarts, timeout_s
        self.restarts = 0
        self.handle: ServerHandle | None = None
        self.follower = LogFollower(log_path) if log_path else None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.attach_url or self.handle.url

    @property
    def api_key(self) -> str | None:
        return self._attach_key if self.attach_url else self.handle.api_key

    @property
    def rid_prefix(self) -> str:
        return self._attach_prefix if self.attach_url else self.handle.rid_prefix

    def start(self) -> str:
        if self.attach_url is None:
            self.handle = launch_server(self.cfg, self.log_path, timeout_s=self.timeout_s, follower=self.follower)
            # A relaunch reuses the port, rid prefix and API key (the
            # launched config holds them), so what the batches hold stays valid.
            self.cfg = self.handle.config
            self.cfg.port = int(self.handle.url.rsplit(":", 1)[1])
        elif not self.healthy():
            raise ServerError(f"no healthy SGLang server at {self.attach_url}")
        return self.url

    def healthy(self) -> bool:
        if self.handle is not None and not self.handle.alive():
            return False
        return server_healthy(self.url, api_key=self.api_key)

    def recover(self) -> None:
        """Make the server serve again, or raise ServerError saying why not."""
        with self._lock:
            if self.healthy():
                return
            if self.attach_url is not None:
                raise ServerError(f"the attached SGLang server at {self.attach_url} is not answering; "
                                  "restart it, then retry the run (stored batches are kept)")
            if self.restarts >= self.max_restarts:
                raise ServerError(f"SGLang server died again after {self.restarts} relaunches; last log lines:\n"
                                  + self.handle.log_tail())
            self.restarts += 1
            logger.warning("SGLang server at %s is down (exit code %s); relaunching (%d of at most %d). "
                           "Last log lines:\n%s", self.url, self.handle.process.poll(), self.restarts,
                           self.max_restarts, self.handle.log_tail(15))
            stop_server(self.handle)
            self.handle = launch_server(self.cfg, self.log_path, timeout_s=self.timeout_s, follower=self.follower)
            logger.warning("SGLang server relaunched at %s", self.url)

    def forward_log(self, log: logging.Logger) -> None:
        if self.follower is not None:
            self.follower.forward(log)

    def stop(self) -> None:
        if self.handle is not None:
            stop_server(self.handle)
