"""A private PostgreSQL server for one test session: its own data dir,
loopback only, a free port, password authentication (so a test can check the
password never lands in a store), stopped at the end. Never a system service.

PostgreSQL refuses to run as root; the tests do run as root here, so the
server runs as `nobody` (runuser) from a data dir that user owns. That dir
lives in a fresh /tmp directory rather than pytest's tmp dir, which is 0700
root and so closed to `nobody`.
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

USER, PASSWORD, DBNAME = "eagle3", "s3cret-not-in-store", "eagle3"


def find_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if not found:
        raise RuntimeError(f"PostgreSQL's {name} is not on PATH nor under /usr/lib/postgresql/*/bin: install "
                           f"Debian's postgresql package (scripts/test.sh does: apt-get install postgresql)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            os.chmod(self.root, 0o755)
            self.as_user = ["runuser", "-u", "nobody", "--"]
        self.data.mkdir()
        pwfile = self.root / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if os.geteuid() == 0:
            shutil.chown(self.data, "nobody")
            shutil.chown(pwfile, "nobody")
        self._run(find_bin("initdb"), "-D", str(self.data), "-U", USER, "--pwfile", str(pwfile),
                  "-A", "scram-sha-256", "-E", "UTF8", "--no-sync")
        pwfile.unlink()
        # Loopback only; the socket dir is the data dir (never /var/run).
        self._run(find_bin("pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "-l", str(self.data / "log"),
                  "-o", f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.data} -c fsync=off "
                        f"-c max_connections=200", "start")
        self.url = f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{self.port}/postgres"
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as db:
            db.execute(f"CREATE DATABASE {DBNAME}")
        self.url = f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{DBNAME}"

    def _run(self, *cmd: str) -> None:
        r = subprocess.run([*self.as_user, *cmd], capture_output=True, text=True, cwd=self.root)
        if r.returncode:
            log = (self.data / "log").read_text()[-2000:] if (self.data / "log").exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}{log}")

    def stop(self) -> None:
        try:
            self._run(find_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def start() -> PostgresServer:
    for attempt in range(3):  # the free port may be taken between probe and start
        try:
            return PostgresServer()
        except RuntimeError:
            if attempt == 2:
                raise
            time.sleep(1)
    raise AssertionError("unreachable")
