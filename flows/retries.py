"""When a failed task is worth retrying: not when its error is one a retry
cannot mend (tasks/failures.py). A task whose errors are all transient
(a server or network fault) keeps its plain retries."""
from __future__ import annotations

from tasks.failures import Permanent


def unless_permanent(task, task_run, state) -> bool:
    """Prefect's retry_condition_fn: retry unless the task's exception is
    Permanent."""
    return not isinstance(getattr(state, "data", None), Permanent)
