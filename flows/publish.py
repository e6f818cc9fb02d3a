"""Flow `publish_drafter`: a drafter folder to a model hub (tasks/train/publish.py).
Dry run by default: lists the files it would send and what stops it.

    python -m flows.publish --drafter-dir runs/demo/train/drafter --repo-id you/smollm2-eagle3
    HF_TOKEN=... python -m flows.publish --drafter-dir ... --repo-id ... --upload

The token is huggingface_hub's (HF_TOKEN, or `hf auth login`), never a
parameter: Prefect keeps parameters in its database and shows them.
"""
from __future__ import annotations

from typing import Annotated

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import Field

from flows.config import described
from flows.retries import unless_permanent
from tasks.failures import Permanent
from tasks.train.config import TrainConfig
from tasks.train.publish import PublishRefused, publish


class NotPublishable(Permanent, PublishRefused):
    """A retry would refuse the same folder."""


@task(name="publish", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=30, retry_condition_fn=unless_permanent)
def publish_task(drafter_dir: str, repo_id: str, upload: bool, private: bool) -> dict:
    log = get_run_logger()
    try:
        made = publish(drafter_dir, repo_id, upload=upload, private=private)
    except PublishRefused as e:
        raise NotPublishable(str(e)) from None
    (log.warning if made.problems else log.info)("%s%s", "" if upload else "dry run: ", made.describe())
    if not upload and made.problems:
        raise NotPublishable(f"{drafter_dir} would be refused: fix the lines above, then run again")
    return {"repo_id": repo_id, "files": made.files, "left_out": made.left_out, "uploaded": upload}


@flow(name="publish_drafter")
@described
def publish_drafter(
    drafter_dir: Annotated[str, Field(description="an exported drafter folder (train_drafter's drafter/)")] = (
        f"{TrainConfig().out_dir}/drafter"),
    repo_id: Annotated[str, Field(description="the model hub repository, <user-or-org>/<name>")] = "",
    upload: Annotated[bool, Field(description="send it (the default is a dry run that lists what it would send)")] = False,
    private: Annotated[bool, Field(description="create the repository private if it does not exist")] = True,
) -> dict:
    """Publish a drafter folder as it is: its card, config and weights."""
    return publish_task(drafter_dir, repo_id, upload, private)


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(publish_drafter, "python -m flows.publish")
