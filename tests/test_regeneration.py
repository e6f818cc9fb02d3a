"""Regeneration: which part of a conversation the target answers, and the
answers themselves, token for token, from a real SGLang server."""
from __future__ import annotations

import json

import pytest
import torch

from tasks.data.regeneration import prompt_messages, regenerate
from tests.conftest import demo_rows, write_jsonl


def test_the_last_user_turn_is_answered_and_later_turns_dropped():
    row = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                        {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                        {"role": "assistant", "content": "old answer"}]}
    assert [m["content"] for m in prompt_messages(row)] == ["s", "a", "b", "c"]
    sharegpt = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "x"}]}
    assert prompt_messages(sharegpt) == [{"role": "user", "content": "q"}]


def test_a_conversation_without_a_user_turn_is_refused():
    with pytest.raises(ValueError, match="no user turn"):
        prompt_messages({"messages": [{"role": "system", "content": "s"}]})


@pytest.mark.server
def test_regenerated_answers_are_the_targets_greedy_tokens(tiny_model, float32_server, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = write_jsonl(tmp_path / "data.jsonl", demo_rows(3) + ["{broken"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    result = regenerate(float32_server.url, source, tmp_path / "out.jsonl", tokenizer,
                        api_key=float32_server.api_key, max_new_tokens=12)
    assert (result["rows"], result["skipped"]) == (3, 1)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    for row, original in zip(rows, demo_rows(3)):
        assert row["messages"][:-1] == original["messages"][:-1]
        prompt_len = row["loss_mask"].index(1)
        prompt = torch.tensor([row["input_ids"][:prompt_len]])
        greedy = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        answered = len(row["input_ids"]) - prompt_len  # 12, or fewer if the target ended its answer
        assert 1 <= answered <= 12 and row["loss_mask"] == [0] * prompt_len + [1] * answered
        # The prompt and the target's own greedy answer, token for token.
        assert row["input_ids"] == greedy[0, :prompt_len + answered].tolist()
        assert answered == 12 or row["input_ids"][-1] == tokenizer.eos_token_id
