"""Conversations captured as each real target generates them, on its
published chat template verbatim (tests/published_templates.py): for every
template and case, the samples equal, token for token and mask for mask,
the generation prompt the template gives each trained turn followed by
what that target emits there, written out here by hand from
../shared/notes/chat-templates.md (reasoning, its end marker, the answer,
tool calls, the stop token); or the row is refused with one line naming
why. docs/reasoning.md holds the same table."""
from __future__ import annotations

import json

import pytest

from tasks.data.chat import ChatRefused, resolve, stop_texts
from tasks.data.dataset import prepare_samples, tokenize_row
from tests.conftest import write_jsonl
from tests.published_templates import ALL, model_dir_for

R, R1, R2, R3 = "Two plus two: count up from two.", "R one.", "R two.", "R three."
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
WEATHER = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'},
           {"role": "assistant", "content": "It is 21 C.", "reasoning_content": "The tool says 21."}]
# The function the tool-call case's row declares (its `tools`, as a chat request carries them).
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CASES = {
    "field": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is 4.", "reasoning_content": R}],
    "inline": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": f"<think>\n{R}\n</think>\n\nIt is 4."}],
    "three turns": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4.", "reasoning_content": R1},
                    {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6.", "reasoning_content": R2},
                    {"role": "user", "content": "4+4?"}, {"role": "assistant", "content": "8.", "reasoning_content": R3}],
    "tool call": WEATHER,
    "system and developer": [{"role": "system", "content": "Be brief."},
                             {"role": "developer", "content": "Answer in English."},
                             {"role": "user", "content": "Hi?"},
                             {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet."}],
    "plain chat": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."},
                   {"role": "user", "content": "Bye?"}, {"role": "assistant", "content": "Goodbye."}],
}
# What each target emits after its generation prompt, with thinking on
# (chat-templates.md), for (reasoning, answer); a tool call's form; and the
# tokens it stops on after an answer and after a tool call.
EMITS = {
    "qwen3": lambda r, a: f"<think>\n{r}\n</think>\n\n{a}<|im_end|>" if r is not None else f"{a}<|im_end|>",
    "kimi-k2.5": lambda r, a: f"{r}</think>{a}<|im_end|>" if r is not None else f"{a}<|im_end|>",
    "glm-4.5": lambda r, a: f"\n<think>{r}</think>\n{a}<|user|>" if r is not None else f"\n{a}<|user|>",
    "deepseek-v3.1": lambda r, a: (f"{r}</think>{a}<｜end▁of▁sentence｜>" if r is not None else
                                   f"{a}<｜end▁of▁sentence｜>"),
    "gpt-oss-120b": lambda r, a: ((f"<|channel|>analysis<|message|>{r}<|end|><|start|>assistant" if r is not None
                                   else "") + f"<|channel|>final<|message|>{a}<|return|>"),
    "llama-3.1": lambda r, a: f"{a}<|eot_id|>",
}
TOOL_EMITS = {
    "qwen3": ('<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
              '\n</tool_call><|im_end|>'),
    "kimi-k2.5": ('Need the tool.</think><|tool_calls_section_begin|><|tool_call_begin|>call_1'
                  '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'),
    "glm-4.5": ("\n<think>Need the tool.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
                "</arg_value>\n</tool_call><|observation|>"),
    "gpt-oss-120b": ('<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant to=functions.get_weather'
                     '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'),
}
# The fields each template reads an assistant turn's reasoning from.
FIELD = {"qwen3": "reasoning_content", "kimi-k2.5": "reasoning_content", "glm-4.5": "reasoning_content",
         "gpt-oss-120b": "thinking", "deepseek-v3.1": "reasoning_content", "llama-3.1": "reasoning_content"}
DEVELOPER_DROPPED = "turn 1's developer turn is not in the chat template's render of this row"
# Refusals, by (target, case): one line each.
REFUSED = {
    ("qwen3", "system and developer"): DEVELOPER_DROPPED,
    ("glm-4.5", "system and developer"): DEVELOPER_DROPPED,
    ("gpt-oss-120b", "system and developer"): DEVELOPER_DROPPED,
    ("deepseek-v3.1", "system and developer"): DEVELOPER_DROPPED,
    # Its template joins tool-call arguments as text; SGLang's chat endpoint hands them as an object.
    ("deepseek-v3.1", "tool call"): ("the chat template fails on turn 1 (assistant, its tool_calls): TypeError: can only "
                                     "concatenate str (not \"dict\") to str"),
}
# Which trained turns share a sample (auto): where the history renders an
# earlier turn exactly as the target emitted it. Every reasoning template
# drops an earlier turn's reasoning from the history once a user asks
# again; a tool call's reasoning stays in the prompt of the answer after
# its result (not gpt-oss's: its template reads `thinking`, which SGLang's
# message model does not carry, so a history never shows an analysis).
GROUPS = {
    "three turns": {t.name: [[1], [3], [5]] for t in ALL},
    "tool call": {"qwen3": [[1, 3]], "kimi-k2.5": [[1, 3]], "glm-4.5": [[1, 3]], "gpt-oss-120b": [[1], [3]]},
    "plain chat": {"qwen3": [[1], [3]], "kimi-k2.5": [[1, 3]], "glm-4.5": [[1, 3]], "gpt-oss-120b": [[1], [3]],
                   "deepseek-v3.1": [[1, 3]], "llama-3.1": [[1, 3]]},
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Each target's tokenizer folder (its template, tokens, stop tokens)."""
    from transformers import AutoTokenizer

    out = {}
    for t in ALL:
        folder = model_dir_for(t, tmp_path_factory.mktemp(t.name))
        out[t.name] = (t, AutoTokenizer.from_pretrained(folder), folder)
    return out


def chat_for(tok, folder, **settings):
    return resolve(tok, stop=stop_texts(tok, folder), date="2026-12-07", **settings)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def with_fields(target, messages):
    """A history as SGLang's chat endpoint hands it to the template: its
    message model keeps reasoning_content (no other reasoning field),
    tool-call arguments parsed."""
    def given(m):
        out = dict(m)
        if m.get("tool_calls"):
            out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]
        return out
    return [given(m) for m in messages]


def served_tools() -> list[dict]:
    """TOOLS as SGLang's chat endpoint hands a request's to the template:
    through its Tool model, dumped (serving_chat.py: item.model_dump()),
    its unset fields as nulls."""
    from sglang.srt.entrypoints.openai.protocol import Tool

    return [Tool.model_validate(t).model_dump() for t in TOOLS]


def row_of(case: str) -> dict:
    return {"messages": CASES[case], **({"tools": TOOLS} if case == "tool call" else {})}


def expected_samples(tok, target, case: str, messages: list[dict], thinking_on: bool):
    """The samples the row must give, built from the template's generation
    prompts and the emissions written out above."""
    fielded = with_fields(target, messages)
    emitted, prompts = {}, {}
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        reasoning = m.get("reasoning_content")
        if reasoning is None and "<think>" in m["content"]:
            reasoning, answer = R, "It is 4."
        else:
            answer = m["content"]
        # A turn without reasoning is rendered as the target answers with thinking off (missing_reasoning off);
        # gpt-oss cannot: an empty analysis.
        thinking = thinking_on and (reasoning is not None or target.switch is None)
        if thinking and reasoning is None:
            reasoning = ""
        kwargs = {target.switch: thinking} if target.switch else {}
        if target.name == "gpt-oss-120b":
            kwargs["strftime_now"] = lambda fmt: "2026-12-07"
        prompts[k] = tok.apply_chat_template(fielded[:k], tokenize=False, add_generation_prompt=True,
                                             tools=served_tools() if case == "tool call" else None, **kwargs)
        if m.get("tool_calls"):
            emitted[k] = TOOL_EMITS[target.name]
        else:
            emitted[k] = EMITS[target.name](reasoning if thinking else None, answer)
    trained = sorted(emitted)
    groups = GROUPS.get(case, {}).get(target.name, [[k] for k in trained] if len(trained) > 1 else [trained])
    out = []
    for group in groups:
        last = group[-1]
        ids = encode(tok, prompts[last]) + encode(tok, emitted[last])
        mask = [0] * len(encode(tok, prompts[last])) + [1] * len(encode(tok, emitted[last]))
        for j in group[:-1]:
            start, piece = len(encode(tok, prompts[j])), encode(tok, prompts[j]) + encode(tok, emitted[j])
            assert ids[:len(piece)] == piece, (target.name, case, j)  # the history holds turn j as emitted
            mask[start:len(piece)] = [1] * (len(piece) - start)
        out.append((ids, mask))
    return out


REASONING_TARGETS = ["qwen3", "kimi-k2.5", "glm-4.5", "gpt-oss-120b", "deepseek-v3.1"]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", REASONING_TARGETS)
def test_each_case_is_captured_as_the_target_emits_it_or_refused_in_one_line(targets, name, case):
    target, tok, folder = targets[name]
    chat = chat_for(tok, folder, thinking=True)
    row = row_of(case)
    if (name, case) in REFUSED:
        with pytest.raises(ValueError) as refused:
            tokenize_row(tok, row, None, chat)
        assert str(refused.value).startswith(REFUSED[(name, case)]) and "\n" not in str(refused.value)
        return
    got = tokenize_row(tok, row, None, chat)
    want = expected_samples(tok, target, case, CASES[case], thinking_on=True)
    assert [(ids, mask) for ids, mask in got] == want


def test_the_served_default_of_each_switch_is_the_capture_default(targets):
    """Unset, capture.thinking is what SGLang serves: Qwen3, GLM-4.5 and
    Kimi-K2.5 reason, DeepSeek-V3.1 does not, gpt-oss always does (no
    switch), Llama-3.1 has no reasoning."""
    found = {n: (c.switch, c.thinking, c.always) for n, (_, tok, folder) in targets.items()
             for c in [chat_for(tok, folder)]}
    assert found == {"qwen3": ("enable_thinking", True, False), "kimi-k2.5": ("thinking", True, False),
                     "glm-4.5": ("enable_thinking", True, False), "gpt-oss-120b": (None, True, True),
                     "deepseek-v3.1": ("thinking", False, False), "llama-3.1": (None, None, False)}
    _, tok, folder = targets["gpt-oss-120b"]
    with pytest.raises(ChatRefused, match="always reasons"):
        chat_for(tok, folder, thinking=False)
    _, tok, folder = targets["llama-3.1"]
    with pytest.raises(ChatRefused, match="finds no reasoning switch"):
        chat_for(tok, folder, thinking=True)


def test_a_dataset_with_reasoning_never_trains_on_an_empty_reasoning_part(targets, tmp_path):
    """Every reasoning template, a reasoning_content dataset: each trained
    turn's loss span holds its reasoning, never an empty reasoning part;
    the one row without reasoning is rendered as the target answers with
    thinking off (its empty part, where the template has one, is prompt),
    but on gpt-oss, which always reasons: an empty analysis under the loss."""
    rows = [{"messages": CASES["field"]}, {"messages": CASES["three turns"]}, {"messages": CASES["plain chat"]}]
    path = write_jsonl(tmp_path / "reasoning.jsonl", rows)
    for name in REASONING_TARGETS:
        _, tok, folder = targets[name]
        samples, rejected = prepare_samples(path, tok, max_length=4096, chat=chat_for(tok, folder, thinking=True))
        assert not rejected, (name, rejected)
        for s in samples:
            spans = _loss_spans(tok, s)
            if s.source_row < 2:
                assert any(r in "".join(spans) for r in (R, R1, R2, R3)), (name, spans)
            for span in spans:
                assert "<think></think>" not in span and "<think>\n\n</think>" not in span, (name, span)
                empty_analysis = "analysis<|message|><|end|>" in span
                assert empty_analysis == (name == "gpt-oss-120b" and s.source_row == 2), (name, span)


def _loss_spans(tok, sample) -> list[str]:
    spans, cur = [], []
    for i, m in zip(sample.input_ids.tolist(), sample.loss_mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    return spans + ([tok.decode(cur)] if cur else [])


def test_the_mismatch_policies_are_named_and_do_what_they_say(targets):
    _, tok, folder = targets["qwen3"]
    plain = {"messages": CASES["plain chat"][:2]}
    reasoned = {"messages": CASES["field"]}
    # A turn without reasoning, thinking on: refused, or an empty reasoning part under the loss, or thinking off.
    with pytest.raises(ValueError, match="has no reasoning but thinking is on.*capture.missing_reasoning"):
        tokenize_row(tok, plain, None, chat_for(tok, folder, missing_reasoning="refuse"))
    (ids, mask), = tokenize_row(tok, plain, None, chat_for(tok, folder, missing_reasoning="empty"))
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "<think>\n\n</think>\n\nHello.<|im_end|>"
    (ids, mask), = tokenize_row(tok, plain, None, chat_for(tok, folder))
    assert tok.decode(ids).endswith("assistant\n<think>\n\n</think>\n\nHello.<|im_end|>")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Hello.<|im_end|>"
    # A turn with reasoning, thinking off: refused naming the settings, or its reasoning dropped.
    off = chat_for(tok, folder, thinking=False)
    with pytest.raises(ValueError, match="has reasoning but thinking is off.*capture.thinking true.*drop"):
        tokenize_row(tok, reasoned, None, off)
    (ids, mask), = tokenize_row(tok, reasoned, None, chat_for(tok, folder, thinking=False, unwanted_reasoning="drop"))
    assert R not in tok.decode(ids) and tok.decode([i for i, m in zip(ids, mask) if m]) == "It is 4.<|im_end|>"


def test_the_turn_setting_chooses_the_samples_and_what_each_costs(targets):
    """auto keeps every turn in as few samples as the renders allow, each
    gives every turn its own, last only the last; every one trains the
    last turn identically."""
    _, tok, folder = targets["kimi-k2.5"]
    plain = {"messages": CASES["plain chat"]}
    by = {turns: tokenize_row(tok, plain, None, chat_for(tok, folder, turns=turns)) for turns in ("auto", "each", "last")}
    assert [len(v) for v in by.values()] == [1, 2, 1]
    assert by["auto"][0][0] == by["each"][1][0] == by["last"][0][0]  # the same tokens
    assert sum(by["auto"][0][1]) == sum(by["each"][0][1]) + sum(by["each"][1][1]) > sum(by["last"][0][1])
    with pytest.raises(ChatRefused, match="turns must be one of"):
        chat_for(tok, folder, turns="all")


def test_inline_reasoning_and_the_field_give_the_same_sample_and_twice_is_refused(targets):
    for name in ("qwen3", "kimi-k2.5", "glm-4.5", "deepseek-v3.1"):
        _, tok, folder = targets[name]
        chat = chat_for(tok, folder, thinking=True)
        assert (tokenize_row(tok, {"messages": CASES["inline"]}, None, chat) ==
                tokenize_row(tok, {"messages": CASES["field"]}, None, chat))
    both = [CASES["field"][0], {**CASES["inline"][1], "reasoning_content": R}]
    with pytest.raises(ValueError, match="assistant turn 1 has reasoning twice"):
        tokenize_row(tok, {"messages": both}, None, chat)
    # Reasoning alone (content null) is an assistant turn too.
    (ids, mask), = tokenize_row(tok, {"messages": [CASES["field"][0], {"role": "assistant", "content": None,
                                                                      "reasoning": R}]}, None, chat)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == f"{R}</think><｜end▁of▁sentence｜>"


def test_llama_31_tool_calls_are_captured_with_their_stop_token(targets):
    """Llama-3.1 (no reasoning): a tool call ends on <|eot_id|> as its
    template renders it, the result (ipython) is prompt."""
    target, tok, folder = targets["llama-3.1"]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "ipython", "content": '{"temp": 21}'}, {"role": "assistant", "content": "It is 21 C."}]
    samples = tokenize_row(tok, {"messages": messages}, None, chat_for(tok, folder))
    spans = [tok.decode([i for i, m in zip(ids, mask) if m]) for ids, mask in samples]
    assert spans == ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>It is 21 C.<|eot_id|>']
    # The result as its template quotes it, in the prompt only.
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temp\\": 21}"' in tok.decode(samples[0][0])


def test_gpt_oss_sample_ids_are_the_same_on_any_day(targets, tmp_path, monkeypatch):
    """gpt-oss's template renders today's date: the date is pinned when the
    store is created and kept in its manifest, so a capture on a later day
    (the clock moved) gives the same sample ids; unpinned, it would not."""
    import datetime as real

    from tasks.capture.config import CaptureConfig
    from tasks.capture.planning import capture_chat
    from tasks.data import chat as chat_module
    from tasks.store.manifest import write_json_atomic
    from tasks.store.shards import FORMAT

    _, tok, folder = targets["gpt-oss-120b"]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CASES["field"]}, {"messages": CASES["plain chat"]}])
    store = tmp_path / "store"
    store.mkdir()

    def on(day: str):
        class Clock(real.date):
            @classmethod
            def today(cls):
                return real.date.fromisoformat(day)

        class Now(real.datetime):
            @classmethod
            def now(cls, tz=None):
                return real.datetime.fromisoformat(day)

        monkeypatch.setattr(chat_module.datetime, "date", Clock)
        import transformers.utils.chat_template_utils as ctu
        monkeypatch.setattr(ctu, "datetime", Now)

    on("2026-12-07")
    first = capture_chat(CaptureConfig(dataset=str(path)), tok, folder, store)
    assert first.date == "2026-12-07"
    write_json_atomic(store / "manifest.json", {"format": FORMAT, "chat": first.record()})
    ids_first = [s.sample_id for s in prepare_samples(path, tok, max_length=4096, chat=first)[0]]
    on("2027-01-02")
    later = capture_chat(CaptureConfig(dataset=str(path)), tok, folder, store)
    assert later == first
    assert [s.sample_id for s in prepare_samples(path, tok, max_length=4096, chat=later)[0]] == ids_first
    # A new store on that day, or the template's own clock, renders another date: other ids.
    other = capture_chat(CaptureConfig(dataset=str(path)), tok, folder, tmp_path / "new-store")
    assert other.date == "2027-01-02"
    assert not {s.sample_id for s in prepare_samples(path, tok, max_length=4096, chat=other)[0]} & set(ids_first)
    # Without a pinned date the template is refused, not rendered with the clock.
    with pytest.raises(ChatRefused, match="template_date"):
        resolve(tok)


def test_the_chat_record_round_trips_through_the_manifest(targets):
    _, tok, folder = targets["gpt-oss-120b"]
    chat = chat_for(tok, folder, kwargs={"reasoning_effort": "high"}, turns="each")
    assert type(chat).from_record(json.loads(json.dumps(chat.record()))) == chat
    assert "Reasoning: high" in tok.decode(tokenize_row(tok, {"messages": CASES["field"]}, None, chat)[0][0])


def test_reasoning_that_the_answer_repeats_is_still_placed_where_the_target_writes_it(targets):
    """A template that leaves the last turn's reasoning out, with a
    reasoning the answer happens to contain ("4." in "It is 4."): found
    missing from the render (the render without it is the same), and
    placed after the generation prompt's <think>; the equality test on a
    real server found a reasoning taken for rendered because its text was in
    the answer."""
    row = {"messages": [{"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "It is 4.", "reasoning_content": "4."}]}
    for name, stop in (("kimi-k2.5", "<|im_end|>"), ("deepseek-v3.1", "<｜end▁of▁sentence｜>")):
        _, tok, folder = targets[name]
        (ids, mask), = tokenize_row(tok, row, None, chat_for(tok, folder, thinking=True))
        assert tok.decode([i for i, m in zip(ids, mask) if m]) == f"4.</think>It is 4.{stop}"
