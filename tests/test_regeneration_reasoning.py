"""Regeneration on a real server for reasoning targets and long answers:
Kimi-K2.5's and Qwen3's templates driven by the switch each reads, rows
checked token for token against the template; answers cut at
max_new_tokens marked, dropped or quarantined; a request SGLang refuses
quarantined at once with its words; every batch's conversations sharing
one pool's width."""
from __future__ import annotations

import copy
import json

import httpx
import pytest

from tasks.regeneration.answer_store import AnswerStore
from tasks.regeneration.answers import Asker
from tasks.regeneration.config import RegenerateConfig
from tasks.regeneration.pool import AnswerPool
from tasks.regeneration.stage import answer_batch, regenerate
from tasks.regeneration.turns import Conversation, render_prompt
from tests.conftest import write_jsonl
from tests.published_templates import KIMI_K25, QWEN3, template

pytestmark = pytest.mark.server

USER, ASSISTANT = "user", "assistant"


def turn(role: str, text: str) -> dict:
    return {"role": role, "content": text}
TWO_TURNS = ({"role": USER, "content": "Name a colour."}, {"role": ASSISTANT, "content": "Red, said a human."})


class Recording(httpx.AsyncBaseTransport):
    """Sends every request on to the real server, keeping its body; with
    `hold`, holds each until that many are open at once (or 10 s pass),
    recording the most that were."""

    def __init__(self, hold: int = 0):
        self.bodies, self.real = [], httpx.AsyncHTTPTransport()
        self.hold, self.open, self.most = hold, 0, 0
        self._reached = None

    async def handle_async_request(self, request):
        import asyncio

        self.bodies.append(json.loads(request.content))
        self.open += 1
        self.most = max(self.most, self.open)
        try:
            if self.hold:
                self._reached = self._reached or asyncio.Event()
                if self.open >= self.hold:
                    self._reached.set()
                try:
                    await asyncio.wait_for(self._reached.wait(), 10)
                except asyncio.TimeoutError:
                    pass
            return await self.real.handle_async_request(request)
        finally:
            self.open -= 1


def generate(server, ids: list[int], n: int) -> list[int]:
    r = httpx.post(f"{server.url}/generate", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=120,
                   json={"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": n}})
    return r.raise_for_status().json()["output_ids"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def ends_server(tmp_path_factory):
    """The tiny model whose answers end (tests/tiny_models.py TINY_ENDS),
    served as regeneration launches its server: float32, prefix cache on."""
    from tasks.regeneration.stage import answer_server
    from tasks.server.config import ServerConfig
    from tasks.server.launch import launch_server
    from tests.conftest import ARTIFACTS
    from tests.tiny_models import TINY_ENDS, ensure_model

    model = ensure_model(TINY_ENDS)
    spec = answer_server(ServerConfig(model=str(model), dtype="float32", max_total_tokens=8192), model)
    with launch_server(spec, ARTIFACTS / "ends-server.log", timeout_s=600) as server:
        yield server


def ask(server, tok, conv: Conversation, **settings) -> tuple[dict | Exception, list[dict]]:
    transport = Recording()
    asker = Asker(server.url, tok, RegenerateConfig(**settings), api_key=server.api_key)
    with AnswerPool(1, api_key=server.api_key, transport=transport) as pool:
        row, = pool.answer_many(asker, [conv])
    return row, transport.bodies


@pytest.mark.parametrize("name, published, switch", [("kimi-k2.5", KIMI_K25, "thinking"),
                                                     ("qwen3", QWEN3, "enable_thinking")])
@pytest.mark.parametrize("thinking", [True, False])
def test_a_reasoning_targets_two_turns_follow_its_own_switch_token_for_token(
        ends_server, tokenizer, name, published, switch, thinking):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template(published)
    server, n = ends_server, 24
    # The first of a few conversations whose two answers both end within n
    # tokens (the same one on every run: greedy, a fixed model).
    for k in range(12):
        conversation = ({"role": USER, "content": f"Name a colour, number {k}."}, TWO_TURNS[1],
                        {"role": USER, "content": f"And a fruit, number {k}?"})
        row, sent = ask(server, tok, Conversation("c", 0, conversation), thinking=thinking, max_new_tokens=n)
        assert not isinstance(row, Exception), row
        if row["turns"] == 2 and not row["cut"]:
            break
    else:
        pytest.fail("no conversation of two uncut turns: the tiny model's answers did not end")
    first, second = sent
    TWO = conversation
    kwargs = {switch: thinking}
    # Each request is the template rendered with the target's own switch (Kimi reads `thinking`:
    # sent as enable_thinking, its reasoning stayed on whatever was asked).
    assert first["input_ids"] == render_prompt(tok, list(TWO[:1]), kwargs)
    answer1 = generate(server, first["input_ids"], n)
    replayed = [TWO[0], {"role": ASSISTANT, "content": tok.decode(answer1, skip_special_tokens=True).strip()}, TWO[2]]
    assert row["messages"][:3] == replayed and "said a human" not in json.dumps(row["messages"])
    context = render_prompt(tok, replayed, kwargs)
    assert second["input_ids"] == context
    if not thinking:
        assert tok.decode(context).endswith("<think></think>" if name == "kimi-k2.5" else "<think>\n\n</think>\n\n")
    # The row: the last turn's context and the target's answer, token for token, ended by the target.
    answer2 = generate(server, context, n)
    assert row["input_ids"] == context + answer2 and answer2[-1] == tok.eos_token_id
    assert row["loss_mask"][len(context):] == [1] * len(answer2)
    # The first answer is trained once, as the ids the target gave after its
    # own prompt: in the row where the context holds exactly those, else
    # (Qwen3's thinking-off prompt closes a reasoning part its history does
    # not render; an answer whose text reads back to other ids) in a sample of its own.
    first_piece = first["input_ids"] + answer1
    samples = [(e["input_ids"], e["loss_mask"]) for e in row.get("earlier_samples", ())]
    inside = row["input_ids"][:len(first_piece)] == first_piece
    assert sum(row["loss_mask"][:len(context)]) == (len(answer1) if inside else 0)
    assert samples == ([] if inside else [(first_piece, [0] * len(first["input_ids"]) + [1] * len(answer1))])
    if name == "qwen3" and not thinking:
        assert not inside


def cut_conversations(tok, server) -> list[Conversation]:
    """Two-turn conversations whose first answer is cut at 3 tokens
    (checked here, not assumed)."""
    out = []
    for k in range(6):
        messages = ({"role": USER, "content": f"Tell me about {k}."}, {"role": ASSISTANT, "content": "x"},
                    {"role": USER, "content": "More?"})
        first = generate(server, render_prompt(tok, list(messages[:1]), {}), 3)
        if len(first) == 3 and tok.eos_token_id not in first:
            out.append(Conversation(f"cut{k}", k, messages))
    assert len(out) >= 2, "the tiny model ended every answer within 3 tokens"
    return out[:2]


@pytest.mark.parametrize("on_truncated", ["keep", "drop", "quarantine"])
def test_an_answer_cut_at_max_new_tokens_is_marked_and_never_a_later_turns_history(
        ends_server, tokenizer, tmp_path, on_truncated):
    cfg = RegenerateConfig(max_new_tokens=3, on_truncated=on_truncated)
    convs = cut_conversations(tokenizer, ends_server)
    store = AnswerStore(tmp_path / "answers", {"source": "s", "settings": cfg.identity()})
    transport = Recording()
    asker = Asker(ends_server.url, tokenizer, cfg, api_key=ends_server.api_key)
    with AnswerPool(2, api_key=ends_server.api_key, transport=transport) as pool:
        result = answer_batch(asker, store, convs, pool)
    # The second turn is never asked: a cut answer is no history.
    assert len(transport.bodies) == 2
    summary = store.summary()
    if on_truncated == "keep":
        rows = [r for _, r in store.read()]
        assert [(r["cut"], r["turns"], len(r["messages"])) for r in rows] == [(True, 1, 2)] * 2
        assert (summary["rows"], summary["cut"], result.cut) == (2, 2, 2)
    elif on_truncated == "drop":
        assert (summary["rows"], summary["dropped"], summary["quarantined"], result.dropped) == (0, 2, 0, 2)
        assert store.dropped_ids() == {c.row_id for c in convs}
        # Settled: a rerun under the same settings does not ask them again.
        assert not store.answered_among([c.row_id for c in convs])
    else:
        assert (summary["rows"], summary["quarantined"]) == (0, 2)
        assert all("max_new_tokens (3)" in reason and attempts == 1 for _, _, reason, attempts in store.quarantined())


def test_a_request_sglang_refuses_is_quarantined_at_once_with_its_words(ends_server, tokenizer, tmp_path):
    cfg = RegenerateConfig(max_new_tokens=3, attempts=3)
    long = Conversation("long", 0, ({"role": USER, "content": "word " * 5000},))
    store = AnswerStore(tmp_path / "answers", {"source": "s", "settings": cfg.identity()})
    transport = Recording()
    asker = Asker(ends_server.url, tokenizer, cfg, api_key=ends_server.api_key)
    with AnswerPool(2, api_key=ends_server.api_key, transport=transport) as pool:
        answer_batch(asker, store, [long], pool)
    assert len(transport.bodies) == 1  # not asked again: the same request gets the same refusal
    (_, _, reason, attempts), = store.quarantined()
    assert "Refused" in reason and "longer than the model's context length" in reason, reason
    assert attempts == 1  # what the record says is what was sent


class LongTails(httpx.AsyncBaseTransport):
    """The `long` conversations' requests are held until every request of
    the `last` ones has been answered (or 60 s pass: `timed_out`)."""

    def __init__(self, long: set[str], last: set[str], prefix: str = "regen-"):
        import asyncio

        self.long, self.last, self.prefix, self.real = long, set(last), prefix, httpx.AsyncHTTPTransport()
        self.answered, self.done, self.timed_out = set(), asyncio.Event(), False

    async def handle_async_request(self, request):
        import asyncio

        row_id = json.loads(request.content)["rid"][len(self.prefix):].split("-")[0]
        if row_id in self.long:
            try:
                await asyncio.wait_for(self.done.wait(), 60)
            except asyncio.TimeoutError:
                self.timed_out = True
        response = await self.real.handle_async_request(request)
        if row_id in self.last:
            self.answered.add(row_id)
            if self.answered == self.last:
                self.done.set()
        return response


def test_batches_after_two_slow_answers_are_answered_while_those_wait(ends_server, tokenizer, tmp_path):
    """Width 4 in batches of 2, the first two batches each holding an answer
    that ends only after the last batch's have: the pool answers batches 3
    and 4 meanwhile. Before, two batch tasks each waited on their slow one
    and nothing else was asked (here: 60 s, then timed out)."""
    from tasks.regeneration.provenance import provenance
    from tasks.regeneration.stage import plan_regeneration
    from tests.tiny_models import TINY_ENDS, ensure_model

    model = ensure_model(TINY_ENDS)
    rows = [{"messages": [{"role": USER, "content": f"Count to {k}."}]} for k in range(8)]
    source = write_jsonl(tmp_path / "data.jsonl", rows)
    cfg = RegenerateConfig(turns="last", max_new_tokens=2, concurrency=4, batch_size=2)
    out = tmp_path / "answers"
    todo = plan_regeneration(source, AnswerStore(out, provenance(source, model, cfg, tokenizer)), cfg, tokenizer).todo
    transport = LongTails(long={todo[0].row_id, todo[2].row_id}, last={todo[6].row_id, todo[7].row_id})
    result = regenerate(ends_server.url, source, out, tokenizer, model, cfg, api_key=ends_server.api_key,
                        transport=transport)
    assert result["rows"] == 8 and not transport.timed_out
    assert result["peak_in_flight"] == 4


def test_a_closed_pool_ends_every_batch_in_it_at_once(ends_server, tokenizer):
    """A run that stops (a stop rule, a cancel) closes its pool: batches
    waiting in it end with PoolClosed (not retried, nothing quarantined)
    instead of keeping the flow's workers, and so the flow, alive."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tasks.regeneration.pool import PoolClosed

    asker = Asker(ends_server.url, tokenizer, RegenerateConfig(), api_key=ends_server.api_key)
    held = LongTails(long={f"c{k}" for k in range(3)}, last={"never"})
    pool = AnswerPool(1, api_key=ends_server.api_key, transport=held)
    conversations = [Conversation(f"c{k}", k, ({"role": USER, "content": "Hi."},)) for k in range(3)]
    with ThreadPoolExecutor(2) as workers:
        first = workers.submit(pool.answer_many, asker, conversations[:2])
        deadline = time.monotonic() + 60
        while pool.in_flight < 1:  # the first conversation held at the transport, the second waiting its turn
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second = workers.submit(pool.answer_many, asker, conversations[2:])  # waits for room, or finds it closed
        t0 = time.monotonic()
        pool.close()
        outs = first.result(timeout=10)
        with pytest.raises(PoolClosed):
            second.result(timeout=10)
    assert time.monotonic() - t0 < 10 and all(isinstance(o, PoolClosed) for o in outs), outs


def test_every_turn_is_answered_with_the_targets_own_earlier_answers(ends_server, tmp_path):
    from transformers import AutoTokenizer

    from tests.tiny_models import TINY_ENDS, ensure_model

    model = ensure_model(TINY_ENDS)
    tokenizer = AutoTokenizer.from_pretrained(model)
    conversation = [turn("system", "Be brief."), turn(USER, "Name a colour."), turn(ASSISTANT, "Red, said a human."),
                    turn(USER, "And a fruit?"), turn(ASSISTANT, "Apple, said a human."), turn(USER, "Why?")]
    source = write_jsonl(tmp_path / "data.jsonl", [{"id": "c1", "messages": conversation}])
    regenerate(ends_server.url, source, tmp_path / "out", tokenizer, model,
               RegenerateConfig(max_new_tokens=24), api_key=ends_server.api_key)
    (_, row), = AnswerStore(tmp_path / "out").read()
    messages = row["messages"]
    assert row["id"] == "c1" and row["turns"] == 3 and not row["cut"]
    assert [m["role"] for m in messages] == ["system", USER, ASSISTANT, USER, ASSISTANT, USER, ASSISTANT]
    assert [m["content"] for m in messages if m["role"] != ASSISTANT] == [
        m["content"] for m in conversation if m["role"] != ASSISTANT]
    assert not any("said a human" in m["content"] for m in messages)
    # Each answer is what the server gives for the context holding the target's earlier answers.
    for k in (2, 4, 6):
        context = render_prompt(tokenizer, messages[:k], {})
        answer = generate(ends_server, context, 24)
        assert tokenizer.decode(answer, skip_special_tokens=True).strip() == messages[k]["content"]
    # The row is the last turn's context and answer, token for token. Each
    # earlier answer (the target's) is trained once, as the ids the server
    # gave after its context: inside the row where its history holds those
    # ids, else as a sample of its own (earlier_samples); the rest is not.
    context = render_prompt(tokenizer, messages[:6], {})
    assert row["input_ids"] == context + generate(ends_server, context, 24)
    samples = [(s["input_ids"], s["loss_mask"]) for s in row.get("earlier_samples", ())]
    samples.append((row["input_ids"], row["loss_mask"]))
    answers = 0
    for k in (2, 4, 6):
        context = render_prompt(tokenizer, messages[:k], {})
        answer = generate(ends_server, context, 24)
        answers += len(answer)
        assert [ids[len(context):len(context) + len(answer)] == answer and mask[len(context):][:len(answer)] ==
                [1] * len(answer) for ids, mask in samples if ids[:len(context)] == context].count(True) >= 1, k
    assert sum(sum(mask) for _, mask in samples) == answers
    masked = tokenizer.decode([t for ids, mask in samples for t, m in zip(ids, mask) if m])
    assert "Name a colour" not in masked and "Be brief" not in masked


def test_an_agentic_rows_tool_calls_stay_the_datasets_and_the_target_answers_after_each_result(
        ends_server, tokenizer):
    """With turns "all" the target answers after a tool's result as after a
    user's turn, with the dataset's call and result in its context (no tool
    runs here to answer calls of its own); nothing but its last answer is
    trained on, as the calls in the context are not its words."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template(QWEN3)
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    head = (turn(USER, "Weather in Paris?"), {"role": ASSISTANT, "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "18C, sunny", "tool_call_id": "c1"})
    conversation = (*head, turn(ASSISTANT, "Sunny, said a human."), turn(USER, "And tomorrow?"),
                    turn(ASSISTANT, "Rain, said a human."))
    row, sent = ask(ends_server, tok, Conversation("a", 0, conversation), max_new_tokens=24, on_truncated="keep")
    assert not isinstance(row, Exception), row
    assert row["turns"] == 2, row  # the tiny model ends its first answer (greedy: every run)
    answer1 = generate(ends_server, render_prompt(tok, list(head), {}), 24)
    replayed = [*head, {"role": ASSISTANT, "content": tok.decode(answer1, skip_special_tokens=True).strip()},
                conversation[4]]
    assert [b["input_ids"] for b in sent] == [render_prompt(tok, list(head), {}), render_prompt(tok, replayed, {})]
    assert row["messages"][:5] == replayed and "said a human" not in json.dumps(row["messages"])
    context = render_prompt(tok, replayed, {})
    answer2 = generate(ends_server, context, 24)
    assert row["input_ids"] == context + answer2
    assert row["loss_mask"] == [0] * len(context) + [1] * len(answer2)
    # "last": the one answer after the last user turn, the dataset's turns before it as they are.
    row, sent = ask(ends_server, tok, Conversation("b", 0, conversation), max_new_tokens=24, turns="last")
    assert [b["input_ids"] for b in sent] == [render_prompt(tok, list(conversation[:5]), {})]


def test_a_server_whose_settings_differ_from_the_first_answering_one_is_refused(ends_server, tmp_path):
    """Nodes' servers (and one attached by URL) are not described by the
    run's server section: the first server that answers into a directory
    records its own settings from /server_info, and a server whose differ
    where a command line set them (a node started in bfloat16 beside float32
    ones) is refused, naming them. A value neither command line set (SGLang
    chose it for the node's GPU) is reported, not refused."""
    from tasks.regeneration.answer_store import SERVED, AnswersMismatch
    from tasks.regeneration.provenance import served_flags

    flags = served_flags(ends_server.url, ends_server.api_key)
    settings = flags["settings"]
    assert settings["dtype"] == "float32" and settings["tp_size"] == 1 and settings["quantization"] is None
    assert settings["enable_deterministic_inference"] is False
    assert "dtype" in flags["given"] and "attention_backend" not in flags["given"]  # the launcher's --dtype
    store = AnswerStore(tmp_path / "a", {"source": "x"})
    assert store.check_served(flags, ends_server.url) is None
    assert store.check_served(served_flags(ends_server.url, ends_server.api_key), ends_server.url) is None
    recorded = (tmp_path / "a" / SERVED).read_text()
    assert json.loads(recorded) == flags and ends_server.api_key not in recorded
    other = AnswerStore(tmp_path / "b", {"source": "x"})
    other.check_served({**flags, "settings": {**settings, "dtype": "bfloat16"}}, "http://node-1")  # the first node's
    with pytest.raises(AnswersMismatch, match=r"made by a server with \{'dtype': 'bfloat16'\}; the one at "
                                              r"http.* runs with \{'dtype': 'float32'\}"):
        other.check_served(flags, ends_server.url)
    chose = AnswerStore(tmp_path / "c", {"source": "x"})
    chose.check_served({**flags, "settings": {**settings, "attention_backend": "fa3"}}, "http://node-1")
    assert "neither command line set them" in chose.check_served(flags, ends_server.url)


def test_a_reasoning_end_the_target_writes_in_other_tokens_is_kept_as_it_wrote_them(ends_server, tokenizer):
    """With a reasoning budget, the reasoning is asked to stop at
    reasoning_end. SGLang matches that string on the text, so the target
    can write it in other tokens than encode(reasoning_end): the answer then
    follows the target's own tokens, with no second marker appended."""
    server, tok = ends_server, tokenizer

    def inside(free: list[int]) -> str | None:
        """A stop string of plain text that starts inside one of the
        target's tokens, whose own encoding the target does not write."""
        for k in range(2, len(free) - 3):
            if tok.eos_token_id in free[:k + 3]:
                return None
            end = tok.decode(free[k:k + 3])[1:]
            marker = tok.encode(end, add_special_tokens=False)
            if len(end) >= 3 and end not in tok.decode(free[:k + 2]) and \
                    not any(free[i:i + len(marker)] == marker for i in range(len(free))):
                return end
        return None

    for n in range(12):
        conversation = (turn(USER, f"Think about {n}, then answer."),)
        prompt = render_prompt(tok, list(conversation), {})
        free = generate(server, prompt, 16)
        end = inside(free)
        if end:
            break
    else:
        pytest.fail("no stop string inside the tiny model's tokens")
    marker = tok.encode(end, add_special_tokens=False)
    row, sent = ask(server, tok, Conversation("m", 0, conversation), max_reasoning_tokens=16, max_new_tokens=8,
                    reasoning_end=end, turns="last")
    assert not isinstance(row, Exception), row
    first, second = sent
    assert first["sampling_params"]["stop"] == [end] and first["input_ids"] == prompt
    reasoning = second["input_ids"][len(prompt):]
    # The target's own tokens up to the one that completes the stop string (ids are not trimmed).
    assert reasoning == free[:len(reasoning)] and tok.decode(reasoning).endswith(end)
    assert tok.eos_token_id not in reasoning
    assert not any(reasoning[i:i + len(marker)] == marker for i in range(len(reasoning)))
    answer = generate(server, prompt + reasoning, 8)
    assert row["input_ids"] == prompt + reasoning + answer
