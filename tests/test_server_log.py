"""A real SGLang server's log as the run's log shows it (the session's
capture server): SGLang's one-line dump of its ~400 settings at start-up is
passed on as the settings that matter, the server's own log keeps it whole,
and the API key shows in neither what is passed on nor the summary."""
from __future__ import annotations

import logging

import pytest

from tasks.server.server_log import LogFollower

pytestmark = pytest.mark.server


def test_the_servers_start_up_settings_reach_the_runs_log_as_one_short_line(capture_server, caplog):
    log = logging.getLogger("eagle3.test-server-log")
    follower = LogFollower(capture_server.log_path)  # from the top: every start-up the log holds
    follower.hide(capture_server.api_key)
    with caplog.at_level("INFO", logger=log.name):
        follower.forward(log, everything=True)
    whole = [line for line in capture_server.log_path.read_text().splitlines() if "server_args={" in line]
    assert whole and min(map(len, whole)) > 10_000  # SGLang's own line, whole in the server's log
    passed_on = [r.getMessage() for r in caplog.records]
    summaries = [m for m in passed_on if "server_args" in m]
    assert len(summaries) == len(whole) and not any("server_args={" in m for m in passed_on)
    assert max(map(len, passed_on)) < 2000
    server = capture_server.spec.server
    ours = summaries[-1]  # this session's server: the log is appended to
    for shown in (f"model_path={server.model!r}", "tp_size=1", "dp_size=1", "attn_dp_size=1",
                  f"max_total_tokens={server.max_total_tokens}", f"chunked_prefill_size={server.chunked_prefill_size}",
                  "attention_backend=", "disable_radix_cache=True", "enable_return_aux_hidden_states=True",
                  "api_key='<redacted>'", f"(all of them: {capture_server.log_path})"):
        assert shown in ours, (shown, ours)
    assert capture_server.api_key not in caplog.text
