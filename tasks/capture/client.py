"""The client side of a capture: send token ids under a fresh rid, then read
back exactly that rid's dump and check it against what was sent.

Nothing here looks at what else is in the dump directory: a capture is found
by its rid alone, so any number of requests can be in flight at once.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import httpx

from tasks.capture.dump import Capture, CaptureError, discard_rid, new_rid, read_capture, remove_capture
from tasks.server.launch import ServerError, ssl_context

T = TypeVar("T")


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
    aux_layer_ids: Sequence[int] | None = None,
) -> Capture:
    """Prefill `input_ids` (no generation) and return its checked capture."""
    rid = new_rid(tag)
    response = await client.post(f"{url}/generate", json={
        "input_ids": [int(i) for i in input_ids],
        "sampling_params": {"max_new_tokens": 0},
        "rid": rid,
    })
    if response.status_code != 200:
        raise CaptureError(f"rid {rid}: server answered HTTP {response.status_code}: {response.text[:300]}")
    # The hook writes during the forward, so the dump exists once the
    # response has arrived.
    try:
        check_meta(response.json()["meta_info"], rid, len(input_ids))
        return read_capture(dump_dir, rid, input_ids, aux_layer_ids=aux_layer_ids)
    except CaptureError:
        discard_rid(dump_dir, rid)  # the retry uses a fresh rid; leave nothing behind
        raise


def capture_many(
    url: str,
    dump_dir: Path,
    id_lists: Sequence[Sequence[int]],
    consume: Callable[[int, Capture], T],
    *,
    concurrency: int = 8,
    aux_layer_ids: Sequence[int] | None = None,
    timeout_s: float = 600.0,
) -> list[T | Exception]:
    """Capture every list of ids with at most `concurrency` requests in
    flight. `consume(i, capture)` runs as each capture arrives; the dump
    files are deleted after it returns. Returns, per input, what `consume`
    returned or the exception that request ended with."""

    async def run() -> list:
        limit = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits, verify=ssl_context()) as client:

            async def one(i: int, ids: Sequence[int]):
                async with limit:
                    capture = await capture_one(client, url, dump_dir, ids, tag=str(i), aux_layer_ids=aux_layer_ids)
                try:
                    return consume(i, capture)
                finally:
                    remove_capture(capture)

            return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(id_lists)), return_exceptions=True)

    return asyncio.run(run())


def probe_capture(url: str, dump_dir: Path, *, num_tokens: int = 16, aux_layer_ids=None) -> dict:
    """Send one small request and check its capture round-trips: the dump
    holds exactly the ids sent, `prompt_tokens` equals their count, nothing
    came from the prefix cache, the values are finite. Returns a summary."""
    ids = list(range(1, num_tokens + 1))

    async def probe():
        async with httpx.AsyncClient(timeout=120.0, verify=ssl_context()) as client:
            return await capture_one(client, url, dump_dir, ids, tag="probe", aux_layer_ids=aux_layer_ids)

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
