"""The spool (`train.spool_bytes`): each epoch's training samples captured
again into a store of their own under <store>/spool/, each shard removed
once every sample in it is trained, and the trainer's checkpointed position
for a capture started again."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from tasks.store.handle import Store
from tasks.store.manifest import manifest_path, write_json_atomic
from tasks.store.shards import shard_path
from tasks.stream.state import trainer_starts, trainer_stopped, trainer_waiting

logger = logging.getLogger("eagle3.stream")

SPOOL = "spool"
POSITION = "position.json"


def epoch_store(store: Path, epoch: int) -> Path:
    """Where a spooled run captures epoch `epoch`'s training samples (the
    held-out ones stay in `store` itself, for every evaluation)."""
    return Path(store) / SPOOL / f"epoch-{epoch:04d}"


def spool_stores(store: Path) -> list[Path]:
    """The spool's epoch stores that exist now, in order."""
    return [d for d in sorted((Path(store) / SPOOL).glob("epoch-*")) if manifest_path(d).exists()]


def spool_schemas(store: Path, url: str) -> list[str] | None:
    """The PostgreSQL schemas of the spool's epoch stores, when every one is
    indexed on the server and database of `url` (a capture nodes' run):
    their bytes are then summed in one query on a connection already open.
    None where one is not."""
    from tasks.store.ledger.open import LEDGER_JSON
    from tasks.store.ledger.postgres import same_server

    schemas = []
    for home in spool_stores(store):
        try:
            record = json.loads((home / LEDGER_JSON).read_text())
        except FileNotFoundError:
            return None
        if record.get("backend") != "postgres" or not same_server(record["url"], url):
            return None
        schemas.append(record["schema"])
    return schemas


def spooled_bytes(store: Path) -> int:
    """Bytes of the shards the spool's indexes hold now (from the ledgers,
    not a directory listing: a shard is in the spool once committed)."""
    total = 0
    for d in sorted((Path(store) / SPOOL).glob("epoch-*")):
        try:
            total += Store.open(d).ledger.summary()["bytes"]
        except Exception:  # noqa: BLE001 - told apart below
            # An epoch store removed meanwhile (all trained: its files, then
            # its index), or not made yet, fails as its backend does (no
            # manifest, no table, a dropped schema); one whose manifest is
            # there failed for real.
            if manifest_path(d).exists():
                raise
    return total


def write_position(store: Path, epoch: int, batches_done: int) -> None:
    """The trainer's last checkpointed position: a capture (re)started
    takes the batches from there on."""
    write_json_atomic(Path(store) / SPOOL / POSITION, {"epoch": epoch, "batches_done": batches_done})


def read_position(store: Path) -> tuple[int, int]:
    try:
        p = json.loads((Path(store) / SPOOL / POSITION).read_text())
    except FileNotFoundError:
        return 0, 0
    return p["epoch"], p["batches_done"]


def drop_spooled_shard(ledger, home: Path, shard: str, trained: bool = True) -> None:
    """Remove a shard from a spool store: the index first, so a crash in
    between leaves an orphan file, never an entry without its data. A
    trained one's samples are retired, so a node taking over a dead node's
    part does not capture them again."""
    if trained:
        ledger.retire_shard(shard)
    else:
        ledger.replace_shard(shard, None, [])
    shard_path(home, shard).unlink(missing_ok=True)


class TrainerStopped(RuntimeError):
    """The trainer of a stream run stopped: the capture stops with it (a
    spooled one would otherwise wait for room for ever)."""


class SpoolDeadlock(RuntimeError):
    """The trainer waits for a sample the capture cannot store until the
    trainer frees room: the spool is too small for this run."""


class TrainerRestarted(Exception):
    """The trainer started again from its checkpoint while the capture
    waited: the capture rewinds (tasks/stream/parts.py rewound_parts)."""


class SpoolBudget:
    """`train.spool_bytes` as the capture's admissions see it: the one place
    that says whether a part may be captured into the spool now, asked by
    the one-server capture before each part and by every capture node's
    lease alike. `room` is the spool's share of the budget (what
    train.cache_epochs keeps in the store is not in it); None: no spool,
    everything is admitted."""

    WAIT_S = 0.5
    LOG_EVERY_S = 30.0
    # Both sides waiting on each other this long is a deadlock: the trainer
    # cannot step without its sample, nor free room without a step. Long
    # enough for any one step or checkpoint (the loader waits ahead of the
    # step).
    DEADLOCK_S = 600.0

    def __init__(self, root: Path, room: int | None, deadlock_s: float | None = None):
        self.root, self.room = Path(root), room
        self.deadlock_s = self.DEADLOCK_S if deadlock_s is None else deadlock_s
        self.starts = trainer_starts(self.root)

    def restarted(self) -> bool:
        """Whether the trainer started again since this was last asked: its
        retry resumes from its checkpoint, and what it trained after it was
        removed from the spool, so the capture must rewind (with a spool)."""
        starts = trainer_starts(self.root)
        moved, self.starts = starts != self.starts and starts > 1, starts  # (the first is the run's start)
        return moved and self.room is not None

    def held(self) -> int:
        return spooled_bytes(self.root) if self.room is not None else 0

    def admits(self, need: int, in_flight: int = 0, held: int | None = None) -> bool:
        """Whether a part that may add `need` bytes fits beside what the
        spool holds and the parts in flight may add. A part larger than
        the room still goes when the spool is empty and nothing is in
        flight: alone, it cannot deadlock."""
        if self.room is None or not need:
            return True
        held = self.held() if held is None else held
        return not (held or in_flight) or held + in_flight + need <= self.room

    def wait_for_room(self, need: int, epoch: int) -> float:
        """Back-pressure for the one-server capture: until the spool admits
        a part of `need` bytes. Seconds waited."""
        since, last = time.time(), 0.0
        while not self.admits(need, held=(held := self.held())):
            if self.restarted():
                raise TrainerRestarted()
            self.refuse_if_stuck(since, f"{held:,} of {self.room:,} bytes held, the next part needs {need:,}")
            if time.time() - last >= self.LOG_EVERY_S:
                last = time.time()
                logger.info("stream capture paused %.0f s before epoch %d's next part: spool %.1f of %.1f MiB, the "
                            "part needs %.1f", last - since, epoch + 1, held / 2**20, self.room / 2**20,
                            need / 2**20)
            time.sleep(self.WAIT_S)
        return time.time() - since

    def refuse_if_stuck(self, since: float, room: str) -> None:
        """For a capture waiting for room since `since`: refused
        (TrainerStopped) once the trainer stopped, since the spool will not
        empty; refused (SpoolDeadlock) once the trainer has waited
        deadlock_s for a sample meanwhile, since neither would ever move."""
        if trainer_stopped(self.root):
            raise TrainerStopped(f"the stream trainer stopped, so the spool of {self.root} will not empty; the "
                                 f"capture stops too, keeping what it stored: run the pipeline again and both resume")
        now = time.time()
        stuck = [w for w in trainer_waiting(self.root) if now - max(w["since"], since) >= self.deadlock_s]
        if stuck:
            raise SpoolDeadlock(
                f"the stream trainer has waited {now - stuck[0]['since']:.0f} s for {stuck[0]['waiting_for']} while "
                f"the capture waits for room in the spool of {self.root} ({room}): the samples the trainer holds at "
                f"once do not fit beside the next part. Run again with a larger train.spool_bytes; the checkpoint "
                f"and what was captured are kept")
