"""The hook's background dump writer: the forward hands each request's states
over and returns; a thread writes the dump files while the scheduler runs the
next batch.

- Hand-off. On CUDA the states are first cloned on the forward's own stream
  (later kernels may overwrite the originals: static input buffers under
  CUDA graphs, in-place ops; a device clone costs well under a millisecond at
  HBM speed and is ordered before them), then copied to pinned host memory
  on a side stream that waits for that clone, so the PCIe copy overlaps the
  next forward; a CUDA event marks its end and the writer thread, never the
  scheduler, waits on it. `record_stream` keeps the caching allocator from
  reusing the clones' memory before the copy has read them. On a CPU the
  states are copied (the server may reuse its buffers). Either way in the
  model's dtype: nothing is upcast.
- Bounded memory. At most `max_pending_bytes` of copies wait for the writer
  (one hand-off larger than that is let through alone). When the writer falls
  behind, `submit` blocks the forward until there is room, and says so in the
  log: back-pressure, never a crash and never an unbounded queue.
- Errors. A failed write is logged and costs only that request's dump (the
  client's bounded wait for it then fails, and the pipeline retries the
  sample under a new rid). Files are written by
  `tasks.capture.dump.write_chunk`, so the atomic rename and rid keying of
  the dump contract are unchanged.

This module is imported inside the SGLang server process: keep it light.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from tasks.capture.dump import write_chunk

logger = logging.getLogger("eagle3.capture_writer")

DEFAULT_MAX_PENDING_BYTES = 1 << 30


@dataclass
class _Job:
    rid: str
    start: int
    tensors: tuple  # host input_ids, aux, final
    aux_layer_ids: tuple
    final_state: str
    nbytes: int
    ready: object = None  # a CUDA event to wait on before the host copies are valid


class DumpWriter:
    """One per hook (so one per scheduler process). `submit` from the forward,
    `flush` to wait until everything submitted is on disk, `close` at the end."""

    def __init__(self, dump_dir: Path, *, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 write: Callable = write_chunk):
        self.dump_dir = Path(dump_dir)
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        self.max_pending_bytes = int(max_pending_bytes)
        self._write = write
        self._jobs: collections.deque[_Job] = collections.deque()
        self._pending_bytes = 0
        self._unfinished = 0
        self._closed = False
        self._cond = threading.Condition()
        self._streams: dict = {}
        self.blocked_s = 0.0  # total time submit() waited for room (back-pressure)
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="eagle3-dump-writer", daemon=True)
        self._thread.start()

    def submit(self, rid: str, start: int, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
               aux_layer_ids: Sequence[int], final_state: str) -> None:
        """Queue one chunk of one request. Returns once the copies are issued
        (CUDA) or taken (CPU), and there was room for them."""
        nbytes = sum(t.numel() * t.element_size() for t in (input_ids, aux, final))
        self._wait_for_room(nbytes)
        try:
            host, ready = self._to_host((input_ids, aux, final))
        except BaseException:
            self._release(nbytes)
            raise
        job = _Job(rid, int(start), host, tuple(int(i) for i in aux_layer_ids), final_state, nbytes, ready)
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()

    def _wait_for_room(self, nbytes: int) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("dump writer is closed")
            if self._fits(nbytes):
                self._reserve(nbytes)
                return
            t0 = time.monotonic()
            logger.warning("dump writer is behind (%d MiB waiting to be written, limit %d MiB): the forward waits "
                           "for it. A faster dump dir (local disk, /dev/shm) or fewer requests in flight avoids this",
                           self._pending_bytes >> 20, self.max_pending_bytes >> 20)
            self._cond.wait_for(lambda: self._fits(nbytes) or self._closed)
            if self._closed:
                raise RuntimeError("dump writer closed while the forward waited for it")
            waited = time.monotonic() - t0
            self.blocked_s += waited
            logger.warning("dump writer caught up after %.2f s", waited)
            self._reserve(nbytes)

    def _fits(self, nbytes: int) -> bool:
        return self._pending_bytes == 0 or self._pending_bytes + nbytes <= self.max_pending_bytes

    def _reserve(self, nbytes: int) -> None:
        self._pending_bytes += nbytes
        self._unfinished += 1

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self._pending_bytes -= nbytes
            self._unfinished -= 1
            self._cond.notify_all()

    def _to_host(self, tensors: tuple) -> tuple[tuple, object]:
        tensors = tuple(t.detach() for t in tensors)
        device = tensors[1].device
        if device.type != "cuda":
            return tuple(t.to("cpu", copy=True) for t in tensors), None
        forward_stream = torch.cuda.current_stream(device)
        tensors = tuple(t.clone() for t in tensors)  # on the forward's stream: see the module docstring
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        side.wait_stream(forward_stream)  # copy what the forward computed, not what was there before
        with torch.cuda.stream(side):
            host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                         for t in tensors)
        for t in tensors:
            if t.is_cuda:  # ids can come from the host
                t.record_stream(side)
        ready = torch.cuda.Event()
        ready.record(side)
        return host, ready

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return  # closed and drained
                job = self._jobs.popleft()
            try:
                if job.ready is not None:
                    job.ready.synchronize()
                self._write(self.dump_dir, job.rid, job.start, *job.tensors, job.aux_layer_ids, job.final_state)
            except Exception:
                self.errors += 1
                logger.exception("dump writer: writing rid %s (tokens from %d) failed; that request has no dump",
                                 job.rid, job.start)
            finally:
                job.tensors = ()
                self._release(job.nbytes)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted chunk is written (or failed). False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._unfinished == 0, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
