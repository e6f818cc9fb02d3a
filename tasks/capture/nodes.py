"""Extraction (and regeneration) across many nodes: the parent run's
share-out of the dataset to node work queues (the child runs it starts and
watches there, through Prefect, are flows/node_runs.py's). A regeneration's
children run flows/regenerate.py on the nodes' servers the same way, with
its answers index in PostgreSQL (flows/regenerate_nodes.py).

One node = one Prefect worker on its own work queue, beside one long-lived
capture server (tasks/server/node.py starts both). The parent plans once,
cuts the plan into shares of rows and hands them out one share per node at a
time; each share runs as a child flow run of the `extract` deployment sent to
that node's queue (`run_deployment(..., work_queue_name=)`), which captures on
the node's own server and commits shards to the shared store. No router sits
in front of the servers: a dump must be read on the node that wrote it, and a
router's retry could capture a sample twice on another one.

A share whose child run does not complete (Failed, Crashed, Cancelled, or
never started by a worker) goes back to the front of the line for the other
nodes, never to a node that failed it while a healthy node that did not is
left; the ledger, not the child's report, says what it had stored, and the
next child stores only the rest. A node that fails `max_node_failures` shares
in a row is drained: given nothing more, with the reason logged. A child on
a node that died stays Running in Prefect unless something marks it Crashed:
flow-run heartbeats and the automation flows/node_runs.py creates.
Every share a node takes is handed back, whatever happens while its child
runs (`feed_node`), and every wait is bounded: no node thread, and so no
parent, can wait for a share that nobody holds.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from tasks.store.lock import LockHeld

# How long a node thread sleeps at most before it looks at the line again
# (it is woken at once when a share finishes; this only bounds the wait).
WAIT_S = 30.0
# What a child refused because its node's dump dir is held says first: an
# earlier child still runs there (one the heartbeat automation marked
# Crashed while it lived, a SIGSTOPped one). The node is busy, not failing.
NODE_BUSY = "node busy with an earlier child run"


class NodeBusy(LockHeld):
    """A child run refused: its node's dump dir is held by another run."""


@dataclass(frozen=True)
class Share:
    """One child run's share: dataset rows, with their planned size."""

    index: int
    rows: tuple[int, ...]
    samples: int
    tokens: int


class Dispatcher:
    """Hands shares of the plan to nodes, one at a time per node, and takes
    back the shares whose run failed. Thread-safe: each node is served by
    its own thread (a Prefect task of the parent run).

    Shares shrink as the plan runs out (guided self-scheduling): each is
    half of what is left per healthy node, in whole batches, and never less
    than `min_share` samples. A child run costs a fixed start-up (a process,
    imports, its plan, attaching and warming up: ~10 s, bench/many_nodes.py),
    so early shares are large to make it negligible, and the last ones small
    so that no node is left with a long tail while the others idle."""

    def __init__(self, samples: list, nodes: list[str], max_node_failures: int, *, min_share: int,
                 batch_size: int = 1, busy_limit_s: float = 600.0):
        if not nodes:
            raise ValueError("no node queues to send work to: give at least one work queue")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"node queues must be distinct, got {nodes}")
        self._pending = deque(samples)
        self._returned: deque[Share] = deque()
        self._failed_on: dict[int, set[str]] = {}  # share index -> nodes whose child runs of it failed
        self._cut_so_far = 0
        self._in_flight = 0
        self._cond = threading.Condition()
        self.nodes = list(nodes)
        self.min_share, self.batch_size = max(1, min_share), max(1, batch_size)
        self.max_node_failures = max_node_failures
        self.busy_limit_s = busy_limit_s
        self._busy_since: dict[str, float] = {}
        self.failures_in_a_row = {n: 0 for n in nodes}
        self.done: dict[str, list[Share]] = {n: [] for n in nodes}
        self.drained: dict[str, str] = {}

    def _cut(self) -> Share:
        healthy = len(self.nodes) - len(self.drained)
        size = max(self.min_share, -(-len(self._pending) // (2 * healthy)))
        size = -(-size // self.batch_size) * self.batch_size
        share = [self._pending.popleft() for _ in range(min(size, len(self._pending)))]
        # A share is rows: a row's samples (one per group of its turns) go together.
        while share and self._pending and self._pending[0].source_row == share[-1].source_row:
            share.append(self._pending.popleft())
        self._cut_so_far += 1
        # Planned tokens where the plan knows them (a capture's samples); a
        # regeneration's conversations are measured only once answered: 0.
        return Share(self._cut_so_far - 1, tuple(dict.fromkeys(s.source_row for s in share)), len(share),
                     sum(getattr(s, "num_tokens", 0) for s in share))

    def _returned_for(self, node: str) -> Share | None:
        """The first returned share `node` may take: one it has not failed,
        or one every healthy node has failed (nobody else will take it)."""
        healthy = {n for n in self.nodes if n not in self.drained}
        for share in self._returned:
            failed = self._failed_on.get(share.index, set())
            if node not in failed or healthy <= failed:
                return share
        return None

    def take(self, node: str) -> Share | None:
        """The next share for `node`; None once there is none left for it
        (all done, or the node drained). While other nodes still run shares
        that may come back, it waits."""
        with self._cond:
            while True:
                if node in self.drained:
                    return None
                share = self._returned_for(node)
                if share is not None:
                    self._returned.remove(share)
                    self._in_flight += 1
                    return share
                if self._pending:
                    self._in_flight += 1
                    return self._cut()
                if self._in_flight == 0 and not self._returned:
                    return None
                self._cond.wait(WAIT_S)

    def finished(self, node: str, share: Share, error: str | None, *, busy: bool = False) -> None:
        """`node` finished `share`: completed (error None) or not (why).
        `busy`: its child was refused because an earlier child still holds
        the node (NODE_BUSY). That is no failure of the node or the share:
        the share goes back for any node, this one included, and the node is
        drained only once it has been busy for `busy_limit_s`."""
        with self._cond:
            self._in_flight -= 1
            if busy:
                self._returned.appendleft(share)
                now = time.monotonic()
                busy_for = now - self._busy_since.setdefault(node, now)
                if busy_for >= self.busy_limit_s:
                    self.drained[node] = (f"busy with an earlier child run for {busy_for:.0f} s "
                                          f"(the last refusal: {error})")
                self._cond.notify_all()
                return
            self._busy_since.pop(node, None)
            if error is None:
                self.failures_in_a_row[node] = 0
                self.done[node].append(share)
            else:
                self.failures_in_a_row[node] += 1
                self._failed_on.setdefault(share.index, set()).add(node)
                self._returned.appendleft(share)  # first in line for the nodes that did not fail it
                if self.failures_in_a_row[node] >= self.max_node_failures:
                    self.drained[node] = (f"{self.failures_in_a_row[node]} shares failed in a row there, "
                                          f"the last: {error}")
            self._cond.notify_all()

    @property
    def left(self) -> int:
        """Samples no node completed (every node drained before they ran)."""
        with self._cond:
            return sum(g.samples for g in self._returned) + len(self._pending)


def feed_node(queue: str, dispatcher: Dispatcher, run_share: Callable[[Share, int], tuple[str | None, str]],
              log: logging.Logger | logging.LoggerAdapter, on_progress: Callable[[], None] = lambda: None,
              busy_wait_s: float | None = None) -> dict:
    """Feed one node its shares until none is left for it. `run_share(share,
    n)` runs the node's n-th share and returns (error or None, the child
    run's name); whatever it raises, the share is handed back to the
    dispatcher (never left counted in flight, which would keep every other
    node waiting for it) and the node goes on with the next one. A progress
    update that raises is logged, never the end of the node's thread: that
    would leave its remaining shares to the others and its report lost. A
    child refused because the node is busy (NODE_BUSY) hands its share back
    uncounted and the node waits `busy_wait_s` before it takes another: by
    default a quarter of the dispatcher's busy limit (at most WAIT_S), so a
    busy node is tried four times at least before it is drained."""
    if busy_wait_s is None:
        busy_wait_s = min(WAIT_S, dispatcher.busy_limit_s / 4)
    samples = tokens = runs = 0
    while (share := dispatcher.take(queue)) is not None:
        runs += 1
        t0 = time.monotonic()
        error, name = f"share {share.index} on {queue}: its child run was never seen to end", "?"
        busy = False
        try:
            error, name = run_share(share, runs)
            busy = error is not None and NODE_BUSY in error
        except Exception as e:  # noqa: BLE001 - any failure hands the share back; the reason is logged
            error = f"watching its child run failed: {type(e).__name__}: {e}"
        finally:
            dispatcher.finished(queue, share, error, busy=busy)
        seconds = time.monotonic() - t0
        if busy and queue not in dispatcher.drained:
            log.warning("share %d: %s is still busy (%s); the share goes back, not counted as a failure, and "
                        "%s is tried again in %.0f s", share.index, queue, error, queue, busy_wait_s)
            time.sleep(busy_wait_s)
        elif error is None:
            samples, tokens = samples + share.samples, tokens + share.tokens
            rate = f", {share.tokens:,} tokens ({share.tokens / max(seconds, 1e-9):.0f} tok/s)" if share.tokens else ""
            log.info("share %d on %s: %d rows%s in %.0f s [%s]", share.index, queue, share.samples, rate, seconds,
                     name)
        else:
            log.warning("share %d on %s did not complete (%s); it goes back in line, first for the other nodes",
                        share.index, queue, error)
        if queue in dispatcher.drained:
            log.error("node %s drained: %s. Its shares go to the other nodes", queue, dispatcher.drained[queue])
        try:
            on_progress()
        except Exception as e:  # noqa: BLE001 - a progress bar (a Prefect API or index read) never stops a node
            log.warning("could not update the progress after share %d (%s: %s); the node goes on",
                        share.index, type(e).__name__, e)
    return {"queue": queue, "samples": samples, "tokens": tokens, "drained": dispatcher.drained.get(queue)}
