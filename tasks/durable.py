"""Replacing a file durably: after a crash or power loss the name holds the
old file or the new one, never a torn or empty one. Used for everything a
later run trusts: the manifest, the verification summary, checkpoints, the
sealed index."""
from __future__ import annotations

import os
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
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
