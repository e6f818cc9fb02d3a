"""Conversation rows beyond the cases of tests/test_chat_templates.py, on
the same published templates: a row's tools in every prompt, a tool call
or a stop token's text the render would lose refused, the reasoning
policies over a whole row, named templates, and the rows a stream run or
a regenerated store gives."""
from __future__ import annotations

import pytest

from tasks.data.chat import reads_date, reasoning_fields
from tasks.data.dataset import renders_tool_calls, tokenize_row
from tests.conftest import write_jsonl
from tests.published_templates import TEMPLATES as TEMPLATES_DIR
from tests.test_chat_templates import CALL, CASES, TOOLS, WEATHER, R, chat_for, row_of, targets  # noqa: F401 -- the fixture



def test_a_rows_tools_reach_every_prompt_as_a_requests_do(targets):
    """The row's function definitions are rendered into each prompt (the
    tool block every tool-calling template writes), as SGLang renders a
    request's `tools`; a row without them renders as a request without."""
    for name, marker in (("qwen3", "# Tools"), ("kimi-k2.5", "tool_declare"), ("glm-4.5", "# Tools"),
                         ("gpt-oss-120b", "# Tools"), ("llama-3.1", "get_weather")):
        _, tok, folder = targets[name]
        with_tools = tokenize_row(tok, row_of("tool call"), None, chat_for(tok, folder, thinking=name != "llama-3.1"
                                                                            or None, unwanted_reasoning="drop"))
        without = tokenize_row(tok, {"messages": CASES["tool call"]}, None,
                               chat_for(tok, folder, thinking=name != "llama-3.1" or None, unwanted_reasoning="drop"))
        assert all(marker in tok.decode(ids) and "The weather in a city." in tok.decode(ids) for ids, _ in with_tools)
        assert not any("The weather in a city." in tok.decode(ids) for ids, _ in without)
        # The definitions are prompt, never trained on.
        assert not any("The weather in a city." in tok.decode([i for i, m in zip(ids, mask) if m])
                       for ids, mask in with_tools)
    _, tok, folder = targets["qwen3"]
    with pytest.raises(ValueError, match="tools must be a list of tool definitions"):
        tokenize_row(tok, {"messages": CASES["field"], "tools": "get_weather"}, None, chat_for(tok, folder))


def test_a_call_the_template_leaves_out_is_refused(targets):
    """gpt-oss's template renders an assistant turn's first tool call only:
    a turn of two parallel calls is refused naming the second, not trained
    as if it were one."""
    _, tok, folder = targets["gpt-oss-120b"]
    rome = {**CALL, "id": "call_2", "function": {**CALL["function"], "arguments": '{"city": "Rome"}'}}
    # "Rome" in the question too: the call is looked for by rendering the row without it, not by its text.
    row = {"messages": [{"role": "user", "content": "Weather in Paris and Rome?"},
                        {"role": "assistant", "content": "", "reasoning_content": "Both.",
                         "tool_calls": [CALL, rome]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
                        {"role": "tool", "tool_call_id": "call_2", "content": "25"}], "tools": TOOLS}
    with pytest.raises(ValueError, match="turn 1's call of get_weather is not in the chat template's render"):
        tokenize_row(tok, row, None, chat_for(tok, folder))
    _, tok, folder = targets["qwen3"]
    # Qwen3's renders both calls: captured, both under the loss.
    (ids, mask), = tokenize_row(tok, row | {"messages": row["messages"] + [
        {"role": "assistant", "content": "Both.", "reasoning_content": "Read them."}]}, None, chat_for(tok, folder))
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert '{"city": "Paris"}' in masked and '{"city": "Rome"}' in masked


def test_a_turn_holding_a_stop_tokens_text_is_refused_not_cut(targets):
    """In its content, or in a tool call's arguments: the target would have
    stopped there, and the loss would end inside the turn."""
    _, tok, folder = targets["glm-4.5"]
    row = {"messages": [{"role": "user", "content": "Say it."},
                        {"role": "assistant", "content": "Here: <|user|> and more.", "reasoning_content": R}]}
    with pytest.raises(ValueError, match="holds the text of the target's stop token '<\\|user\\|>'"):
        tokenize_row(tok, row, None, chat_for(tok, folder))
    _, tok, folder = targets["qwen3"]
    call = {**CALL, "function": {**CALL["function"], "arguments": '{"city": "a<|im_end|>b"}'}}
    row = {"messages": [WEATHER[0], {"role": "assistant", "content": "", "reasoning_content": "x", "tool_calls": [call]}]}
    with pytest.raises(ValueError, match="holds the text of the target's stop token '<\\|im_end\\|>'"):
        tokenize_row(tok, row, None, chat_for(tok, folder))


def test_a_gpt_oss_tool_call_without_reasoning_is_refused(targets):
    """gpt-oss always writes an analysis before it calls a tool, and its
    template renders none for a call that has none: refused, not trained as
    a call straight after the prompt."""
    _, tok, folder = targets["gpt-oss-120b"]
    row = {"messages": [WEATHER[0], {"role": "assistant", "content": "", "tool_calls": [CALL]}], "tools": TOOLS}
    with pytest.raises(ValueError, match="assistant turn 1 has no reasoning, the target always reasons first"):
        tokenize_row(tok, row, None, chat_for(tok, folder))


def test_turns_last_on_regenerated_answers_trains_their_last_answer_alone(targets):
    """A regenerated answers row holds earlier answers in its loss where its
    history holds them as written, and others in earlier_samples: with
    capture.turns last, only its loss's last run."""
    _, tok, folder = targets["kimi-k2.5"]
    row = {"row_id": "r", "input_ids": list(range(10)), "loss_mask": [0, 1, 1, 0, 0, 1, 1, 1, 0, 0],
           "earlier_samples": [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}]}
    assert tokenize_row(tok, row, None, chat_for(tok, folder, turns="last")) == [
        (list(range(10)), [0, 0, 0, 0, 0, 1, 1, 1, 0, 0])]
    assert len(tokenize_row(tok, row, None, chat_for(tok, folder))) == 2
    # Rows of ids a user gives are no conversation: kept whole.
    mine = {"input_ids": list(range(4)), "loss_mask": [1, 0, 1, 1]}
    assert tokenize_row(tok, mine, None, chat_for(tok, folder, turns="last")) == [(list(range(4)), [1, 0, 1, 1])]


def test_dropping_unwanted_reasoning_drops_it_from_the_whole_row(targets):
    """unwanted_reasoning drop: no turn's reasoning reaches any render, the
    history's included (Qwen3 renders a tool call's reasoning in the
    history of the answer after its result)."""
    _, tok, folder = targets["qwen3"]
    samples = tokenize_row(tok, row_of("tool call"), None, chat_for(tok, folder, thinking=False,
                                                                   unwanted_reasoning="drop"))
    assert samples and not any("Need the tool." in tok.decode(ids) or "The tool says" in tok.decode(ids)
                               for ids, _ in samples)


def test_a_tokenizer_with_named_templates_is_read_whole(targets):
    """A tokenizer may carry several templates by name (default, tool_use):
    their switch and date are found in any of them."""
    named = {"default": (TEMPLATES_DIR / "qwen3.jinja").read_text(),
             "tool_use": (TEMPLATES_DIR / "gpt-oss-120b.jinja").read_text()}
    assert reads_date(named) and set(reasoning_fields(named)) == {"reasoning_content", "thinking", "reasoning"}
    _, tok, _ = targets["qwen3"]
    tok = __import__("copy").deepcopy(tok)
    tok.chat_template = named
    assert renders_tool_calls(tok)


def test_a_stream_run_refuses_rows_of_several_samples_naming_what_to_do(targets, tmp_path):
    """A stream run spools by row; a conversation of several samples (Qwen3
    drops an earlier turn's reasoning) is refused at its plan, with the two
    ways out, not spooled wrong."""
    from tasks.stream.plan import SeveralSamplesARow, planned_samples

    _, tok, folder = targets["qwen3"]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CASES["three turns"]}, {"messages": CASES["field"]}])
    with pytest.raises(SeveralSamplesARow, match="give 2 samples beyond one each.*mode offline.*capture.turns last"):
        planned_samples([str(path)], tok, max_length=4096, policy="truncate", chat=chat_for(tok, folder))
    samples, _ = planned_samples([str(path)], tok, max_length=4096, policy="truncate",
                                 chat=chat_for(tok, folder, turns="last"))
    assert [s.source_row for s in samples] == [0, 1]
