"""A folder written whole or not at all: filled under a temporary name
beside its place, fsynced, then swapped in (an export SGLang may be reading,
or a server may be loading, is never seen half-written)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable


def write_dir_atomically(out_dir: Path, fill: Callable[[Path], None]) -> Path:
    """`fill(tmp)` writes the folder's files into tmp; then tmp replaces
    `out_dir` (an old one is deleted only once the new one is in place)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    fill(tmp)
    _fsync_tree(tmp)
    _swap_in(tmp, out_dir)
    return out_dir


def _fsync_tree(directory: Path) -> None:
    for path in [*directory.iterdir(), directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _swap_in(new: Path, out_dir: Path) -> None:
    """Put `new` at `out_dir`; the old export is deleted only once the new
    one is in place, so a crash never leaves neither. Linux exchanges the two
    atomically; elsewhere the old one is first renamed aside (a crash in that
    instant leaves it there, whole, under .<name>.old-<pid>)."""
    if not out_dir.exists():
        os.replace(new, out_dir)
        return
    if _exchange(new, out_dir):
        shutil.rmtree(new)  # now the old export
        return
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    os.replace(out_dir, old)
    os.replace(new, out_dir)
    shutil.rmtree(old)


def _exchange(a: Path, b: Path) -> bool:
    """renameat2(RENAME_EXCHANGE); False where the OS or filesystem lacks it."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
