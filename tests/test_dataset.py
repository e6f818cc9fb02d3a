import json

import pandas as pd
import pytest
from transformers import AutoTokenizer

from tasks.data.dataset import prepare_samples, read_rows, sample_id, tokenize_row
from tests.conftest import write_jsonl

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "Six."}]
# SmolLM2's kind of template: ChatML without {% generation %} markers.
PLAIN_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def masked_text(tokenizer, ids, mask):
    return tokenizer.decode([i for i, m in zip(ids, mask) if m])


def test_loss_mask_covers_assistant_turns_only(tokenizer):
    (ids, mask), = tokenize_row(tokenizer, {"messages": CHAT})
    full = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    # The template's render up to the last turn's stop token: its "\n" is the next turn's, never generated.
    assert len(ids) == len(mask) and ids == full[:len(ids)] and tokenizer.decode(full[len(ids):]) == "\n"
    assert masked_text(tokenizer, ids, mask) == "It is 4.<|im_end|>Six.<|im_end|>"


def test_loss_mask_without_generation_markers(tokenizer):
    """SmolLM2's kind of template: the same mask, from the template's own
    renders (it renders "\n" after <|im_end|>, which the target never
    generates: out of the loss)."""
    plain = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = PLAIN_CHATML
    (ids, mask), = tokenize_row(plain, {"messages": CHAT})
    assert masked_text(plain, ids, mask) == "It is 4.<|im_end|>Six.<|im_end|>"


def test_all_formats_give_the_same_sample(tokenizer, tmp_path):
    (ids, mask), = tokenize_row(tokenizer, {"messages": CHAT})
    sharegpt = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in CHAT]
    rows = [{"messages": CHAT}, {"conversations": sharegpt}, {"input_ids": ids, "loss_mask": mask}]
    for path in (write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "d.json", tmp_path / "d.parquet"):
        if path.suffix == ".json":
            path.write_text(json.dumps(rows))
        elif path.suffix == ".parquet":
            pd.DataFrame({"input_ids": [ids], "loss_mask": [mask]}).to_parquet(path)
        samples, rejected = prepare_samples(path, tokenizer, max_length=4096)
        assert not rejected, rejected
        assert {s.sample_id for s in samples} == {sample_id(ids, mask)}, path


def test_plain_text_rows_train_on_every_token(tokenizer, tmp_path):
    (s,), _ = prepare_samples(write_jsonl(tmp_path / "t.jsonl", [{"text": "Hello there, world."}]), tokenizer, max_length=64)
    assert s.loss_mask.all() and tokenizer.decode(s.input_ids) == "Hello there, world."


def test_bad_rows_are_rejected_with_reasons_and_the_rest_kept(tokenizer, tmp_path):
    long_chat = [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"messages": CHAT}, "{not json", {"messages": []}, {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": long_chat}, {"messages": [{"role": "user", "content": "no answer"}]}, {"prompt": "?"},
        {"input_ids": [1, 2, 10**9]},
    ])
    samples, rejected = prepare_samples(path, tokenizer, max_length=128, policy="skip")
    assert [s.source_row for s in samples] == [0]
    reasons = {r.source_row: r.reason for r in rejected}
    assert "bad JSON on line 2" in reasons[1]
    assert reasons[2] == "empty conversation"
    assert "unknown role 'wizard'" in reasons[3]
    assert "> max_length 128 (policy: skip)" in reasons[4]
    assert reasons[5] == "no assistant turn to train on"
    assert "none of: messages" in reasons[6]
    assert "input_ids must be" in reasons[7]
    # Truncating the long row cuts its answer off, so it has nothing to learn from.
    _, rejected = prepare_samples(path, tokenizer, max_length=128, policy="truncate")
    assert "no loss tokens" in {r.source_row: r.reason for r in rejected}[4]
    short_answer = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 300}]
    (s,), _ = prepare_samples(write_jsonl(tmp_path / "long.jsonl", [{"messages": short_answer}]), tokenizer,
                              max_length=128, policy="truncate")
    assert s.num_tokens == 128 and s.loss_mask[-1] == 1


def test_unreadable_files_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(read_rows(tmp_path / "missing.jsonl"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown dataset format '.csv'"):
        list(read_rows(tmp_path / "d.csv"))
    with pytest.raises(ValueError, match="unknown max-length policy|must be one of"):
        prepare_samples(write_jsonl(tmp_path / "x.jsonl", [{"text": "a"}]), None, max_length=8, policy="drop")


def test_sample_id_is_content_addressed():
    assert sample_id([1, 2, 3], [0, 1, 1]) == sample_id([1, 2, 3], [0, 1, 1])
    assert sample_id([1, 2, 3], [0, 1, 1]) != sample_id([1, 2, 3], [1, 1, 1])
    assert sample_id([1, 2, 3], [0, 1, 1]) != sample_id([1, 2, 4], [0, 1, 1])
