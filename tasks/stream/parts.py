"""The stream capture's parts: what it captures, cut from the plan in the
order training reads it, and (capture nodes) the queue in the store's
PostgreSQL index the nodes lease them from.

One capture server captures the parts in order itself (flows/stream.py
capture_in_order).
Many nodes each run a loop (flows/stream_node.py) that leases the next part,
captures it on its own server and marks it done. A lease lasts LEASE_S and
is renewed while its node captures: a node that dies stops renewing, and
another node takes the part once the lease has run out; the samples the
dead node had committed are skipped by that node's extraction plan (stored
ids), so nothing is captured twice into the index.

Leases are taken one at a time (a transaction-scoped advisory lock), not
with FOR UPDATE SKIP LOCKED: a part into the spool is leased only if the
spool has room for it beside the parts other nodes are capturing, and that
check must see every lease. A lease is a few milliseconds; nodes take a
part every few seconds each, far from contention at tens of nodes; while
the spool is full, their polls are answered without the lock. And parts
are leased strictly in order: one skipped for lack of room would let later
ones fill the spool before the part the trainer waits for.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tasks.stream.plan import StreamPlan
from tasks.store.handle import Store
from tasks.store.manifest import manifest_path
from tasks.stream.spool import (SpoolBudget, drop_spooled_shard, epoch_store, read_position, spool_schemas,
                                spooled_bytes)

LEASE_S = 30.0  # renewed every LEASE_S / 3 while its node captures
HELD_OUT = -1  # the epoch of the first part: held-out and unusable rows, into the store


@dataclass(frozen=True)
class Part:
    """Rows captured together into one store (`into`, relative to the run's
    store: "" for the store itself, or an epoch's spool store)."""
    seq: int
    epoch: int
    into: str
    rows: tuple[int, ...]
    need: int  # bytes it may add to the spool (0: into the store)
    tokens: int
    taken: int  # samples of its epoch captured once it is, of
    of: int
    lease: int = 0  # the fencing number of the lease a node holds it under (PartQueue.lease)

    def store(self, root: Path) -> Path:
        return Path(root) / self.into if self.into else Path(root)


def cut_parts(plan: StreamPlan, batch_size: int, room: int | None = None,
              position: tuple[int, int] = (0, 0)) -> list[Part]:
    """Every part of a capture started at the trainer's checkpointed
    `position` (epoch, batches done): the held-out and unusable rows first,
    then each epoch's training rows in training order. With a spool of
    `room` bytes, each into its epoch's spool store (except the rows
    train.cache_epochs keeps in the store), in parts of part_samples; without
    one, 32 batches a part."""
    spooled = room is not None
    first = tuple(plan.heldout + plan.rejected)
    parts = [Part(0, HELD_OUT, "", first, 0, sum(plan.tokens[r] for r in plan.heldout), 0, 0)] if first else []
    size = part_samples(plan, batch_size, room) if spooled else 32 * batch_size
    cached = set(plan.cached)
    first_epoch, done = position if spooled else (0, 0)
    for e in range(first_epoch, len(plan.epochs)):
        rows = [r for b in plan.epochs[e][done if e == first_epoch else 0:] for r in b]
        spool = str(epoch_store(Path(), e)) if spooled else ""
        # The cached rows are a prefix of the first epoch's order: they come first.
        taken = 0
        for into, segment in (("", [r for r in rows if r in cached]), (spool, [r for r in rows if r not in cached])):
            for k in range(0, len(segment), size):
                piece = tuple(segment[k:k + size])
                taken += len(piece)
                parts.append(Part(len(parts), e, into, piece, plan.shard_bytes(list(piece), batch_size) if into else 0,
                                  sum(plan.tokens[r] for r in piece), taken, len(rows)))
    return parts


def capture_parts(plan: StreamPlan, batch_size: int, root: Path, spool_bytes: int | None) -> list[Part]:
    """The capture's parts, from the trainer's checkpointed position with a
    spool (train.spool_bytes, None: none)."""
    room = plan.spool_room(spool_bytes)
    return cut_parts(plan, batch_size, room, read_position(root) if room is not None else (0, 0))


def rewound_parts(plan: StreamPlan, batch_size: int, root: Path, spool_bytes: int) -> list[Part]:
    """The capture's parts once the trainer started again from its
    checkpoint (Prefect's retry after a rank died, an OOM, a database blink):
    the spool cut back to what the trainer reads in order from there
    (trim_spool), then the parts from its position on, less the leading
    ones already stored whole. Without this the retry waited for what it had
    trained after the checkpoint, removed and never captured again."""
    trim_spool(root, plan)
    parts = capture_parts(plan, batch_size, root, spool_bytes)
    stored: dict[Path, set[str]] = {}

    def whole(part: Part) -> bool:
        home = part.store(root)
        if home not in stored:
            stored[home] = {int(r) for r in Store.open(home).ledger.samples().source_row} \
                if manifest_path(home).exists() else set()
        return set(part.rows) <= stored[home]

    while parts and whole(parts[0]):
        parts.pop(0)
    return parts


def part_samples(plan: StreamPlan, batch_size: int, room: int) -> int:
    """Samples a spooled part takes: whole capture batches, two at least (as
    many as one extraction has in flight, so the spool holds little more
    than the trainer needs), and more while a part of them averages within a
    quarter of the room the trainer's own minimum leaves: each part costs an
    extraction run (a plan, a warm-up, its task runs in Prefect), which at
    a Kimi-size spool (~370 GB) would otherwise be paid every few MB. A
    part, or one per capture node, then fits beside what the trainer holds."""
    rows = [r for b in plan.epochs[0] for r in b] if plan.epochs else []
    if not rows:
        return 2 * batch_size
    per_sample = plan.shard_bytes(rows, batch_size) / len(rows)
    fits = int((room - plan.minimum) / 4 / per_sample) // batch_size * batch_size
    return max(2 * batch_size, fits)


# The database's clock, in seconds: every node's lease is timed by it, not
# by the node's own (20 s of skew between two nodes stole live leases).
NOW = "extract(epoch FROM clock_timestamp())"
# The next part any node may lease: not done, and not leased by a live node.
NEXT = (f"seq, epoch, into_store, rows, need, tokens, taken, of FROM stream_parts WHERE state <> 'done' AND "
        f"(state = 'todo' OR leased_until < {NOW}) ORDER BY seq")


class PartQueue:
    """The parts of a stream capture on many nodes, in the store's own
    PostgreSQL schema (`ledger`: the store's PostgresLedger, whose schema
    holds the stream_parts table).

    Each lease is fenced: it takes a number from a sequence no plan ever
    resets, and renewing, finishing or releasing a part needs that number.
    A node loop that lost its part (its lease ran out, or the run was
    planned again after its head was killed) can no longer mark it done,
    and learns at its next renewal that it should stop."""

    def __init__(self, ledger):
        self.ledger = ledger

    def _serialise(self, db) -> None:
        """Until `db`'s transaction ends, no other leases a part."""
        db.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"{self.ledger.schema}.stream_parts",))

    def plan(self, parts: list[Part]) -> None:
        """These parts, replacing any an earlier run left: a capture started
        again is cut again from the trainer's position (and what it
        stored is skipped by each part's own extraction plan)."""
        with self.ledger.transaction() as db, db.cursor() as cur:
            self._serialise(db)
            cur.execute("DELETE FROM stream_parts")
            cur.executemany("INSERT INTO stream_parts VALUES (%s,%s,%s,%s,%s,%s,%s,%s,'todo',NULL,NULL,NULL,0,NULL,"
                            "NULL)", [(p.seq, p.epoch, p.into, json.dumps(p.rows), p.need, p.tokens, p.taken, p.of)
                                      for p in parts])

    def lease(self, node: str, budget: SpoolBudget) -> Part | str | None:
        """The next part for `node`, leased to it (its `lease` the fencing
        number); "wait" while the parts left are leased by live nodes;
        "full" while the budget does not admit the next one (into the
        spool) beside what the spool holds and the parts in flight may
        add; None once every part is done."""
        # While the spool is full every waiting node polls here: answered
        # without the lock (counting the spool's bytes takes a connection
        # per epoch store), so 16 waiting nodes do not queue behind each
        # other. Room seen here is checked again under the lock.
        if budget.room is not None:
            with self.ledger.transaction() as db:
                ahead = db.execute(f"SELECT {NEXT} LIMIT 1").fetchone()
                if ahead is not None and ahead[4] and not budget.admits(ahead[4], self._in_flight(db),
                                                                        self._held(db, budget)):
                    return "full"
        with self.ledger.transaction() as db:
            self._serialise(db)
            row = db.execute(f"SELECT {NEXT} LIMIT 1").fetchone()
            if row is None:
                left = db.execute("SELECT count(*) FROM stream_parts WHERE state <> 'done'").fetchone()[0]
                return "wait" if left else None
            part = Part(row[0], row[1], row[2], tuple(json.loads(row[3])), row[4], row[5], row[6], row[7])
            if part.need and budget.room is not None and not budget.admits(part.need, self._in_flight(db),
                                                                           self._held(db, budget)):
                return "full"
            lease = db.execute(f"UPDATE stream_parts SET state = 'leased', node = %s, "
                               f"lease = nextval('stream_part_leases'), leased_until = {NOW} + %s WHERE seq = %s "
                               f"RETURNING lease", (node, LEASE_S, part.seq)).fetchone()[0]
            return replace(part, lease=lease)

    def _held(self, db, budget: SpoolBudget) -> int:
        """What the spool holds now: its epoch stores' shard bytes, summed on
        `db` when they are indexed beside the queue (one query, not a
        connection or two per epoch store on every poll)."""
        import psycopg
        from psycopg import sql

        for _ in range(3):
            schemas = spool_schemas(budget.root, self.ledger.url)
            if schemas is None:
                return budget.held()
            if not schemas:
                return 0
            total = sql.SQL(" + ").join(sql.SQL("(SELECT coalesce(sum(bytes), 0) FROM {}.shards)").format(
                sql.Identifier(s)) for s in schemas)
            try:
                with db.transaction():  # a savepoint: the lease's transaction outlives a miss
                    return int(db.execute(sql.SQL("SELECT ") + total).fetchone()[0])
            except psycopg.errors.UndefinedTable:  # an epoch store dropped (all trained) meanwhile: list again
                continue
        return budget.held()

    @staticmethod
    def _in_flight(db) -> int:
        """Bytes the parts leased now may add to the spool. What a part in
        flight has committed is counted twice (held and its need): a node
        may wait a little early, never overfill."""
        return db.execute(f"SELECT coalesce(sum(need), 0) FROM stream_parts WHERE state = 'leased' AND "
                          f"leased_until >= {NOW}").fetchone()[0]

    def renew(self, part: Part) -> bool:
        """Extend the lease of `part`; False if it is no longer this
        lease's (it ran out and another node took the part, or the run was
        planned again): its holder should stop capturing it."""
        with self.ledger.transaction() as db:
            cur = db.execute(f"UPDATE stream_parts SET leased_until = {NOW} + %s WHERE seq = %s AND lease = %s AND "
                             f"state = 'leased'", (LEASE_S, part.seq, part.lease))
            return cur.rowcount == 1

    def done(self, part: Part) -> bool:
        """`part` is stored, under its lease; False (nothing marked) if the
        lease is no longer its: whoever holds the part now marks it, once
        it stored it (what this node committed is skipped by its plan)."""
        with self.ledger.transaction() as db:
            cur = db.execute(f"UPDATE stream_parts SET state = 'done', done_at = {NOW}, error = NULL WHERE seq = %s "
                             f"AND lease = %s AND state = 'leased'", (part.seq, part.lease))
            return cur.rowcount == 1

    def release(self, part: Part, error: str) -> None:
        """`part` failed under its lease: back in line for any node, first."""
        with self.ledger.transaction() as db:
            db.execute("UPDATE stream_parts SET state = 'todo', leased_until = NULL, failures = failures + 1, "
                       "error = %s WHERE seq = %s AND lease = %s AND state = 'leased'", (error[:500], part.seq,
                                                                                          part.lease))

    def progress(self) -> dict:
        """Parts in all and done, the training tokens done, and the last
        training part done (its seq, or None): a few aggregates, polled
        while the nodes run (a run of 600k samples has ~100k parts)."""
        total, done, tokens, last = self.ledger.query(
            "SELECT count(*), count(*) FILTER (WHERE state = 'done'), coalesce(sum(tokens) FILTER (WHERE state = "
            "'done' AND epoch >= 0), 0), max(seq) FILTER (WHERE state = 'done' AND epoch >= 0) FROM stream_parts")[0]
        return {"parts": total, "done": done, "tokens": int(tokens), "last": last}

    def done_by_node(self) -> dict[str, int]:
        return dict(self.ledger.query("SELECT node, count(*) FROM stream_parts WHERE state = 'done' GROUP BY node "
                                      "ORDER BY node"))

    def parts(self):
        """Every part's state, node and failures (a DataFrame, by seq)."""
        import pandas as pd

        return pd.DataFrame(self.ledger.query("SELECT seq, epoch, into_store, state, node, failures, error, tokens, "
                                              "taken, of, done_at FROM stream_parts ORDER BY seq"),
                            columns=["seq", "epoch", "into", "state", "node", "failures", "error", "tokens", "taken",
                                     "of", "done_at"])


# The resume's trim: the spool cut back in the plan's order (here, beside the
# parts, so the spool reads nothing of the plan).
def trim_spool(store: Path, plan: StreamPlan) -> int:
    """A spooled run started again, before either side starts: its spool
    cut back to what the trainer reads first, in order, from its
    checkpointed position, up to the first sample missing (trained after
    the checkpoint, so removed, or not yet captured when the run stopped).
    Every shard spooled after that is removed, to be captured again in its
    turn: each was let in while the parts before it were held, and kept it
    could fill the room those need now, each side then waiting on the
    other. Bytes removed."""
    epoch, done = read_position(store)
    cached = set(plan.cached)  # into the store, not the spool
    order = [(e, r) for e in range(epoch, len(plan.epochs))
             for b in plan.epochs[e][done if e == epoch else 0:] for r in b if r not in cached]
    homes = {e: epoch_store(store, e) for e in range(epoch, len(plan.epochs))}
    ledgers = {e: Store.open(home).ledger for e, home in homes.items() if manifest_path(home).exists()}
    for ledger in ledgers.values():  # what was trained since the checkpoint is needed again
        ledger.forget_retired()
    shard_of = {(e, int(row)): shard for e, ledger in ledgers.items()
                for row, shard in ledger.samples()[["source_row", "shard"]].itertuples(index=False)}
    before, later = spooled_bytes(store), True
    while later:  # a shard holding samples on both sides of the cut moves the cut before it
        cut = next((k for k, key in enumerate(order) if key not in shard_of), len(order))
        later = {(key[0], shard_of[key]) for key in order[cut:] if key in shard_of}
        for e, shard in sorted(later):
            drop_spooled_shard(ledgers[e], homes[e], shard, trained=False)
        shard_of = {key: shard for key, shard in shard_of.items() if (key[0], shard) not in later}
    return before - spooled_bytes(store)
