"""Replacing a file durably: after a crash or power loss the name holds the
old file or the new one, never a torn or empty one. Used for everything a
later run trusts: the manifest, the verification summary, checkpoints, the
sealed index; and a folder, the exported drafters."""
from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Callable


def replace_durably(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` fills a temp file beside `path`; it is fsynced, renamed
    over `path`, and the directory fsynced so the rename survives too. The
    temp name is per process and thread, and is removed if anything fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.unlink(missing_ok=True)
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync(path.parent)


def replace_dir_durably(out_dir: Path, fill: Callable[[Path], None]) -> Path:
    """A folder written whole or not at all (an export SGLang may be reading
    or loading is never seen half-written): `fill(tmp)` writes its files into
    a temporary folder beside it, which is fsynced and then replaces
    `out_dir` (an old one is deleted only once the new one is in place), and
    the parent fsynced so the swap survives too, as replace_durably's
    rename does."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    fill(tmp)
    for path in [*tmp.iterdir(), tmp]:
        _fsync(path)
    _swap_in(tmp, out_dir)
    _fsync(out_dir.parent)
    return out_dir


def _fsync(path: Path) -> None:
    """A file's data, or a directory's entries, on disk."""
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
