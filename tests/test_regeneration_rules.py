"""Regeneration's rules that need no server: the server it launches, the
settings it refuses, the thinking switch it finds, reading answers."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tasks.server.config import ServerConfig
from tasks.server.launch import CaptureSpec, LaunchSpec, build_command


def parsed(cmd: list[str]):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(cmd[3:])


def test_the_answers_server_keeps_sglangs_prefix_cache_and_a_capture_server_does_not(tmp_path):
    from tasks.regeneration.stage import answer_server

    server = ServerConfig(model="/models/m")
    assert parsed(build_command(answer_server(server, Path("/models/m")), 1, cpu=True)).disable_radix_cache is False
    assert parsed(build_command(LaunchSpec(server), 1, cpu=True)).disable_radix_cache is True
    assert parsed(build_command(CaptureSpec(server, dump_dir=tmp_path, capture_module="model"), 1,
                                cpu=True)).disable_radix_cache is True
    with pytest.raises(ValueError, match="must compute every token it captures"):
        CaptureSpec(server, dump_dir=tmp_path, prefix_cache=True)
