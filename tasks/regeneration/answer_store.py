"""The regenerated answers on disk: JSONL shards and their index.

    <out>/provenance.json      what the answers were made from: the source
                               dataset (path, sha256), the target (path,
                               config sha256), the settings; written once,
                               checked on every open
    <out>/answers-<hash>.jsonl one batch's answered conversations, one row a
                               line (FORMAT below), written durably, then
    <out>/index.sqlite         committed: shards(name, sha256, bytes, rows,
      (or index.json, naming   answer_tokens), rows(row_id, source_row,
      its PostgreSQL schema:   shard, offset, length, tokens, answer_tokens,
      answer_index.py)         cut), quarantine(row_id, source_row, reason,
                               attempts, kind: failed | cut, the latter
                               dropped by on_truncated), crashes(row_id, count)

A conversation is answered when, and only when, the index has committed its
shard: a shard file the index does not name (a run killed between the two)
is never read, and the batch's retry writes a shard of its own. Each shard
file has a name no other writer uses, and a conversation is committed once:
of two nodes that answered it (one taken for dead), the second's commit
finds it taken and keeps the first's answer. A directory of answers is
a dataset (tasks/data/dataset.py read_rows): its rows, in source order, each
under its source row number, read at the offsets the index holds.
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from pathlib import Path
from typing import Collection, Iterator, Sequence

from tasks.durable import replace_durably
from tasks.failures import Permanent
from tasks.regeneration.answer_index import has_index, open_index
from tasks.store.manifest import write_json_once

# /2: rows marked cut, conversations dropped for a cut answer (their kind
# in the quarantine table), the template and weights in the provenance.
# /3: the turns grouped as capture groups them (earlier_samples), answers
# with their reasoning_content, no loss after a turn's stop token.
FORMAT = "eagle3-answers/3"
# Answer shards open at once while reading (a 600k-conversation run has
# thousands; the usual limit is 1,024 descriptors).
OPEN_SHARDS = 8
PROVENANCE = "provenance.json"
SERVED = "served.json"  # the first answering server's settings (provenance.py served_flags)
# Types both backends take ("offset" is a keyword in PostgreSQL: quoted).
SCHEMA = """
CREATE TABLE IF NOT EXISTS shards(
    name TEXT PRIMARY KEY, sha256 TEXT NOT NULL, bytes BIGINT NOT NULL, rows BIGINT NOT NULL,
    answer_tokens BIGINT NOT NULL, created DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS rows(
    row_id TEXT PRIMARY KEY, source_row BIGINT NOT NULL UNIQUE, shard TEXT NOT NULL REFERENCES shards(name),
    "offset" BIGINT NOT NULL, length BIGINT NOT NULL, tokens BIGINT NOT NULL, answer_tokens BIGINT NOT NULL,
    cut BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS quarantine(
    row_id TEXT PRIMARY KEY, source_row BIGINT NOT NULL, reason TEXT NOT NULL, attempts BIGINT NOT NULL,
    at DOUBLE PRECISION NOT NULL, kind TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS crashes(row_id TEXT PRIMARY KEY, count BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS sweeps(n BIGINT PRIMARY KEY, at DOUBLE PRECISION NOT NULL);
CREATE INDEX IF NOT EXISTS rows_by_shard ON rows(shard);
"""


class AnswersMismatch(Permanent, ValueError):
    """An answers directory made from another dataset, target or settings."""


class Swept(Permanent, RuntimeError):
    """A commit whose file a sweep of unindexed files may have removed."""


def row_tokens(row: dict) -> int:
    """The tokens an answers row's samples hold (its own and its earlier_samples)."""
    return len(row["input_ids"]) + sum(len(s["input_ids"]) for s in row.get("earlier_samples", ()))


def is_answers_dir(path: Path) -> bool:
    return Path(path).is_dir() and has_index(path)


def sources_provenance(sources: Sequence[Path]) -> dict[str, dict]:
    """For a store's manifest: the provenance of each source that is an
    answers directory, by its resolved path."""
    return {str(Path(s).resolve()): json.loads((Path(s) / PROVENANCE).read_text())
            for s in sources if is_answers_dir(s)}


def _refuse_changes(root: Path, kept: dict, new: dict, keys: set) -> None:
    changed = sorted(k for k in keys if kept.get(k) != new.get(k))
    if changed:
        raise AnswersMismatch(
            f"the answers in {root} were made from another {', '.join(changed)} "
            f"({ {k: kept.get(k) for k in changed} }, now { {k: new.get(k) for k in changed} }): give another "
            f"regenerate.out, or remove it to answer again")


class AnswerStore:
    """One answers directory. Safe from the threads Prefect runs batch tasks
    in, and from many nodes with a PostgreSQL index: one short connection
    per call."""

    def __init__(self, root: Path, provenance: dict | None = None, index_url: str | None = None):
        """Open `root`; with `provenance`, create it if new (its index where
        index_url says: answer_index.py), or refuse it if its answers were
        made from anything else."""
        self.root = Path(root)
        kept = self.root / PROVENANCE
        if provenance is not None and not kept.is_file():
            self.root.mkdir(parents=True, exist_ok=True)
            record = {"format": FORMAT, **provenance}
            replace_durably(kept, lambda tmp: tmp.write_text(json.dumps(record, indent=1) + "\n"))
        elif not kept.is_file():
            raise FileNotFoundError(f"{self.root} holds no regenerated answers ({PROVENANCE} missing)")
        self.provenance = json.loads(kept.read_text())
        if self.provenance.get("format") != FORMAT:
            raise AnswersMismatch(
                f"the answers in {self.root} are in format {self.provenance.get('format')!r}, made before its "
                f"rows were rendered as capture renders them (tasks/data/chat.py); this version reads {FORMAT!r}: "
                f"answer again into a new regenerate.out")
        if provenance is not None:
            new = {"format": FORMAT, **provenance}
            _refuse_changes(self.root, self.provenance, new, set(self.provenance) | set(new))
        self.index = open_index(self.root, SCHEMA, index_url, new=provenance is not None)

    def check_made_from(self, record: dict) -> None:
        """Refuse a writer (a node's child run) whose own record differs from
        the answers' in any key both hold (AnswersMismatch, naming them)."""
        # Paths are the node's own (a checkpoint mounted elsewhere): the
        # fingerprints say whether it is the same target.
        _refuse_changes(self.root, self.provenance, record, set(record) & set(self.provenance) - {"target", "source"})

    def check_served(self, flags: dict, url: str) -> str | None:
        """Record the settings of the first server that answers into this
        directory (provenance.py served_flags); refuse a server whose
        settings differ where either one's command line set them
        (AnswersMismatch naming them): a node's server started with another
        dtype or quantization, or a resume on another server, would mix two
        servers' answers in one dataset. Values both servers' SGLang chose
        itself (per GPU type) are only reported: the warning, or None."""
        path = self.root / SERVED
        if write_json_once(path, flags):
            return None
        kept = json.loads(path.read_text())
        was, now = kept["settings"], flags["settings"]
        changed = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
        set_by_hand = [k for k in changed if k in kept["given"] or k in flags["given"]]
        if set_by_hand:
            raise AnswersMismatch(
                f"the answers in {self.root} were made by a server with "
                f"{({k: was.get(k) for k in set_by_hand})}; the one at {url} runs with "
                f"{({k: now.get(k) for k in set_by_hand})} (its /server_info): start it with the same settings, "
                f"or give another regenerate.out")
        if changed:
            return (f"the server at {url} resolved {({k: now.get(k) for k in changed})} where the first server "
                    f"that answered into {self.root} had {({k: was.get(k) for k in changed})}; neither command line "
                    f"set them (SGLang chose them for its hardware), so its answers are kept: numerics may differ")
        return None

    def _rows(self, sql: str, args=()) -> list[tuple]:
        return self.index.rows(sql, args)

    def answered_ids(self) -> set[str]:
        return {r[0] for r in self._rows("SELECT row_id FROM rows")}

    def answered_among(self, row_ids: Sequence[str]) -> set[str]:
        """Which of these (a batch's) are answered: a batch asks about its own
        rows, not every row of a 600k-conversation index."""
        if not row_ids:  # PostgreSQL refuses an empty IN ()
            return set()
        marks = ",".join("?" * len(row_ids))
        return {r[0] for r in self._rows(f"SELECT row_id FROM rows WHERE row_id IN ({marks})", tuple(row_ids))}

    def commit(self, records: list[dict]) -> str | None:
        """Write `records` (FORMAT rows, each with row_id and source_row) as
        one shard and commit it with its rows in one transaction, ending any
        quarantine of theirs; the shard's name (None: nothing to write, or
        every row committed by another writer first). Rows another writer
        committed first are left out of a shard written again."""
        if not records:
            return None
        lines = [(json.dumps(r, ensure_ascii=False) + "\n").encode() for r in records]
        # The rows' hash names the shard for a person; the token keeps two
        # writers of the same rows (a node taken for dead, and the one given
        # its share) off one file.
        digest = hashlib.sha256("".join(r["row_id"] for r in records).encode()).hexdigest()[:20]
        body = b"".join(lines)
        # Read before the file exists, and named in it: a sweep removes only
        # files written before it began, and a commit of one of those is refused.
        swept = self._sweeps()
        name = f"answers-{digest}-{secrets.token_hex(4)}-s{swept}.jsonl"
        replace_durably(self.root / name, lambda tmp: tmp.write_bytes(body))
        offsets, at = [], 0
        for line in lines:
            offsets.append(at)
            at += len(line)
        answer_tokens = sum(r["answer_tokens"] for r in records)
        try:
            with self.index.transaction() as db:
                self.index.hold_sweeps(db)
                db.execute("SELECT COALESCE(MAX(n), 0) FROM sweeps")
                if db.fetchall()[0][0] != swept:
                    raise Swept(f"the answers in {self.root} were swept of files no commit names after this batch "
                                f"wrote {name} (this writer was taken for dead, and the run that owns the directory "
                                f"went on without it): the batch is not committed; rerun that run to answer any "
                                f"conversation it reports missing")
                db.execute("INSERT INTO shards VALUES (?,?,?,?,?,?)",
                           (name, hashlib.sha256(body).hexdigest(), len(body), len(records), answer_tokens,
                            time.time()))
                db.executemany("INSERT INTO rows VALUES (?,?,?,?,?,?,?,?)",
                               [(r["row_id"], r["source_row"], name, o, len(line), row_tokens(r),
                                 r["answer_tokens"], int(r.get("cut", False)))
                                for r, o, line in zip(records, offsets, lines)])
                db.executemany("DELETE FROM quarantine WHERE row_id = ?", [(r["row_id"],) for r in records])
        except Swept:
            (self.root / name).unlink(missing_ok=True)
            raise
        except Exception as e:
            if not self.index.is_duplicate(e):
                raise
            (self.root / name).unlink(missing_ok=True)
            taken = self.answered_among([r["row_id"] for r in records])
            if not taken:
                raise
            return self.commit([r for r in records if r["row_id"] not in taken])
        return name

    def quarantine(self, rows: list[tuple[str, int, str, int]], kind: str = "failed") -> None:
        """(row_id, source_row, reason, attempts) of conversations given up on
        (kind "failed": a rerun asks again) or dropped for a cut answer
        (kind "cut": not asked again under the same settings)."""
        with self.index.transaction() as db:
            db.executemany("INSERT INTO quarantine VALUES (?,?,?,?,?,?) ON CONFLICT(row_id) DO UPDATE SET "
                           "source_row = excluded.source_row, reason = excluded.reason, "
                           "attempts = excluded.attempts, at = excluded.at, kind = excluded.kind",
                           [(*r, time.time(), kind) for r in rows])

    def drop(self, rows: list[tuple[str, int, str]]) -> None:
        """(row_id, source_row, reason) of conversations on_truncated drop left out."""
        self.quarantine([(*r, 0) for r in rows], kind="cut")

    def dropped_ids(self) -> set[str]:
        return {r[0] for r in self._rows("SELECT row_id FROM quarantine WHERE kind = 'cut'")}

    def record_crash(self, row_ids: list[str], at_least: int = 0) -> dict[str, int]:
        """One more server crash with these conversations in flight (each
        count then at least `at_least`); their counts."""
        with self.index.transaction() as db:
            db.executemany("INSERT INTO crashes VALUES (?, ?) ON CONFLICT(row_id) DO UPDATE SET count = CASE WHEN "
                           "crashes.count + 1 > excluded.count THEN crashes.count + 1 ELSE excluded.count END",
                           [(r, max(1, at_least)) for r in row_ids])
        counts = self.crash_counts()
        return {r: counts[r] for r in row_ids}

    def crash_counts(self) -> dict[str, int]:
        return dict(self._rows("SELECT row_id, count FROM crashes"))

    def quarantined(self) -> list[tuple[str, int, str, int]]:
        return self._rows("SELECT row_id, source_row, reason, attempts FROM quarantine WHERE kind = 'failed' "
                          "ORDER BY source_row")

    def summary(self, span: tuple[int, int] | None = None) -> dict:
        """Rows, tokens, shards and quarantined conversations in the index
        (with `span`, of the source rows in it: a node's share)."""
        where, args = ("WHERE source_row BETWEEN ? AND ?", span) if span else ("", ())
        (rows, tokens, answer_tokens, cut), = self._rows(
            f"SELECT COUNT(*), COALESCE(SUM(tokens), 0), COALESCE(SUM(answer_tokens), 0), COALESCE(SUM(cut), 0) "
            f"FROM rows {where}", args)
        (shards,), = self._rows("SELECT COUNT(*) FROM shards")
        kinds = dict(self._rows(f"SELECT kind, COUNT(*) FROM quarantine {where} GROUP BY kind", args))
        # int(): PostgreSQL sums to a Decimal.
        return {"rows": int(rows), "tokens": int(tokens), "answer_tokens": int(answer_tokens), "shards": int(shards),
                "cut": int(cut), "quarantined": int(kinds.get("failed", 0)), "dropped": int(kinds.get("cut", 0))}

    def read(self, rows: Collection[int] | None = None) -> Iterator[tuple[int, dict]]:
        """(source row, row) for every answered conversation in source order
        (with `rows`, only those), read at the index's offsets."""
        index = self._rows('SELECT source_row, shard, "offset", length FROM rows ORDER BY source_row')
        handles: dict[str, object] = {}  # the OPEN_SHARDS used last, oldest first
        try:
            for source_row, shard, offset, length in index:
                if rows is not None and source_row not in rows:
                    continue
                f = handles.pop(shard, None)
                if f is None:
                    if len(handles) >= OPEN_SHARDS:
                        handles.pop(next(iter(handles))).close()
                    f = open(self.root / shard, "rb")
                handles[shard] = f
                f.seek(offset)
                yield source_row, json.loads(f.read(length))
        finally:
            for f in handles.values():
                f.close()

    def export(self, path: Path) -> int:
        """Every answered conversation, in source order, as one JSONL file
        (written durably); the rows written."""
        written = 0

        def write(tmp: Path) -> None:
            nonlocal written
            with open(tmp, "w") as f:
                for _, r in self.read():  # row by row: 600k rows of ids do not fit in memory at once
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
                    written += 1
        replace_durably(Path(path), write)
        return written

    def _sweeps(self) -> int:
        return self._rows("SELECT COALESCE(MAX(n), 0) FROM sweeps")[0][0]

    def remove_unindexed(self) -> list[str]:
        """Delete shard files the index does not name, and their temps: a
        writer killed between its file and its commit left them. Only files
        written before this sweep began (their names carry the sweeps a
        writer saw): one written since may be committed yet. A writer taken
        for dead that is not (a node cut off) and commits a file this sweep
        may remove is refused (Swept), so the index never names a removed
        file. Call under the directory's lock, when every node's child has
        ended."""
        with self.index.transaction() as db:  # waits for the commits under way
            db.execute("INSERT INTO sweeps VALUES ((SELECT COALESCE(MAX(n), 0) + 1 FROM sweeps), ?)", (time.time(),))
            db.execute("SELECT MAX(n) FROM sweeps")
            sweep = db.fetchall()[0][0]
        named = {r[0] for r in self._rows("SELECT name FROM shards")}
        removed = []
        for path in self.root.iterdir():
            shard = path.name.lstrip(".").split(".jsonl")[0] + ".jsonl"
            written = re.fullmatch(r"answers-[0-9a-f]+-[0-9a-f]+(?:-s(\d+))?\.jsonl", shard)
            if path.is_file() and written and int(written.group(1) or 0) < sweep and (
                    path.name.startswith(".") or shard not in named):
                path.unlink(missing_ok=True)
                removed.append(path.name)
        return removed

    def verify(self) -> list[dict]:
        """Every shard recounted against the index: its bytes and sha256, its
        rows (ids, offsets, token counts, a loss mask per id, an answer),
        one report a shard; `ok` False with the reasons where any differ."""
        reports = []
        for name, sha, size, n, answer_tokens in self._rows(
                "SELECT name, sha256, bytes, rows, answer_tokens FROM shards ORDER BY name"):
            problems = []
            path = self.root / name
            body = path.read_bytes() if path.is_file() else None
            digest = hashlib.sha256(body).hexdigest() if body is not None else None
            if body is None:
                problems.append("file missing")
            elif len(body) != size or digest != sha:
                problems.append(f"{len(body)} bytes, sha256 {digest[:12]}: not the {size} bytes, sha256 {sha[:12]} "
                                f"committed")
            else:
                indexed = self._rows('SELECT row_id, source_row, "offset", length, tokens, answer_tokens FROM rows '
                                     'WHERE shard = ? ORDER BY "offset"', (name,))
                lines = body.splitlines(keepends=True)
                if len(indexed) != n or len(lines) != n:
                    problems.append(f"{len(lines)} lines, {len(indexed)} indexed rows: {n} committed")
                got = 0
                for row_id, source_row, offset, length, tokens, answered in indexed:
                    record = json.loads(body[offset:offset + length])
                    pieces = [(s.get("input_ids"), s.get("loss_mask")) for s in [record, *record.get("earlier_samples", ())]]
                    ids = sum((len(i or ()) for i, _ in pieces), 0)
                    if (record.get("row_id"), record.get("source_row")) != (row_id, source_row):
                        problems.append(f"row at {offset} is {record.get('row_id')}, not {row_id}")
                    elif ids != tokens or any(not i or len(i) != len(m or ()) for i, m in pieces):
                        problems.append(f"row {source_row}: {ids} ids in {len(pieces)} samples, mask values "
                                        f"{[len(m or ()) for _, m in pieces]}, {tokens} indexed")
                    elif record.get("answer_tokens") != answered or not all(any(m) for _, m in pieces):
                        problems.append(f"row {source_row}: no answer, or not the {answered} answer tokens indexed")
                    got += answered
                if got != answer_tokens:
                    problems.append(f"{got} answer tokens in its rows, {answer_tokens} committed")
            reports.append({"shard": name, "rows": n, "answer_tokens": answer_tokens, "ok": not problems,
                            "problems": problems})
        return reports
