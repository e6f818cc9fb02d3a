"""The quick tier: `pytest --quick` (`./scripts/test.sh --quick`) runs every
test that starts no server, for a contributor who changed one function.

A test starts a server when it asks for a fixture that starts one (the
session's SGLang servers, its Prefect API, its PostgreSQL) or launches one
itself; the second kind carries `@pytest.mark.server`. A test that launches
one unmarked is not silently slow in the quick tier: under `--quick` every
process start that would be a server fails at once, naming the mark.
The hooks are imported into conftest.py, which is where pytest reads them."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Fixtures that start a server for the session (tests/conftest.py).
SERVER_FIXTURES = frozenset({"session_servers", "prefect_api", "postgres_url"})

# What a server's command line holds: SGLang's launcher, Prefect's API
# (ours, the CLI's, ephemeral mode's uvicorn), PostgreSQL, a Prefect worker.
SERVER_COMMANDS = ("sglang.launch_server", "flows.local_api", "uvicorn", "pg_ctl", "postgres")


def starts_server(item: pytest.Item) -> bool:
    if item.get_closest_marker("server"):
        return True
    if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    # The ledger tests take PostgreSQL through getfixturevalue, by param.
    return callspec is not None and callspec.params.get("ledger_url") == "postgres"


def is_server_command(args) -> bool:
    words = [str(a) for a in ([args] if isinstance(args, (str, bytes)) else args)]
    line = " ".join(words)
    prefect_server = any(w.endswith("prefect") for w in words) and ({"server", "worker"} & set(words))
    return bool(prefect_server) or any(c in line for c in SERVER_COMMANDS)


class _QuickTierPopen(subprocess.Popen):
    def __init__(self, args, *a, **kw):
        if is_server_command(args):
            raise RuntimeError(f"the quick tier starts no server, and this test started one ({args!r}): "
                               "mark it @pytest.mark.server (tests/tiers.py)")
        super().__init__(args, *a, **kw)


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="the quick tier: only the tests that start no server (SGLang, Prefect, PostgreSQL)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if starts_server(item) and not item.get_closest_marker("server"):
            item.add_marker(pytest.mark.server)
    if not config.getoption("--quick"):
        return
    dropped = [i for i in items if i.get_closest_marker("server")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if not i.get_closest_marker("server")]
    subprocess.Popen = _QuickTierPopen
