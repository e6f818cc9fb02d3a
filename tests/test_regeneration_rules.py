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


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def templated(tokenizer, template: str):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def test_each_reasoning_template_is_driven_by_the_switch_sglang_reads(tokenizer):
    from tasks.regeneration.config import RegenerateConfig
    from tasks.regeneration.turns import check_template, render_prompt
    from tests.published_templates import KIMI_K25, QWEN3, template

    kimi, qwen = templated(tokenizer, template(KIMI_K25)), templated(tokenizer, template(QWEN3))
    off = RegenerateConfig(thinking=False)
    kimi_use, qwen_use = check_template(kimi, off), check_template(qwen, off)
    assert (kimi_use.switch, qwen_use.switch) == ("thinking", "enable_thinking")
    user = [{"role": "user", "content": "Hi."}]
    assert kimi.decode(render_prompt(kimi, user, kimi_use.template_kwargs(False))).endswith(
        "<|im_assistant|>assistant<|im_middle|><think></think>")
    # On, its generation prompt opens the reasoning part.
    assert kimi.decode(render_prompt(kimi, user, kimi_use.template_kwargs(True))).endswith(
        "assistant<|im_middle|><think>")
    # Unset, nothing is passed: the template's own default.
    assert check_template(kimi, RegenerateConfig()).template_kwargs(None) == {}


def test_a_template_that_never_reads_the_switch_is_refused_at_the_plan(tokenizer, tmp_path):
    from tasks.regeneration.answer_store import AnswerStore
    from tasks.regeneration.config import RegenerateConfig
    from tasks.regeneration.provenance import provenance
    from tasks.regeneration.stage import plan_regeneration
    from tasks.data.chat import ChatRefused
    from tests.conftest import demo_rows, write_jsonl
    from tests.published_templates import KIMI_K25, LLAMA31, template

    source = write_jsonl(tmp_path / "data.jsonl", demo_rows(2))
    plain = templated(tokenizer, template(LLAMA31))  # no reasoning, no switch
    for cfg, why in [(RegenerateConfig(thinking=True), "finds no reasoning switch"),
                     (RegenerateConfig(thinking=False, thinking_switch="enable_thinking"),
                      "does not read 'enable_thinking'")]:
        store = AnswerStore(tmp_path / f"out-{why[:4]}", provenance(source, Path(tokenizer.name_or_path), cfg))
        with pytest.raises(ChatRefused, match=why):
            plan_regeneration(source, store, cfg, plain)
    # Kimi's template named the Qwen3 way: refused, not silently left thinking.
    with pytest.raises(ChatRefused, match="does not read 'enable_thinking'"):
        from tasks.regeneration.turns import check_template

        check_template(templated(tokenizer, template(KIMI_K25)), RegenerateConfig(thinking=False,
                                                                          thinking_switch="enable_thinking"))


def test_a_reasoning_budget_with_thinking_off_is_refused():
    from pydantic import ValidationError

    from tasks.regeneration.config import RegenerateConfig

    with pytest.raises(ValidationError, match="max_reasoning_tokens is a budget for reasoning"):
        RegenerateConfig(thinking=False, max_reasoning_tokens=64)


def test_an_answer_after_a_closed_reasoning_part_is_not_joined_twice():
    from tasks.regeneration.turns import after_closed_reasoning

    marker, nl2 = [7, 8], [9]
    # The thinking-off render ends "</think>\n\n"; the target wrote "\n\n" first.
    assert after_closed_reasoning([1, 7, 8, 9], [9, 5, 6], marker) == [5, 6]
    assert after_closed_reasoning([1, 7, 8, 9], [5, 6], marker) == [5, 6]  # nothing doubled: kept whole
    assert after_closed_reasoning([1, 2, 3], nl2 + [5], marker) == [9, 5]  # no closed part in the render


def test_the_askers_repr_holds_no_api_key(tokenizer):
    from tasks.regeneration.answers import Asker
    from tasks.regeneration.config import RegenerateConfig

    assert "s3cret" not in repr(Asker("http://x", tokenizer, RegenerateConfig(), api_key="s3cret"))


def test_reading_answers_holds_a_bounded_number_of_shards_open(tmp_path):
    """600k conversations in batches of 64 are 9,375 shards: reading them
    all (the capture's plan, the export) must not hold each one open."""
    import os

    from tasks.regeneration.answer_store import OPEN_SHARDS, AnswerStore

    store = AnswerStore(tmp_path / "answers", {"source": "s", "settings": {}})
    shards = 1100
    for k in range(shards):
        store.commit([{"row_id": f"r{k}", "source_row": k, "input_ids": [1, 2], "loss_mask": [0, 1],
                       "answer_tokens": 1}])
    # Rows interleave shards: row k sits in shard k, read in source order.
    before, most = len(os.listdir("/proc/self/fd")), 0
    rows = []
    for row, record in store.read():
        rows.append((row, record["row_id"]))
        most = max(most, len(os.listdir("/proc/self/fd")) - before)
    assert rows == [(k, f"r{k}") for k in range(shards)]
    assert most <= OPEN_SHARDS
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_resume_or_a_child_with_another_template_weights_flags_or_settings_is_refused(tiny_model, tokenizer,
                                                                                     tmp_path):
    import shutil

    from tasks.regeneration.answer_store import AnswerStore, AnswersMismatch
    from tasks.regeneration.config import RegenerateConfig
    from tasks.regeneration.provenance import provenance, sampled_without_determinism
    from tests.conftest import demo_rows, write_jsonl
    from tests.published_templates import LLAMA31, template

    source = write_jsonl(tmp_path / "data.jsonl", demo_rows(2))
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    cfg, server, out = RegenerateConfig(), ServerConfig(model=str(model)), tmp_path / "answers"
    AnswerStore(out, provenance(source, model, cfg, tokenizer, server))
    AnswerStore(out, provenance(source, model, cfg, tokenizer, server))  # the same: resumed
    with pytest.raises(AnswersMismatch, match="made from another chat_template_sha256"):
        AnswerStore(out, provenance(source, model, cfg, templated(tokenizer, template(LLAMA31)), server))
    with pytest.raises(AnswersMismatch, match=r"made from another server .*'--quantization': 'fp8'"):
        AnswerStore(out, provenance(source, model, cfg, tokenizer,
                                    ServerConfig(model=str(model), extra_args=["--quantization", "fp8"])))
    # Other weights of the same shapes (a LoRA merged into one layer's q_proj):
    # a byte of that tensor, in the middle of the file.
    import json

    weights = model / "model.safetensors"
    body = bytearray(weights.read_bytes())
    header = int.from_bytes(body[:8], "little")
    start = json.loads(body[8:8 + header])["model.layers.3.self_attn.q_proj.weight"]["data_offsets"][0]
    body[8 + header + start + 1] ^= 1
    weights.write_bytes(bytes(body))
    with pytest.raises(AnswersMismatch, match="made from another weights"):
        AnswerStore(out, provenance(source, model, cfg, tokenizer, server))
    # A node's child checks its own record (no dataset hash, its own paths) against the parent's.
    store = AnswerStore(out)
    unchanged = tmp_path / "unchanged"
    shutil.copytree(tiny_model, unchanged)
    store.check_made_from(provenance(None, unchanged, cfg, tokenizer))
    with pytest.raises(AnswersMismatch, match=r"made from another settings .*'max_new_tokens': 256.*'max_new_tokens': 9"):
        store.check_made_from(provenance(None, unchanged, cfg.model_copy(update={"max_new_tokens": 9}), tokenizer))
    # Sampled answers the server will not draw again: said in the run's summary.
    sampled = RegenerateConfig(temperature=0.7)
    assert "--enable-deterministic-inference" in sampled_without_determinism(sampled, server)
    assert sampled_without_determinism(sampled, ServerConfig(model=str(model),
                                                             extra_args=["--enable-deterministic-inference"])) is None
    assert sampled_without_determinism(cfg, server) is None


def test_regeneration_pins_a_templates_date_and_renders_a_rows_tools(tmp_path):
    """gpt-oss's template reads today's date: unset, regenerate.template_date
    is the day the answers were first made (their provenance), so a resume
    on another day renders the same prompts; a row's tools reach its
    prompts and name its answers (another set of tools, another row id)."""
    import json

    from transformers import AutoTokenizer

    from tasks.regeneration.config import RegenerateConfig
    from tasks.regeneration.turns import pin_date, render_prompt, row_id
    from tests.published_templates import GPT_OSS, QWEN3, model_dir_for

    tok = AutoTokenizer.from_pretrained(model_dir_for(GPT_OSS, tmp_path / "gpt-oss"))
    out = tmp_path / "answers"
    fresh = pin_date(RegenerateConfig(), tok, out)
    assert fresh.template_date == __import__("datetime").date.today().isoformat()
    out.mkdir()
    (out / "provenance.json").write_text(json.dumps({"settings": {"template_date": "2026-01-02"}}))
    resumed = pin_date(RegenerateConfig(), tok, out)
    assert resumed.template_date == "2026-01-02"
    assert pin_date(RegenerateConfig(template_date="2025-05-05"), tok, out).template_date == "2025-05-05"
    from tasks.regeneration.turns import check_template

    kwargs = check_template(tok, resumed).template_kwargs(None)
    assert "Current date: 2026-01-02" in tok.decode(render_prompt(tok, [{"role": "user", "content": "Hi"}], kwargs))
    qwen = AutoTokenizer.from_pretrained(model_dir_for(QWEN3, tmp_path / "qwen3"))
    assert pin_date(RegenerateConfig(), qwen, out).template_date is None  # its template reads no date
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    user = [{"role": "user", "content": "Weather?"}]
    assert "get_weather" in qwen.decode(render_prompt(qwen, user, {}, tools))
    assert row_id(user, {}, tools) != row_id(user, {}) == row_id(user, {}, [])
