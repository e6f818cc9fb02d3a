"""The capture canary (tasks/capture/canary.py): its draw, its bound, and
on the session's real SGLang server, every fault it exists for, injected
into real captures checked against that server's real logprobs."""
from __future__ import annotations

import json

import pytest
import torch

from tasks.capture import canary
from tasks.capture.canary import CanaryMismatch, CanaryTally, Head, check_capture, server_logprobs
from tasks.capture.client import capture_many
from tasks.capture.dump import Capture
from tasks.store.shards import BF16, FP8


def test_the_draw_is_seeded_stable_and_never_leaves_a_batch_without_one():
    ids = [f"s{i}" for i in range(2000)]
    chosen = canary.pick_canaries(ids, 0.01)
    assert chosen == canary.pick_canaries(list(reversed(ids)), 0.01)  # order and batching do not matter
    assert chosen == {i for i in ids if canary.is_canary(i, 0.01)}
    assert 0.005 < len(chosen) / len(ids) < 0.02
    assert canary.pick_canaries(ids, 0.01, seed=1) != chosen
    quiet = [i for i in ids if i not in chosen][:20]
    assert len(canary.pick_canaries(quiet, 0.01)) == 1  # a batch the draw missed still gets one
    assert canary.pick_canaries(ids, 0.0) == set() and canary.pick_canaries(ids, 1.0) == set(ids)


def test_positions_cover_both_sides_of_every_chunk_boundary():
    where = canary.canary_positions("a", 600, [0, 256, 512], 4)
    assert {255, 256, 511, 512} <= set(where) and len(where) <= 8
    assert max(where) <= 598  # the last token predicts nothing
    assert where == canary.canary_positions("a", 600, [0, 256, 512], 4)
    assert canary.canary_positions("a", 1, [0], 4) == []


def test_the_head_scores_a_full_log_softmax_within_its_own_rounding(monkeypatch):
    monkeypatch.setattr(canary, "HEAD_CHUNK_ROWS", 7)  # chunks that split the vocabulary unevenly
    g = torch.Generator().manual_seed(0)
    w = torch.randn(30, 16, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 16, generator=g).to(torch.bfloat16).float()  # stored states: bf16 values
    t = torch.tensor([0, 6, 7, 29, 13])
    spread = torch.rand(5, 16, generator=g)
    head = Head.of(w)
    lp, z_t, zmax, s_t, smax = head.score(x, t, spread)
    z = x @ w.float().T
    var = spread @ w.float().square().T
    u = head.rounding
    assert u == 2.0 ** -8  # a bf16 head is multiplied in bf16: its logits carry one rounding
    ref = torch.log_softmax(z, 1)[torch.arange(5), t]
    assert ((lp - ref).abs() <= u * (z[torch.arange(5), t].abs() + z.abs().amax(1)) + 1e-5).all()
    torch.testing.assert_close(zmax, z.abs().amax(1), rtol=u, atol=0)
    torch.testing.assert_close(s_t, var[torch.arange(5), t].sqrt(), rtol=2 * u, atol=0)
    torch.testing.assert_close(smax, var.amax(1).sqrt(), rtol=2 * u, atol=0)
    exact = Head.of(w.float())  # an fp32 head: fp32 throughout, no rounding of ours
    lp32, *_ = exact.score(x, t, spread)
    assert exact.rounding == 0 and torch.allclose(lp32, ref, rtol=0, atol=1e-5)


def served(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, compute=torch.bfloat16) -> list[float]:
    """What SGLang reports: logits from the server's state in its compute
    dtype (fp32 accumulation, rounded to the compute dtype), log_softmax in fp32."""
    z = (x.to(compute).float() @ w.float().T).to(compute).float()
    return torch.log_softmax(z, 1)[torch.arange(len(targets)), targets].tolist()


def fake_capture(final: torch.Tensor, ids: torch.Tensor) -> Capture:
    aux = torch.stack([final, final, final], 1)
    return Capture("r", ids, aux, final, (1, 3, 4), [])


@pytest.mark.parametrize("compute, storage", [(torch.bfloat16, BF16), (torch.bfloat16, FP8), (torch.float32, BF16),
                                              (torch.float16, FP8)])
def test_the_bound_holds_for_what_a_server_computes_and_shifted_states_break_it(compute, storage):
    """Logits of std 2 to 18 over a 4096-token vocabulary at H 512: the
    server's numbers always inside the derived bound, and the bound tight
    enough that a shift by one token is far outside it."""
    g = torch.Generator().manual_seed(1)
    n, h, v = 64, 512, 4096
    w = (torch.randn(v, h, generator=g) * 0.05).to(torch.bfloat16)
    x = (torch.randn(n, h, generator=g) * 2).to(compute)
    x[::7] *= 8  # rows of very different scale (FP8's per-row scale, bf16's relative rounding)
    ids = torch.randint(0, v, (n,), generator=g)
    logprobs = [None] + served(x[:-1], w, ids[1:], compute)
    result = check_capture(fake_capture(x, ids), logprobs, Head.of(w), sample_id="a", positions=n,
                           storage_dtype=storage)
    assert len(result.positions) == n - 1 and result.ok
    assert 0 < result.worst_ratio <= 1
    shifted = fake_capture(torch.roll(x, 1, 0), ids)
    with pytest.raises(CanaryMismatch, match="disagrees with the server's own logprobs"):
        check_capture(shifted, logprobs, Head.of(w), sample_id="a", positions=n, storage_dtype=storage)


def test_the_tally_stops_a_run_only_when_canaries_fail_wholesale():
    good = canary.CanaryResult("a", [1], [0.0], [0.0], [1.0], [])
    tally = CanaryTally(max_ratio=0.02, min_failed=3)
    for _ in range(200):
        tally.passed(good)
    tally.mismatched("one glitch")
    tally.mismatched("two")
    tally.check()  # 2 of 202: retried batches, not a verdict
    tally.mismatched("sample x: CanaryMismatch: ...")
    tally.check()  # 3 of 203 = 1.5% <= 2%
    wrong = CanaryTally(max_ratio=0.02, min_failed=3)
    for _ in range(3):
        wrong.mismatched("sample y: CanaryMismatch: position 4: server -7.1, stored state -3.2")
    with pytest.raises(canary.CanaryDisagrees, match="captures disagree with the server's own logprobs: 3 of 3"):
        wrong.check()


def test_a_profile_outlier_is_named():
    history = [[1.0 + 0.01 * k, 2.0, 0.5, 0.0, 0.9, 0.8, 0.7] for k in range(10)]
    assert canary.profile_outlier([1.03, 2.0, 0.5, 0.0, 0.9, 0.8, 0.7], history) == ""
    assert canary.profile_outlier([1.03, 2.0, 0.5, 0.0, 0.9, 0.8, 0.7], history[:5]) == ""  # too little history
    out = canary.profile_outlier([1.03, 2.9, 0.5, 0.0, 0.9, 0.1, 0.7], history)
    assert "log-RMS of aux state 1 2.900" in out and "cosine of aux state 1 and aux state 2 0.100" in out
    assert "final" not in out


# --- on the real server ---------------------------------------------------

def real_captures(server, ids_lists, answer=lambda c, meta: server_logprobs(meta, c.input_ids.tolist())):
    """Captures of `ids_lists` by the session's server, each with what
    `answer` makes of the server's answer (by default the logprobs of its
    prompt, asked in the capture request itself) as its `canary`."""
    def keep(i, c):
        return Capture(c.rid, c.input_ids.clone(), c.aux_hidden_states.clone(), c.final_hidden_state.clone(),
                       c.aux_layer_ids, list(c.files), c.canary)

    outs = capture_many(server.url, server.spec.dump_dir, ids_lists, keep, api_key=server.api_key,
                        rid_prefix=server.rid_prefix, canaries={i: answer for i in range(len(ids_lists))})
    assert not [o for o in outs if isinstance(o, Exception)], outs
    return outs


def replaced(c: Capture, *, aux=None, final=None) -> Capture:
    return Capture(c.rid, c.input_ids, c.aux_hidden_states if aux is None else aux,
                   c.final_hidden_state if final is None else final, c.aux_layer_ids, c.files, c.canary)


def test_on_a_real_server_the_canary_passes_and_catches_each_fault(capture_server, tiny_model, tmp_path):
    from tests.conftest import CHUNKED_PREFILL
    from tests.tiny_models import build_tiny_llama

    g = torch.Generator().manual_seed(3)
    n = CHUNKED_PREFILL + 60  # longer than a forward's token budget: two forwards at least
    lengths = [n, n] + [int(k) for k in torch.randint(30, 200, (10,), generator=g)]
    caps = real_captures(capture_server, [torch.randint(3, 2000, (k,), generator=g).tolist() for k in lengths])
    a, b, rest = caps[0], caps[1], caps[2:]
    # More than one forward (where they split depends on what else was scheduled).
    assert len(a.chunk_starts) >= 2
    edge = a.chunk_starts[1]
    head = canary.load_head(str(tiny_model))
    history = [canary.profile(c) for c in rest]

    def check(c, logprobs=None, h=head, storage=BF16):
        return check_capture(c, c.canary if logprobs is None else logprobs, h, sample_id="a", positions=8,
                             storage_dtype=storage, history=history)

    for c in caps:
        for storage in (BF16, FP8):
            assert check(c, storage=storage).ok
    clean = check(a)
    assert clean.profile_outlier == "" and edge - 1 in clean.positions and edge in clean.positions

    faults = {
        # the seeds' failure: a dump taken for another request of the same length
        "swapped with another request's": replaced(a, aux=b.aux_hidden_states, final=b.final_hidden_state),
        "shifted by one token": replaced(a, final=torch.roll(a.final_hidden_state, 1, 0)),
        "a chunk from another request": replaced(a, final=torch.cat([a.final_hidden_state[:edge],
                                                                     b.final_hidden_state[edge:]])),
        "aux and final tensors swapped": replaced(
            a, aux=torch.cat([a.aux_hidden_states[:, :2], a.final_hidden_state[:, None]], 1),
            final=a.aux_hidden_states[:, 2]),
    }
    for what, bad in faults.items():
        with pytest.raises(CanaryMismatch, match="stored final state disagrees"):
            check(bad)
    # A server serving other weights than the checkpoint (same config): its
    # logprobs do not come from the head the checkpoint holds.
    other = tmp_path / "other"
    other.mkdir()
    build_tiny_llama(other, seed=1)
    assert json.loads((other / "config.json").read_text()) == json.loads((tiny_model / "config.json").read_text())
    with pytest.raises(CanaryMismatch, match="stored final state disagrees"):
        check(a, h=canary.load_head(str(other)))

    # What the head cannot see: an aux layer shifted by a token.
    aux = a.aux_hidden_states
    shifted_layer = aux.clone()
    shifted_layer[:, 1] = torch.roll(aux[:, 1], 1, 0)
    outlier = check(replaced(a, aux=shifted_layer)).profile_outlier
    assert "cosine of aux state 0 and aux state 1" in outlier and "cosine of aux state 1 and aux state 2" in outlier
    # Two layers swapped show only where their norms differ: here layers 1 and
    # 4 of the random model are near-equal (log-RMS -2.29 and -2.27, cosine
    # 0.98), so the profile cannot tell (nor would a drafter).


def test_the_vocabularys_last_token_passes_though_sglang_reports_it_as_0(capture_server, tiny_model):
    # SGLang 0.5.23 reports every id >= vocab_size - 1 as 0 in its prompt
    # logprobs. Seen: row 30 of the demo data holds the tiny vocabulary's
    # last token (2047, "Ġexams"), and its canary was quarantined as a
    # capture of other tokens on every try.
    from tasks.capture.dump import CaptureError

    head = canary.load_head(str(tiny_model))
    last = head.vocab_size - 1
    ids = [5, 17, last, 40, last, 9] * 10
    (cap,) = real_captures(capture_server, [ids], answer=lambda c, meta: meta)
    with pytest.raises(CaptureError, match=f"is for token 0, {last} was sent"):
        server_logprobs(cap.canary, ids)  # a report of token 0 is taken for the last one only knowing the vocab
    assert canary.checker(head, sample_id="last", positions=60)(cap, cap.canary).ok


def test_a_run_told_the_wrong_checkpoint_stores_nothing_and_stops(capture_server, tiny_model, tiny_layers, tmp_path):
    """The session's real server serves the tiny model; the run believes it
    serves another checkpoint of the same config (as a server whose weights
    changed under the same path would look). Every batch's canary fails,
    no batch is stored, and the third failure stops the run."""
    import numpy as np

    from tasks.capture.config import CaptureConfig
    from tasks.capture.bookkeeping import FailureGuard
    from tasks.capture.extraction import Endpoint, extract_batch
    from tasks.data.dataset import Sample, sample_id
    from tasks.store.handle import Store
    from tasks.store.ledger.open import open_ledger, open_store
    from tasks.store.shards import FORMAT
    from tasks.store.verification import verify_store
    from tests.tiny_models import build_tiny_llama

    other = tmp_path / "other"
    other.mkdir()
    build_tiny_llama(other, seed=1)
    store = tmp_path / "store"
    open_store(store, {"format": FORMAT, "target": {"name": "tiny"}, "tokenizer": {"sha256": "t"},
                       "aux_layers": {"sglang_layer_output_ids": list(tiny_layers.sglang_ids)}, "hidden_size": 128,
                       "dtype": BF16, "max_length": 512, "max_length_policy": "truncate"})
    g = np.random.default_rng(0)

    def batch(k):
        out = []
        for row in range(4 * k, 4 * k + 4):
            ids = g.integers(3, 2000, int(g.integers(20, 80))).astype(np.int32)
            mask = np.ones(len(ids), np.uint8)
            out.append(Sample(sample_id(ids, mask), row, ids, mask))
        return out

    batches = [batch(k) for k in range(3)]
    cfg = CaptureConfig(sample_attempts=2)
    guard = FailureGuard(canaries=CanaryTally(max_ratio=0.02, min_failed=3))

    def run(samples, checkpoint, **kw):
        endpoint = Endpoint(capture_server.url, capture_server.spec.dump_dir, tiny_layers.sglang_ids,
                            checkpoint, api_key=capture_server.api_key, rid_prefix=capture_server.rid_prefix)
        return extract_batch(endpoint, Store.open(store), "d.jsonl", samples, cfg, **{"guard": guard, **kw})

    for samples in batches[:2]:
        with pytest.raises(canary.CanaryBatchRejected, match="batch not stored: sample .*server .*stored state"):
            run(samples, other)
    with pytest.raises(canary.CanaryDisagrees, match="captures disagree with the server's own logprobs: 3 of 3"):
        run(batches[2], other)
    ledger = open_ledger(store)
    assert ledger.summary()["samples"] == 0
    q = ledger.quarantined()
    assert len(q) == 3 and q.reason.str.contains(r"CanaryMismatch: .*position \d+: server -?\d").all()
    # The right checkpoint: the batch goes in, its canary recorded for the shard.
    guard = FailureGuard()
    result = run(batches[0], tiny_model)
    assert result.samples == 4 and result.canaries == 1
    (row,) = ledger.canaries().itertuples()
    # 0 happens: a bf16 head rounds our logits as the server's bf16 forward rounds its own
    assert row.shard == result.shard and 0 <= row.worst_ratio <= 1 and row.positions >= 1
    report = verify_store(store, recheck_source=False)
    assert report.ok and report.files.canaries.tolist() == [1] and report.canary["samples"] == 1

    # A batch whose task will retry it: its disagreeing canary is not
    # quarantined yet (a stream trainer waiting for that sample stops on a
    # quarantine row, though the retry may store it); the retry stores it.
    spare, before = batch(3), len(ledger.quarantined())
    with pytest.raises(canary.CanaryBatchRejected):
        run(spare, other, guard=FailureGuard(), last_try=False)
    assert len(ledger.quarantined()) == before
    assert run(spare, tiny_model, guard=FailureGuard()).samples == 4


def test_a_target_whose_logits_sglang_softcaps_is_refused_before_anything_runs_naming_the_key(
        tiny_model, prefect_api, tmp_path):
    """SGLang caps the logits of any target whose config sets
    final_logit_softcapping (Gemma's); the canary's head does not, so every
    canary of such a target would fail mid-run. The extraction refuses it
    in its plan, naming the key and the way out, before a store is created
    or a server launched; a stream run's plan refuses it before the trainer
    starts."""
    import shutil

    from flows.extract import extract_hidden_states
    from tasks.capture.canary import CanaryCannotCheck
    from tasks.capture.config import CaptureConfig
    from tasks.server.config import ServerConfig
    from tasks.store.config import StoreConfig
    from tasks.stream.plan import plan_stream
    from tasks.train.config import TrainConfig
    from tests.conftest import demo_rows, write_jsonl

    model = tmp_path / "capped"
    shutil.copytree(tiny_model, model, symlinks=True)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 30.0}))
    capture = CaptureConfig(dataset=str(write_jsonl(tmp_path / "data.jsonl", demo_rows(4))), max_length=256)
    refused = r"^the target's config sets final_logit_softcapping 30\.0: .* set capture\.canary_fraction 0"
    with pytest.raises(CanaryCannotCheck, match=refused):
        extract_hidden_states(server=ServerConfig(model=str(model)), capture=capture,
                              store=StoreConfig(path=str(tmp_path / "store")))
    assert not (tmp_path / "store" / "manifest.json").exists()
    with pytest.raises(CanaryCannotCheck, match=refused):
        plan_stream(str(model), capture, TrainConfig(out_dir=str(tmp_path / "t"), stream=True))
    canary.refuse_unchecked_logits({**config, "final_logit_softcapping": 30.0}, canary_fraction=0.0)  # opted out
    canary.refuse_unchecked_logits({**config, "final_logit_softcapping": None}, canary_fraction=0.01)
