"""The server section (tasks/server/config.py): its settings are checked
where they are given, with SGLang's own rules for data parallelism, and reach
the launch command as SGLang's parser reads them."""
from __future__ import annotations

import argparse
import re

import pytest
from pydantic import ValidationError

from tasks.server.config import ServerConfig
from tasks.server.launch import CaptureSpec, build_command


def sglang_reads(cmd: list[str]) -> argparse.Namespace:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(cmd[3:])


@pytest.mark.parametrize("settings, message", [
    ({"tp_size": 0}, "greater than or equal to 1"),
    ({"dp_size": 0}, "greater than or equal to 1"),
    ({"max_restarts": -1}, "greater than or equal to 0"),
    ({"dtype": "fp8"}, "'auto', 'float32', 'bfloat16' or 'float16'"),
    ({"chunked_prefill_size": 0}, "-1 to turn chunked prefill off"),
    ({"mem_fraction_static": 1.5}, "less than or equal to 1"),
    ({"tp_sise": 2}, "Extra inputs are not permitted"),
    ({"dp_attention": True}, "needs server.dp_size > 1"),
    ({"dp_attention": True, "dp_size": 2, "tp_size": 3}, "tp_size % attn_dp_size == 0"),
    ({"api_key": "k"}, "for attaching to a server you started (server.url)"),
    ({"url": "http://h:1", "rid_prefix": "../"}, "rid prefix '../' is not usable"),
])
def test_a_setting_sglang_or_the_launcher_cannot_use_is_refused_where_it_is_given(settings, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        ServerConfig(**settings)


def test_data_parallel_attention_reaches_sglang_as_attention_groups(tmp_path):
    spec = CaptureSpec(ServerConfig(model="m", tp_size=4, dp_size=2, dp_attention=True), dump_dir=tmp_path,
                       capture_module="model")
    args = sglang_reads(build_command(spec, 1234, cpu=True))
    # SGLang 0.5.23's own reading of the deprecated `--dp-size 2 --enable-dp-attention`.
    assert (args.tp_size, args.attn_dp_size, args.dp_size, args.enable_dp_attention) == (4, 2, 1, False)
    assert spec.ranks == 4  # the groups split the tensor-parallel ranks


def test_data_parallel_replicas_reach_sglang_as_replicas(tmp_path):
    spec = CaptureSpec(ServerConfig(model="m", tp_size=2, dp_size=3), dump_dir=tmp_path, capture_module="model")
    args = sglang_reads(build_command(spec, 1234, cpu=True))
    assert (args.tp_size, args.attn_dp_size, args.dp_size) == (2, 1, 3)
    assert spec.ranks == 6  # each replica has its own tensor-parallel ranks


def test_the_section_gives_the_command_its_settings(tmp_path):
    server = ServerConfig(model="/models/m", dtype="float16", max_total_tokens=4096, chunked_prefill_size=-1,
                          mem_fraction_static=0.5, extra_args=["--max-running-requests", "8"])
    args = sglang_reads(build_command(CaptureSpec(server, dump_dir=tmp_path, capture_module="model"), 1234, cpu=True))
    assert (args.model_path, args.dtype, args.max_total_tokens, args.chunked_prefill_size,
            args.mem_fraction_static, args.max_running_requests) == ("/models/m", "float16", 4096, -1, 0.5, 8)


def test_a_launch_spec_of_an_attached_server_is_refused(tmp_path):
    with pytest.raises(ValueError, match="server.url is 'http://h:1': that server is attached to"):
        CaptureSpec(ServerConfig(url="http://h:1"), dump_dir=tmp_path)


def test_a_node_takes_the_server_section_from_its_command_line():
    from flows.cli import config_from_argv
    from flows.node import node

    values, _ = config_from_argv(node, ["--queue", "q", "--server.model", "/models/m", "--server.tp-size", "8",
                                        "--server.dp-size", "2", "--server.dp-attention",
                                        "--server.extra-args", "--max-running-requests 8"])
    assert values["server"] == ServerConfig(model="/models/m", tp_size=8, dp_size=2, dp_attention=True,
                                            extra_args=["--max-running-requests", "8"])
    assert config_from_argv(node, ["--queue", "q"])[0]["server"] == ServerConfig()
