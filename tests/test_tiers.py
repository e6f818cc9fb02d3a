"""The quick tier's rules (tests/tiers.py): which tests it leaves out, and
that a server started under it fails at once instead of running slowly."""
import os
import subprocess
import sys

import pytest

from tests.tiers import REPO, _QuickTierPopen, is_server_command


@pytest.mark.parametrize("cmd", [
    [sys.executable, "-m", "sglang.launch_server", "--model-path", "m"],
    [sys.executable, "-m", "flows.local_api", "4200", "1"],
    ["/venv/bin/prefect", "server", "start"],
    ["/venv/bin/prefect", "worker", "start", "--pool", "p"],
    ["/usr/lib/postgresql/15/bin/pg_ctl", "-D", "d", "start"],
    [sys.executable, "-m", "uvicorn", "prefect.server.api.server:create_app"],
])
def test_a_server_start_is_refused_in_the_quick_tier_naming_the_mark(cmd):
    assert is_server_command(cmd)
    with pytest.raises(RuntimeError, match="mark it @pytest.mark.server"):
        _QuickTierPopen(cmd)


def test_other_processes_start_in_the_quick_tier():
    cmd = [sys.executable, "-c", "print('prefect server')"]
    assert not is_server_command([sys.executable, "-m", "torch.distributed.run", "train.py"])
    out = _QuickTierPopen(cmd, stdout=subprocess.PIPE, text=True).communicate()[0]
    assert out == "prefect server\n"


CASE_CONFTEST = """
import pytest
from tests.tiers import pytest_addoption, pytest_collection_modifyitems

@pytest.fixture
def prefect_api():
    yield "url"

@pytest.fixture(params=["sqlite", "postgres"])
def ledger_url(request):
    return request.param
"""

CASES = """
import pytest

def test_plain(): pass
def test_flow(prefect_api): pass
def test_ledger(ledger_url): pass
@pytest.mark.server
def test_launches(): pass
"""


def _passed(tmp_path, *args) -> set[str]:
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "addopts=",
                          "--rootdir", str(tmp_path), *args, str(tmp_path)],
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return {line.split()[0].split("::")[1] for line in run.stdout.splitlines() if " PASSED" in line}


def test_the_quick_tier_leaves_out_every_test_that_asks_for_a_server(tmp_path):
    (tmp_path / "conftest.py").write_text(CASE_CONFTEST)
    (tmp_path / "test_case.py").write_text(CASES)
    assert _passed(tmp_path, "--quick") == {"test_plain", "test_ledger[sqlite]"}
    assert _passed(tmp_path) == {"test_plain", "test_flow", "test_ledger[sqlite]", "test_ledger[postgres]",
                                 "test_launches"}
