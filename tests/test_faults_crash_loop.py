"""A sample that crashes the server every time it is sent: the run names it,
quarantines it after it has been in flight, alone, at a second crash, and
stores every other sample of its batch; the crash counts outlive the run, so
a rerun does not crash-loop either. The same for a conversation whose
regeneration crashes the server (its suspects sent alone together first,
then one by one), and a crash that was no conversation's doing costs the
regeneration one round of its suspects together (on the same server: one
launch)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tasks.capture.config import CaptureConfig
from tasks.capture.extraction import CRASH_LIMIT, Endpoint, ServerUnavailable, extract_batch
from tasks.data.dataset import Sample
from tasks.regeneration.answer_store import AnswerStore
from tasks.regeneration.answers import Asker
from tasks.regeneration.config import RegenerateConfig
from tasks.regeneration.pool import AnswerPool
from tasks.regeneration.provenance import provenance
from tasks.regeneration.stage import CRASH_LIMIT as ANSWER_CRASHES, ServerDown, answer_batch, plan_regeneration
from tasks.server.config import ServerConfig
from tasks.server.launch import CaptureSpec
from tasks.server.supervisor import ServerSupervisor
from tasks.store.ledger.open import open_ledger
from tasks.store.handle import Store
from tasks.store.verification import verify_store
from tasks.target.layers import AuxLayers
from tasks.store.ledger.open import open_store
from tasks.store.manifest import build_manifest
from tasks.target.architectures import architecture_at, load_tokenizer
from tests.conftest import ARTIFACTS, write_jsonl

pytestmark = pytest.mark.server

POISON = [1999, 1998, 1997]
POISON_ONCE = [1996, 1995, 1994]  # crashes the server the first time only


def test_a_sample_that_crashes_the_server_is_quarantined_and_the_rest_stored(tiny_model, tmp_path):
    layers = AuxLayers.for_model(8)
    rng = random.Random(5)
    samples = []
    for k in range(10):
        ids = [rng.randrange(3, 1990) for _ in range(rng.randrange(8, 40))]
        if k == 6:
            ids[4:4] = POISON
        samples.append(Sample(sample_id=f"s{k}", source_row=k, input_ids=np.array(ids, dtype=np.int32),
                              loss_mask=np.ones(len(ids), dtype=np.uint8)))
    store = tmp_path / "store"
    open_store(store, build_manifest(tiny_model, load_tokenizer(tiny_model), layers, architecture_at(tiny_model),
                                     max_length=512, policy="truncate", sources=["data.jsonl"]))
    crash = {"name": "crash_on_poison", "target_modules": ["model.embed_tokens"],
             "hook_factory": "tests.sglang_crash_hook:make_crash_hook",
             "config": {"poison": POISON, "poison_once": POISON_ONCE, "once": str(tmp_path / "crashed-once")}}
    # Relaunched after each crash: the capture's, the regeneration's, and the one-off.
    restarts = CRASH_LIMIT + ANSWER_CRASHES + 1
    cfg = CaptureSpec(ServerConfig(model=str(tiny_model), max_total_tokens=4096, max_restarts=restarts),
                      dump_dir=tmp_path / "dumps", extra_hooks=(crash,))
    log = ARTIFACTS / "crash-loop-server.log"
    log.unlink(missing_ok=True)  # launches append: this run's four crashes only
    server = ServerSupervisor(cfg, log)
    server.start()
    unavailable, regeneration, one_off = [], [], []
    try:
        for attempt in range(4):  # as the flow's batch task retries
            try:
                endpoint = Endpoint(server.url, cfg.dump_dir, layers.sglang_ids, api_key=server.api_key,
                                    rid_prefix=server.rid_prefix, on_down=server.recover)
                result = extract_batch(endpoint, Store.open(store), "data.jsonl", samples, CaptureConfig(concurrency=4))
                break
            except ServerUnavailable as e:
                unavailable.append(str(e))
        else:
            pytest.fail(f"the batch never completed: {unavailable}")
        groups, groups_once = [], []
        answers = regenerate_on_a_crashing_server(server, tiny_model, tmp_path, regeneration, POISON, groups)
        once = regenerate_on_a_crashing_server(server, tiny_model, tmp_path / "once", one_off, POISON_ONCE,
                                               groups_once)
    finally:
        server.stop()
    # Crash 1: s6 in flight with others; crash 2: s6 sent alone; then it is quarantined.
    assert len(unavailable) == CRASH_LIMIT, unavailable
    assert "s6 (crash 1)" in unavailable[0] and unavailable[1].endswith("s6 (crash 2)"), unavailable
    assert result.quarantined == ["s6"]
    ledger = open_ledger(store)
    assert ledger.stored_ids() == {s.sample_id for s in samples} - {"s6"}
    reason = ledger.quarantined().set_index("sample_id").loc["s6", "reason"]
    assert "SGLang server crashes" in reason, reason
    assert ledger.crash_counts()["s6"] == CRASH_LIMIT
    assert all(n == 1 for i, n in ledger.crash_counts().items() if i != "s6")  # innocents: in flight once
    assert verify_store(store, recheck_source=False, write_report=False).ok
    # The regeneration: the poisoned conversation (row 2) in flight at the first crash with
    # the others, then in their group sent alone, then alone, and quarantined; the others answered.
    assert len(regeneration) == ANSWER_CRASHES and server.restarts == restarts, regeneration
    # Each crashed server exited at once: no 5-s wait for crash diagnostics on a CPU (server_environment).
    assert log.read_text().count("crashed with exit code") == restarts
    assert "before crash diagnostics" not in log.read_text()
    poisoned = answers.quarantined()
    assert [(row, attempts) for _, row, _, attempts in poisoned] == [(2, ANSWER_CRASHES)], poisoned
    assert "it crashed the server again" in poisoned[0][2] and regeneration[2].endswith(f"{poisoned[0][0]} (crash 3)")
    # Together: every suspect of the first crash in one group (those still in
    # flight when the poison's forward came crashed with it), then one by one.
    assert groups[0] == regeneration[0].count("(crash 1)") >= 2 and set(groups[1:]) == {1}, groups
    assert f"{poisoned[0][0]} (crash 2)" in regeneration[1]
    assert [row for row, _ in answers.read()] == [0, 1, 3, 4, 5] and all(r["ok"] for r in answers.verify())
    # A crash that was no conversation's doing: one crash, then the six
    # suspects answered in one round together (one by one, a server's whole
    # width waited on each of them).
    suspects = one_off[0].count("(crash 1)")
    assert len(one_off) == 1 and suspects >= 2 and (tmp_path / "crashed-once").exists(), one_off
    assert [row for row, _ in once.read()] == [0, 1, 2, 3, 4, 5] and not once.quarantined()
    assert groups_once == [suspects] and set(once.crash_counts().values()) == {1}, groups_once

class Watched(AnswerPool):
    """The run's pool, keeping the size of each group sent alone."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.alone = []

    def answer_many(self, asker, conversations, attempt=1, *, alone=False):
        if alone:
            self.alone.append(len(conversations))
        return super().answer_many(asker, conversations, attempt, alone=alone)


def regenerate_on_a_crashing_server(server: ServerSupervisor, model, tmp_path, down: list, poison=POISON,
                                    alone: list | None = None) -> AnswerStore:
    """Six conversations, row 2 asking about the poison's text, answered
    batch by batch as the flow's retried task does; `down` gets each
    ServerDown's message, `alone` the sizes of the groups sent alone."""
    tokenizer = load_tokenizer(model)
    text = tokenizer.decode(poison)
    assert tokenizer.encode(text, add_special_tokens=False) == poison
    tmp_path.mkdir(exist_ok=True)
    source = write_jsonl(tmp_path / "conversations.jsonl", [
        {"messages": [{"role": "user", "content": f"Say something about {text if k == 2 else k}."}]}
        for k in range(6)])
    # Long enough that the others are still in flight when the poison's forward crashes the server.
    cfg = RegenerateConfig(max_new_tokens=24, concurrency=6)
    answers = AnswerStore(tmp_path / "answers", provenance(source, model, cfg))
    asker = Asker(server.url, tokenizer, cfg, api_key=server.api_key)
    batch = plan_regeneration(source, answers, cfg, tokenizer).todo
    with Watched(cfg.concurrency, api_key=server.api_key) as pool:
        for attempt in range(5):
            try:
                answer_batch(asker, answers, batch, pool, on_down=server.recover)
                if alone is not None:
                    alone += pool.alone
                return answers
            except ServerDown as e:
                down.append(str(e))
    pytest.fail(f"the regeneration batch never completed: {down}")
