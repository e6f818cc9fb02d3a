"""Drafters evaluated as SGLang serves them, on the tiny model: greedy output
exactly the plain server's, acceptance pooled and as a mean of per-request
means from SGLang's own counts, per position, a concurrency sweep, two
drafters side by side in one run."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from flows.evaluate import baseline_server
from tasks.evaluation.acceptance import acceptance
from tasks.evaluation.config import EvaluateConfig
from tasks.evaluation.side_by_side import (CPU_SAMPLED, Drafter, SpeculationChangedOutput, evaluate_drafters,
                                          greedy_changes)
from tasks.evaluation.generate import GenerationRun, serving_dtype
from tasks.evaluation.prompts import humaneval_problems, prompt_set, render
from tasks.server.config import ServerConfig
from tasks.server.cpu.shim import gpu_present
from tasks.server.launch import CaptureSpec, LaunchSpec, SpeculativeSpec, build_command
from tasks.store.config import StoreConfig
from tasks.target.architectures import load_tokenizer
from tasks.train.config import TrainConfig
from tests.conftest import ARTIFACTS, FIVE_LAYER_IDS
from tests.random_drafter import export_random_drafter

# The first one's greedy continuation is a run of one token (516, from the first token on) then others: a
# drafter pinned to it has its very first verify step accept all 3 drafts (so where the replayed walk
# starts shows), then steps accepting all and none.
PROMPTS = [[1] + [1592] * 12 + [1648, 723, 1606, 979, 516], [1, 42], [1, 200, 300, 400]]
MAX_NEW_TOKENS = 24


def target_greedy(model_path, prompts, max_new_tokens):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    outputs = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(ids):].tolist())
    return outputs


def pin_drafter_to(draft_dir, token: int) -> None:
    """Make the drafter propose `token` at every step, whatever it sees.

    A random drafter is almost never right, so it would leave SGLang's accept
    path (verify accepting drafts, moving their KV slots) unexercised. Here the
    final norm keeps one hidden dimension d, draft ids 0 and 1 score +d and
    -d (one of them wins, with no tie), and both map to `token`."""
    path = draft_dir / "model.safetensors"
    weights = load_file(path)
    hidden = weights["norm.weight"].shape[0]
    norm = torch.zeros_like(weights["norm.weight"])
    norm[0] = 1.0
    head = torch.zeros_like(weights["lm_head.weight"])
    head[0, 0], head[1, 0] = 10.0, -10.0
    d2t = weights["d2t"].clone()
    d2t[0], d2t[1] = token, token - 1
    weights.update({"norm.weight": norm, "lm_head.weight": head, "d2t": d2t})
    assert head.shape[1] == hidden
    save_file(weights, path)


@pytest.fixture(scope="module")
def pinned_drafter(tiny_model, tmp_path_factory):
    # The tiny target repeats a few tokens greedily; drafting its favourite
    # gets whole runs of drafts accepted, and some rejected.
    favourite = Counter(t for out in target_greedy(tiny_model, PROMPTS, MAX_NEW_TOKENS)
                        for t in out).most_common(1)[0][0]
    # Layers the float32 server captures, so its served text can be scored (check_served_text).
    draft_dir = export_random_drafter(tiny_model, tmp_path_factory.mktemp("drafter") / "eagle3",
                                      draft_vocab_size=512, aux_layer_ids=FIVE_LAYER_IDS[:3])
    pin_drafter_to(draft_dir, favourite)
    return draft_dir


@pytest.mark.server
def test_a_running_baseline_sets_the_dtype_and_a_different_one_is_refused(capture_server, tmp_path):
    from tasks.server.launch import server_dtype

    url, key, model = capture_server.url, capture_server.api_key, capture_server.spec.server.model
    theirs = serving_dtype(model, None, url, key)
    assert theirs == server_dtype(capture_server.spec, cpu=True)  # what the server was started with
    other = next(d for d in ("float32", "bfloat16") if d != theirs)
    with pytest.raises(ValueError, match=f"evaluate.dtype is {other}, but the baseline server at {url} computes in"):
        serving_dtype(model, other, url, key)
    with pytest.raises(ValueError, match="server.url is not set"):
        baseline_server(ServerConfig(model=model), EvaluateConfig(baseline="attached"))
    attached = ServerConfig(model=model, url=url)
    assert baseline_server(attached, EvaluateConfig()) is None
    assert baseline_server(attached, EvaluateConfig(baseline="attached")) is attached
    # Another running server of the target, by URL, with its own key (or none).
    elsewhere = baseline_server(attached, EvaluateConfig(baseline="http://deploy:30000",
                                                         baseline_api_key="k3y-elsewhere"))
    assert (elsewhere.url, elsewhere.api_key.get_secret_value(), elsewhere.model) == (
        "http://deploy:30000", "k3y-elsewhere", model)
    assert "k3y" not in repr(elsewhere) and elsewhere.model_dump(mode="json")["api_key"] == "**********"
    # A config saved with the mask in the key's place is refused, not sent to a server as its key.
    with pytest.raises(ValueError, match=r"'\*{10}' is the mask .* set \$EAGLE3_API_KEY"):
        ServerConfig.model_validate(elsewhere.model_dump(mode="json"))
    with pytest.raises(ValueError, match=r"'\*{10}' is the mask .* set \$EAGLE3_BASELINE_API_KEY"):
        EvaluateConfig(baseline="http://deploy:30000", baseline_api_key="**********")
    with pytest.raises(ValueError, match="give 'launch', 'attached' or the http"):
        EvaluateConfig(baseline="plain")
    with pytest.raises(ValueError, match="baseline_api_key is for a baseline server at a URL"):
        EvaluateConfig(baseline="attached", baseline_api_key="k")


def test_speculative_server_command(tmp_path):
    cfg = SpeculativeSpec(ServerConfig(model="m"), draft_model_path="d", speculative_num_steps=5,
                          speculative_eagle_topk=2, speculative_num_draft_tokens=8)
    cmd = build_command(cfg, 1234, cpu=True)
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--speculative-algorithm"] == "EAGLE3" and flags["--speculative-draft-model-path"] == "d"
    assert (flags["--speculative-num-steps"], flags["--speculative-eagle-topk"],
            flags["--speculative-num-draft-tokens"]) == ("5", "2", "8")
    assert flags["--attention-backend"] == "intel_amx"
    assert "--enable-return-aux-hidden-states" not in cmd
    assert "--attention-backend" not in build_command(cfg, 1234, cpu=False)
    assert "--speculative-algorithm" not in build_command(LaunchSpec(ServerConfig(model="m")), 1234, cpu=True)
    chain_cmd = build_command(SpeculativeSpec.chain(ServerConfig(model="m"), "d", 3), 1234, cpu=True)
    chain = dict(zip(chain_cmd, chain_cmd[1:]))
    assert (chain["--speculative-num-steps"], chain["--speculative-eagle-topk"],
            chain["--speculative-num-draft-tokens"]) == ("3", "1", "4")  # top-1: the drafts and the bonus token
    # A capture server has no drafter to serve, a plain or speculative one no dump dir.
    with pytest.raises(TypeError, match="draft_model_path"):
        CaptureSpec(ServerConfig(model="m"), dump_dir=tmp_path, draft_model_path="d")
    with pytest.raises(TypeError, match="dump_dir"):
        SpeculativeSpec(ServerConfig(model="m"), dump_dir=tmp_path, draft_model_path="d")


def test_acceptance_is_pooled_and_a_mean_of_means_from_the_raw_counts():
    # Two requests: 9 tokens in 3 steps (accepted 0, 1 and 3 drafts), 4 tokens in 1 step (2 accepted).
    metas = [{"completion_tokens": 9, "spec_verify_ct": 3, "spec_correct_drafts_histogram": [1, 1, 0, 1]},
             {"completion_tokens": 4, "spec_verify_ct": 1, "spec_correct_drafts_histogram": [0, 0, 1]}]
    a = acceptance(metas, num_drafts=4)
    assert (a.completion_tokens, a.verify_steps, a.histogram) == (13, 4, [1, 1, 1, 1, 0])
    assert a.pooled == 13 / 4 and a.mean_of_means == (9 / 3 + 4 / 1) / 2
    # Steps that accepted their 1st, 2nd, 3rd and 4th draft.
    assert a.per_position == [3 / 4, 2 / 4, 1 / 4, 0.0]
    assert a.accept_rate == (0 + 1 + 2 + 3) / (4 * 4)
    with pytest.raises(ValueError, match="counts 2 verify steps, meta_info says 3"):
        acceptance([{"completion_tokens": 9, "spec_verify_ct": 3, "spec_correct_drafts_histogram": [1, 1]}], 3)
    with pytest.raises(ValueError, match="more than 2 drafts"):
        acceptance(metas, num_drafts=2)
    with pytest.raises(ValueError, match="not speculative"):
        acceptance([{"completion_tokens": 9}], 3)


def test_prompt_sets_render_through_the_chat_template_and_bad_rows_are_refused(tiny_model, tmp_path):
    tokenizer = load_tokenizer(tiny_model)
    human = prompt_set("humaneval", count=3, tokenizer=tokenizer, store=None, heldout_fraction=0.1)
    first = humaneval_problems()[0]["prompt"]
    assert len(human.prompts) == 3 and human.prompts[0] == tokenizer.apply_chat_template(
        [{"role": "user", "content": first}], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    rows = tmp_path / "mine.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]})
                    + "\n" + json.dumps({"text": "plain text"}) + "\n")
    mine = prompt_set(str(rows), count=8, tokenizer=tokenizer, store=None, heldout_fraction=0.1)
    assert mine.prompts == [render(tokenizer, [{"role": "user", "content": "hi"}]),
                            list(tokenizer("plain text")["input_ids"])]
    rows.write_text(rows.read_text() + json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="row 2: no user turn"):
        prompt_set(str(rows), count=8, tokenizer=tokenizer, store=None, heldout_fraction=0.1)
    with pytest.raises(FileNotFoundError, match="neither one of heldout, humaneval nor a file"):
        prompt_set("gsm9k", count=8, tokenizer=tokenizer, store=None, heldout_fraction=0.1)


def test_a_pipeline_with_a_missing_prompt_file_is_refused_before_it_captures(tmp_path, monkeypatch):
    import flows.pipeline
    from flows.pipeline import eagle3_pipeline

    def captured(*a, **kw):
        raise AssertionError("the capture started")

    monkeypatch.setattr(flows.pipeline, "extract_hidden_states", captured)
    store = tmp_path / "store"
    with pytest.raises(FileNotFoundError, match="'heldout_prompts.jsonl' is neither .* nor a file"):
        eagle3_pipeline.fn(server=ServerConfig(model="smollm2-135m-instruct"), store=StoreConfig(path=str(store)),
                           train=TrainConfig(out_dir=str(tmp_path / "train")),
                           evaluate=EvaluateConfig(prompt_sets=["humaneval", "heldout_prompts.jsonl"]))
    assert not store.exists() and not (tmp_path / "train").exists()


@pytest.mark.server
def test_two_drafters_are_compared_in_one_run_and_a_changed_greedy_output_fails_it(tiny_model, float32_server,
                                                                                   pinned_drafter, tmp_path):
    # The pinned drafter, and an untrained one whose server has a real fault:
    # a hook negating the target's final hidden state, so its greedy tokens
    # are other tokens. The run measures both, then fails naming the second.
    random = export_random_drafter(tiny_model, tmp_path / "random" / "drafter", draft_vocab_size=512)
    negate = {"name": "negate_final_norm", "target_modules": ["model.norm"],
              "hook_factory": "tests.sglang_wrong_logits_hook:make_negating_hook", "config": {}}
    drafters = [Drafter("pinned", pinned_drafter, 3), Drafter("faulty", random, 3, hooks=(negate,))]
    # The prompts the pinned drafter's token was chosen on, as a user's file of token ids.
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    tokenizer = load_tokenizer(tiny_model)
    sets = [prompt_set(name, count=3, tokenizer=tokenizer, store=None, heldout_fraction=0.1)
            for name in (str(rows), "humaneval")]
    out = ARTIFACTS / "evaluation"
    # 100 verify steps: more than one round of 2 requests at one stream gives (~23 each).
    cfg = EvaluateConfig(num_prompts=3, max_new_tokens=MAX_NEW_TOKENS, concurrency=[1, 4], min_verify_steps=100,
                         baseline="attached", simulate=True)
    with pytest.raises(SpeculationChangedOutput, match="faulty on .*prompts.jsonl") as failed:
        # The served text captured on the float32 server too (it captures five layers, the drafters' among them).
        evaluate_drafters(ServerConfig(model=str(tiny_model)), drafters, sets, cfg, log_dir=out,
                          baseline_url=float32_server.url, baseline_api_key=float32_server.api_key,
                          capture_server=float32_server)
    assert "pinned" not in str(failed.value)
    report = json.loads((out / "evaluation.json").read_text())  # written before the run failed
    assert report["baseline"] == float32_server.url
    assert set(report["greedy_changed"]) == {f"faulty on {rows}", "faulty on humaneval"}
    raw = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    by = {}
    for r in raw:
        by.setdefault((r["drafter"], r["prompt_set"], r["mode"]), []).append(r)
    rows_by = {(r["drafter"], r["prompt_set"], r["mode"]): r for r in report["acceptance"]}
    # Drafters x sets x (greedy, and on a GPU sampled: a CPU's SGLang verifies a sampled request greedily).
    modes = 2 if gpu_present() else 1
    assert report["sampled_note"] == (None if gpu_present() else CPU_SAMPLED)
    assert set(by) == set(rows_by) and len(rows_by) == 2 * 2 * modes
    for key, requests in by.items():
        row = rows_by[key]
        # By hand from SGLang's per-request counts.
        tokens, steps = sum(r["completion_tokens"] for r in requests), sum(r["spec_verify_ct"] for r in requests)
        assert len(requests) == 3 and tokens == 3 * MAX_NEW_TOKENS
        assert row["pooled"] == tokens / steps
        assert row["mean_of_means"] == sum(r["completion_tokens"] / r["spec_verify_ct"] for r in requests) / 3
        for r in requests:
            assert sum(r["spec_correct_drafts_histogram"]) == r["spec_verify_ct"]
        assert sum(row["histogram"]) == steps == row["verify_steps"]
        assert len(row["histogram"]) == 3 + 1 and len(row["per_position"]) == 3
        if row["mode"] == "greedy":
            assert row["outputs_equal"] is (row["drafter"] == "pinned")
        else:
            assert row["outputs_equal"] is None
    pinned = rows_by[("pinned", str(rows), "greedy")]
    assert pinned["pooled"] > 1.0 and pinned["per_position"][0] > 0
    assert 0 < pinned["accept_rate"] < 1  # drafts accepted and drafts rejected
    assert [(r["drafter"], r["concurrency"]) for r in report["sweep"]] == [
        (d, c) for d in ("pinned", "faulty") for c in (1, 4)]
    for point in report["sweep"]:
        assert point["verify_steps"] >= 100 and point["requests"] % (2 * point["concurrency"]) == 0
        assert point["per_user_speedup"] > 0 and point["total_speedup"] > 0
        if point["concurrency"] == 1:
            assert point["requests"] > 2  # rounds were added until the point had its verify steps
    # Each speculative server in the attached baseline's float32, its prefix cache off.
    settings = report["settings"]
    assert settings["sglang"] == "0.5.23" and settings["dtype"] == "float32"
    # Speeds on a CPU are said not to be GPU figures, in the report and the plot's title.
    assert settings["device"] == ("gpu" if gpu_present() else "cpu")
    assert (report["speeds_note"] is None) == gpu_present()
    for name in ("pinned", "faulty"):
        command = settings["commands"][name]
        assert "--disable-radix-cache" in command and "--dtype float32" in command, command
    assert (out / "sweep.png").stat().st_size > 0 and (out / "acceptance.csv").read_text().count("\n") == 1 + 2 * 2 * modes
    check_served_text(report, out, favourite=pinned_favourite(pinned_drafter), raw=by)


def pinned_favourite(draft_dir) -> int:
    return int(load_file(draft_dir / "model.safetensors")["d2t"][0])


def check_served_text(report: dict, out, favourite: int, raw: dict) -> None:
    """The simulation on served text, recomputed by hand for the pinned
    drafter, which proposes `favourite` whatever it sees: the chain starting
    at token t hits its k-th draft while the text's tokens t+2 .. t+2+k are
    all `favourite`. SGLang's own per-request histogram must equal the walk
    replayed over the text; the faulty drafter changed its outputs, so its
    texts are left out."""
    texts = [json.loads(line) for line in (out / "served_text.jsonl").read_text().splitlines()]
    assert len(texts) == 2 * 3 and all(t["as_served"] for t in texts)
    rows = {(r["drafter"], r["prompt_set"]): r for r in report["served_text"]}
    assert set(rows) == {(d, s) for d in ("pinned", "faulty") for s in {t["prompt_set"] for t in texts}}
    for (drafter, name), row in rows.items():
        if drafter == "faulty":
            assert row["requests"] == 0 and row["left_out"] == report["greedy_changed"][f"faulty on {name}"]
            continue
        mine = [t for t in texts if t["prompt_set"] == name]
        histograms, chained, counted = [], [0, 0, 0], [0, 0, 0]
        for t in mine:
            text, n = t["prompt_ids"] + t["continuation"], len(t["prompt_ids"])
            assert len(t["continuation"]) == MAX_NEW_TOKENS + 3
            run = lambda start: next((k for k in range(3) if text[start + 2 + k] != favourite), 3)  # noqa: E731
            histogram, start, made = [0] * 4, n - 1, 1
            while made < MAX_NEW_TOKENS:
                histogram[run(start)] += 1
                made, start = made + run(start) + 1, start + run(start) + 1
            histograms.append(histogram)
            for start in range(n - 1, n + MAX_NEW_TOKENS):
                for k in range(3):
                    if start + k + 2 < n + MAX_NEW_TOKENS:
                        counted[k] += 1
                        chained[k] += run(start) > k
        served = [r["spec_correct_drafts_histogram"] + [0] * (4 - len(r["spec_correct_drafts_histogram"]))
                  for r in raw[("pinned", name, "greedy")]]
        assert served == histograms, (name, served, histograms)  # SGLang's count is the replayed walk
        if name != "humaneval":  # the first prompt's run of the pinned token: steps accepting none and all three
            assert histograms[0][0] and histograms[0][3], histograms
            assert mine[0]["continuation"][:4] == [favourite] * 4  # the first chain's three drafts all hit
        assert row["requests"] == 3 and row["replay_equals_sglang"] == 3 and row["replay_differs"] == []
        assert row["replayed_histogram"] == row["sglang_histogram"] == [sum(c) for c in zip(*histograms)]
        assert row["per_position"]["served_text_all_positions"] == [c / n for c, n in zip(chained, counted)]
        assert row["target_agrees"] == 1.0  # the captured states' greedy tokens are the served text
        assert row["per_position"]["heldout_training"] is None  # no training run beside the pinned drafter
    table = (out / "served_text.csv").read_text().splitlines()
    assert len(table) == 1 + 2 * 3  # the pinned drafter's three positions on each set


def test_a_drafter_that_changed_a_greedy_output_is_named():
    plain = {"s": GenerationRun([[1, 2], [3, 4]], [{}, {}], 1.0)}
    spec = {"s": GenerationRun([[1, 2], [3, 5]], [{}, {}], 1.0)}
    assert greedy_changes(plain, spec) == {"s": [1]}


def test_the_demo_targets_template_renders_humaneval_and_its_drafter_exports_in_sglangs_layout(tmp_path):
    """SmolLM2-135M-Instruct, the demo's target (a real tokenizer and chat
    template, a 49k vocabulary, tied embeddings): HumanEval renders through
    its own ChatML template, and a drafter for it exports in SGLang's layout
    and reads back whole. The demo serves it; the suite does not (two
    SmolLM2 launches cost it 95 s): a launched baseline is
    tests/test_architectures.py's (Qwen3), a tied target's embeddings
    tests/test_drafter.py's."""
    from tasks.target.models import SMOLLM2, resolve_model
    from tasks.train.eagle3.export import export_weights, load_exported

    model = resolve_model(SMOLLM2)
    tokenizer = load_tokenizer(model)
    prompts = prompt_set("humaneval", count=2, tokenizer=tokenizer, store=None, heldout_fraction=0.1).prompts
    first = humaneval_problems()[0]["prompt"]
    assert len(prompts) == 2 and tokenizer.decode(prompts[0]) == (
        f"<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{first}<|im_end|>\n<|im_start|>assistant\n")
    drafter = export_random_drafter(model, tmp_path / "random" / "drafter", draft_vocab_size=2048)
    config = json.loads((drafter / "config.json").read_text())
    assert (config["vocab_size"], config["draft_vocab_size"], config["tie_word_embeddings"]) == (49152, 2048, False)
    written = load_file(str(drafter / "model.safetensors"))
    read = export_weights(load_exported(drafter, model))
    assert set(read) == set(written) and all(torch.equal(read[k], written[k]) for k in read)


def test_the_replayed_walk_moves_as_sglang_verifies_and_counts_the_last_step_whole():
    from tasks.evaluation.served_text import clustered_se, replay

    # Chain starting at t accepts run[t] drafts (of 3). A 2-token prompt: the first chain starts at token 1.
    run = {1: 2, 4: 0, 5: 3}
    hits = torch.tensor([[run.get(t, 0) > k for t in range(13)] for k in range(3)])
    scored = torch.ones(3, 13, dtype=torch.bool)
    # 1 token from the prefill, +3 (2 drafts and the target's), +1, +4: 9 tokens, past max_new_tokens 8, and
    # the last step's three drafts all count, as SGLang counts them.
    assert replay(hits, scored, prompt_len=2, max_new_tokens=8) == [1, 0, 1, 1]
    scored[:, 5:] = False  # a text too short for the chain at token 5
    with pytest.raises(ValueError, match="runs past the served text"):
        replay(hits, scored, prompt_len=2, max_new_tokens=8)
    # Requests as clusters: 2 of 2 and 0 of 2 give p = 0.5 with residuals +1 and -1.
    assert clustered_se([2, 0], [2, 2]) == 0.5 and clustered_se([1, 1], [2, 2]) == 0.0
