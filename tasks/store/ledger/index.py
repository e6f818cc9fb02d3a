"""The ledger's interface: what the rest of the project asks of a store's
index. A sample is stored when, and only when, the ledger has committed its
shard. No SQL lives outside a backend (sqlite.py, postgres.py). Tables, in
every backend:

    shards(name, sha256, bytes, num_samples, num_tokens, created)
    samples(sample_id, source, source_row, shard, position, token_offset,
            num_tokens, num_loss_tokens, checksum)
    quarantine(source, source_row, sample_id, reason, attempts, at)
                                       one record a sample (a row that gives
                                       several keeps one for each), or a row's
                                       own (sample_id null: it gives none)
    crashes(sample_id, count, at)      samples in flight when the server died
    canaries(shard, sample_id, positions, worst_deviation, worst_ratio,
             profile, profile_outlier, at)
                                       the capture canary of committed samples
                                       (tasks/capture/canary.py)
"""
from __future__ import annotations

import abc
from pathlib import Path
from typing import Sequence

import pandas as pd

from tasks.store.shards import ShardInfo

SHARD_COLUMNS = ["name", "sha256", "bytes", "num_samples", "num_tokens", "created"]
SAMPLE_COLUMNS = ["sample_id", "source", "source_row", "shard", "position", "token_offset", "num_tokens",
                  "num_loss_tokens", "checksum"]
QUARANTINE_COLUMNS = ["source", "source_row", "sample_id", "reason", "attempts", "at"]
CANARY_COLUMNS = ["shard", "sample_id", "positions", "worst_deviation", "worst_ratio", "profile", "profile_outlier",
                  "at"]


class Ledger(abc.ABC):
    """The index of one store. Safe to call from the threads Prefect runs
    mapped tasks in."""

    store: Path

    @abc.abstractmethod
    def stored_ids(self) -> set[str]:
        """Every committed sample id."""

    @abc.abstractmethod
    def commit_shard(self, shard: ShardInfo, rows: list[dict], canaries: list[dict] = ()) -> None:
        """In one transaction: the shard, its samples (rows as made by
        `write_shard`), their canaries (CanaryResult.record), and the end of
        any quarantine of their source rows."""

    def has_shard(self, name: str) -> bool:
        return name in set(self.shards().name)

    @abc.abstractmethod
    def replace_shard(self, old: str, new: ShardInfo | None, rows: list[dict]) -> None:
        """In one transaction: drop shard `old` and its samples, commit `new`
        (None: nothing) with rows; the canaries of samples kept follow them
        to `new`, the others go. Only pruning (tasks/store/prune.py) does
        this, under the store's lock; commit_shard never replaces."""

    @abc.abstractmethod
    def retire_shard(self, name: str) -> None:
        """A spool store's shard whose every sample is trained: in one
        transaction it leaves the index with its samples and canaries, and
        its sample ids are kept as retired. A capture of the same rows (a
        node taking over a dead node's part) skips them (`captured_ids`)
        instead of capturing again what the trainer consumed."""

    @abc.abstractmethod
    def forget_retired(self) -> None:
        """The trainer reads from its checkpoint again: what it trained
        since is needed again, so no retired id is skipped any more."""

    def captured_ids(self) -> set[str]:
        """What a capture into this store skips: every committed sample id,
        and those committed, trained and retired (a spool store)."""
        return self.stored_ids() | self.retired_ids()

    @abc.abstractmethod
    def captured_among(self, sample_ids: Sequence[str]) -> set[str]:
        """Which of these (a batch's) a capture skips, as captured_ids: a
        batch asks about its own samples, not for every id of an index of
        millions on each of its thousands of batches."""

    @abc.abstractmethod
    def retired_ids(self) -> set[str]:
        """Every retired sample id (retire_shard)."""

    @abc.abstractmethod
    def quarantine(self, rows: list[dict]) -> None:
        """rows: source, source_row, sample_id (or None: the row gives no
        sample), reason, attempts. A sample's record replaces its earlier
        one; committing a sample clears its own and its row's."""

    @abc.abstractmethod
    def record_crash(self, sample_ids: list[str]) -> dict[str, int]:
        """Count one more server crash against each sample that was in
        flight when it happened; returns their counts. Kept across runs: a
        sample that kills the server kills it again on every rerun."""

    @abc.abstractmethod
    def crash_counts(self) -> dict[str, int]:
        """Server crashes each sample was in flight at, for every sample
        that was in flight at one."""

    @abc.abstractmethod
    def summary(self) -> dict:
        """samples, tokens, loss_tokens, shards, bytes, quarantined, and
        newest_shard (its `created` time, None for an empty store)."""

    @abc.abstractmethod
    def shards(self) -> pd.DataFrame:
        """One row per committed shard (SHARD_COLUMNS)."""

    @abc.abstractmethod
    def samples(self) -> pd.DataFrame:
        """One row per committed sample (SAMPLE_COLUMNS), by shard and position."""

    @abc.abstractmethod
    def quarantined(self) -> pd.DataFrame:
        """One row per quarantined source row (QUARANTINE_COLUMNS)."""

    @abc.abstractmethod
    def canaries(self, latest: int | None = None) -> pd.DataFrame:
        """One row per canary of a committed sample (CANARY_COLUMNS), oldest
        first; only the `latest` ones if given."""

    def drop(self) -> None:
        """Remove the index, its store being removed (a spool's epoch store,
        all trained). A file beside the store (SQLite) goes with it."""

    @abc.abstractmethod
    def sample_index(self) -> list[tuple]:
        """(sample_id, shard, token_offset, num_tokens, num_loss_tokens,
        source_row, checksum) per sample, by shard and position: what a
        reader needs."""

    @abc.abstractmethod
    def shard_index(self, sample_id: str) -> list[tuple]:
        """sample_index's rows of the shard holding `sample_id` ([] while it
        is not stored): two indexed lookups, for a reader waiting on a
        growing store (a stream trainer), where re-reading the whole index
        per miss would cost O(store)."""
