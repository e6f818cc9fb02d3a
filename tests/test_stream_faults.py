"""Stream mode at the size it exists for (#39): the faults of many ranks,
many nodes and long runs, each injected for real."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tasks.stream.state import trainer_waiting

REPO = Path(__file__).resolve().parent.parent


def test_trainer_processes_of_the_same_pid_on_other_hosts_each_say_what_they_wait_for(tmp_path):
    """Ranks on different hosts (or in containers) share pid numbers: two
    trainer processes, each the first process of a pid namespace of its
    own (pid 1 both), wait for different samples at once; the capture sees
    both, not one file the other overwrote."""
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from tasks.stream.state import mark_waiting
        assert os.getpid() == 1
        mark_waiting({str(tmp_path)!r}, sys.argv[1])
        open(sys.argv[2], "w").close()
        time.sleep(60)
    """)
    procs = [subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", script, what,
                               str(tmp_path / f"ready-{k}")]) for k, what in enumerate(("sample a", "sample b"))]
    try:
        while not all((tmp_path / f"ready-{k}").exists() for k in range(2)):
            assert all(p.poll() is None for p in procs)
            time.sleep(0.05)
        assert sorted(w["waiting_for"] for w in trainer_waiting(tmp_path)) == ["sample a", "sample b"]
    finally:
        for p in procs:
            p.kill()
            p.wait()
