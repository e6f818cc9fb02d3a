"""Start one extraction node (tasks/server/node.py): a long-lived capture
server on the server section's settings and a Prefect worker on the node's
own work queue, for the child runs of `extract_across_nodes`.

    python -m flows.node --queue node-a --server.model /models/kimi-k2.5 --server.tp-size 8 \\
        --server.dp-size 8 --server.dp-attention
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

from pydantic import Field

from tasks.capture.config import CaptureConfig
from tasks.server.config import ServerConfig
from tasks.server.node import node_launch, run_node
from tasks.store.shards import WRITER_NAME

CAPTURE = CaptureConfig.model_fields


def node(
    queue: Annotated[str, Field(description="this node's work queue (and its name in the shards it writes)",
                                pattern=WRITER_NAME.pattern)],
    server: ServerConfig = ServerConfig(),
    aux_layer_ids: Annotated[Optional[list[int]], CAPTURE["aux_layer_ids"]] = None,
    dump_dir: Annotated[Optional[str], Field(description="node-local dump dir (default: under /dev/shm)")] = None,
    pool: Annotated[str, Field(description="the work pool")] = "eagle3",
    log_dir: Annotated[Optional[str], Field(description="server and worker logs (default: runs/node-<queue>)")] = None,
) -> None:
    """A capture server and a worker on this node's queue, until stopped (Ctrl-C or SIGTERM)."""
    # What the node does to its server (a relaunch, a stop) goes to its output.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_node(queue, node_launch(queue, server, aux_layer_ids, dump_dir), pool,
             Path(log_dir or f"runs/node-{queue}").resolve())


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(node, "python -m flows.node")
