"""What a stream run captures, in the order training reads it: held-out
samples first (the untrained drafter is evaluated on them before the first
step), then each epoch's batches in training order, whose first positions
also count the draft vocabulary. The planned samples are written beside the
store once, for every trainer rank."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tasks.capture.canary import refuse_unchecked_logits
from tasks.capture.config import CaptureConfig
from tasks.capture.planning import capture_chat
from tasks.data.chat import ChatRender
from tasks.data.dataset import Rejected, Sample, prepare_samples, require_usable
from tasks.durable import replace_durably
from tasks.failures import Permanent
from tasks.store.handle import Store
from tasks.store.manifest import manifest_path, write_json_atomic
from tasks.store.shards import BF16, bytes_per_token
from tasks.stream.spool import spool_stores
from tasks.target.checkpoint import Target
from tasks.target.models import resolve_model
from tasks.train.config import TrainConfig
from tasks.train.data import plan_batches, split

logger = logging.getLogger("eagle3.stream")

# The planned samples (id, row, token and loss-token counts), written by the
# plan once: every trainer rank reads them instead of tokenising the
# dataset again (600k samples: minutes of CPU per rank, 8 ranks a node).
PLANNED = "stream-samples.parquet"
# The rows train.cache_epochs keeps in the store for every epoch, chosen at
# the run's first plan (cached_for_the_run).
CACHED = "stream-cached.json"


class SeveralSamplesARow(Permanent, ValueError):
    """Rows that give several samples, which a stream run cannot spool yet."""


def planned_samples(sources: list[str], tokenizer, *, max_length: int, policy: str,
                    chat: ChatRender | None = None) -> tuple[list[Sample], list[Rejected]]:
    """Every sample the capture of these sources will store (once per id, in
    row order), from their tokenisation alone (conversations as `chat`
    renders them), and the rows it will quarantine instead."""
    out, rejected, seen = [], [], set()
    for source in sources:
        samples, unusable = prepare_samples(Path(source), tokenizer, max_length=max_length, policy=policy, chat=chat)
        require_usable(Path(source), samples, unusable)
        rows = [s.source_row for s in samples]
        several = len(rows) - len(set(rows))
        if several:
            raise SeveralSamplesARow(
                f"a stream run captures and spools by dataset row, and rows of {source} give {several} samples "
                f"beyond one each (conversations whose template renders an earlier turn otherwise than the target "
                f"emitted it, as reasoning dropped from a later history: tasks/data/chat.py): run it offline "
                f"(mode offline), or train on each conversation's last turn (capture.turns last)")
        rejected += unusable
        for s in samples:
            if s.sample_id not in seen:
                seen.add(s.sample_id)
                out.append(s)
    return out, rejected


def without_quarantined(samples: list[Sample], store: Path) -> list[Sample]:
    """The samples, less those the store has quarantined (an earlier run's
    capture failed them for good): they are left out of a stream run's plan
    as an offline run over the store leaves them out, so a run started
    again trains on the offline batches (its trainer's checkpoint, cut from
    the old split, is refused unless train.on_store_change is replan)."""
    if not manifest_path(store).exists():
        return samples
    gone = set(Store.open(store).ledger.quarantined().sample_id.dropna())
    kept = [s for s in samples if s.sample_id not in gone]
    if len(kept) < len(samples):
        logger.info("stream: %d samples the store %s quarantined are left out of the plan, as offline",
                    len(samples) - len(kept), store)
    return kept


def keep_spool_quarantine(store: Path) -> int:
    """A spooled part's quarantine (a sample that crashed the server, or
    whose batch failed for good) lands in its epoch's spool store, which is
    removed once that epoch is trained: its rows are kept in the store's own
    index, so this and every later plan leaves the sample out. Rows kept."""
    if not manifest_path(store).exists():
        return 0
    rows = [r for home in spool_stores(store) for r in Store.open(home).ledger.quarantined().to_dict("records")]
    if rows:
        Store.open(store).ledger.quarantine(rows)
    return len(rows)


def planned_columns(samples: list[Sample]) -> dict[str, list]:
    """What a trainer needs of each planned sample, as columns."""
    return {"sample_id": [s.sample_id for s in samples], "source_row": [s.source_row for s in samples],
            "num_tokens": [s.num_tokens for s in samples],
            "num_loss_tokens": [int(s.loss_mask.sum()) for s in samples]}


def _planned_key(sources: list[str], target_path: str, max_length: int, policy: str, chat: dict | None) -> str:
    """What the planned samples depend on: the sources (by path, size and
    mtime: one changed in place is planned again), the tokenizer's model,
    the length policy and how conversations are rendered."""
    files = sorted(str(Path(s).resolve()) for s in sources)
    return json.dumps({"sources": [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files],
                       "target": str(Path(target_path).resolve()), "max_length": max_length, "policy": policy,
                       "chat": chat}, sort_keys=True)


def write_planned(store: Path, samples: list[Sample], sources: list[str], target_path: str, *, max_length: int,
                  policy: str, chat: ChatRender | None = None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(planned_columns(samples)).replace_schema_metadata(
        {"eagle3_key": _planned_key(sources, target_path, max_length, policy, chat and chat.record())})
    Path(store).mkdir(parents=True, exist_ok=True)
    replace_durably(Path(store) / PLANNED, lambda tmp: pq.write_table(table, tmp))


def read_planned(store: Path, manifest: dict):
    """The planned samples the plan wrote for this store's manifest (a
    DataFrame), or None: none written, or written for other sources, model
    or length policy."""
    import pyarrow.parquet as pq

    path = Path(store) / PLANNED
    try:
        table = pq.read_table(path)
        key = _planned_key(manifest["sources"], manifest["target_path"], manifest["max_length"],
                           manifest["max_length_policy"], manifest.get("chat"))
    except FileNotFoundError:
        return None
    if (table.schema.metadata or {}).get(b"eagle3_key", b"").decode() != key:
        logger.info("stream: %s was planned from other sources or settings than the store's: tokenising", path)
        return None
    return table.to_pandas()


def check_mode(mode: str, train: TrainConfig, capture_nodes=()) -> None:
    """Refuse stream settings in a pipeline run that does not stream: an
    offline run would otherwise take them silently and do something else."""
    if mode == "stream":
        return
    if capture_nodes:
        raise ValueError(f"capture_nodes {list(capture_nodes)}: they capture for a stream run; set mode stream, or "
                         f"capture offline on many nodes with python -m flows.extract_nodes")
    if train.spool_bytes is not None:
        raise ValueError(f"train.spool_bytes {train.spool_bytes:,} bounds a stream run's disk: set mode stream, or "
                         f"leave it unset (an offline run keeps every shard in the store)")
    if train.stream:
        raise ValueError("train.stream: the pipeline trains while capturing with mode stream (which sets it); with "
                         "mode offline leave it false")


class UnsharedIndex(Permanent, ValueError):
    """A stream run read or written from several hosts on a SQLite index."""


def require_shared_index(train: TrainConfig, ledger_url: str | None, nodes=()) -> None:
    """A stream run whose store's indexes (its own and its spool stores')
    are written or read from more than one host, by capture nodes or by
    trainer ranks on several nodes, needs them in PostgreSQL: SQLite's
    locking does not hold on shared storage (NFS, Lustre), where a reader
    on another host can see a half-written index."""
    hosts = ([f"capture nodes ({', '.join(nodes)})"] if nodes else []) + (
        [f"trainer ranks on {train.nnodes} nodes (train.nnodes)"] if train.nnodes > 1 else [])
    if hosts and not ledger_url:
        raise UnsharedIndex(f"this stream run reaches its store's index from several hosts ({' and '.join(hosts)}): "
                            f"set store.ledger_url to a PostgreSQL URL (or 'env' for $EAGLE3_LEDGER_URL); a SQLite "
                            f"index must not be shared between hosts")


class SpoolTooSmall(Permanent, ValueError):
    """The spool cannot hold what training reads before its first step."""


@dataclass(frozen=True)
class StreamPlan:
    """Dataset rows in the order training reads them: held out, then each
    epoch's batches (as rows), with the token counts the spool is sized by."""
    heldout: list[int]
    rejected: list[int]  # rows that give no sample: quarantined, as offline
    epochs: list[list[list[int]]]
    tokens: dict[int, int]  # row -> tokens
    bytes_per_token: int
    # Training rows captured once, into the store, and read there in every
    # epoch (train.cache_epochs): a prefix of the first epoch's order.
    cached: list[int] = field(default_factory=list)
    cached_bytes: int = 0
    minimum: int = 0  # bytes the spool must hold at once (spool_minimum)
    heldout_bytes: int = 0  # at most what the held-out samples take in the store (with a spool)

    def spool_room(self, spool_bytes: int | None) -> int | None:
        """The spool's share of the budget (None: no spool): what the store
        keeps (the held-out samples evaluation reads, and what
        train.cache_epochs keeps for every epoch) is not in it."""
        return None if spool_bytes is None else spool_bytes - self.heldout_bytes - self.cached_bytes

    def shard_bytes(self, rows: list[int], batch_size: int) -> int:
        """At most what these rows take as shards of batch_size samples:
        their tensors, and per shard a header of its sample ids and offsets."""
        return self.shard_bytes_of(sum(self.tokens[r] for r in rows), -(-len(rows) // batch_size), batch_size)

    def shard_bytes_of(self, tokens: int, shards: int, batch_size: int) -> int:
        return tokens * self.bytes_per_token + shards * (16384 + 80 * batch_size)


def plan_stream(model: str, capture: CaptureConfig, train: TrainConfig, store: Path | None = None, *,
                dtype: str = BF16, served_prompts: int = 0) -> StreamPlan:
    """What a stream run captures, in the order training reads it (refused,
    with a spool too small to reach the first step); with `store`, the
    planned samples are written there for the trainer's ranks. `dtype`:
    the store's (store.dtype), which the spool's bytes are sized by (FP8
    takes half of bf16's). With a spool, only the held-out samples
    evaluation reads are captured (heldout_read, `served_prompts` the
    evaluation's served prompts), counted in the budget."""
    target = Target.load(str(resolve_model(model)), capture.aux_layer_ids)
    refuse_unchecked_logits(target.config, capture.canary_fraction)  # before the trainer starts
    dataset = str(Path(capture.dataset).resolve())
    tokenizer = target.tokenizer()
    chat = capture_chat(capture, tokenizer, target.path, None if store is None else Path(store))
    samples, unusable = planned_samples([dataset], tokenizer, max_length=capture.max_length,
                                        policy=capture.max_length_policy, chat=chat)
    if store is not None:
        keep_spool_quarantine(Path(store))
        samples = without_quarantined(samples, Path(store))
        write_planned(store, samples, [dataset], target.path, max_length=capture.max_length,
                      policy=capture.max_length_policy, chat=chat)
    return plan_order(planned_columns(samples), [r.source_row for r in unusable],
                      bytes_per_token(target.hidden_size, len(target.layers.sglang_ids), dtype), capture.batch_size,
                      train, store, served_prompts)


def plan_order(planned: dict[str, list], rejected: list[int], per_token: int, batch_size: int, train: TrainConfig,
               store: Path | None = None, served_prompts: int = 0) -> StreamPlan:
    """The plan of planned samples' columns (planned_columns: id, row,
    tokens, loss tokens), `rejected` the rows that give none, `per_token`
    the store's bytes per token: no tokenizer, no model (bench/stream_scale.py
    plans a Kimi-size run from drawn lengths)."""
    ids, rows = planned["sample_id"], planned["source_row"]
    train_idx, held_idx = split(ids, train.heldout_fraction)
    lengths = np.asarray(planned["num_tokens"], dtype=np.int64)
    epochs = range(train.epochs if train.spool_bytes is not None else 1)
    if train.spool_bytes is not None:
        held_idx = held_idx[:heldout_read(train, served_prompts)]
    plan = StreamPlan(
        heldout=[rows[i] for i in held_idx],
        # The capture's first part takes them: it quarantines them with their
        # reasons, as an offline run does.
        rejected=list(rejected),
        epochs=[[[rows[i] for i in b] for b in plan_batches(lengths, train_idx, train.tokens_per_batch, train.seed, e)]
                for e in epochs],
        tokens=dict(zip(rows, (int(n) for n in lengths))),
        bytes_per_token=per_token)
    if train.spool_bytes is not None:
        need = spool_minimum(plan, dict(zip(rows, planned["num_loss_tokens"])), batch_size, train)
        held = plan.shard_bytes(plan.heldout, batch_size) if plan.heldout else 0
        plan = replace(plan, minimum=need, heldout_bytes=held)
        if train.spool_bytes < need + held:
            raise SpoolTooSmall(
                f"train.spool_bytes {train.spool_bytes:,} cannot hold what training reads before its first steps: "
                f"{need:,} bytes (the first train.vocab_positions {train.vocab_positions:,} loss positions count "
                f"the draft vocabulary, then a step's batches and the loader's look-ahead), beside the "
                f"{len(plan.heldout):,} held-out samples evaluation reads ({held:,} bytes, kept in the store): "
                f"raise it, or lower train.vocab_positions or train.eval_max_samples")
        if train.cache_epochs:
            plan = cached_for_the_run(plan, train, batch_size, store)
    return plan


def heldout_read(train: TrainConfig, served_prompts: int = 0) -> int:
    """Held-out samples a spooled run captures: the first ones in split
    order, as many as evaluation reads (train.eval_max_samples after each
    epoch; and the evaluation's served prompts, twice as many, since a
    sample whose answer starts at its first token gives no prompt). Not the
    whole held-out split: at Kimi-K2.5's size its 5% of 600k samples were
    ~4 TB of bf16 states, 5-10x the spool, captured before the first step."""
    return max(train.eval_max_samples, 2 * served_prompts)


def cached_for_the_run(plan: StreamPlan, train: TrainConfig, batch_size: int, store: Path | None) -> StreamPlan:
    """The plan with train.cache_epochs' rows. They are chosen once, at the
    run's first plan, and kept beside the store (CACHED): the room for them
    depends on the trainer's devices, nodes and accumulation, which a
    resume may change (a node lost), and a set chosen again would leave out
    of later epochs' parts rows the store lacks, the first epoch having
    spooled them (8 to 4 devices on a 4k-sample plan lost 105 rows). A
    resume whose trainer holds more at once than the kept set leaves room
    for is refused."""
    key = hashlib.sha256(json.dumps([plan.heldout, plan.epochs, plan.bytes_per_token, batch_size]).encode()
                         ).hexdigest()
    path = Path(store) / CACHED if store is not None else None
    try:
        kept = json.loads(path.read_text()) if path is not None else None
    except FileNotFoundError:
        kept = None
    if kept is not None and kept["key"] == key:
        plan = cache_first_capture(plan, 0, batch_size, rows=kept["rows"])
        if plan.cached_bytes + plan.heldout_bytes + plan.minimum > train.spool_bytes:
            raise SpoolTooSmall(
                f"train.spool_bytes {train.spool_bytes:,} cannot hold the {len(plan.cached):,} samples this run keeps "
                f"for every epoch ({plan.cached_bytes:,} bytes, chosen at its first plan) beside what the trainer "
                f"now holds at once ({plan.minimum:,} bytes on {train.devices * train.nnodes} device(s), "
                f"accumulating {train.accumulate}): raise it, or resume on the devices the run started on")
        return plan
    plan = cache_first_capture(plan, train.spool_bytes - plan.minimum - plan.heldout_bytes, batch_size)
    if path is not None:
        write_json_atomic(path, {"key": key, "rows": plan.cached})
    return plan


def cache_first_capture(plan: StreamPlan, room: int, batch_size: int, rows: list[int] | None = None) -> StreamPlan:
    """The plan with the first epoch's first training rows kept for every
    epoch, as many as `room` bytes hold (what the budget leaves beside the
    spool's working set), or `rows`; later epochs capture only the
    others."""
    cached, tokens = [], 0
    for row in (r for b in plan.epochs[0] for r in b) if rows is None else ():
        if plan.shard_bytes_of(tokens + plan.tokens[row], -(-(len(cached) + 1) // batch_size), batch_size) > room:
            break
        cached.append(row)
        tokens += plan.tokens[row]
    cached = cached if rows is None else list(rows)
    kept = set(cached)
    later = [[[r for r in b if r not in kept] for b in epoch] for epoch in plan.epochs[1:]]
    return replace(plan, epochs=plan.epochs[:1] + later, cached=cached,
                               cached_bytes=plan.shard_bytes(cached, batch_size) if cached else 0)


def spool_minimum(plan: StreamPlan, loss: dict[int, int], batch_size: int, train: TrainConfig) -> int:
    """Bytes the trainer holds before it can free any: the samples counting
    the draft vocabulary (they come first; `loss`: row -> loss tokens) or,
    if more, a step's batches and the loader's look-ahead (4), per device;
    and room for the capture's next part beside them."""
    counted = tokens = 0
    for row in (r for b in plan.epochs[0] for r in b):
        if counted >= train.vocab_positions:
            break
        counted += loss[row]
        tokens += plan.tokens[row]
    ahead = (4 + train.accumulate) * train.devices * train.nnodes * train.tokens_per_batch
    longest = sorted(plan.tokens.values())[-2 * batch_size:]  # and one part of the capture beside them
    return max(tokens, ahead) * plan.bytes_per_token + plan.shard_bytes_of(sum(longest), 2, batch_size)

