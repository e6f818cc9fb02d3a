"""A reasoning target's own data, end to end on the tiny model: a dataset
of several-turn conversations whose answers carry `reasoning_content`,
on Qwen3's and Kimi-K2.5's published chat templates (verbatim, in the
target's folder as its checkpoint has it), captured on the session's
server, verified, trained and served in SGLang with greedy output
unchanged; the store's samples hold each turn's reasoning under the loss,
as the target emits it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import demo_rows, tiny_train_config, write_jsonl
from tests.published_templates import KIMI_K25, QWEN3, TEMPLATES

pytestmark = pytest.mark.server


def reasoning_rows(n: int) -> list[dict]:
    """Conversations of two or three turns from the demo's prompts, each
    answer with its reasoning."""
    base = demo_rows(n + 2)
    rows = []
    for k in range(n):
        turns = []
        for j, row in enumerate(base[k:k + 2 + k % 2]):
            user, answer = row["messages"][0]["content"], row["messages"][1]["content"]
            turns += [{"role": "user", "content": user},
                      {"role": "assistant", "content": answer,
                       "reasoning_content": f"Step {j + 1}: the user asks {len(user.split())} words; answer briefly."}]
        rows.append({"messages": turns})
    return rows


def target_with_template(tiny_model: Path, template: str, out: Path) -> Path:
    """The tiny model's checkpoint, with a published chat template as its
    tokenizer's own (the same config and weights: the session's server
    serves it)."""
    from transformers import AutoTokenizer

    shutil.copytree(tiny_model, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = (TEMPLATES / template).read_text()
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("target", [QWEN3, KIMI_K25], ids=lambda t: t.name)
def test_a_reasoning_dataset_on_a_published_template_is_captured_trained_and_served(
        target, tiny_model, capture_server, float32_server, prefect_api, tmp_path):
    from flows.pipeline import eagle3_pipeline
    from transformers import AutoTokenizer

    from tasks.capture.config import CaptureConfig
    from tasks.data.chat import ChatRender
    from tasks.data.dataset import prepare_samples
    from tasks.evaluation.config import EvaluateConfig
    from tasks.server.config import ServerConfig
    from tasks.store.config import StoreConfig
    from tasks.store.reader import StoreReader
    from tasks.store.verification import verify_store

    model = target_with_template(tiny_model, target.template, tmp_path / f"tiny-{target.name}")
    rows = reasoning_rows(40)
    dataset = write_jsonl(tmp_path / "reasoning.jsonl", rows)
    server = capture_server
    summary = eagle3_pipeline(
        server=ServerConfig(model=str(model), url=server.url, api_key=server.api_key, rid_prefix=server.rid_prefix),
        capture=CaptureConfig(dataset=str(dataset), max_length=2048, batch_size=32, dump_dir=str(server.spec.dump_dir)),
        store=StoreConfig(path=str(tmp_path / "store")),
        train=tiny_train_config(tmp_path / "train", epochs=2),
        evaluate=EvaluateConfig(num_prompts=4, max_new_tokens=24, concurrency=[1], min_verify_steps=16,
                                baseline=float32_server.url, baseline_api_key=float32_server.api_key))
    store = Path(summary["store"])
    manifest = json.loads((store / "manifest.json").read_text())
    chat = ChatRender.from_record(manifest["chat"])
    assert (chat.switch, chat.thinking, chat.turns) == (target.switch, True, "auto")
    # Every assistant turn is trained, a sample each (its reasoning dropped from later histories).
    tok = AutoTokenizer.from_pretrained(model)
    planned, rejected = prepare_samples(dataset, tok, max_length=2048, chat=chat)
    assert not rejected and len(planned) == sum(len(r["messages"]) // 2 for r in rows)
    reader = StoreReader(store)
    assert sorted(reader.sample_ids) == sorted(s.sample_id for s in planned)
    reasoned = 0
    for i in range(len(reader)):
        sample = reader[i]
        ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].tolist()
        masked = tok.decode([t for t, m in zip(ids, mask) if m])
        reasoned += masked.startswith("<think>\nStep " if target is QWEN3 else "Step ")
        assert "</think>" in masked and masked.endswith("<|im_end|>"), masked
    assert reasoned == len(reader)
    # The verification renders the dataset again with the manifest's settings and finds every sample.
    report = verify_store(store, write_report=False)
    assert report.ok and set(report.samples.status) == {"OK"}, report.failures()
    assert summary["outputs_equal"] is True and summary["sglang_accept_length"] >= 1.0, summary


@pytest.fixture(scope="module")
def chars_server():
    """The tiny model that reads back what it writes (tests/tiny_models.py
    TINY_CHARS), served as regeneration launches its server."""
    from tasks.regeneration.stage import answer_server
    from tasks.server.config import ServerConfig
    from tasks.server.launch import launch_server
    from tests.conftest import ARTIFACTS
    from tests.tiny_models import TINY_CHARS, ensure_model

    model = ensure_model(TINY_CHARS)
    spec = answer_server(ServerConfig(model=str(model), dtype="float32", max_total_tokens=8192), model)
    with launch_server(spec, ARTIFACTS / "chars-server.log", timeout_s=600) as server:
        yield server


def test_a_regenerated_store_and_a_capture_of_the_same_answers_are_equal_token_for_token(chars_server, tmp_path):
    """The target answers two-turn conversations with reasoning on Kimi-K2.5's
    published template (its generation prompt opens the reasoning; a budget
    closes it): the answers directory, read as a dataset, and the same
    answers written out as messages with their reasoning_content and
    captured, give the same samples, id for id (an id is the content address
    of a sample's tokens and mask), in the same order. The first turn of
    each is a sample of its own (the history drops its reasoning)."""
    from transformers import AutoTokenizer

    from tasks.capture.config import CaptureConfig
    from tasks.capture.planning import capture_chat
    from tasks.data.dataset import prepare_samples
    from tasks.regeneration.answer_store import AnswerStore
    from tasks.regeneration.config import RegenerateConfig
    from tasks.regeneration.stage import regenerate
    from tests.tiny_models import TINY_CHARS, ensure_model

    model = ensure_model(TINY_CHARS)
    tok = AutoTokenizer.from_pretrained(model)
    # Prompts in characters it reads (no spaces), two turns each.
    asks = [row["messages"][0]["content"].replace(" ", "_") for row in demo_rows(64)]
    rows = [{"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": "x"},
                          {"role": "user", "content": b}]} for a, b in zip(asks[::2], asks[1::2])]
    source = write_jsonl(tmp_path / "data.jsonl", rows)
    # One request at a time: the same batches, so the same greedy answers, on every run.
    cfg = RegenerateConfig(thinking=True, max_reasoning_tokens=2, max_new_tokens=32, on_truncated="drop",
                           concurrency=1)
    regenerate(chars_server.url, source, tmp_path / "answers", tok, model, cfg, api_key=chars_server.api_key)
    answered = {row["source_row"]: row for _, row in AnswerStore(tmp_path / "answers").read()}
    # A random model sometimes ends its turn inside the reasoning (no end marker): no reasoned
    # conversation of the target's to compare. The others are.
    reasoned = {r: row for r, row in answered.items() if row["turns"] == 2 and all(
        m.get("reasoning_content") for m in row["messages"] if m["role"] == "assistant")}
    assert len(reasoned) >= 3, {r: row["messages"] for r, row in answered.items()}
    regenerated, rejected = prepare_samples(tmp_path / "answers", tok, max_length=4096, rows=set(reasoned))
    assert not rejected and len(regenerated) == 2 * len(reasoned)  # the first turn a sample of its own
    messages = write_jsonl(tmp_path / "answers.jsonl", [{"messages": row["messages"]} for row in reasoned.values()])
    chat = capture_chat(CaptureConfig(dataset=str(messages), thinking=True), tok, model)
    captured, rejected = prepare_samples(messages, tok, max_length=4096, chat=chat)
    assert not rejected
    assert [s.sample_id for s in captured] == [s.sample_id for s in regenerated]
    # What both hold: each turn's prompt, its reasoning, the end marker, the answer, the stop token.
    first, row = captured[0], next(iter(reasoned.values()))
    masked = tok.decode([t for t, m in zip(first.input_ids.tolist(), first.loss_mask.tolist()) if m])
    assert masked == f"{row['messages'][1]['reasoning_content']}</think>{row['messages'][1]['content']}<|im_end|>"
