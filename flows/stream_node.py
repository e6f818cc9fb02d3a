"""Flow `stream_capture_node`: one capture node's side of a stream run on
many nodes. Sent to the node's work queue by the run (flows/stream.py
capture_on_nodes), as the `stream-node` deployment; it loops, one part at a
time, until every part of the run is done:

    lease the next part (it fits in the spool) -> capture it on this node's
    server (an extract subflow, lease renewed meanwhile) -> mark it done

A part it fails goes back in line for any node; MAX_FAILURES in a row and
this node stops (its flow run Failed), leaving the parts to the others.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

from prefect import flow, get_run_logger
from pydantic import Field

from flows.config import described
from flows.extract import extract_hidden_states
from tasks.capture.config import CaptureConfig
from tasks.server.config import ServerConfig
from tasks.server.supervisor import FROM_NODE
from tasks.store.config import StoreConfig
from tasks.store.handle import Store
from tasks.stream.parts import LEASE_S, Part, PartQueue
from tasks.stream.spool import SpoolBudget, TrainerStopped
from tasks.stream.state import trainer_stopped

MAX_FAILURES = 2
SERVER_MODEL = ServerConfig.model_fields["model"]  # the target: the node's server serves it


@contextmanager
def renewing(queue: PartQueue, part: Part, node: str):
    """`node`'s lease of `part`, renewed every LEASE_S / 3 while inside."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(LEASE_S / 3):
            try:
                if not queue.renew(part):
                    get_run_logger().warning("part %d: the lease is no longer %s's", part.seq, node)
                    return
            except Exception as e:  # noqa: BLE001 - the index blinked: the next renewal tries again
                get_run_logger().warning("part %d: lease not renewed (%s: %s)", part.seq, type(e).__name__, e)

    thread = threading.Thread(target=renew, name=f"lease-{part.seq}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@flow(name="stream_capture_node")
@described
def stream_capture_node(
    model: Annotated[str, SERVER_MODEL],
    capture: CaptureConfig,
    store: StoreConfig,
    parent_run: Annotated[str, Field(description="the stream run holding the store: this run writes under its lock")],
    node: Annotated[str, Field(description="this node's name, in the names of the shards it writes")],
    room: Annotated[Optional[int], Field(description="bytes the spool may hold (none: no spool)")] = None,
) -> dict:
    """Capture the parts of a stream run's plan on this node's server, each
    leased from the store's index, until every part is done."""
    log = get_run_logger()
    root = Path(store.path)
    queue = PartQueue(Store.open(root).ledger)
    server = ServerConfig(model=model, url=FROM_NODE)
    budget = SpoolBudget(root, room)
    parts = tokens = failures = 0
    waiting = last_log = None
    started = time.time()
    while True:
        if trainer_stopped(root):
            raise TrainerStopped(f"the stream trainer stopped; {node} stops capturing into {root}, keeping what it "
                                 f"stored: run the pipeline again and both resume")
        part = queue.lease(node, budget)
        if part is None:
            break
        if part in ("wait", "full"):
            waiting = waiting or time.time()
            if part == "full":
                budget.refuse_if_stuck(waiting, f"{room:,} bytes held or in flight")
            if time.time() - (last_log or waiting) >= budget.LOG_EVERY_S:
                last_log = time.time()
                log.info("%s waiting %.0f s: %s", node, last_log - waiting,
                         "the spool is full" if part == "full" else "the parts left are being captured by others")
            time.sleep(budget.WAIT_S)
            continue
        waiting = last_log = None
        into = store.model_copy(update={"path": str(part.store(root))})
        try:
            with renewing(queue, part, node):
                extract_hidden_states(server=server, capture=capture, store=into, verify=False, rows=list(part.rows),
                                      parent_run=parent_run, node=node)
        except Exception as e:
            queue.release(part, f"{type(e).__name__}: {e}")
            failures += 1
            if failures >= MAX_FAILURES:
                raise
            log.warning("part %d failed on %s (%s: %s); it goes back in line", part.seq, node, type(e).__name__, e)
            continue
        failures = 0
        if not queue.done(part):
            log.warning("part %d: %s stored it, but its lease was lost meanwhile (it ran out, or the run was planned "
                        "again): the node holding it now marks it done", part.seq, node)
            continue
        parts, tokens = parts + 1, tokens + part.tokens
        log.info("part %d (epoch %d, %d samples) stored by %s; %d parts, %s tokens at %.0f tok/s on this node",
                 part.seq, part.epoch + 1, len(part.rows), node, parts, f"{tokens:,}",
                 tokens / max(1e-9, time.time() - started))
    return {"node": node, "parts": parts, "tokens": tokens}
