"""Waiting for a flow's mapped batch tasks: the extraction's and the
regeneration's."""
from __future__ import annotations

from typing import Callable

from prefect.futures import PrefectFutureList, as_completed

from tasks.failures import EndsRun


def drain(futures: PrefectFutureList, after_each: Callable[[], None]) -> list[str]:
    """Wait for every batch as it finishes, calling `after_each` after each
    (progress; a stop rule, which raises); the failed ones as 'task run id:
    error'. Told to stop (Ctrl-C, SIGTERM, a cancel) or stopped by
    `after_each`, or by a batch's EndsRun (its server gone for good), no
    batch not yet started starts."""
    failures = []
    try:
        for future in as_completed(futures):
            try:
                future.result()
            except EndsRun:
                raise  # the server is gone: every batch left would fail the same way
            except Exception as e:
                failures.append(f"{future.task_run_id}: {e}")
            after_each()
    except BaseException:
        for future in futures:
            future.wrapped_future.cancel()
        raise
    return failures
