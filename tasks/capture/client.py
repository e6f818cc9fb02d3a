"""The client side of a capture: send token ids under a fresh rid, then read
back exactly that rid's dump and check it against what was sent.

Nothing here looks at what else is in the dump directory: a capture is found
by its rid alone, so any number of requests can be in flight at once. Every
rid starts with the capture server's own prefix (the hook captures nothing
else) and every request carries the server's API key. Dumps
are read and checked in a pool of threads (safetensors reads and torch's
checks release the GIL), so the event loop keeps sending while they load.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import httpx

from tasks.capture.config import CaptureConfig
from tasks.capture.dump import (
    RID_PREFIX, Capture, CaptureError, CaptureMissing, CaptureRefused, discard_rid, new_rid, read_capture, remove_capture,
)
from tasks.sglang_api import ServerError, client_options
from tasks.store.shards import default_workers

T = TypeVar("T")
# Checks a capture against the server's answer to its request (meta_info,
# with the logprobs of its prompt): tasks/capture/canary.py checker.
Canary = Callable[[Capture, dict], object]

# The hook hands dumps to a background writer (tasks/capture/writer.py), so
# the HTTP response can arrive before the file is renamed into place. How
# long to wait for it: the writer's queue is bounded (the forward blocks when
# it is full), so a healthy one is at most a second or so behind; a dump
# still missing after this is one the writer failed to write.
DUMP_WAIT_S = 10.0
# Answers about the request itself, the same on every try (401 and 403 are
# not among them: a wrong key is the run's fault, not the sample's).
REFUSALS = (400, 413, 422)


def check_meta(meta: dict, rid: str, num_sent: int) -> None:
    """The server's own account of the request must match what was sent."""
    if meta.get("id") != rid:
        raise CaptureError(f"server answered for rid {meta.get('id')!r}, sent {rid}")
    if meta.get("prompt_tokens") != num_sent:
        raise CaptureError(f"rid {rid}: server saw {meta.get('prompt_tokens')} prompt tokens, {num_sent} were sent")
    if meta.get("cached_tokens", 0):
        raise CaptureError(
            f"rid {rid}: {meta['cached_tokens']} tokens came from the prefix cache and were "
            "not recomputed; start the server with --disable-radix-cache"
        )


async def capture_one(
    client: httpx.AsyncClient,
    url: str,
    dump_dir: Path,
    input_ids: Sequence[int],
    *,
    tag: str = "",
    rid_prefix: str = RID_PREFIX,
    aux_layer_ids: Sequence[int] | None = None,
    executor: Executor | None = None,
    dump_wait_s: float = DUMP_WAIT_S,
    canary: Canary | None = None,
    failed: list[str] | None = None,
) -> Capture:
    """Prefill `input_ids` (no generation) and return its checked capture,
    read in `executor` (the loop's default one if None). `client` carries
    the server's API key (client_options); `rid_prefix` is the server's.
    With a `canary`, the same request asks for every prompt token's logprob
    and `canary(capture, logprobs)` checks the capture against them (in
    `executor`); what it returns is kept as `capture.canary`. A failed
    attempt's rid is appended to `failed`, its dump removed."""
    rid = new_rid(tag, rid_prefix)
    request = {"input_ids": [int(i) for i in input_ids], "sampling_params": {"max_new_tokens": 0}, "rid": rid}
    if canary is not None:
        request |= {"return_logprob": True, "logprob_start_len": 0}
    try:
        response = await client.post(f"{url}/generate", json=request)
        if response.status_code in REFUSALS:
            raise CaptureRefused(f"rid {rid}: server refused the request, HTTP {response.status_code}: "
                                 f"{response.text[:300]}")
        if response.status_code != 200:
            raise CaptureError(f"rid {rid}: server answered HTTP {response.status_code}: {response.text[:300]}")
        try:
            meta = response.json()["meta_info"]
        except (ValueError, KeyError, TypeError):
            raise CaptureError(f"rid {rid}: {url} answered HTTP 200 without SGLang's JSON (no meta_info): "
                               f"{response.text[:120]!r}; is it an SGLang server?") from None
        check_meta(meta, rid, len(input_ids))
        read = partial(read_capture, dump_dir, rid, input_ids, aux_layer_ids=aux_layer_ids)
        capture = await _read_when_written(read, dump_wait_s, executor)
        if canary is not None:
            capture.canary = await asyncio.get_running_loop().run_in_executor(executor, canary, capture, meta)
        return capture
    except BaseException:
        # Whatever ended the attempt (a bad capture, a timeout, the server
        # going down, cancellation), its dump must not stay in the (RAM-backed)
        # dump dir; one the writer lands later is swept by the caller (failed).
        discard_rid(dump_dir, rid)
        if failed is not None:
            failed.append(rid)
        raise


async def _read_when_written(read: Callable[[], Capture], wait_s: float, executor: Executor | None) -> Capture:
    """The server has answered, so the forward ran and the hook has queued
    the dump, but its writer thread may not have renamed every chunk into
    place yet: poll (short sleeps, growing to 50 ms) until the chain is whole
    or `wait_s` has passed. Plain polling needs nothing from the filesystem
    (no inotify), so it works on any dump dir, shared memory included."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + wait_s
    delay = 0.001
    while True:
        try:
            return await loop.run_in_executor(executor, read)
        except CaptureMissing as e:
            if time.monotonic() >= deadline:
                raise CaptureMissing(f"{e} (waited {wait_s:.0f} s for the hook's writer)") from None
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


def capture_many(
    url: str,
    dump_dir: Path,
    id_lists: Sequence[Sequence[int]],
    consume: Callable[[int, Capture], T],
    *,
    api_key: str | None = None,
    rid_prefix: str = RID_PREFIX,
    concurrency: int = CaptureConfig.model_fields["concurrency"].default,
    aux_layer_ids: Sequence[int] | None = None,
    timeout_s: float = CaptureConfig.model_fields["request_timeout_s"].default,
    read_workers: int | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    dump_wait_s: float = DUMP_WAIT_S,
    canaries: dict[int, Canary] | None = None,
    failed: list[str] | None = None,
) -> list[T | Exception]:
    """Capture every list of ids with at most `concurrency` requests in
    flight. `consume(i, capture)` runs as each capture arrives; the dump
    files are deleted after it returns. Returns, per input, what `consume`
    returned or the exception that request ended with (in input order).
    `api_key` and `rid_prefix` are the capture server's (ServerHandle and
    ServerSupervisor have both). `read_workers` threads read and check dumps
    (default: one per core, at most 8); `transport` replaces the network
    (benchmarks, tests); `canaries` maps an input's index to the canary
    its capture is checked with (capture_one); `failed` collects the rids
    of failed requests (a dump can land after its request failed: sweep
    them later with discard_rid)."""

    async def run(pool: Executor) -> list:
        limit = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        options = client_options(api_key, transport)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits, **options) as client:

            async def one(i: int, ids: Sequence[int]):
                async with limit:
                    capture = await capture_one(client, url, dump_dir, ids, tag=str(i), rid_prefix=rid_prefix,
                                                aux_layer_ids=aux_layer_ids, executor=pool,
                                                dump_wait_s=dump_wait_s, canary=(canaries or {}).get(i),
                                                failed=failed)
                try:
                    return consume(i, capture)
                finally:
                    remove_capture(capture)

            return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(id_lists)), return_exceptions=True)

    with ThreadPoolExecutor(max_workers=read_workers or default_workers(), thread_name_prefix="dump-read") as pool:
        return asyncio.run(run(pool))


def probe_capture(url: str, dump_dir: Path, *, api_key: str | None = None, rid_prefix: str = RID_PREFIX,
                  num_tokens: int = 16, aux_layer_ids=None) -> dict:
    """Send one small request and check its capture round-trips: the dump
    holds exactly the ids sent, `prompt_tokens` equals their count, nothing
    came from the prefix cache, the values are finite. Returns a summary."""
    ids = list(range(1, num_tokens + 1))

    async def probe():
        async with httpx.AsyncClient(timeout=120.0, **client_options(api_key)) as client:
            return await capture_one(client, url, dump_dir, ids, tag="probe", rid_prefix=rid_prefix,
                                     aux_layer_ids=aux_layer_ids)

    try:
        capture = asyncio.run(probe())
    except (CaptureError, httpx.HTTPError) as e:
        raise ServerError(f"probe capture against {url} failed: {e}") from e
    remove_capture(capture)
    return {
        "tokens": capture.num_tokens,
        "aux_layer_ids": list(capture.aux_layer_ids),
        "hidden_size": int(capture.final_hidden_state.shape[-1]),
        "dtype": str(capture.final_hidden_state.dtype).removeprefix("torch."),
    }
