"""The capture contract between the hook inside SGLang and the pipeline.

One request = one rid the pipeline made up. For every prefill forward that
serves part of that request, the hook writes one chunk file

    <dump_dir>/<rid>@<start>.safetensors

holding the tokens [start, end) of the prompt:

    input_ids           int64 [n]
    aux_hidden_states   model dtype [n, N, H]   (ascending layer order)
    final_hidden_state  model dtype [n, H]      (after the final norm)

with metadata `rid`, `start`, `end`, `aux_layer_ids` (SGLang's "output of
layer i" ids, JSON), `hf_hidden_states_indices` (the same layers as HF
`hidden_states` indices) and `final_state`. A prompt served in one forward is one
file; chunked prefill gives one file per chunk, and each chunk's `end` names
the next file, so a reader follows the chain from `@0` without listing the
directory. Files appear atomically (temp name, then rename), so a file that
exists is whole.

This module is imported inside the SGLang server process: keep it light.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# The hook's default prefix, and what every prefix we draw starts with. It is
# public, so a server the launcher starts captures under a fresh random
# prefix instead (new_rid_prefix): a local process that does not know it
# cannot make the hook write. A server started without one (attach mode)
# captures this one.
RID_PREFIX = "e3-"
# A rid becomes a file name: plain characters only, bounded, and never a
# leading dot (no hidden files, no "." or "..").
RID_PATTERN = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")
# A prefix, a 64-character tag and a uuid must still fit RID_PATTERN.
RID_PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,29}$")
SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"


class CaptureError(RuntimeError):
    """A capture is missing or does not match what was sent."""


class CaptureRefused(CaptureError):
    """The server refused the request as such (HTTP 400, 413, 422: too long,
    a token id out of the vocabulary, ...): sending it again gets the same
    answer, so it is not retried."""


class CaptureMissing(CaptureError):
    """No (complete) capture exists for a rid."""


def is_safe_rid(rid: str) -> bool:
    return isinstance(rid, str) and RID_PATTERN.fullmatch(rid) is not None


def new_rid_prefix() -> str:
    """A fresh random prefix for one server: RID_PREFIX, 8 random hex digits, '-'."""
    return f"{RID_PREFIX}{secrets.token_hex(4)}-"


def check_rid_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not RID_PREFIX_PATTERN.fullmatch(prefix):
        raise ValueError(f"rid prefix {prefix!r} is not usable: it must be 1 to 30 of A-Z a-z 0-9 _ . - and not "
                         "start with a dot; give the rid_prefix the capture server's hook was started with")
    return prefix


def new_rid(tag: str = "", prefix: str = RID_PREFIX) -> str:
    """A fresh rid for one attempt at one request, under the capture
    server's `prefix`. Never reuse a rid: a retry gets a new one, so a late or
    stale dump can never be taken for it."""
    tag = re.sub(r"[^A-Za-z0-9_-]", "", tag)[:64]
    return f"{check_rid_prefix(prefix)}{tag + '-' if tag else ''}{uuid.uuid4().hex}"


def chunk_path(dump_dir: Path, rid: str, start: int) -> Path:
    if not is_safe_rid(rid):
        raise ValueError(f"unsafe rid {rid!r}: must match {RID_PATTERN.pattern}")
    return Path(dump_dir) / f"{rid}@{int(start)}{SUFFIX}"


def write_chunk(
    dump_dir: Path,
    rid: str,
    start: int,
    input_ids: torch.Tensor,
    aux_hidden_states: torch.Tensor,
    final_hidden_state: torch.Tensor,
    aux_layer_ids: Sequence[int],
    final_state: str,
) -> Path:
    """Write one chunk atomically: a reader sees the whole file or none."""
    path = chunk_path(dump_dir, rid, start)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    tensors = {
        "input_ids": input_ids.to(torch.int64).contiguous(),
        "aux_hidden_states": aux_hidden_states.contiguous(),
        "final_hidden_state": final_hidden_state.contiguous(),
    }
    metadata = {
        "rid": rid,
        "start": str(int(start)),
        "end": str(int(start) + int(input_ids.shape[0])),
        "aux_layer_ids": json.dumps([int(i) for i in aux_layer_ids]),
        # The same layers in HF's convention (hidden_states index = i + 1).
        "hf_hidden_states_indices": json.dumps([int(i) + 1 for i in aux_layer_ids]),
        "final_state": final_state,
    }
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


@dataclass
class Capture:
    rid: str
    input_ids: torch.Tensor  # int64 [n]
    aux_hidden_states: torch.Tensor  # [n, N, H]
    final_hidden_state: torch.Tensor  # [n, H]
    aux_layer_ids: tuple[int, ...]
    files: list[Path]
    canary: object | None = None  # the canary's result, when it was one (tasks/capture/canary.py)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def chunk_starts(self) -> list[int]:
        """Where each forward of a chunked prefill began (from the chunks' names)."""
        return [int(f.name[: -len(SUFFIX)].rsplit("@", 1)[1]) for f in self.files]


def read_capture(
    dump_dir: Path,
    rid: str,
    sent_ids: Sequence[int],
    *,
    aux_layer_ids: Sequence[int] | None = None,
) -> Capture:
    """Load the capture of `rid` and check it against what was sent.

    Raises CaptureMissing when no complete chain of chunks exists, and
    CaptureError when the ids, length, layers or values disagree.
    """
    dump_dir = Path(dump_dir)
    total = len(sent_ids)
    if total == 0:
        raise CaptureError(f"rid {rid}: nothing was sent")
    ids, aux, final, files = [], [], [], []
    layers = None
    start = 0
    while start < total:
        path = chunk_path(dump_dir, rid, start)
        if not path.exists():
            where = "no capture" if start == 0 else f"capture stops at token {start} of {total}"
            raise CaptureMissing(
                f"rid {rid}: {where} in {dump_dir} (expected {path.name}). Was the "
                "server started with the capture hook on this dump dir, and was the "
                "prompt served without the prefix cache (cached_tokens == 0)?"
            )
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            chunk_ids = f.get_tensor("input_ids")
            chunk_aux = f.get_tensor("aux_hidden_states")
            chunk_final = f.get_tensor("final_hidden_state")
        if meta.get("rid") != rid or int(meta.get("start", -1)) != start:
            raise CaptureError(f"{path.name}: written for rid {meta.get('rid')!r} at {meta.get('start')}, not {rid} at {start}")
        end = int(meta["end"])
        n = end - start
        if n <= 0 or chunk_ids.shape[0] != n or chunk_aux.shape[0] != n or chunk_final.shape[0] != n:
            raise CaptureError(f"{path.name}: token counts disagree ({meta}, shapes {tuple(chunk_ids.shape)}, "
                               f"{tuple(chunk_aux.shape)}, {tuple(chunk_final.shape)})")
        chunk_layers = tuple(json.loads(meta["aux_layer_ids"]))
        if layers is not None and chunk_layers != layers:
            raise CaptureError(f"{path.name}: aux layers {chunk_layers} differ from earlier chunks' {layers}")
        layers = chunk_layers
        ids.append(chunk_ids)
        aux.append(chunk_aux)
        final.append(chunk_final)
        files.append(path)
        start = end
    if start != total:
        raise CaptureError(f"rid {rid}: capture has {start} tokens, {total} were sent")
    def joined(parts):
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    capture = Capture(rid, joined(ids), joined(aux), joined(final), layers, files)
    sent = torch.as_tensor(sent_ids, dtype=torch.int64)
    if not torch.equal(capture.input_ids, sent):
        first = int((capture.input_ids != sent).nonzero()[0])
        raise CaptureError(f"rid {rid}: captured token ids differ from those sent (first at position {first})")
    if aux_layer_ids is not None and tuple(aux_layer_ids) != layers:
        raise CaptureError(f"rid {rid}: captured aux layers {layers}, expected {tuple(aux_layer_ids)}")
    if capture.aux_hidden_states.shape[1] != len(layers) or capture.aux_hidden_states.shape[2] != capture.final_hidden_state.shape[1]:
        raise CaptureError(f"rid {rid}: aux shape {tuple(capture.aux_hidden_states.shape)} does not fit "
                           f"{len(layers)} layers of width {capture.final_hidden_state.shape[1]}")
    for name in ("aux_hidden_states", "final_hidden_state"):
        finite = torch.isfinite(getattr(capture, name))
        if not finite.all():
            raise CaptureError(f"rid {rid}: {int((~finite).sum())} non-finite values in {name}")
    return capture


def remove_capture(capture: Capture) -> None:
    for path in capture.files:
        path.unlink(missing_ok=True)


def discard_rids(dump_dir: Path, rids: set[str]) -> int:
    """discard_rid for many rids in one listing of the directory (their
    chunks and the writer's temp files); returns how many files went.
    Cleanup only: never a source of progress."""
    if not rids:
        return 0
    try:
        entries = list(Path(dump_dir).iterdir())
    except FileNotFoundError:
        return 0  # no dump was ever written there
    removed = 0
    for path in entries:
        name = path.name.removeprefix(TMP_PREFIX)
        if SUFFIX in name and name.split("@", 1)[0] in rids:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def discard_rid(dump_dir: Path, rid: str) -> None:
    """Delete whatever a failed request left (its chain may be broken, so
    its chunks are found by name). Cleanup only: never a source of progress."""
    chunk_path(dump_dir, rid, 0)  # refuses an unsafe rid before globbing with it
    for path in Path(dump_dir).glob(f"{rid}@*{SUFFIX}"):
        path.unlink(missing_ok=True)
