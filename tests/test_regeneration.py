"""Regeneration: which turns the target answers and with what in its
context, the answers themselves token for token from a real SGLang server,
a killed run resumed, and a reasoning template's switch and budget."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
import torch

from tasks.data.dataset import prepare_samples
from tasks.regeneration.answer_store import FORMAT as ANSWERS_FORMAT, AnswerStore, AnswersMismatch
from tasks.regeneration.config import RegenerateConfig
from tasks.regeneration.provenance import provenance
from tasks.regeneration.stage import regenerate
from tasks.regeneration.turns import answer_points, prompt_messages, render_prompt
from tasks.server.config import API_KEY_ENV
from tests.conftest import demo_rows, wait_for, write_jsonl
from tests.prefect_stack import REPO

USER, ASSISTANT = "user", "assistant"


def turn(role: str, text: str) -> dict:
    return {"role": role, "content": text}


def test_which_user_turns_are_answered():
    messages = [turn("system", "s"), turn(USER, "a"), turn(ASSISTANT, "b"), turn(USER, "c"), turn(USER, "d"),
                turn(ASSISTANT, "old answer"), turn(USER, "e")]
    assert answer_points(messages, "all") == [1, 4, 6]  # "c" was never answered: it stays, unanswered
    assert answer_points(messages, "last") == [6]
    assert [m["content"] for m in prompt_messages({"messages": messages[:6]})] == ["s", "a", "b", "c", "d"]
    sharegpt = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "x"}]}
    assert prompt_messages(sharegpt) == [turn(USER, "q")]
    with pytest.raises(ValueError, match="no user turn"):
        answer_points([turn("system", "s")], "all")
    # A user turn followed by neither an answer nor the end: nothing to answer with "all" (it raised
    # UnboundLocalError after the plan had taken the row).
    with pytest.raises(ValueError, match="none is answered with turns 'all'"):
        answer_points([turn(USER, "a"), turn("system", "s"), turn(ASSISTANT, "b")], "all")
    assert answer_points([turn(USER, "a"), turn("system", "s"), turn(ASSISTANT, "b")], "last") == [0]
    # An agentic row: the target answers after a tool's result too, and a
    # turn that calls tools is the dataset's (its results answer its calls).
    calls = {"role": ASSISTANT, "content": "", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    agentic = [turn(USER, "q"), calls, turn("tool", "r"), turn(ASSISTANT, "final"), turn(USER, "q2"),
               turn(ASSISTANT, "a2")]
    assert answer_points(agentic, "all") == [2, 4]
    assert answer_points(agentic, "last") == [4] and answer_points(agentic[:3], "last") == [2]
    assert answer_points(agentic[:3], "all") == [2]


def generate(server, ids: list[int], n: int) -> list[int]:
    r = httpx.post(f"{server.url}/generate", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=120,
                   json={"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": n}})
    return r.raise_for_status().json()["output_ids"]


@pytest.mark.server
def test_the_last_turns_answer_is_the_targets_greedy_tokens(tiny_model, float32_server, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = write_jsonl(tmp_path / "data.jsonl", demo_rows(3) + ["{broken"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    result = regenerate(float32_server.url, source, tmp_path / "out", tokenizer, tiny_model,
                        RegenerateConfig(turns="last", max_new_tokens=12), api_key=float32_server.api_key)
    assert (result["rows"], result["rejected"]) == (3, 1)
    rows = [row for _, row in AnswerStore(tmp_path / "out").read()]
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


@pytest.mark.server
def test_a_killed_regeneration_resumes_and_answers_each_conversation_once(tiny_model, float32_server, prefect_api,
                                                                          tmp_path):
    """SIGKILLed once its first shard is committed, the flow is started
    again: it answers only the rest, and the answers equal an uninterrupted
    run's (greedy, one request at a time)."""
    source = write_jsonl(tmp_path / "data.jsonl", demo_rows(8))
    out = tmp_path / "answers"
    argv = [sys.executable, "-m", "flows.regenerate", "--dataset", str(source), "--server.model", str(tiny_model),
            "--server.url", float32_server.url, "--regenerate.out", str(out), "--regenerate.batch-size", "2",
            "--regenerate.concurrency", "1", "--regenerate.max-new-tokens", "24", "--regenerate.turns", "last"]
    env = {**os.environ, "PREFECT_API_URL": prefect_api, API_KEY_ENV: float32_server.api_key}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "stderr", "w"))
    try:
        wait_for(lambda: (out / "index.sqlite").exists() and AnswerStore(out).summary()["shards"] >= 1, proc,
                 tmp_path / "stderr")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = AnswerStore(out).summary()
    assert 2 <= before["rows"] < 8, before
    kept = {p.name: p.read_bytes() for p in out.glob("answers-*.jsonl")}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # The rerun's plan asks only for the rest (each batch also skips what is answered: the second guard).
    assert (f"8 conversations in {source}: {before['rows']} answered before, {8 - before['rows']} to answer"
            in done.stdout + done.stderr), done.stderr[-3000:]
    store = AnswerStore(out)
    assert store.summary()["rows"] == 8 and store.summary()["quarantined"] == 0
    assert [r for r, _ in store.read()] == list(range(8))  # each conversation once, under its source row
    # What the killed run committed stays as it was (a shard it left half written, if any, was written again).
    indexed = {name for name, in store._rows("SELECT name FROM shards")}
    assert all(kept[name] == (out / name).read_bytes() for name in kept if name in indexed)
    assert len(indexed) == 4 and all(r["ok"] for r in store.verify())
    uninterrupted = tmp_path / "uninterrupted"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    regenerate(float32_server.url, source, uninterrupted, tokenizer, tiny_model,
               RegenerateConfig(turns="last", max_new_tokens=24, concurrency=1, batch_size=2),
               api_key=float32_server.api_key)
    assert [r for _, r in store.read()] == [r for _, r in AnswerStore(uninterrupted).read()]
    # The capture reads the directory as its dataset: each row's exact ids and mask, under its source row.
    samples, rejected = prepare_samples(out, tokenizer, max_length=4096, rows={1, 6})
    assert not rejected and [(s.source_row, s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples] == [
        (r, row["input_ids"], row["loss_mask"]) for r, row in store.read() if r in (1, 6)]
    # The store the capture makes of them names what they were made from.
    from flows.extract import create_store
    from tasks.capture.config import CaptureConfig
    from tasks.store.config import StoreConfig
    from tasks.target.checkpoint import Target

    made = create_store(Target.load(str(tiny_model)), tokenizer, CaptureConfig(dataset=str(out)),
                        StoreConfig(path=str(tmp_path / "store")))
    from tasks.server.config import ServerConfig

    served = ServerConfig(model=str(tiny_model), url=float32_server.url)
    settings = RegenerateConfig(turns="last", max_new_tokens=24, concurrency=1, batch_size=2)
    assert made.manifest["regenerated"] == {str(out.resolve()): {"format": ANSWERS_FORMAT, **provenance(
        source, tiny_model, settings, tokenizer, served)}}
    # A corrupt byte is found, naming its shard; the answers, opened for other settings, are refused.
    name = sorted(indexed)[0]
    damaged = bytearray((out / name).read_bytes())
    damaged[10] ^= 1
    (out / name).write_bytes(bytes(damaged))
    bad = [r for r in store.verify() if not r["ok"]]
    assert [r["shard"] for r in bad] == [name] and "sha256" in bad[0]["problems"][0], bad
    with pytest.raises(AnswersMismatch, match=r"made from another settings .*max_new_tokens': 24"):
        AnswerStore(out, provenance(source, tiny_model, settings.model_copy(update={"max_new_tokens": 25}),
                                    tokenizer, served))


def test_two_writers_of_one_conversation_commit_it_once(ledger_url, tmp_path):
    """Two nodes answered the same conversations (one taken for dead went on,
    and the one given its share): the later commit keeps the earlier
    answers, commits its other rows in a shard of its own, and deletes the
    file it wrote first. The index, read with the database's own driver,
    holds each row once; the PostgreSQL one's record carries no password."""
    from tests.conftest import IndexDB

    out = tmp_path / "answers"
    store = AnswerStore(out, {"source": "x"}, index_url="env" if ledger_url else None)

    def row(i: int, who: str) -> dict:
        return {"row_id": f"r{i}", "source_row": i, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1],
                "answer_tokens": 2, "by": who}

    first = store.commit([row(0, "a"), row(1, "a")])
    second = store.commit([row(1, "b"), row(2, "b")])
    # The first writer's batch again, all taken: nothing written, and the first's file untouched.
    assert store.commit([row(0, "b"), row(1, "b")]) is None
    assert [(r, a["by"]) for r, a in AnswerStore(out).read()] == [(0, "a"), (1, "a"), (2, "b")]
    assert sorted(p.name for p in out.glob("answers-*")) == sorted([first, second])
    with IndexDB(out, ledger_url, "index.json", "index.sqlite") as db:
        assert db.execute("SELECT source_row, shard FROM rows ORDER BY source_row").fetchall() == [
            (0, first), (1, first), (2, second)]
        assert db.execute("SELECT name, rows FROM shards ORDER BY rows DESC").fetchall() == [(first, 2), (second, 1)]
    assert all(r["ok"] for r in store.verify())
    # Crash counts: one more each crash, or straight to a floor (a suspect that crashed the server alone).
    assert store.record_crash(["r7", "r8"]) == {"r7": 1, "r8": 1}
    assert store.record_crash(["r8"], at_least=3) == {"r8": 3} and store.record_crash(["r8"]) == {"r8": 4}
    assert store.crash_counts() == {"r7": 1, "r8": 4}
    if ledger_url:
        from tests.pg_server import PASSWORD

        assert PASSWORD not in (out / "index.json").read_text() and not (out / "index.sqlite").exists()


# A writer taken for dead that is not: it stops after its file is written
# ("file") or inside its commit's transaction ("transaction") until told to go.
WRITER = r"""
import sys, time
from pathlib import Path
import tasks.regeneration.answer_store as answer_store
out, flags, pause = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

def wait():
    (flags / "paused").touch()
    while not (flags / "go").exists():
        time.sleep(0.05)

store = answer_store.AnswerStore(out)
if pause == "file":
    real = answer_store.replace_durably
    answer_store.replace_durably = lambda path, write: (real(path, write), wait())
else:
    hold = store.index.hold_sweeps
    store.index.hold_sweeps = lambda db: (hold(db), wait())
print(store.commit([{"row_id": "z", "source_row": 9, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1],
                     "answer_tokens": 2}]))
"""


@pytest.mark.parametrize("pause", ["file", "transaction"])
def test_a_writer_taken_for_dead_never_commits_a_file_the_sweep_removed(ledger_url, tmp_path, pause):
    """A node's child taken for dead goes on (its host cut off): the parent
    sweeps the files no commit names, then the child commits. Before, the
    index then named a removed file (verify failed for good, the rows
    counted as answered). Now the late commit is refused and its file gone;
    a commit already under way when the sweep comes is waited for and kept."""
    import threading

    out, flags = tmp_path / "answers", tmp_path / "flags"
    flags.mkdir()
    store = AnswerStore(out, {"source": "x"}, index_url="env" if ledger_url else None)
    errors = tmp_path / "writer.err"
    with errors.open("w") as err:
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(out), str(flags), pause], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=err, text=True)
    wait_for(lambda: (flags / "paused").exists(), writer, errors, timeout_s=120)
    written = sorted(p.name for p in out.glob("answers-*"))
    assert len(written) == 1
    swept = []
    sweep = threading.Thread(target=lambda: swept.append(store.remove_unindexed()))
    sweep.start()
    if pause == "transaction":
        sweep.join(3)
        assert sweep.is_alive()  # waiting for the commit under way
    else:
        sweep.join(120)
        assert swept == [written] and not list(out.glob("answers-*"))
    (flags / "go").touch()
    stdout, _ = writer.communicate(timeout=120)
    stderr = errors.read_text()
    sweep.join(120)
    if pause == "file":
        assert writer.returncode != 0 and "were swept of files no commit names after this batch wrote" in stderr
        assert not list(out.glob("answers-*")) and not list(store.read())
    else:
        assert writer.returncode == 0, stderr
        assert swept == [[]] and stdout.split() == written and [r for r, _ in store.read()] == [9]
    assert all(r["ok"] for r in store.verify())


def test_a_file_written_while_the_sweep_runs_is_neither_removed_nor_refused(ledger_url, tmp_path):
    """A writer that reads the sweeps after a sweep began and writes its file
    before that sweep lists the directory: the file carries the sweep it
    saw, so the sweep leaves it, and its commit is taken (before, the sweep
    removed it and the commit passed the fence: the index named a removed
    file)."""
    import threading

    out, flags = tmp_path / "answers", tmp_path / "flags"
    flags.mkdir()
    store = AnswerStore(out, {"source": "x"}, index_url="env" if ledger_url else None)
    errors = tmp_path / "writer.err"
    writer = []
    rows = store._rows

    def listing_after_the_writers_file(sql, args=()):
        if sql.startswith("SELECT name FROM shards"):  # the sweep's own number is committed by now
            with errors.open("w") as err:
                writer.append(subprocess.Popen([sys.executable, "-c", WRITER, str(out), str(flags), "file"],
                                               cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True))
            wait_for(lambda: (flags / "paused").exists(), writer[0], errors, timeout_s=120)
        return rows(sql, args)

    store._rows = listing_after_the_writers_file
    swept = store.remove_unindexed()
    written = sorted(p.name for p in out.glob("answers-*"))
    assert swept == [] and len(written) == 1 and written[0].endswith("-s1.jsonl")
    (flags / "go").touch()
    stdout, _ = writer[0].communicate(timeout=120)
    assert writer[0].returncode == 0, errors.read_text()
    assert stdout.split() == written and [r for r, _ in AnswerStore(out).read()] == [9]
    assert all(r["ok"] for r in AnswerStore(out).verify())
    # The next sweep leaves it too: it is committed.
    assert AnswerStore(out).remove_unindexed() == [] and sorted(p.name for p in out.glob("answers-*")) == written


THINKING_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}"
    "{%- else %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


class Recording(httpx.AsyncBaseTransport):
    """Sends every request on to the real server, keeping its body."""

    def __init__(self):
        self.bodies, self.real = [], httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request):
        self.bodies.append(json.loads(request.content))
        return await self.real.handle_async_request(request)


@pytest.mark.server
def test_a_reasoning_templates_switch_reaches_the_server_and_dropped_reasoning_is_not_trained_on(
        tiny_model, float32_server, tmp_path):
    from transformers import AutoTokenizer

    from tasks.regeneration.answers import Asker
    from tasks.regeneration.pool import AnswerPool
    from tasks.regeneration.turns import Conversation

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = THINKING_TEMPLATE
    conv = Conversation("c", 0, (turn(USER, "Think, then answer."),))
    marker = tokenizer.encode("</think>", add_special_tokens=False)

    def ask(**settings):
        transport = Recording()
        asker = Asker(float32_server.url, tokenizer, RegenerateConfig(thinking_switch="enable_thinking", **settings),
                      api_key=float32_server.api_key)
        with AnswerPool(1, api_key=float32_server.api_key, transport=transport) as pool:
            row, = pool.answer_many(asker, [conv])
        assert not isinstance(row, Exception), row
        return row, transport.bodies

    # Thinking on, with a budget: the reasoning is cut at 4 tokens and closed,
    # then answered on a budget of its own; dropped, the row holds the answer
    # after the context a request without thinking gets.
    row, sent = ask(thinking=True, max_reasoning_tokens=4, max_new_tokens=6, keep_reasoning=False)
    reasoning_request, answer_request = sent
    assert tokenizer.decode(reasoning_request["input_ids"]).endswith("<|im_start|>assistant\n<think>\n")
    assert reasoning_request["sampling_params"]["max_new_tokens"] == 4
    prompt = reasoning_request["input_ids"]
    reasoning = answer_request["input_ids"][len(prompt):]
    assert answer_request["input_ids"][:len(prompt)] == prompt and reasoning[-len(marker):] == marker
    assert answer_request["sampling_params"]["max_new_tokens"] == 6
    answer = generate(float32_server, answer_request["input_ids"], 6)
    without = render_prompt(tokenizer, [turn(USER, "Think, then answer.")], {"enable_thinking": False})
    # Exactly the answer's tokens after the thinking-off render, whose "</think>\n\n" the
    # answer's own first tokens are not added to again.
    closed = tokenizer.encode("</think>\n\n", add_special_tokens=False)[len(marker):]
    assert without[-len(closed) - len(marker):] == marker + closed
    after = answer[len(closed):] if answer[:len(closed)] == closed else answer
    assert row["input_ids"] == without + after and row["loss_mask"] == [0] * len(without) + [1] * len(after)
    assert row["answer_tokens"] == len(reasoning) + len(answer)
    assert "</think>" not in row["messages"][-1]["content"]
    # Kept, the row is the reasoning and the answer as the target produced them.
    kept, _ = ask(thinking=True, max_reasoning_tokens=4, max_new_tokens=6)
    assert kept["input_ids"] == prompt + reasoning + answer
    # Thinking off: the switch reaches the template, which closes the reasoning itself.
    _, sent = ask(thinking=False, max_new_tokens=6)
    assert tokenizer.decode(sent[0]["input_ids"]).endswith("<think>\n\n</think>\n\n")
