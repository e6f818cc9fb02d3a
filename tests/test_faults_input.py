"""Bad input, written to real files byte for byte: each bad row is
quarantined with a precise reason and every good row around it is kept."""
import json

import pytest
from transformers import AutoTokenizer

from tasks.data.dataset import prepare_samples, read_rows, sample_id, tokenize_row
from tests.conftest import write_jsonl

CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]
GOOD = json.dumps({"messages": CHAT}).encode() + b"\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def reasons(rejected):
    return {r.source_row: r.reason for r in rejected}


def test_a_non_utf8_byte_loses_only_its_line(tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    bad = json.dumps({"messages": [{"role": "user", "content": "caf_"}, CHAT[1]]}).encode().replace(b"_", b"\xe9")
    path.write_bytes(GOOD + bad + b"\n" + GOOD)
    samples, rejected = prepare_samples(path, tokenizer, max_length=128)
    assert [s.source_row for s in samples] == [0, 2]
    column = bad.index(0xE9) + 1
    assert reasons(rejected) == {1: f"not UTF-8 on line 2: byte 0xe9 at column {column}"}


def test_deep_nesting_is_rejected_not_a_crash(tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(GOOD + b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n" + GOOD)
    samples, rejected = prepare_samples(path, tokenizer, max_length=128)
    assert [s.source_row for s in samples] == [0, 2]
    assert reasons(rejected)[1] == "JSON nested too deeply on line 2"


def test_a_huge_line_is_refused_unread_and_rows_after_it_keep_their_numbers(tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(GOOD + b'{"text": "' + b"x" * 5000 + b'"}\n' + GOOD)
    rows = list(read_rows(path, max_row_bytes=1000))
    assert [i for i, _ in rows] == [0, 1, 2]
    assert rows[1][1].reason == "line 2 is longer than 1,000 bytes; not read"
    assert rows[2][1] == {"messages": CHAT}


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_asked_for_rows_read_as_the_whole_file_reads_them(tmp_path, suffix):
    """A part of a stream run reads only its rows (a JSONL line not asked
    for is not decoded): each one, good or bad, as a whole read gives it,
    with its own number, and nothing else."""
    path = tmp_path / f"d{suffix}"
    if suffix == ".jsonl":
        path.write_bytes(GOOD + b"{broken\n" + b'{"text": "' + b"x" * 5000 + b'"}\n' + b"\n" + GOOD + b"\xe9\n" + GOOD)
    elif suffix == ".json":
        path.write_text(json.dumps([{"messages": CHAT}, {"text": "a"}, 12345, {"messages": CHAT}, {"text": "b"}]))
    else:
        import pandas as pd

        pd.DataFrame({"text": [f"row {i}" for i in range(3000)]}).to_parquet(path)
    whole = list(read_rows(path, max_row_bytes=1000))
    for asked in ({0}, {1, 2, 3, 5}, [6, 4, 1], range(len(whole)), {len(whole) - 1, len(whole) + 5}, set(), {2999}):
        got = list(read_rows(path, max_row_bytes=1000, rows=asked))
        assert [(i, repr(r)) for i, r in got] == [(i, repr(r)) for i, r in whole if i in set(asked)], asked


def test_a_json_array_is_streamed_row_by_row(tokenizer, tmp_path):
    path = tmp_path / "d.json"
    rows = [{"messages": CHAT}, {"text": "é" * 3000}, 12345, {"messages": CHAT}]
    path.write_text(" \n" + json.dumps(rows, ensure_ascii=False, indent=1))
    import tasks.data.dataset as dataset

    chunk = dataset._CHUNK
    dataset._CHUNK = 7  # rows, numbers and multi-byte characters cut across reads
    try:
        assert [r for _, r in read_rows(path)] == rows
    finally:
        dataset._CHUNK = chunk
    data = b'[{"text": "ok"}, {"text": "\xff"}]'
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"not UTF-8 at byte offset {data.index(0xFF)}"):
        list(read_rows(path))
    path.write_text('[{"text": "ok"} {"text": "no comma"}]')
    with pytest.raises(ValueError, match="expected ',' or ']' after row 0"):
        list(read_rows(path))
    path.write_text('{"text": "not a list"}')
    with pytest.raises(ValueError, match="must be a list of rows"):
        list(read_rows(path))
    path.write_text('[{"text": "a' + "x" * 3000 + '"}]')
    with pytest.raises(ValueError, match="row 0 is longer than 1,000 bytes"):
        list(read_rows(path, max_row_bytes=1000))


def test_pretokenised_rows_are_checked_exactly(tokenizer, tmp_path):
    ids = [5, 6, 7]
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"input_ids": ids},                                   # 0: no mask: all ones
        {"input_ids": ids, "loss_mask": None},                # 1: null: all ones
        {"input_ids": ids, "loss_mask": []},                  # 2
        {"input_ids": ids, "loss_mask": 0},                   # 3
        {"input_ids": ids, "loss_mask": False},               # 4
        {"input_ids": ids, "loss_mask": [1, 1]},              # 5
        {"input_ids": [5, True, 7]},                          # 6
        {"input_ids": ids, "loss_mask": [1, True, 0]},        # 7
        {"input_ids": ids, "loss_mask": [0, 1, 1]},           # 8
    ])
    samples, rejected = prepare_samples(path, tokenizer, max_length=128)
    assert [s.source_row for s in samples] == [0, 1, 8]
    assert samples[0].sample_id == samples[1].sample_id == sample_id(ids, [1, 1, 1])
    assert samples[2].loss_mask.tolist() == [0, 1, 1]
    why = reasons(rejected)
    assert why[2] == "loss_mask has 0 values for 3 input ids"
    assert why[3] == "loss_mask must be a list of 0/1, one per input id, not 0"
    assert why[4] == "loss_mask must be a list of 0/1, one per input id, not False"
    assert why[5] == "loss_mask has 2 values for 3 input ids"
    assert why[6].startswith("input_ids must be a list of integer token ids")
    assert why[7] == "loss_mask values must be the integers 0 or 1"


TOOL_CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
# ChatML with {% generation %} markers that also renders tool calls.
TOOL_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] }}"
    "{%- for call in message.get('tool_calls', []) %}{{- '<call>' + call['function']['name'] + '</call>' }}{%- endfor %}"
    "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_tool_calls_are_rendered_or_the_row_refused(tokenizer, tmp_path):
    row = {"messages": [CHAT[0], {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}]}
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, row])
    samples, rejected = prepare_samples(path, tokenizer, max_length=128)
    assert [s.source_row for s in samples] == [0]
    assert "assistant turn 1 has tool_calls, which this tokenizer's chat template does not render" in \
        reasons(rejected)[1]
    tools = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tools.chat_template = TOOL_TEMPLATE
    samples, rejected = prepare_samples(path, tools, max_length=128)
    assert not rejected and [s.source_row for s in samples] == [0, 1]
    masked = tools.decode([i for i, m in zip(samples[1].input_ids, samples[1].loss_mask) if m])
    assert "add" in masked  # the call is what the drafter learns
    (ids, _), = tokenize_row(tools, {"messages": [CHAT[0], {"role": "assistant", "content": "",
                                                             "tool_calls": [TOOL_CALL]}]})
    assert samples[1].input_ids.tolist() == ids


def test_tool_results_and_developer_turns_are_kept_where_the_template_renders_them_else_the_row_refused(
        tokenizer, tmp_path):
    """Agentic rows: a tool's result and a developer turn were refused as
    unknown roles. They are kept where the target's template renders them in
    the row, out of the loss; a row whose template leaves one out (Qwen3's
    drops "developer" turns) is refused naming it. Tool-call arguments are
    parsed as SGLang's chat endpoint parses them before rendering."""
    from tasks.data.dataset import to_messages
    from tests.published_templates import QWEN3, template

    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    agentic = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                            {"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "content": "18C, sunny", "tool_call_id": "c1"},
                            {"role": "assistant", "content": "It is 18C and sunny."}]}
    developer = {"conversations": [{"from": "developer", "value": "Answer in French."},
                                   {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Bonjour"}]}
    unparsable = {"messages": [agentic["messages"][0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": "{city: Paris"}}]}]}
    path = write_jsonl(tmp_path / "d.jsonl", [agentic, developer, unparsable])
    qwen = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    qwen.chat_template = template(QWEN3)
    samples, rejected = prepare_samples(path, qwen, max_length=256)
    # Without reasoning, each turn as Qwen3 answers with thinking off: the
    # history renders the call without that prompt's empty reasoning part,
    # so the call and the answer are two samples.
    assert [s.source_row for s in samples] == [0, 0]
    assert reasons(rejected)[1] == ("turn 0's developer turn is not in the chat template's render of this row (the "
                                    "template leaves it out here); use a template that renders it, or drop the row")
    assert "arguments that are not JSON (SGLang refuses them too)" in reasons(rejected)[2]
    text = qwen.decode(samples[1].input_ids)
    masked = [qwen.decode([i for i, m in zip(s.input_ids, s.loss_mask) if m]) for s in samples]
    assert "<tool_response>\n18C, sunny\n</tool_response>" in text and "18C, sunny" not in "".join(masked)
    # The arguments rendered once, as a JSON object (a string would be quoted again by `tojson`).
    assert masked == ['<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                      "It is 18C and sunny.<|im_end|>"]
    # A template that renders every role (the tiny model's ChatML) keeps the developer turn.
    samples, rejected = prepare_samples(path, tokenizer, max_length=256)
    assert [s.source_row for s in samples] == [1] and "tool_calls" in reasons(rejected)[0]
    assert "<|im_start|>developer\nAnswer in French.<|im_end|>" in tokenizer.decode(samples[0].input_ids)
    # Llama 3.1's name for a tool's result.
    assert to_messages({"messages": [{"role": "ipython", "content": "4"}]})[0]["role"] == "tool"


@pytest.mark.parametrize("content", [b"", b"\n\n", b"{broken json\n" + json.dumps({"messages": []}).encode() + b"\n"])
def test_a_dataset_with_no_usable_row_is_refused_naming_it_and_nothing_is_stored(tiny_model, tmp_path, content):
    """An empty file, blank lines, or only rows that are rejected: the
    extraction's plan (and a stream run's) stops with one error naming the
    file, before a server is launched, instead of a run that stores
    nothing and passes verification (seen: exit 0, 'verification passed: 0
    files, 0 samples'). The store keeps no row of it."""
    from tasks.capture.config import CaptureConfig
    from tasks.capture.planning import plan_extraction
    from tasks.data.dataset import NoUsableRows
    from tasks.failures import Permanent
    from tasks.store.ledger.open import open_store
    from tasks.stream.plan import planned_samples
    from tests.test_store import MANIFEST

    dataset = tmp_path / "data.jsonl"
    dataset.write_bytes(content)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ledger = open_store(tmp_path / "store", MANIFEST)
    with pytest.raises(NoUsableRows, match=rf"^dataset {dataset} has no usable row \((it holds no rows|all 2 rows "
                                          rf"rejected, e\.g\. row 0: .*)\): give a JSONL.*\(capture\.dataset\)$") as e:
        plan_extraction(CaptureConfig(dataset=str(dataset)), tok, ledger)
    assert isinstance(e.value, Permanent)  # no task retry runs it again
    assert ledger.quarantined().empty and not ledger.captured_ids()
    with pytest.raises(NoUsableRows):
        planned_samples([str(dataset)], tok, max_length=256, policy="truncate")
