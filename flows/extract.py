"""Flow `extract_hidden_states`: plan -> launch (or attach) -> warm up ->
reset dump dir -> extract batches (mapped, retried) -> verify -> stop server.

    python -m flows.extract --help
"""
from __future__ import annotations

import hashlib
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Literal, Optional

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff
from pydantic import Field

from flows import params
from flows.artifacts import artifact_key
from flows.cli import described
from flows.verify import verify_task
from tasks.capture import extraction
from tasks.capture.dump import RID_PREFIX
from tasks.paths import default_dump_root
from tasks.server.launch import ServerConfig, check_serves
from tasks.server.supervisor import ServerSupervisor, attach_api_key, from_node_env
from tasks.store.ledger import open_ledger, open_store
from tasks.store.lock import check_held_by, hold_lock
from tasks.store.manifest import build_manifest
from tasks.store.shards import WRITER_NAME, remove_leaked_temps
from tasks.target.architectures import Architecture, architecture_of, load_tokenizer
from tasks.target.layers import AuxLayers
from tasks.target.models import resolve_model


@task(name="plan", cache_policy=NO_CACHE)
def plan_task(dataset: str, model: str, store: str, max_length: int, policy: str, aux_layer_ids,
              store_dtype: str = "bfloat16", ledger_url: Optional[str] = None, rows: Optional[list[int]] = None,
              owner: bool = True):
    log = get_run_logger()
    model_path = resolve_model(model)
    config = json.loads((model_path / "config.json").read_text())
    arch = architecture_of(config)
    layers = AuxLayers.for_model(arch.sizes(config)["num_hidden_layers"], aux_layer_ids)
    tokenizer = load_tokenizer(model_path)
    manifest = build_manifest(model_path, tokenizer, layers, arch, max_length=max_length, policy=policy,
                              sources=[str(Path(dataset).resolve())], storage=store_dtype)
    ledger = open_store(Path(store), manifest, ledger_url)
    if owner:  # the run holds the store's lock: nobody is writing a temp (a child's siblings may be)
        leaked = remove_leaked_temps(Path(store))
        if leaked:
            log.warning("removed %d unfinished shard temp files of a killed run: %s", len(leaked),
                        ", ".join(leaked[:5]))
    plan = extraction.plan_extraction(Path(dataset), tokenizer, ledger, max_length=max_length, policy=policy,
                                      rows=rows)
    log.info("plan: %d rows -> %d to capture (%s tokens), %d already stored, %d rejected; %s, aux layers: %s",
             plan.total_samples, len(plan.todo), f"{plan.todo_tokens:,}", plan.already_stored,
             len(plan.rejected), arch.name, layers.describe())
    for r in plan.rejected[:20]:
        log.warning("rejected row %d: %s", r.source_row, r.reason)
    return plan, model_path, arch, layers, manifest["hidden_size"]


@task(name="storage-preflight", cache_policy=NO_CACHE)
def preflight_task(plan, store: str, dump_dir: str, hidden_size: int, in_flight_tokens: int,
                   storage: str = "bfloat16") -> dict:
    estimate = extraction.storage_preflight(plan, Path(store), Path(dump_dir), hidden_size=hidden_size,
                                            in_flight_tokens=in_flight_tokens, storage=storage)
    text = (f"### Storage plan\n\n| | |\n|---|---|\n| tokens to capture | {estimate['tokens']:,} |\n"
            f"| bytes per token | {estimate['bytes_per_token']:,} |\n"
            f"| store needs | {estimate['store_bytes'] / 2**30:.3f} GiB of {estimate['store_free'] / 2**30:.1f} GiB free "
            f"(`{store}`) |\n| dump dir needs | {estimate['dump_bytes'] / 2**30:.3f} GiB of "
            f"{estimate['dump_dir_free'] / 2**30:.1f} GiB free (`{dump_dir}`) |\n")
    create_markdown_artifact(markdown=text, key=artifact_key("storage-plan", store), description="storage plan")
    get_run_logger().info("storage: store needs %.3f GiB (%.1f free), dump dir %.3f GiB (%.1f free)",
                          estimate["store_bytes"] / 2**30, estimate["store_free"] / 2**30,
                          estimate["dump_bytes"] / 2**30, estimate["dump_dir_free"] / 2**30)
    return estimate


@task(name="launch-server", cache_policy=NO_CACHE)
def launch_task(model_path: Path, dump_dir: str, arch: Architecture, layers: AuxLayers, server_url: Optional[str],
                tp_size: int, max_total_tokens: int, chunked_prefill_size: Optional[int], extra_server_args: list[str],
                max_server_restarts: int, log_path: str, server_api_key: Optional[str] = None,
                server_rid_prefix: str = RID_PREFIX) -> ServerSupervisor:
    log = get_run_logger()
    if server_url:
        supervisor = ServerSupervisor(attach_url=server_url, api_key=attach_api_key(server_api_key),
                                      rid_prefix=server_rid_prefix, max_restarts=0)
        log.info("attaching to the SGLang server at %s (rid prefix %r, %s)", server_url, server_rid_prefix,
                 "with an API key" if supervisor.api_key else "no API key")
    else:
        cfg = ServerConfig(model_path=str(model_path), dump_dir=Path(dump_dir),
                           aux_layer_ids=arch.sglang_layer_ids(layers.sglang_ids), capture_module=arch.decoder_stack,
                           tp_size=tp_size, max_total_tokens=max_total_tokens,
                           chunked_prefill_size=chunked_prefill_size, extra_args=tuple(extra_server_args))
        # A launched server draws its own rid prefix and API key; explicit ones are refused there.
        supervisor = ServerSupervisor(cfg, Path(log_path), api_key=server_api_key, rid_prefix=server_rid_prefix,
                                      max_restarts=max_server_restarts)
        log.info("launching SGLang on %s (tp=%d), log: %s", model_path, tp_size, log_path)
    log.info("SGLang server ready at %s", supervisor.start())
    check_serves(supervisor.url, model_path, api_key=supervisor.api_key)
    return supervisor


@task(name="warm-up", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10)
def warm_up_task(server: ServerSupervisor, dump_dir: str, layers: AuxLayers) -> dict:
    summary = extraction.warm_up(server.url, Path(dump_dir), aux_layer_ids=layers.sglang_ids,
                                 api_key=server.api_key, rid_prefix=server.rid_prefix)
    get_run_logger().info("warm-up probes round-trip: %s", summary)
    return summary


@task(name="reset-dump-dir", cache_policy=NO_CACHE)
def reset_dump_dir_task(dump_dir: str, rid_prefix: str) -> int:
    removed = extraction.reset_dump_dir(Path(dump_dir), rid_prefix=rid_prefix)
    get_run_logger().info("dump dir %s ready (%d stale dumps of this pipeline removed)", dump_dir, removed)
    return removed


# Retries and their delays are flow parameters (see _extract_all): these are
# the defaults for a direct call.
def _worth_retrying(task, task_run, state) -> bool:
    # A run stopped for failing captures wholesale stays stopped.
    return not isinstance(getattr(state, "data", None), extraction.TooManyFailures)


@task(name="extract-batch", cache_policy=NO_CACHE, retries=3,
      retry_delay_seconds=exponential_backoff(backoff_factor=5), retry_jitter_factor=0.5,
      retry_condition_fn=_worth_retrying)
def extract_batch_task(batch: list, server: ServerSupervisor, dump_dir: str, store: str, source: str,
                       layers: AuxLayers, concurrency: int, sample_attempts: int,
                       guard: extraction.FailureGuard | None = None, node: str = "") -> dict:
    log = get_run_logger()
    result = extraction.extract_batch(server.url, Path(dump_dir), Path(store), source, batch,
                                      aux_layer_ids=layers.sglang_ids, api_key=server.api_key,
                                      rid_prefix=server.rid_prefix, concurrency=concurrency,
                                      sample_attempts=sample_attempts, on_server_down=server.recover,
                                      guard=guard, writer=node)
    server.forward_log(log)
    log.info("batch of %d: stored %d samples, %d tokens in %.1f s (%.0f tok/s) -> %s; retried %d, quarantined %d",
             len(batch), result.samples, result.tokens, result.seconds, result.tokens_per_s, result.shard,
             result.retried, len(result.quarantined))
    return {"shard": result.shard, "samples": result.samples, "tokens": result.tokens,
            "quarantined": result.quarantined}


@task(name="stop-server", cache_policy=NO_CACHE)
def stop_task(server: ServerSupervisor) -> None:
    server.stop()
    if server.attach_url:
        get_run_logger().info("detached from the SGLang server at %s (left running)", server.url)
    else:
        get_run_logger().info("SGLang server at %s stopped (%d relaunches during the run)", server.url,
                              server.restarts)


@flow(name="extract_hidden_states", task_runner=ThreadPoolTaskRunner(max_workers=2))
@described
def extract_hidden_states(
    dataset: params.Dataset = params.DEFAULT_DATASET,
    model: params.Model = params.DEFAULT_MODEL,
    store: Annotated[str, Field(description="store directory (created, or resumed if it exists)")] = "runs/demo/store",
    server_url: params.ServerUrl = None,
    server_api_key: params.ServerApiKey = None,
    server_rid_prefix: params.ServerRidPrefix = RID_PREFIX,
    dump_dir: params.DumpDir = None,
    batch_size: params.BatchSize = 32,
    concurrency: Annotated[int, Field(description="requests in flight per batch", ge=1)] = 8,
    max_length: params.MaxLength = 2048,
    max_length_policy: Annotated[Literal["truncate", "skip"], Field(description="what to do with a longer sample")] = "truncate",
    aux_layer_ids: Annotated[Optional[list[int]], Field(description="SGLang 'output of layer i' ids (default: [1, n//2-1, n-4])")] = None,
    tp_size: Annotated[int, Field(description="tensor-parallel size of a launched server", ge=1)] = 1,
    max_total_tokens: Annotated[int, Field(description="KV pool size of a launched server, in tokens")] = 65536,
    chunked_prefill_size: Annotated[Optional[int], Field(description="SGLang chunked prefill size (default: SGLang's)")] = None,
    extra_server_args: Annotated[list[str], Field(description="extra arguments for sglang.launch_server (a flag the launcher sets from another parameter is refused, naming that parameter)")] = [],
    sample_attempts: Annotated[int, Field(description="tries per sample before it is quarantined", ge=1)] = 3,
    batch_retries: Annotated[int, Field(description="retries of a failed batch task (server or network faults)", ge=0)] = 3,
    batch_retry_delay_s: Annotated[float, Field(description="first retry delay in seconds; doubles each retry, with jitter", ge=0)] = 5.0,
    max_server_restarts: Annotated[int, Field(description="relaunches of a crashed launched server", ge=0)] = 2,
    max_quarantine_ratio: Annotated[float, Field(description="fail the run when more than this share of the samples tried fail their capture", ge=0, le=1)] = 0.05,
    max_consecutive_failures: Annotated[int, Field(description="fail the run after this many failed captures in a row", ge=1)] = 20,
    verify: Annotated[bool, Field(description="verify the store at the end")] = True,
    store_dtype: params.StoreDtype = "bfloat16",
    ledger_url: params.LedgerUrl = None,
    rows: Annotated[Optional[list[int]], Field(description="only these dataset rows (0-based): a node's share, "
                                                           "set by extract_across_nodes")] = None,
    parent_run: Annotated[Optional[str], Field(description="the extract_across_nodes run holding the store, "
                                                           "set by it: this run writes under its lock")] = None,
    node: Annotated[str, Field(description="this node's name, in the names of the shards it writes (a store "
                                           "many nodes write)",
                               pattern=f"^({WRITER_NAME.pattern.strip('^$')})?$")] = "",  # or none
) -> dict:
    """Capture EAGLE-3 hidden states (3 aux layers + final) for every token of a
    dataset into a verified, sharded store."""
    log = get_run_logger()
    store = str(Path(store).resolve())
    # A child of extract_across_nodes on a node: "env" is that node's server.
    server_url = from_node_env("server_url", server_url)
    dump_dir = from_node_env("dump_dir", dump_dir)
    server_rid_prefix = from_node_env("server_rid_prefix", server_rid_prefix)
    # One dump dir per store: a rerun after a killed run resets the same dir,
    # so orphaned dumps never pile up in RAM-backed /dev/shm.
    dump_dir = str(dump_dir or default_dump_root() / f"store-{hashlib.sha256(store.encode()).hexdigest()[:12]}")
    log_path = str(Path(store).parent / "logs" / "sglang-server.log")

    # The whole run holds the store: a second run would plan the same samples
    # and race this one for the same shard names and ledger rows.
    held = (nullcontext(check_held_by(Path(store), parent_run)) if parent_run else
            hold_lock(Path(store), f"extract_hidden_states of {dataset}", run=flow_run.get_id()))
    with held:
        plan, model_path, arch, layers, hidden = plan_task(dataset, model, store, max_length, max_length_policy,
                                                           aux_layer_ids, store_dtype, ledger_url, rows,
                                                           owner=not parent_run)
        # Before the preflight: dumps a killed run left in RAM-backed /dev/shm
        # would otherwise count against the space it asks for, for good.
        reset_dump_dir_task(dump_dir, server_rid_prefix)
        preflight_task(plan, store, dump_dir, hidden, in_flight_tokens=2 * concurrency * max_length,
                       storage=store_dtype)
        server = None
        try:
            if plan.todo:
                server = launch_task(model_path, dump_dir, arch, layers, server_url, tp_size, max_total_tokens,
                                     chunked_prefill_size, extra_server_args, max_server_restarts, log_path,
                                     server_api_key, server_rid_prefix)
                warm_up_task(server, dump_dir, layers)
                reset_dump_dir_task(dump_dir, server.rid_prefix)
                batch_task = extract_batch_task.with_options(
                    retries=batch_retries, retry_jitter_factor=0.5,
                    retry_delay_seconds=exponential_backoff(backoff_factor=batch_retry_delay_s) if batch_retry_delay_s else 0)
                guard = extraction.FailureGuard(max_ratio=max_quarantine_ratio,
                                                max_consecutive=max_consecutive_failures)
                failures = _extract_all(batch_task, plan, server, dump_dir, store, layers, batch_size, concurrency,
                                        sample_attempts, guard, node)
                guard.check()  # this reason first: the batches it stopped are its consequence
                if failures:
                    raise RuntimeError(f"{len(failures)} batches failed after their retries: "
                                       + "; ".join(failures[:5]) + " (rerun the flow: stored batches are kept)")
                guard.finish()
            else:
                log.info("nothing to capture: every sample of %s is already stored", dataset)
        finally:
            if server is not None:
                stop_task(server)
        summary = open_ledger(Path(store)).summary()
        result = {"store": store, **summary}
        if verify:
            report = verify_task(store)
            result["verification"] = report
        return result


def _extract_all(batch_task, plan, server, dump_dir, store, layers, batch_size, concurrency,
                 sample_attempts, guard, node) -> list[str]:
    log = get_run_logger()
    batches = plan.batches(batch_size)
    meter = extraction.ProgressMeter(open_ledger(Path(store)), plan.todo_tokens, len(plan.todo))
    artifact = create_progress_artifact(progress=0.0, key=artifact_key("extraction-progress", store),
                                        description=f"extraction into {store}")
    log.info("extracting %d samples in %d batches of up to %d", len(plan.todo), len(batches), batch_size)
    futures = batch_task.map(batches, unmapped(server), unmapped(dump_dir), unmapped(store),
                                     unmapped(plan.source), unmapped(layers), unmapped(concurrency),
                                     unmapped(sample_attempts), unmapped(guard), unmapped(node))
    failures = []
    for future in as_completed(futures):
        try:
            future.result()
        except Exception as e:
            failures.append(f"{future.task_run_id}: {e}")
        progress = meter.read()
        update_progress_artifact(artifact, progress=min(progress["percent"], 100.0))
        log.info("progress: %s", meter.describe(progress))
    return failures


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(extract_hidden_states, "python -m flows.extract")
