"""Flow `extract_hidden_states`: plan -> launch (or attach) -> warm up ->
reset dump dir -> extract batches (mapped, retried) -> verify -> stop server.

    python -m flows.extract --help
    python -m flows.extract --config configs/extract.yaml --server.tp-size 2
"""
from __future__ import annotations

import hashlib
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Iterator, Optional

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff
from pydantic import Field

from flows.artifacts import artifact_key
from flows.batches import drain
from flows.config import described
from flows.retries import unless_permanent
from flows.run_record import keep_run_config
from flows.verify import VerifyAtEnd, verify_task
from tasks.capture import bookkeeping, extraction, nodes, planning
from tasks.capture.canary import refuse_unchecked_logits
from tasks.capture.config import CaptureConfig
from tasks.data.chat import ChatRender
from tasks.paths import default_dump_root, ensure_private_dir
from tasks.regeneration.answer_store import sources_provenance
from tasks.server.config import ServerConfig
from tasks.server.launch import CaptureSpec, check_serves
from tasks.server.supervisor import RUN_SERVER, ServerSupervisor, node_sections, share, unshare
from tasks.store.config import StoreConfig
from tasks.store.handle import Store
from tasks.store.lock import LockHeld, check_held_by, hold_lock
from tasks.store.manifest import build_manifest
from tasks.store.shards import WRITER_NAME, remove_leaked_temps
from tasks.target.checkpoint import Target
from tasks.target.models import resolve_model


@dataclass(frozen=True)
class Planned:
    """What planning resolved once for the rest of the run."""
    plan: planning.Plan
    target: Target
    store: Store


def create_store(target: Target, tokenizer, capture: CaptureConfig, store: StoreConfig) -> Store:
    """The store this capture writes: created, or checked to have been made
    the same way (tasks/store/manifest.py)."""
    source = Path(capture.dataset).resolve()
    chat = planning.capture_chat(capture, tokenizer, target.path, Path(store.path))
    manifest = build_manifest(target.path, tokenizer, target.layers, target.arch, max_length=capture.max_length,
                              policy=capture.max_length_policy, sources=[str(source)], dtype=store.dtype,
                              regenerated=sources_provenance([source]), chat=chat.record())
    return Store.create(Path(store.path), manifest, store.ledger_url)


@task(name="plan", cache_policy=NO_CACHE)
def plan_task(model: str, capture: CaptureConfig, store: StoreConfig, rows: Optional[list[int]] = None,
              owner: bool = True) -> Planned:
    log = get_run_logger()
    target = Target.load(model, capture.aux_layer_ids)
    refuse_unchecked_logits(target.config, capture.canary_fraction)
    tokenizer = target.tokenizer()
    opened = create_store(target, tokenizer, capture, store)
    if owner:  # the run holds the store's lock: nobody is writing a temp (a child's siblings may be)
        leaked = remove_leaked_temps(opened.path)
        if leaked:
            log.warning("removed %d unfinished shard temp files of a killed run: %s", len(leaked),
                        ", ".join(leaked[:5]))
    chat = ChatRender.from_record(opened.manifest["chat"])
    plan = planning.plan_extraction(capture, tokenizer, opened.ledger, rows, chat)
    log.info("plan: %d samples -> %d to capture (%s tokens), %d already stored, %d rows rejected; %s, aux layers: "
             "%s; conversations: %s", plan.total_samples, len(plan.todo), f"{plan.todo_tokens:,}", plan.already_stored,
             len(plan.rejected), target.arch.name, target.layers.describe(), chat.describe())
    for r in plan.rejected[:20]:
        log.warning("rejected row %d: %s", r.source_row, r.reason)
    return Planned(plan, target, opened)


@task(name="storage-preflight", cache_policy=NO_CACHE)
def preflight_task(planned: Planned, dump_dir: Path, capture: CaptureConfig) -> dict:
    store = planned.store
    estimate = planning.storage_preflight(planned.plan, store.path, dump_dir,
                                            hidden_size=planned.target.hidden_size,
                                            in_flight_tokens=2 * capture.concurrency * capture.max_length,
                                            dtype=store.dtype)
    text = (f"### Storage plan\n\n| | |\n|---|---|\n| tokens to capture | {estimate['tokens']:,} |\n"
            f"| bytes per token | {estimate['bytes_per_token']:,} |\n"
            f"| store needs | {estimate['store_bytes'] / 2**30:.3f} GiB of {estimate['store_free'] / 2**30:.1f} GiB free "
            f"(`{store.path}`) |\n| dump dir needs | {estimate['dump_bytes'] / 2**30:.3f} GiB of "
            f"{estimate['dump_dir_free'] / 2**30:.1f} GiB free (`{dump_dir}`) |\n")
    create_markdown_artifact(markdown=text, key=artifact_key("storage-plan", store.path), description="storage plan")
    get_run_logger().info("storage: store needs %.3f GiB (%.1f free), dump dir %.3f GiB (%.1f free)",
                          estimate["store_bytes"] / 2**30, estimate["store_free"] / 2**30,
                          estimate["dump_bytes"] / 2**30, estimate["dump_dir_free"] / 2**30)
    return estimate


@task(name="launch-server", cache_policy=NO_CACHE)
def launch_task(target: Target, server: ServerConfig, dump_dir: Path, log_path: Path) -> ServerSupervisor:
    log = get_run_logger()
    if server.url and server.url.startswith(RUN_SERVER):
        supervisor = ServerSupervisor(server)
        log.info("on the run's capture server (started by its first stage with work; log: %s)", log_path)
    elif server.url:
        supervisor = ServerSupervisor(server)
        log.info("attaching to the SGLang server at %s (rid prefix %r, %s)", server.url, server.rid_prefix,
                 "with an API key" if supervisor.api_key else "no API key")
    else:
        supervisor = ServerSupervisor(capture_spec(target, server, dump_dir), log_path)
        log.info("launching SGLang on %s (tp %d, dp %d%s), log: %s", target.path, server.tp_size, server.dp_size,
                 ", dp attention" if server.dp_attention else "", log_path)
    log.info("SGLang server ready at %s", supervisor.start())
    check_serves(supervisor.url, target.path, api_key=supervisor.api_key)
    return supervisor


def endpoint(server: ServerSupervisor, dump_dir: Path, target: Target) -> extraction.Endpoint:
    return extraction.Endpoint(server.url, dump_dir, target.layers.sglang_ids, target.path, api_key=server.api_key,
                               rid_prefix=server.rid_prefix, on_down=server.recover)


@contextmanager
def one_server(server: ServerConfig, capture: CaptureConfig, store: Path) -> Iterator[tuple[ServerConfig,
                                                                                          CaptureConfig]]:
    """One capture server for several stages of a run: the sections they
    name it by (tasks/server/supervisor.py share). The first stage with
    work starts it; it stops when the block ends."""
    dump_dir = Path(capture.dump_dir) if capture.dump_dir else default_dump_dir(store)
    target = Target.load(str(resolve_model(server.model)), capture.aux_layer_ids)
    live = ServerSupervisor(capture_spec(target, server, dump_dir), store / "logs" / "sglang-server.log")
    url = share(live)
    try:
        yield server.model_copy(update={"url": url}), capture.model_copy(update={"dump_dir": str(dump_dir)})
    finally:
        unshare(url)
        live.stop()
        if live.handle is not None:  # a dump that landed after its request failed: none can land now
            try:  # this server's own rids only: another run may share an explicit dump dir
                extraction.reset_dump_dir(dump_dir, rid_prefix=live.rid_prefix, orphans=False)
            except OSError as e:
                get_run_logger().warning("late dumps in %s not cleared: %s", dump_dir, e)


def capture_spec(target: Target, server: ServerConfig, dump_dir: Path) -> CaptureSpec:
    return CaptureSpec(server=server.model_copy(update={"model": str(target.path)}), dump_dir=dump_dir,
                       aux_layer_ids=target.served_layer_ids, capture_module=target.arch.decoder_stack)


@task(name="warm-up", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10)
def warm_up_task(server: ServerSupervisor, dump_dir: Path, target: Target) -> dict:
    summary = extraction.warm_up(endpoint(server, dump_dir, target))
    get_run_logger().info("warm-up probes round-trip: %s", summary)
    return summary


@task(name="reset-dump-dir", cache_policy=NO_CACHE)
def reset_dump_dir_task(dump_dir: Path, rid_prefix: str) -> int:
    removed = extraction.reset_dump_dir(dump_dir, rid_prefix=rid_prefix)
    get_run_logger().info("dump dir %s ready (%d stale dumps of this pipeline removed)", dump_dir, removed)
    return removed


# Retries and their delays come from the capture section (_extract_all). A
# run stopped for failing captures wholesale stays stopped.
@task(name="extract-batch", cache_policy=NO_CACHE, retry_condition_fn=unless_permanent)
def extract_batch_task(batch: list, server: ServerSupervisor, dump_dir: Path, planned: Planned,
                       capture: CaptureConfig, guard: bookkeeping.FailureGuard | None = None, node: str = "",
                       parent_run: str | None = None) -> dict:
    log = get_run_logger()
    if parent_run:  # a child of a many-node run: only while its parent holds the store
        check_held_by(planned.store.path, parent_run)
    result = extraction.extract_batch(endpoint(server, dump_dir, planned.target), planned.store,
                                      planned.plan.source, batch, capture, guard=guard, writer=node,
                                      last_try=task_run.run_count > capture.batch_retries)
    server.forward_log(log)
    log.info("batch of %d: stored %d samples, %d tokens in %.1f s (%.0f tok/s) -> %s; retried %d, quarantined %d, "
             "canaries passed %d", len(batch), result.samples, result.tokens, result.seconds, result.tokens_per_s,
             result.shard, result.retried, len(result.quarantined), result.canaries)
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


def default_dump_dir(store: Path) -> Path:
    """One dump dir per store: a rerun after a killed run resets the same
    dir, so orphaned dumps never pile up in RAM-backed /dev/shm."""
    return default_dump_root() / f"store-{hashlib.sha256(str(store).encode()).hexdigest()[:12]}"


@contextmanager
def hold_dump_dir(dump_dir: Path, store: Path, *, child: bool) -> Iterator[None]:
    """Hold the run's dump dir. A child of extract_across_nodes refused
    here is told apart (NodeBusy): an earlier child still runs on its node,
    which is busy, not failing, and must not be drained for it."""
    with ExitStack() as stack:
        try:
            stack.enter_context(hold_lock(ensure_private_dir(dump_dir), f"the dump dir of extract_hidden_states "
                                          f"into {store}", run=flow_run.get_id()))
        except LockHeld as e:
            if child:
                raise nodes.NodeBusy(f"{nodes.NODE_BUSY}: {e}") from e
            raise
        yield


@flow(name="extract_hidden_states", task_runner=ThreadPoolTaskRunner(max_workers=2))
@described
def extract_hidden_states(
    server: ServerConfig = ServerConfig(),
    capture: CaptureConfig = CaptureConfig(),
    store: StoreConfig = StoreConfig(),
    verify: VerifyAtEnd = True,
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
    # A child of extract_across_nodes: server.url "env" is its node's server.
    server, capture = node_sections(server, capture)
    path = Path(store.path).resolve()
    store = store.model_copy(update={"path": str(path)})
    dump_dir = Path(capture.dump_dir) if capture.dump_dir else default_dump_dir(path)
    # The server's log and orphan record belong to the store whose lock
    # protects them: two runs on sibling stores never share one.
    log_path = path / "logs" / "sglang-server.log"

    # The whole run holds the store: a second run would plan the same samples
    # and race this one for the same shard names and ledger rows.
    held = (nullcontext(check_held_by(path, parent_run)) if parent_run else
            hold_lock(path, f"extract_hidden_states of {capture.dataset}", run=flow_run.get_id()))
    # And its dump dir: a second run there would reset it under this one (a
    # node's second child, when a live one was taken for dead, or another
    # store's run attached to the same server). The lock dies with its process.
    with held, hold_dump_dir(dump_dir, path, child=bool(parent_run)):
        keep_run_config(path / "runs", "extract_hidden_states", store.path)
        planned = plan_task(server.model, capture, store, rows, owner=not parent_run)
        # Before the preflight: dumps a killed run left in RAM-backed /dev/shm
        # would otherwise count against the space it asks for, for good.
        reset_dump_dir_task(dump_dir, server.rid_prefix)
        preflight_task(planned, dump_dir, capture)
        live = guard = None
        try:
            if planned.plan.todo:
                live = launch_task(planned.target, server, dump_dir, log_path)
                warm_up_task(live, dump_dir, planned.target)
                reset_dump_dir_task(dump_dir, live.rid_prefix)
                guard = bookkeeping.FailureGuard.of_capture(capture)
                failures = _extract_all(planned, live, dump_dir, capture, guard, node, parent_run)
                guard.check()  # this reason first: the batches it stopped are its consequence
                if failures:
                    raise RuntimeError(f"{len(failures)} batches failed after their retries: "
                                       + "; ".join(failures[:5]) + " (rerun the flow: stored batches are kept)")
                guard.finish()
                log.info("canary: %s", guard.canaries.describe())
            else:
                log.info("nothing to capture: every sample of %s is already stored", capture.dataset)
        finally:
            try:
                if live is not None:
                    try:
                        stop_task(live)
                    finally:
                        # A cancelled run starts no task, not even this one: the
                        # stop itself must not depend on it.
                        live.stop()
            finally:
                # However the run ended: a dump that landed after its request
                # failed stays nowhere (once a launched server has stopped,
                # none can land later).
                if guard is not None:
                    guard.sweep(dump_dir)
        result = {"store": str(path), **planned.store.ledger.summary()}
        if verify:
            result["verification"] = verify_task(str(path))
        return result


def _extract_all(planned: Planned, server: ServerSupervisor, dump_dir: Path, capture: CaptureConfig,
                 guard: bookkeeping.FailureGuard, node: str, parent_run: str | None) -> list[str]:
    log = get_run_logger()
    plan, store = planned.plan, planned.store
    batch_task = extract_batch_task.with_options(
        retries=capture.batch_retries, retry_jitter_factor=0.5,
        retry_delay_seconds=(exponential_backoff(backoff_factor=capture.batch_retry_delay_s)
                             if capture.batch_retry_delay_s else 0))
    batches = plan.batches(capture.batch_size)
    meter = bookkeeping.ProgressMeter(store.ledger, plan.todo_tokens, len(plan.todo))
    artifact = create_progress_artifact(progress=0.0, key=artifact_key("extraction-progress", store.path),
                                        description=f"extraction into {store.path}")
    log.info("extracting %d samples in %d batches of up to %d", len(plan.todo), len(batches), capture.batch_size)
    futures = batch_task.map(batches, unmapped(server), unmapped(dump_dir), unmapped(planned), unmapped(capture),
                             unmapped(guard), unmapped(node), unmapped(parent_run))

    def after_each() -> None:
        progress = meter.read()
        update_progress_artifact(artifact, progress=min(progress["percent"], 100.0),
                                 description=f"extraction into {store.path}: {meter.describe(progress)}; "
                                             f"canary: {guard.canaries.describe()}")
        log.info("progress: %s; canary %s", meter.describe(progress), guard.canaries.describe())

    return drain(futures, after_each)


if __name__ == "__main__":
    from flows.cli import run_cli

    run_cli(extract_hidden_states, "python -m flows.extract")
