"""Flow `verify_store`: recount and check every file and sample of a store,
and with --seal, once it passes, export its index beside the shards
(tasks/store/seal.py).

    python -m flows.verify --store runs/demo/store [--seal]
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import Field

from flows.artifacts import artifact_key
from flows.config import described
from tasks.failures import Permanent
from tasks.store.config import StoreConfig
from tasks.store.prune import prune_gone
from tasks.store.seal import seal as seal_plain
from tasks.store.verification import verify_store as verify_plain


# The extraction flows' parameter: whether the run ends with verify_task.
VerifyAtEnd = Annotated[bool, Field(description="verify the store at the end")]


class VerificationFailed(Permanent, RuntimeError):
    """The store failed verification: the report says which files and samples."""


@task(name="verify", cache_policy=NO_CACHE)
def verify_task(store: str, recheck_source: bool = True) -> dict:
    log = get_run_logger()
    report = verify_plain(Path(store), recheck_source=recheck_source)
    files = report.files
    create_table_artifact(table=files.to_dict("records"), key=artifact_key("verification", store),
                          description=f"verification of {store}")
    for row in files.itertuples():
        level = log.info if row.status == "OK" else log.warning
        level("%s %s: %d samples, %d tokens, %d canaries%s%s", row.status, row.shard, row.samples, row.tokens,
              row.canaries, f" (worst {row.canary_worst_ratio:.2f} of bound)" if row.canaries else "",
              f" — {row.problems}" if row.problems else "")
    failed = report.samples[report.samples.status != "OK"]
    for row in failed.head(50).itertuples():
        level = log.warning if row.status == "SOURCE_MISSING" else log.error
        level("%s sample %s (row %d) in %s: %s", row.status, row.sample_id, row.source_row, row.shard, row.problems)
    log.info("verification %s: %d files, %d samples, %d tokens; report: %s",
             "passed" if report.ok else "FAILED", len(files), len(report.samples),
             int(report.samples.tokens.sum()) if len(report.samples) else 0, report.paths.get("summary_report"))
    c = report.canary
    log.info("canary: %d samples (%d positions) agree with the server's own logprobs; worst deviation %.4f "
             "(%.2f of its bound); %d aux profile outliers", c["samples"], c["positions"], c["worst_deviation"],
             c["worst_ratio"], c["profile_outliers"])
    if not report.ok:
        raise VerificationFailed(f"store {store} failed verification:\n{report.failures()}\n"
                                 f"(report: {report.paths.get('files_report')})")
    return {"ok": True, "files": len(files), "samples": len(report.samples), "canary": report.canary, **report.paths}


@task(name="prune-gone", cache_policy=NO_CACHE)
def prune_gone_task(store: str) -> dict:
    result = prune_gone(Path(store))
    get_run_logger().info("pruned %d samples whose source rows are gone (%d shards rewritten, %d removed)",
                          result["pruned"], result["rewritten"], result["removed"])
    return result


@task(name="seal", cache_policy=NO_CACHE)
def seal_task(store: str) -> dict:
    record = seal_plain(Path(store))
    s = record["summary"]
    get_run_logger().info("sealed %s: %d samples in %d shards, %d quarantined -> %s/index/", store, s["samples"],
                          s["shards"], s["quarantined"], store)
    return record


@flow(name="verify_store")
@described
def verify_store(
    store: Annotated[str, Field(description="store directory to verify")] = StoreConfig().path,
    recheck_source: Annotated[bool, Field(description="also re-tokenise the sources and find each sample in them (by content)")] = True,
    prune_gone: Annotated[bool, Field(description="first remove the samples no source row gives any more (rows removed or edited)")] = False,
    seal: Annotated[bool, Field(description="once verification passes, export the index to <store>/index/ (Parquet and a SQLite copy) for readers without the ledger's database")] = False,
) -> dict:
    """Verify a store: per file and per sample, against its ledger and its sources."""
    if prune_gone:
        prune_gone_task(store)
    result = verify_task(store, recheck_source)
    if seal:
        # Only a verified store is sealed: verify_task raised otherwise.
        result["sealed"] = seal_task(store)
    return result


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(verify_store, "python -m flows.verify")
