"""The dump dir under hostile conditions (issue: /dev/shm is world-writable):
another user's directory, a world-writable one, a symlink in its place, and a
symlink planted at the write-check's name are each refused or defused before
any capture is trusted, and nothing outside the dump dir is written."""
import os
import stat

import pytest

from tasks.capture.dump import TMP_PREFIX
from tasks.capture.extraction import reset_dump_dir
from tasks.paths import default_dump_root, ensure_private_dir


def test_the_default_root_is_per_user():
    assert default_dump_root().name.endswith(f"-{os.getuid()}")


def test_a_new_dump_dir_is_private(tmp_path):
    d = ensure_private_dir(tmp_path / "a" / "dumps")
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700


def test_a_world_writable_dump_dir_is_refused(tmp_path):
    d = tmp_path / "dumps"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by other users.*chmod go-w"):
        reset_dump_dir(d)


def test_another_users_dump_dir_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.fail("this test plants a directory owned by another user, which needs root (CI runs as root)")
    d = tmp_path / "dumps"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)  # nobody
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        reset_dump_dir(d)


def test_a_symlink_in_place_of_the_dump_dir_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "dumps").symlink_to(target)
    with pytest.raises(PermissionError, match="not a directory but a symlink"):
        reset_dump_dir(tmp_path / "dumps")


def test_a_planted_write_check_symlink_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    d = ensure_private_dir(tmp_path / "dumps")
    (d / f"{TMP_PREFIX}write-check").symlink_to(victim)
    reset_dump_dir(d)
    assert victim.read_text() == "precious"
    assert list(d.iterdir()) == []
