"""Regeneration's faults: a server gone for good ends the run at once."""
from __future__ import annotations

import threading
import time

import pytest

from tasks.sglang_api import ServerGone


def test_a_server_gone_for_good_ends_the_flow_at_the_first_batch_without_retries(prefect_api):
    from prefect import flow, task
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.batches import drain
    from flows.retries import unless_permanent

    ran, lock = [], threading.Lock()

    @task(retries=3, retry_delay_seconds=5, retry_condition_fn=unless_permanent)
    def batch(k: int) -> int:
        with lock:
            ran.append(k)
        if k == 0:
            raise ServerGone("the SGLang server at http://127.0.0.1:1 died again after 2 relaunches")
        time.sleep(0.5)
        return k

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def batches() -> list[str]:
        return drain(batch.map(list(range(40))), lambda: None)

    t0 = time.monotonic()
    with pytest.raises(ServerGone, match="127.0.0.1:1 died again"):
        batches()
    # Batch 0 ran once (no retry); of the other 39 at most the ones already
    # started beside it, not all 39 failing or running after it.
    assert ran.count(0) == 1 and len(ran) < 10, ran
    assert time.monotonic() - t0 < 60
