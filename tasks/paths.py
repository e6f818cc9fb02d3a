"""Where the project keeps what it builds and ships.

Everything heavy (converted checkpoints, the libcuda stub, test models) lives
in one git-ignored cache so a clean clone stays small and set-up is idempotent.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"


def cache_root() -> Path:
    """`$EAGLE3_CACHE_DIR`, else `.cache/` in the repository."""
    root = Path(os.environ.get("EAGLE3_CACHE_DIR", REPO_ROOT / ".cache"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def default_dump_root() -> Path:
    """Captures are written once and read back at once: RAM-backed /dev/shm
    keeps them off the disk that holds the store, where it exists. One root
    per user: /dev/shm is world-writable, and a shared, predictable name
    could be created first by someone else."""
    shm = Path("/dev/shm")
    return shm / f"eagle3-dumps-{os.getuid()}" if shm.is_dir() else cache_root() / "dumps"


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and a missing parent chain) readable by this user only,
    or check that an existing one is a real directory this user owns that no
    one else can write to: anyone who can write there could plant symlinks
    or swap dump files between the server writing them and the client
    reading them. Raises PermissionError saying what is wrong."""
    path = Path(path)
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a directory but a {'symlink' if stat.S_ISLNK(st.st_mode) else 'file'}: "
                              "remove it, or choose another dump dir")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): another user "
                              "could read or replace the dumps there; remove it, or choose another dump dir")
    if st.st_mode & 0o022:
        raise PermissionError(f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): they could "
                              f"plant or swap dump files; `chmod go-w {path}`, or choose another dump dir")
    return path
