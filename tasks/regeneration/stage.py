"""Regeneration as a stage: the plan over a dataset's rows, and one batch
answered and committed, with the capture's guarantees: a rerun answers only
what is missing (conversations are keyed by row_id, turns.py), a
conversation that keeps failing is quarantined with its reason, one in
flight at CRASH_LIMIT server crashes (the last while sent alone) is taken
for their cause, and nothing
is answered until its shard is committed (answer_store.py)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from tasks.data.chat import renderer
from tasks.data.dataset import Rejected, check_rendered, read_rows, renders_tool_calls, row_tools, to_messages
from tasks.failures import EndsRun, Permanent
from tasks.regeneration.answer_store import AnswerStore
from tasks.regeneration.answers import Asker, Cut, NoAnswer
from tasks.regeneration.pool import AnswerPool, PoolClosed
from tasks.regeneration.provenance import provenance, served_flags
from tasks.regeneration.config import RegenerateConfig
from tasks.regeneration.turns import Conversation, answer_points, check_template, pin_date, row_id
from tasks.server.config import ServerConfig
from tasks.server.launch import LaunchSpec
from tasks.sglang_api import server_down, server_healthy, server_says, was_in_flight

logger = logging.getLogger("eagle3.regeneration")

# A conversation in flight at a crash is a suspect. The suspects are then
# sent together, alone: most crashes are no conversation's doing, and one
# round answers them all where one at a time would hold a whole server for
# each. Crashed together, each is sent alone, and one that crashes the
# server then is taken for its cause. So: 1 in the crowd, 2 in its group, 3
# alone; a group of one that crashes is already alone (the capture's
# extraction.py sends each suspect alone at once: its limit is 2).
CRASH_LIMIT = 3


class ServerDown(RuntimeError):
    """The server stopped answering mid-batch; the batch is retried."""


class TooManyQuarantined(Permanent, RuntimeError):
    """Conversations fail wholesale: the server or the settings are wrong."""


def answer_server(server: ServerConfig, model_path: Path) -> LaunchSpec:
    """The plain server a run launches for its answers: with SGLang's prefix
    cache, so turn k reuses the KV of the turns before it (and the answer
    request of a reasoning budget, its reasoning's)."""
    return LaunchSpec(server.model_copy(update={"model": str(model_path)}), prefix_cache=True)


@dataclass
class RegenerationPlan:
    todo: list[Conversation]
    rows: int  # usable rows (conversations with a user turn to answer)
    answered: int  # of them, answered before this run
    rejected: list[Rejected]
    # A node's share: the source rows it spans, which no other share's do
    # (shares are runs of the parent's plan): its progress is read there,
    # beside the other nodes' commits.
    span: tuple[int, int] | None = None

    def batches(self, size: int) -> list[list[Conversation]]:
        return [self.todo[i:i + size] for i in range(0, len(self.todo), size)]


def plan_regeneration(source: Path, store: AnswerStore, cfg: RegenerateConfig, tokenizer,
                      only: Sequence[int] | None = None) -> RegenerationPlan:
    """Every row of `source` with a user turn to answer (with `only`, of
    those rows: a node's share), less those answered under the store's
    provenance; a row that is no conversation is Rejected with its reason
    (and not answered)."""
    chat = check_template(tokenizer, cfg)  # refused here, before any request
    render = renderer(tokenizer, chat)
    settings = {k: store.provenance[k] for k in ("target_config_sha256", "settings")}
    answered, seen = store.answered_ids() | store.dropped_ids(), set()
    todo, rejected, rows, done = [], [], 0, 0
    tool_calls = renders_tool_calls(tokenizer)
    for i, row in read_rows(Path(source), rows=only):
        try:
            if isinstance(row, Rejected):
                raise ValueError(row.reason)
            messages = to_messages(row, tool_calls=tool_calls, markers=(chat.start, chat.end))
            tools = row_tools(row)
            check_rendered(render, messages, tools)
            answer_points(messages, cfg.turns)
        except ValueError as e:
            rejected.append(Rejected(i, str(e)))
            continue
        rid = row_id(messages, settings, tools)
        if rid in seen:
            rejected.append(Rejected(i, f"the same conversation as an earlier row ({rid})"))
            continue
        seen.add(rid)
        rows += 1
        if rid in answered:
            done += 1
            continue
        extra = (("id", row["id"]),) if "id" in row else ()
        todo.append(Conversation(rid, i, tuple(messages), extra, tuple(tools or ())))
    if not rows:
        why = f"e.g. row {rejected[0].source_row}: {rejected[0].reason}" if rejected else "it holds no rows"
        raise ValueError(f"dataset {source} has no conversation to answer ({why}): give rows of messages or "
                         f"conversations with a user turn")
    return RegenerationPlan(todo, rows, done, rejected, (min(only), max(only)) if only else None)


@dataclass
class BatchAnswers:
    shard: str | None
    rows: int
    answer_tokens: int
    seconds: float
    quarantined: list[str] = field(default_factory=list)
    cut: int = 0  # rows stored with their last answer cut (on_truncated keep)
    dropped: int = 0  # conversations not stored for a cut answer (on_truncated drop)


def answer_batch(asker: Asker, store: AnswerStore, batch: Sequence[Conversation], pool: AnswerPool, *,
                 on_down: Callable[[], None] | None = None) -> BatchAnswers:
    """Answer a batch through the run's pool and commit it as one shard.
    Each conversation gets up to cfg.attempts tries; one failing them all
    (or refused by SGLang, which a retry cannot change) is quarantined with
    its last error, the rest stored; an answer cut at max_new_tokens is
    kept marked, dropped or quarantined (cfg.on_truncated). If the server
    stops answering, the conversations in flight are counted against it,
    `on_down` makes it serve again (or raises), and ServerDown is raised so
    the batch is retried."""
    t0 = time.perf_counter()
    answered = store.answered_among([c.row_id for c in batch])
    pending = [c for c in batch if c.row_id not in answered]
    crashes = store.crash_counts()
    culprits = [c for c in pending if crashes.get(c.row_id, 0) >= CRASH_LIMIT]
    store.quarantine([(c.row_id, c.source_row, "in flight at an SGLang server crash, then sent alone, it crashed the "
                       "server again: taken for the cause (see the server's log)", crashes[c.row_id])
                      for c in culprits])
    pending = [c for c in pending if c not in culprits]
    done: dict[str, dict] = {}
    errors: dict[str, str] = {}
    dropped: list[Conversation] = []
    drop_reasons: dict[str, str] = {}

    # What a quarantined row records: the tries of this run of the batch
    # (a refusal: 1); a batch task Prefect retried counts from 0 again.
    tries: dict[str, int] = {}

    def send(group: list[Conversation], attempt: int, alone: bool = False) -> list[Conversation]:
        for c in group:
            tries[c.row_id] = tries.get(c.row_id, 0) + 1
        outs = pool.answer_many(asker, group, attempt, alone=alone)
        stop = next((o for o in outs if isinstance(o, (PoolClosed, EndsRun))), None)
        if stop is not None:  # the run is stopping: nothing of this batch is quarantined or committed
            raise stop
        down = [o for o in outs if isinstance(o, Exception) and server_down(o)]
        if down and not server_healthy(asker.url, api_key=asker.api_key):
            in_flight = [c.row_id for c, o in zip(group, outs) if isinstance(o, Exception) and was_in_flight(o)]
            # Alone and the only one left in flight: nothing else can have crashed it.
            suspects = store.record_crash(in_flight, at_least=CRASH_LIMIT if alone and len(in_flight) == 1 else 0)
            # What was answered before the crash is kept: alone, each held a whole server.
            store.commit([done.pop(c.row_id) for c in batch if c.row_id in done] +
                         [o for o in outs if isinstance(o, dict)])
            if on_down is not None:
                on_down()
            raise ServerDown(f"SGLang server at {asker.url} stopped answering mid-batch ({down[0]!r}); the batch "
                             f"is retried. In flight, sent alone from now on (together, then one by one): "
                             f"{', '.join(f'{r} (crash {n})' for r, n in suspects.items()) or 'none'}")
        failed = []
        for c, out in zip(group, outs):
            if isinstance(out, Cut) and asker.cfg.on_truncated != "quarantine":
                dropped.append(c)  # drop, or keep with nothing to keep (reasoning cut before its end)
                drop_reasons[c.row_id] = str(out)
            elif isinstance(out, Exception):
                errors[c.row_id] = f"{type(out).__name__}: {out}"
                # Refused or cut, or no answer from a greedy target: another try gets the same.
                if isinstance(out, Permanent) or (isinstance(out, NoAnswer) and asker.cfg.temperature == 0):
                    given_up.append(c)
                else:
                    failed.append(c)
            else:
                done[c.row_id] = out
        return failed

    def ask(group: list[Conversation], attempt: int) -> list[Conversation]:
        # In flight at an earlier crash: alone (CRASH_LIMIT's ladder), on every try, so a crash then names them.
        failed = []
        for c in [c for c in group if crashes.get(c.row_id, 0) >= 2]:
            failed += send([c], attempt, alone=True)
        together = [c for c in group if crashes.get(c.row_id, 0) == 1]
        for i in range(0, len(together), pool.width):
            failed += send(together[i:i + pool.width], attempt, alone=True)
        crowd = [c for c in group if not crashes.get(c.row_id, 0)]
        return failed + (send(crowd, attempt) if crowd else [])

    given_up: list[Conversation] = []
    for attempt in range(1, asker.cfg.attempts + 1):
        if not pending:
            break
        if attempt > 1:
            logger.warning("asking again for %d conversations (attempt %d of %d); last error: %s", len(pending),
                           attempt, asker.cfg.attempts, errors[pending[-1].row_id])
        pending = ask(pending, attempt)
    shard = store.commit([done[c.row_id] for c in batch if c.row_id in done])
    quarantined = given_up + pending
    store.quarantine([(c.row_id, c.source_row, errors[c.row_id], tries[c.row_id]) for c in quarantined])
    store.drop([(c.row_id, c.source_row, f"{drop_reasons[c.row_id]}; dropped (regenerate.on_truncated: "
                 f"{asker.cfg.on_truncated})") for c in dropped])
    for c in quarantined:
        logger.error("quarantined row %d (%s): %s", c.source_row, c.row_id, errors[c.row_id])
    return BatchAnswers(shard, len(done), sum(r["answer_tokens"] for r in done.values()), time.perf_counter() - t0,
                        [c.row_id for c in culprits + quarantined], cut=sum(r["cut"] for r in done.values()),
                        dropped=len(dropped))


@dataclass
class Progress:
    """Progress read from the index, never from logs or listings."""
    store: AnswerStore
    plan: RegenerationPlan
    t0: float = field(default_factory=time.perf_counter)
    start: dict = field(init=False)

    def __post_init__(self):
        self.start = self.store.summary(self.plan.span)

    def read(self) -> dict:
        now = self.store.summary(self.plan.span)
        rows, tokens = now["rows"] - self.start["rows"], now["answer_tokens"] - self.start["answer_tokens"]
        cut, dropped = now["cut"] - self.start["cut"], now["dropped"] - self.start["dropped"]
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        todo, settled = len(self.plan.todo), rows + dropped
        return {"rows": rows, "todo": todo, "answer_tokens": tokens, "tokens_per_s": tokens / elapsed,
                "eta_s": (todo - settled) * elapsed / settled if settled else None, "quarantined": now["quarantined"],
                "cut": cut, "dropped": dropped, "percent": 100.0 * settled / todo if todo else 100.0}

    def check(self, max_ratio: float, min_tried: int = 100) -> None:
        """Stop the run when more than `max_ratio` of the conversations tried failed."""
        p = self.read()
        tried = p["rows"] + p["quarantined"] - self.start["quarantined"]
        failed = p["quarantined"] - self.start["quarantined"]
        if tried >= min_tried and failed > max_ratio * tried:
            raise TooManyQuarantined(
                f"{failed} of {tried} conversations tried were quarantined (max_quarantine_ratio {max_ratio}); "
                f"stopping: the {p['rows']} answered are kept. Fix the server or the settings (see the "
                f"quarantine's reasons in {self.store.root}) and rerun, which asks again for the rest")

    @staticmethod
    def describe(p: dict) -> str:
        eta = "?" if p["eta_s"] is None else f"{p['eta_s'] / 60:.1f} min"
        return (f"{p['rows']}/{p['todo']} conversations ({p['percent']:.1f}%), {p['answer_tokens']:,} tokens "
                f"generated at {p['tokens_per_s']:.0f} tok/s, ETA {eta}, cut at max_new_tokens {p['cut']} kept "
                f"+ {p['dropped']} dropped, quarantined {p['quarantined']}")


def served_ranks(url: str, api_key: str | None = None) -> int:
    """The data-parallel ranks of the server at `url` as it runs (replicas,
    or attention groups under DP attention: SGLang refuses both above 1),
    from its /server_info: a node's server is not described by the run's
    own server section."""
    info = server_says(url, "/server_info", "dp_size", "its data-parallel size", api_key=api_key)
    groups = server_says(url, "/server_info", "attn_dp_size", "its attention DP size", api_key=api_key)
    return max(int(info or 1), int(groups or 1))


def batch_workers(width: int, batch_size: int) -> int:
    """Batch tasks that keep a pool of `width` full: one more than the
    batches its width spans (a batch waiting on its slowest answer holds a
    worker, not the server)."""
    return -(-width // batch_size) + 1


def regenerate(url: str, source: Path, out: Path, tokenizer, model_path: Path, cfg: RegenerateConfig = RegenerateConfig(),
               *, api_key: str | None = None, rid_prefix: str = "regen-", ranks: int = 1, transport=None) -> dict:
    """The whole stage on a running server, without Prefect (scripts,
    benchmarks): the answers into `out`, batches committed as they fill,
    cfg.concurrency conversations in flight per data-parallel rank; its
    summary, with the pool's mean and peak width."""
    from concurrent.futures import ThreadPoolExecutor

    cfg = pin_date(cfg, tokenizer, out)
    store = AnswerStore(out, provenance(source, model_path, cfg, tokenizer))
    plan = plan_regeneration(source, store, cfg, tokenizer)
    if plan.todo:  # a rerun with nothing to answer asks no server
        differs = store.check_served(served_flags(url, api_key), url)
        if differs:
            logger.warning(differs)
    asker = Asker(url, tokenizer, cfg, api_key=api_key, rid_prefix=rid_prefix)
    progress = Progress(store, plan)
    width = cfg.concurrency * ranks
    # The pool closes first on the way out: a batch still in it ends (PoolClosed)
    # instead of keeping the workers' exit waiting.
    with ThreadPoolExecutor(batch_workers(width, cfg.batch_size)) as workers, \
            AnswerPool(width, api_key=api_key, transport=transport, timeout_s=cfg.request_timeout_s) as pool:
        futures = [workers.submit(answer_batch, asker, store, b, pool) for b in plan.batches(cfg.batch_size)]
        try:
            for done in futures:
                done.result()
                logger.info("progress: %s", progress.describe(progress.read()))
                progress.check(cfg.max_quarantine_ratio)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        flight = {"mean_in_flight": pool.mean_in_flight(), "peak_in_flight": pool.peak}
    return {**store.summary(), **flight, "rejected": len(plan.rejected), "seconds": time.perf_counter() - progress.t0}
