"""The answers' pool: one object holds a run's requests to its server, so
the server always has `width` conversations to work on.

Batches stay the unit of commit (answer_store.py writes one shard a batch)
and of Prefect's retries, but no longer of scheduling: every batch task of
a run hands its conversations to the same pool, each conversation starts
as soon as any other finishes, and a batch waiting for its slowest answer
holds one slot, not the server. Before, two batch tasks each sent
min(concurrency, batch) requests and a batch ended only with its longest
answer: with long-tailed reasoning the server idled behind the tails.

A batch is admitted only while fewer than `width` conversations wait or
run, so the pool holds at most width + one batch, however many batch tasks
Prefect starts. Conversations sent `alone` (in flight at a server crash:
suspects) wait until nothing else is in flight and hold every slot while
they run together, so a crash then names them, whichever batch task sent
the others.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import CancelledError, Future
from typing import Sequence

import httpx

from tasks.failures import Permanent
from tasks.regeneration.answers import Asker, answer
from tasks.regeneration.turns import Conversation
from tasks.sglang_api import client_options


class PoolClosed(Permanent, RuntimeError):
    """The run closed its pool (it is stopping): not retried."""


class AnswerPool:
    """`width` conversations in flight on one server, from any thread."""

    def __init__(self, width: int, *, api_key: str | None = None, transport=None, timeout_s: float = 3600.0):
        if width < 1:
            raise ValueError(f"an answer pool needs a width of at least 1, not {width}")
        self.width = width
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="answer-pool", daemon=True)
        self._thread.start()
        self._admitted = 0
        self._room = threading.Condition()
        self._closed = False
        # For the bench and the logs: how many were in flight, over time.
        self.in_flight = self.peak = 0
        self._flight_area, self._flight_since, self._t0 = 0.0, time.perf_counter(), time.perf_counter()
        self._client, self._slots, self._solo = self._call(self._start(api_key, transport, timeout_s)).result()

    async def _start(self, api_key, transport, timeout_s):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=self.width)
        client = httpx.AsyncClient(timeout=timeout_s, limits=limits, **client_options(api_key, transport))
        return client, asyncio.Semaphore(self.width), asyncio.Lock()

    def _call(self, coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def answer_many(self, asker: Asker, conversations: Sequence[Conversation], attempt: int = 1, *,
                    alone: bool = False) -> list[dict | Exception]:
        """Each conversation's answers row, or the exception that stopped
        it, in order, once all have ended; blocks while the pool is full.
        With `alone`, they run together with nothing else in flight."""
        # Built here, in the caller's thread: not on the loop every answer in flight waits on.
        _ = (asker.template, asker.marker)
        with self._room:
            self._room.wait_for(lambda: self._closed or self._admitted < self.width)
            if self._closed:
                raise PoolClosed("the run's answer pool is closed: the run is stopping")
            self._admitted += len(conversations)
            # Scheduled under the lock close() takes: it cancels every one of them.
            if alone:
                futures = [self._call(self._alone(asker, list(conversations), attempt))]
            else:
                futures = [self._call(self._one(asker, c, attempt)) for c in conversations]
        try:
            results = [f.result() for f in futures]
        except (CancelledError, RuntimeError) as e:  # the loop went while one was scheduled
            raise PoolClosed(f"the run's answer pool closed: {e!r}") from e
        return results[0] if alone else results

    async def _one(self, asker: Asker, conv: Conversation, attempt: int):
        try:
            async with self._slots:
                return await self._settled(asker, conv, attempt)
        except asyncio.CancelledError:  # close() while it waited for a slot
            return PoolClosed("the run's answer pool closed while the conversation waited")
        finally:
            self._leave(1)

    async def _alone(self, asker: Asker, conversations: list[Conversation], attempt: int) -> list:
        taken = 0
        try:
            async with self._solo:
                for _ in range(self.width):
                    await self._slots.acquire()
                    taken += 1
                return list(await asyncio.gather(*(self._settled(asker, c, attempt) for c in conversations)))
        except asyncio.CancelledError:  # close(): the run is stopping
            return [PoolClosed("the run's answer pool closed while the conversation waited")] * len(conversations)
        finally:
            for _ in range(taken):
                self._slots.release()
            self._leave(len(conversations))

    async def _settled(self, asker: Asker, conv: Conversation, attempt: int):
        """The answers row, or the exception that stopped it."""
        try:
            return await self._run(asker, conv, attempt)
        except asyncio.CancelledError:  # close(): the run is stopping
            return PoolClosed("the run's answer pool closed while the conversation was in flight")
        except Exception as e:  # noqa: BLE001 - the batch decides: retried, quarantined, or the server's
            return e

    def _leave(self, n: int) -> None:
        with self._room:
            self._admitted -= n
            self._room.notify_all()

    async def _run(self, asker: Asker, conv: Conversation, attempt: int) -> dict:
        self._count(+1)
        try:
            return await answer(self._client, asker, conv, attempt)
        finally:
            self._count(-1)

    def _count(self, step: int) -> None:
        now = time.perf_counter()
        self._flight_area += self.in_flight * (now - self._flight_since)
        self._flight_since, self.in_flight = now, self.in_flight + step
        self.peak = max(self.peak, self.in_flight)

    def mean_in_flight(self) -> float:
        """Conversations in flight, averaged over the pool's life so far."""
        now = time.perf_counter()
        area = self._flight_area + self.in_flight * (now - self._flight_since)
        return area / max(now - self._t0, 1e-9)

    def close(self) -> None:
        """Stop: what waits for room is refused, what is in flight is
        cancelled (its batch gets PoolClosed), so no batch task outlives
        the run."""
        with self._room:
            if self._closed:
                return
            self._closed = True
            self._room.notify_all()
            stopping = self._call(self._cancel_all())
        stopping.result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    async def _cancel_all(self) -> None:
        while pending := [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self._client.aclose()
        await self._loop.shutdown_default_executor()  # the template renders (asyncio.to_thread)

    def __enter__(self) -> "AnswerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
