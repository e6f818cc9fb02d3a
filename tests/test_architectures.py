"""Capture across architectures: the table's per-class knowledge, and a real
SGLang CPU server per architecture whose captures equal an independent HF
transformers forward, with the manifest's layer ids naming the right
layers, and on which the whole pipeline trains a drafter SGLang serves.
(Data-parallel attention: tests/test_configs.py, from the command line.)"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from flows.pipeline import eagle3_pipeline
from tasks.capture import canary
from tasks.capture.client import capture_many
from tasks.capture.config import CaptureConfig
from tasks.evaluation.config import EvaluateConfig
from tasks.regeneration.config import RegenerateConfig
from tasks.server.config import ServerConfig
from tasks.server.launch import CaptureSpec, build_command, cpu_attention_backend, hook_spec, launch_server
from tasks.target.architectures import ARCHITECTURES, DEEPSEEK_V3, KIMI_K25, LLAMA, UnsupportedArchitecture, \
    architecture_of
from tasks.store.config import StoreConfig
from tasks.target.layers import AuxLayers
from tasks.target.reference import load_reference_model, reference_states
from tasks.train.config import TrainConfig
from tests.conftest import ARTIFACTS, demo_rows, write_jsonl
from tests.reference_comparison import compare_with_reference
from tests.tiny_models import TINY_DEEPSEEK_V3, TINY_GLM4_MOE, TINY_GPT_OSS, TINY_KIMI_K25, TINY_QWEN3, \
    TINY_QWEN3_MOE, ensure_model


def test_layer_ids_mean_the_output_of_layer_i_on_every_architecture():
    # SGLang's classes turn explicit ids into layers_to_capture (capture
    # entering layer j = output of layer j - 1) differently; what we pass must
    # give layers_to_capture == [i + 1 for i in ours] on each.
    def llama_rule(passed):  # models/llama.py, qwen3.py, glm4_moe.py, gpt_oss.py
        return [v + 1 for v in passed]

    def deepseek_rule(passed):  # models/deepseek_v2.py set_eagle3_layers_to_capture
        return [v + 1 for v in passed] if passed[0] == 1 else list(passed)

    for ours in ([1, 3, 4], [2, 5, 6], [1, 14, 26], [3, 4, 5]):
        want = [i + 1 for i in ours]
        assert llama_rule(LLAMA.sglang_layer_ids(ours)) == want
        assert deepseek_rule(DEEPSEEK_V3.sglang_layer_ids(ours)) == want
        assert deepseek_rule(KIMI_K25.sglang_layer_ids(ours)) == want
    with pytest.raises(ValueError, match="output of layer 0"):
        DEEPSEEK_V3.sglang_layer_ids([0, 3, 4])


def test_kimi_sizes_come_from_text_config_and_its_stack_is_the_language_model():
    config = {"architectures": ["KimiK25ForConditionalGeneration"],
              "text_config": {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840},
              "vision_config": {"hidden_size": 1152}}
    arch = architecture_of(config)
    assert arch is KIMI_K25 and arch.sizes(config)["hidden_size"] == 7168
    assert arch.decoder_stack == "language_model.model"
    assert arch.embed_weight.startswith("language_model.")
    with pytest.raises(UnsupportedArchitecture, match="supported:"):
        architecture_of({"architectures": ["SomethingElseForCausalLM"]})


def test_the_capture_hooks_target_the_stack_and_its_first_layer(tmp_path):
    cfg = CaptureSpec(ServerConfig(model="m"), dump_dir=tmp_path, capture_module="language_model.model")
    targets = [spec["target_modules"] for spec in hook_spec(cfg)]
    assert targets == [["language_model.model.layers.0"], ["language_model.model"]]


@pytest.mark.parametrize("flag", ["--enable-two-batch-overlap", "--attn-cp-size=2"])
def test_flags_that_break_capture_are_refused(tmp_path, flag):
    cfg = CaptureSpec(ServerConfig(model="m", extra_args=[flag]), dump_dir=tmp_path, capture_module="model")
    with pytest.raises(ValueError, match="not supported on a capture server"):
        build_command(cfg, 1234, cpu=True)


@pytest.mark.parametrize("arch, backend", [("LlamaForCausalLM", None), ("DeepseekV3ForCausalLM", "intel_amx"),
                                           ("KimiK25ForConditionalGeneration", "intel_amx")])
def test_mla_targets_get_the_intel_amx_backend_on_a_cpu_only(tmp_path, arch, backend):
    # torch_native, SGLang's CPU default, has no MLA path: the first prefill
    # of a DeepSeek-V3 or Kimi target dies there.
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    cfg = CaptureSpec(ServerConfig(model=str(tmp_path)), dump_dir=tmp_path / "d")
    assert cpu_attention_backend(cfg) == backend
    on_cpu, on_gpu = build_command(cfg, 1, cpu=True), build_command(cfg, 1, cpu=False)
    assert ("--attention-backend" in on_cpu) == (backend is not None) and "--attention-backend" not in on_gpu
    own = CaptureSpec(ServerConfig(model=str(tmp_path), extra_args=["--attention-backend=x"]), dump_dir=tmp_path / "d")
    assert "--attention-backend" not in build_command(own, 1, cpu=True)  # the user's choice stands


@pytest.mark.server
def test_a_hook_that_attaches_to_nothing_fails_the_launch(tiny_model, tmp_path):
    from tasks.sglang_api import ServerError

    cfg = CaptureSpec(ServerConfig(model=str(tiny_model), max_total_tokens=4096), dump_dir=tmp_path / "dumps",
                      capture_module="no_such_module")
    with pytest.raises(ServerError, match="attached to no module"):
        launch_server(cfg, tmp_path / "server.log", timeout_s=600)


REGENERATED_TOKENS = 16


def check_regenerated(store: Path, dataset: Path, model: Path) -> None:
    """The pipeline's regenerated answers (in the store, by default) are what
    its store holds: every conversation answered, each sample its answers
    row token for token, its loss on the target's answers only; the
    manifest names what they were made from."""
    from tasks.regeneration.answer_store import AnswerStore
    from tasks.store.ledger.open import open_ledger

    answers = AnswerStore(store / "regenerated")
    assert answers.summary()["rows"] == len(demo_rows(120)) and not answers.quarantined()
    rows = dict(answers.read())
    assert all(0 < r["answer_tokens"] <= REGENERATED_TOKENS * r["turns"] for r in rows.values())
    samples = open_ledger(store).samples().set_index("source_row")
    assert sorted(samples.index) == sorted(rows)
    assert {r: (int(s.num_tokens), int(s.num_loss_tokens)) for r, s in samples.iterrows()} == {
        r: (len(a["input_ids"]), sum(a["loss_mask"])) for r, a in rows.items()}
    regenerated = json.loads((store / "manifest.json").read_text())["regenerated"]
    (source, made_from), = regenerated.items()
    assert source == str(answers.root.resolve()) and made_from["source"] == str(dataset.resolve())
    assert made_from["target"] == str(model) and made_from["settings"]["max_new_tokens"] == REGENERATED_TOKENS


@pytest.mark.server
@pytest.mark.parametrize("name", [TINY_QWEN3, TINY_QWEN3_MOE, TINY_DEEPSEEK_V3, TINY_KIMI_K25, TINY_GLM4_MOE,
                                  TINY_GPT_OSS])
def test_each_architecture_captures_hfs_states_and_trains_a_drafter_sglang_serves(name, prefect_api, tmp_path):
    """One capture server per architecture for all of it: its captures equal
    an independent HF forward (prompts across the chunk and gpt-oss's
    window, a non-default aux layer set), then the whole pipeline runs
    attached to it: capture (MLA and sinks on this CPU through our ops),
    training with the embedding and head from the right tensors (Kimi's
    under language_model.), export (DeepSeek-V3's drafter of the MLA layout),
    and SGLang serving the drafter speculatively on that target with greedy
    output unchanged (Kimi-K2.5's and DeepSeek-V3's: tests/test_drafter_in_sglang.py)."""
    # float32 on both sides: a random MoE router has near-ties that bf16
    # rounding flips (seen: one token of 70 routed differently, cosine 0.998
    # from there on), which would measure rounding, not the capture.
    # SGLang's gpt-oss keeps its attention weights in bf16 whatever --dtype
    # says (float32 fails on a dtype mismatch): bf16 on both sides there,
    # with a model whose tokens go to every expert (tests/tiny_models.py).
    dtype = "bfloat16" if name == TINY_GPT_OSS else "float32"
    # DeepSeek-V3's pipeline trains, exports, checks and serves the MLA drafter
    # (its forwards against SGLang's: tests/test_drafter_in_sglang.py); the
    # others, and Kimi-K2.5's (the same text model), the Llama layout.
    attention = "mla" if name == TINY_DEEPSEEK_V3 else "gqa"
    # Both layouts' drafters on Kimi-K2.5 and DeepSeek-V3 are served in SGLang by
    # tests/test_drafter_in_sglang.py (their forwards equal ours there, greedy output the
    # target's): these two pipelines end at the checked export (evaluate.enabled false).
    served = name not in (TINY_KIMI_K25, TINY_DEEPSEEK_V3)
    model = ensure_model(name)
    config = json.loads((model / "config.json").read_text())
    arch = architecture_of(config)
    assert arch is ARCHITECTURES[config["architectures"][0]]
    # A store of five layers (not the default three), the drafter trained on three of them.
    layers = AuxLayers.for_model(arch.sizes(config)["num_hidden_layers"], [1, 2, 4, 5, 6])
    drafter_layers = [2, 4, 5]
    rng = random.Random(0)
    # 300 > the chunk: two forwards, the second over a cached prefix (MLA's
    # absorbed path); 70 and 300 > gpt-oss's 32-token window.
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (5, 70, 300)]
    # Kimi-K2.5 is served with its checkpoint's own processor code, as the real one is.
    extra = ["--trust-remote-code"] if arch is KIMI_K25 else []
    section = ServerConfig(model=str(model), max_total_tokens=8192, chunked_prefill_size=256, dtype=dtype,
                           extra_args=extra)
    spec = CaptureSpec(section, dump_dir=tmp_path / "dumps", aux_layer_ids=arch.sglang_layer_ids(layers.sglang_ids))
    reference = load_reference_model(str(model), getattr(torch, dtype))

    def check(i, capture):
        assert capture.aux_layer_ids == layers.sglang_ids  # what the hook saw SGLang capture
        assert capture.canary.ok and len(capture.canary.positions) >= min(8, len(prompts[i]) - 1)
        ref_aux, ref_final = reference_states(reference, prompts[i], layers)
        return compare_with_reference(capture, ref_aux, ref_final)

    # Every prompt a canary: its final state, through the head read from the
    # checkpoint's own tensor names, gives the server's logprobs.
    head = canary.load_head(str(model))
    canaries = {i: canary.checker(head, sample_id=str(i)) for i in range(len(prompts))}
    with launch_server(spec, ARTIFACTS / f"{name}-server.log", timeout_s=600) as server:
        results = capture_many(server.url, spec.dump_dir, prompts, check, concurrency=3,
                               aux_layer_ids=layers.sglang_ids, api_key=server.api_key, rid_prefix=server.rid_prefix,
                               canaries=canaries)
        for n, result in zip((5, 70, 300), results):
            assert not isinstance(result, Exception), f"{name}, {n} tokens: {result!r}"
            assert result["min_cosine_aux"] >= 0.999 and result["min_cosine_final"] >= 0.999, (name, n, result)
        # What the README's table quotes.
        (ARTIFACTS / "architectures").mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "architectures" / f"{name}.json").write_text(json.dumps(
            {"dtype": dtype, "by_prompt_length": dict(zip((5, 70, 300), results))}, indent=1) + "\n")

        attached = section.model_copy(update={"url": server.url, "api_key": server.api_key,
                                              "rid_prefix": server.rid_prefix})
        dataset = write_jsonl(tmp_path / "data.jsonl", demo_rows(120))
        # Kimi-K2.5's pipeline first has the target answer every turn again, on this server (served outside
        # its rid prefix, not captured): the capture reads those answers as its dataset.
        regenerate = RegenerateConfig(enabled=name == TINY_KIMI_K25, max_new_tokens=REGENERATED_TOKENS)
        summary = eagle3_pipeline(
            regenerate=regenerate,
            server=attached,
            capture=CaptureConfig(dataset=str(dataset), max_length=512, batch_size=32,
                                  aux_layer_ids=list(layers.sglang_ids), dump_dir=str(spec.dump_dir)),
            store=StoreConfig(path=str(tmp_path / "run" / "store")),
            train=TrainConfig(out_dir=str(tmp_path / "run" / "train"), aux_layer_ids=drafter_layers,
                              draft_vocab_size=512, ttt_steps=3, epochs=3, lr=5e-3, tokens_per_batch=1024,
                              serve_steps=3, attention=attention),
            # The plain outputs from this server (no second launch of the target), but Qwen3's: from a plain
            # server the evaluation launches, its default (the suite's one launched baseline).
            # One stream, greedy: the sweep and sampling are tests/test_serving.py's.
            evaluate=EvaluateConfig(enabled=served, num_prompts=4, max_new_tokens=24, concurrency=[1],
                                    temperature=0.0, baseline="launch" if name == TINY_QWEN3 else "attached",
                                    min_verify_steps=16))
    if served:
        assert summary["outputs_equal"] is True, summary
        evaluation = json.loads((Path(summary["evaluation"]) / "evaluation.json").read_text())
        assert evaluation["baseline"] == ("launched" if name == TINY_QWEN3 else attached.url), evaluation
        assert summary["sglang_accept_length"] > 1.0, summary  # drafts were accepted in SGLang
    else:
        assert "sglang_accept_length" not in summary and not (tmp_path / "run" / "train" / "evaluation").exists()
    if name == TINY_QWEN3:  # launched in the target's dtype, as the capture's server was
        assert f"--dtype {dtype}" in evaluation["settings"]["commands"]["plain"], evaluation["settings"]
    if regenerate.enabled:
        check_regenerated(tmp_path / "run" / "store", dataset, model)
        # The run's summary counts the answers cut at max_new_tokens, as the rows mark them.
        from tasks.regeneration.answer_store import AnswerStore

        cut = sum(row["cut"] for _, row in AnswerStore(tmp_path / "run" / "store" / "regenerated").read())
        assert (summary["regenerated"]["rows"], summary["regenerated"]["cut"]) == (120, cut), summary
        # The drafter's card says the target answered its data, named by its file (no path of this machine).
        card = (Path(summary["drafter_dir"]) / "README.md").read_text()
        assert f"answers regenerated by the target from `{dataset.name}` into `regenerated`" in card, card
        assert str(tmp_path) not in card
    # The pipeline's run checked a canary in each of its 4 batches at least, recorded per shard.
    report = json.loads((tmp_path / "run" / "store" / "reports" / "latest.json").read_text())
    assert report["canary"]["samples"] >= 4 and 0 <= report["canary"]["worst_ratio"] <= 1, report
    # The drafter learned. Not a fixed figure: the captures are batched
    # float32 forwards whose last bits can depend on what the server batched
    # together, and three epochs turn that into a spread. Seen: the slowest
    # learners (Qwen3, Qwen3-MoE), each retrained on one store of this test
    # with seeds 0-7, end at tau 0.18-0.30 (means 0.264 and 0.254, sd 0.042
    # each); the untrained one at <= 0.007. 0.08 above it is mean - 4 sd,
    # and a drafter that learned nothing stays near 0. (Four epochs reached
    # 0.38 but cost 5.5 s more per architecture; two, 0.13-0.15 with the
    # same sd, leave too little room.)
    assert summary["heldout_tau"] > summary["untrained_tau"] + 0.08, summary
    drafter = json.loads((Path(summary["drafter_dir"]) / "config.json").read_text())
    assert drafter["architectures"] == [{"gqa": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}[attention]]
    assert drafter["vocab_size"] == arch.sizes(config)["vocab_size"]
    assert drafter["eagle3_training"]["target"] == Path(model).name  # as a user finds it, no path of this machine
    # The drafter is told the layers it was trained on, as this class reads them.
    assert drafter["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == arch.sglang_layer_ids(drafter_layers)
    assert drafter["eagle_config"]["layer_output_ids"] == drafter_layers
    # The store holds all five, at the bytes per token its contract says.
    from tasks.store.reader import StoreReader
    from tasks.store.shards import bytes_per_token

    reader = StoreReader(tmp_path / "run" / "store")
    assert reader.manifest["aux_layers"]["sglang_layer_output_ids"] == list(layers.sglang_ids)
    assert tuple(reader[0]["aux_hidden_states"].shape[1:]) == (5, arch.sizes(config)["hidden_size"])
    shard_bytes = sum(p.stat().st_size for p in (tmp_path / "run" / "store").rglob("shard-*.safetensors"))
    tokens = int(reader.num_tokens.sum())
    assert bytes_per_token(arch.sizes(config)["hidden_size"], 5) <= shard_bytes / tokens < \
        bytes_per_token(arch.sizes(config)["hidden_size"], 5) * 1.05  # headers: a few KB per shard
