"""Flow `verify_store`: recount and check every file and sample of a store.

    python -m flows.verify --store runs/demo/store
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import Field

from flows.artifacts import artifact_key
from flows.cli import described
from tasks.store.verification import verify_store as verify_plain


class VerificationFailed(RuntimeError):
    pass


@task(name="verify", cache_policy=NO_CACHE)
def verify_task(store: str, recheck_source: bool = True) -> dict:
    log = get_run_logger()
    report = verify_plain(Path(store), recheck_source=recheck_source)
    files = report.files
    create_table_artifact(table=files.to_dict("records"), key=artifact_key("verification", store),
                          description=f"verification of {store}")
    for row in files.itertuples():
        level = log.info if row.status == "OK" else log.warning
        level("%s %s: %d samples, %d tokens%s", row.status, row.shard, row.samples, row.tokens,
              f" — {row.problems}" if row.problems else "")
    failed = report.samples[report.samples.status == "FAIL"]
    for row in failed.head(50).itertuples():
        log.error("sample %s (row %d) in %s: %s", row.sample_id, row.source_row, row.shard, row.problems)
    log.info("verification %s: %d files, %d samples, %d tokens; report: %s",
             "passed" if report.ok else "FAILED", len(files), len(report.samples),
             int(report.samples.tokens.sum()) if len(report.samples) else 0, report.paths.get("summary_report"))
    if not report.ok:
        raise VerificationFailed(f"store {store} failed verification:\n{report.failures()}\n"
                                 f"(report: {report.paths.get('files_report')})")
    return {"ok": True, "files": len(files), "samples": len(report.samples), **report.paths}


@flow(name="verify_store")
@described
def verify_store(
    store: Annotated[str, Field(description="store directory to verify")] = "runs/demo/store",
    recheck_source: Annotated[bool, Field(description="also re-tokenise each sample's source row and compare")] = True,
) -> dict:
    """Verify a store: per file and per sample, against its ledger and its sources."""
    return verify_task(store, recheck_source)


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(verify_store, "python -m flows.verify")
