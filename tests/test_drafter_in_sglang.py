"""Our drafter inside SGLang's own classes, `LlamaForCausalLMEagle3` (attention
gqa) and `Eagle3DeepseekV2ForCausalLM` (mla), in a real speculative server
(one launch per target, layout and variant, for the module): the
parameters it loaded are ours, the aux states it is fed are the target's
states of the layers the drafter was trained on (not SGLang's default ones),
they are aligned as training assumes (aux state of token t with the embedding
of token t+1), and its forwards equal our drafter's: the draft extend, and
the draft decode steps that follow it, which feed back the drafter's own
hidden state (pre-norm for eagle3, normed for eagle3.1) and attend to the
extend's keys plus the chain's own (the TTT unroll of tasks/train/eagle3/ttt.py).
The greedy output through the drafter is the target's own. The Llama
target's store is captured by a real server with five layers and checked
against HF before a drafter trains on a triple of it.

The same store feeds a DFlash drafter (all five layers), served by the
evaluation beside an EAGLE-3 one (the side_by_side fixture, the suite's
DFlash server): SGLang's DFlashDraftModel holds our tensors, projects the
trained layers' states, and computes each draft block as our training
forward does. That EAGLE-3 drafter, probed there, is the Llama case of the
checks above."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tasks.server.config import ServerConfig
from tasks.server.launch import SpeculativeSpec, launch_server
from tasks.target.layers import AuxLayers, default_aux_layer_ids
from tasks.target.reference import load_reference_model, reference_states
from tasks.train.config import TrainConfig
from tasks.target.embeddings import load_target_embeddings
from tasks.train.eagle3.model import Eagle3Drafter
from tasks.train.layers.sizes import target_sizes
from tasks.train.eagle3.export import export_weights, load_exported
from tasks.train.loop import train
from tests.conftest import ARTIFACTS, FIVE_LAYER_IDS, random_store
from tests.draft_probe_records import (DFLASH_BLOCK, PROMPT, Served, SideBySide, _first_request, _prefill_extend,
                                       _probed, eagle_probe, greedy, hf_greedy)
from tests.tiny_models import TINY, TINY_DEEPSEEK_V3, TINY_KIMI_K25, ensure_model

pytestmark = pytest.mark.server

# A store of five layers, and each variant's drafter trained on its own
# three of them, not SGLang's default (1, 3, 4) for these 8-layer targets: a
# server that ignored the drafter's config would feed it other layers, and so
# would one given them in the wrong convention for the target's class
# (Kimi-K2.5's reads ids starting at 1 shifted, others unshifted: one triple
# of each).
STORE_LAYER_IDS = FIVE_LAYER_IDS
AUX_LAYER_IDS = {"eagle3": (2, 5, 6), "eagle3.1": (1, 4, 5)}
# The drafter, fp32 on both sides: what is left is summation order (SGLang's
# fused qkv and gate_up matmuls, its attention against ours), <= 1e-6 seen.
# Ten times that still fails the near misses: a decode step at the extend's
# last position instead of the next (rope off by one) is off by >= 6e-4, one
# without the chain's earlier key by ~4e-3 (both targets).
ATOL, RTOL = 1e-5, 1e-5
# The target's states, SGLang's model against HF's (other attention and, for
# Kimi-K2.5, MLA and MoE kernels): <= 3e-5 seen; neighbouring layers differ
# by > 0.1.
TARGET_ATOL, TARGET_RTOL = 2e-4, 1e-3


def _distinct_fc_norms(drafter_dir: Path) -> None:
    """eagle3.1's fc_norm weights, each made its own and far from 1: a brief
    training leaves them within bf16's rounding of their initial ones, where
    a server that built the norms but kept its own weights would pass."""
    path = drafter_dir / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        w = tensors[f"fc_norm.{i}.weight"]
        tensors[f"fc_norm.{i}.weight"] = (1 + 0.5 * torch.randn(w.shape, generator=g)).to(w.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def llama_store(float32_server, prefect_api, tmp_path_factory) -> Path:
    """The Llama target's five-layer store, captured by a real SGLang server
    (float32) through the extraction flow, which verifies it. (Kimi-K2.5's
    five-layer capture: tests/test_architectures.py.)"""
    from flows.extract import extract_hidden_states
    from tests.conftest import attach, demo_rows, write_jsonl

    d = tmp_path_factory.mktemp("llama-store")
    dataset = write_jsonl(d / "data.jsonl", demo_rows(8))
    result = extract_hidden_states(**attach(float32_server, store=d / "store", dataset=str(dataset), max_length=64,
                                            batch_size=8, aux_layer_ids=list(STORE_LAYER_IDS)))
    from transformers import AutoTokenizer

    from tasks.data.dataset import prepare_samples

    # Every row that fits (row 5 has no assistant token within 64: rejected).
    fits, _ = prepare_samples(dataset, AutoTokenizer.from_pretrained(ensure_model(TINY)), max_length=64)
    assert result["samples"] == len(fits) >= 6 and result["verification"]["ok"], result
    return Path(result["store"])


def test_the_captured_llama_store_holds_the_targets_five_layers(llama_store):
    from tasks.store.reader import StoreReader

    reader = StoreReader(llama_store)
    layers = AuxLayers(STORE_LAYER_IDS)
    assert reader.manifest["aux_layers"]["sglang_layer_output_ids"] == list(STORE_LAYER_IDS)
    reference = load_reference_model(str(ensure_model(TINY)), torch.float32)
    for i in range(len(reader)):
        sample = reader[i]
        aux, final = reference_states(reference, sample["input_ids"].tolist(), layers)
        # Stored in bf16 from SGLang's float32 states: rounding to nearest is
        # off by up to half a step, 2^-8 relative (bf16's unit roundoff).
        torch.testing.assert_close(sample["aux_hidden_states"].float(), aux, atol=TARGET_ATOL,
                                   rtol=TARGET_RTOL + 2.0 ** -8)
        torch.testing.assert_close(sample["final_hidden_state"].float(), final, atol=TARGET_ATOL,
                                   rtol=TARGET_RTOL + 2.0 ** -8)


# Kimi-K2.5: a wrapper target whose embedding sits under language_model.,
# an MLA target on a CPU, and a YaRN rope the drafter takes over. The
# grid's diagonals: what a variant changes (fc norms, what is fed back) does
# not depend on the target or the layout, nor what a target changes
# (embedding, rope, attention) on the variant. The MLA layout (its
# attention, deepseek-yarn rope and mscale, fused q_a/kv_a) is served on
# both MLA targets, each with the other variant; Kimi-K2.5 and DeepSeek-V3
# differ in SGLang only by the wrapper (the embedding, multimodal inputs).
GRID = [(TINY, "eagle3", "gqa"), (TINY_KIMI_K25, "eagle3.1", "gqa"), (TINY_KIMI_K25, "eagle3", "mla"),
        (TINY_DEEPSEEK_V3, "eagle3.1", "mla")]


@pytest.fixture(scope="module", params=GRID, ids=lambda p: "-".join(p))
def served(request, tmp_path_factory) -> Served:
    """A drafter trained (briefly: what is checked is the path, not its
    quality) on its AUX_LAYER_IDS of a five-layer store (the MLA targets'
    random states), served with the probe, and one greedy request through
    it. The Llama target's is the side-by-side evaluation's EAGLE-3 drafter
    (the same training on its captured store), probed there: one server
    start less."""
    target, variant, attention = request.param
    if target == TINY:
        return request.getfixturevalue("side_by_side").eagle
    target_path = ensure_model(target)
    d = tmp_path_factory.mktemp(f"served-{target}-{variant}-{attention}")
    store = random_store(d, target_path, 8, max_length=64, aux_layer_ids=STORE_LAYER_IDS)
    result = train(TrainConfig(out_dir=str(d / "train"), variant=variant, attention=attention,
                               aux_layer_ids=list(AUX_LAYER_IDS[variant]), draft_vocab_size=256, ttt_steps=2,
                               epochs=1, tokens_per_batch=512, heldout_fraction=0.25, eval_max_samples=4), store)
    if variant == "eagle3.1":
        _distinct_fc_norms(Path(result.drafter_dir))
    probe = d / "probe"
    cfg = SpeculativeSpec(ServerConfig(model=str(target_path), dtype="float32", max_total_tokens=8192,
                                       extra_args=["--forward-hooks", json.dumps([eagle_probe(probe)])]),
                          draft_model_path=result.drafter_dir)
    log = ARTIFACTS / f"draft-probe-server-{target}-{variant}-{attention}.log"
    with launch_server(cfg, log, timeout_s=600) as server:
        output_ids = greedy(server.url, server.api_key)
    return Served(target_path, Path(result.drafter_dir), variant, attention, output_ids, *_probed(probe))


def _drafter(served: Served) -> Eagle3Drafter:
    return load_exported(served.drafter_dir, served.target_path)


def test_sglang_loads_our_drafter(served):
    """Every parameter of SGLang's drafter model holds ours (fused as its
    loader fuses them): none is left as it was built."""
    ours = export_weights(_drafter(served))
    attn, mlp = "midlayer.self_attn.", "midlayer.mlp."
    layer = "midlayer." if served.attention == "mla" else "layers.0."  # SGLang's own module names
    pairs = {"fc.weight": ours["fc.weight"], "norm.weight": ours["norm.weight"],
             "embed_tokens.weight": load_target_embeddings(served.target_path)[0],  # shared from the target
             f"{layer}mlp.gate_up_proj.weight": torch.cat([ours[mlp + "gate_proj.weight"],
                                                          ours[mlp + "up_proj.weight"]]),
             f"{layer}mlp.down_proj.weight": ours[mlp + "down_proj.weight"]}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        pairs[f"{layer}{norm}.weight"] = ours[f"midlayer.{norm}.weight"]
    if served.attention == "mla":
        # q_a and kv_a fused, in that order.
        pairs[f"{layer}self_attn.fused_qkv_a_proj_with_mqa.weight"] = torch.cat(
            [ours[attn + "q_a_proj.weight"], ours[attn + "kv_a_proj_with_mqa.weight"]])
        for part in ("q_a_layernorm", "q_b_proj", "kv_a_layernorm", "kv_b_proj", "o_proj"):
            pairs[f"{layer}self_attn.{part}.weight"] = ours[f"{attn}{part}.weight"]
    else:
        pairs[f"{layer}self_attn.qkv_proj.weight"] = torch.cat([ours[f"{attn}{p}_proj.weight"] for p in "qkv"])
        pairs[f"{layer}self_attn.o_proj.weight"] = ours[attn + "o_proj.weight"]
    if served.variant == "eagle3.1":
        pairs.update({f"fc_norm.{i}.weight": ours[f"fc_norm.{i}.weight"] for i in range(3)})
    assert sorted(served.params) == sorted(pairs)
    for name, want in pairs.items():
        assert torch.equal(served.params[name], want.float()), name


def test_the_greedy_output_through_the_drafter_is_the_targets_own(served):
    assert served.output_ids == hf_greedy(served.target_path, len(served.output_ids))


SIDE_BY_SIDE_TOKENS = 12


@pytest.fixture(scope="module")
def side_by_side(llama_store, float32_server, tmp_path_factory) -> SideBySide:
    """An EAGLE-3 drafter (three of the store's five layers) and a DFlash
    drafter (all five) trained briefly on the captured Llama store, served
    side by side by the evaluation (tasks/evaluation/side_by_side.py) beside
    the float32 server as the plain baseline, PROMPT its one prompt; the
    DFlash server carries the probe (SGLang's DFLASH path on this CPU: its
    stand-ins in tasks/server/cpu/dflash.py). The suite's
    one DFlash server start."""
    from tasks.evaluation.config import EvaluateConfig
    from tasks.evaluation.prompts import prompt_set
    from tasks.evaluation.side_by_side import drafter_at, evaluate_drafters
    from tasks.target.architectures import load_tokenizer
    from tests.sglang_draft_probe import DFLASH_PROBE_MODULES

    d = tmp_path_factory.mktemp("side-by-side")
    common = dict(tokens_per_batch=512, heldout_fraction=0.25, eval_max_samples=4)
    eagle = train(TrainConfig(out_dir=str(d / "eagle3"), aux_layer_ids=list(AUX_LAYER_IDS["eagle3"]),
                              draft_vocab_size=256, ttt_steps=2, epochs=1, **common), llama_store)
    # Served while training too (serve_every), after its last epoch; serve_steps 2 is an EAGLE-3
    # chain's, which a DFlash drafter is not served with.
    dflash = train(TrainConfig(out_dir=str(d / "dflash"), method="dflash", block_size=DFLASH_BLOCK, max_anchors=16,
                               epochs=2, serve_every=2, serve_prompts=2, serve_max_new_tokens=8, serve_steps=2,
                               **common), llama_store)
    probe = d / "probe"
    hooks = ({"name": "dflash_probe", "target_modules": DFLASH_PROBE_MODULES,
              "hook_factory": "tests.sglang_draft_probe:make_dflash_probe", "config": {"out_dir": str(probe)}},)
    eagle_probed = d / "eagle-probe"
    drafters = [replace(drafter_at(eagle.drafter_dir), hooks=(eagle_probe(eagle_probed),)),
                replace(drafter_at(dflash.drafter_dir), hooks=hooks)]
    rows = d / "prompt.jsonl"
    rows.write_text(json.dumps({"input_ids": PROMPT}) + "\n")
    sets = [prompt_set(str(rows), count=1, tokenizer=load_tokenizer(ensure_model(TINY)), store=None,
                       heldout_fraction=0.25)]
    # Greedy only, one stream: the probe's first request after SGLang's warm-up is PROMPT's.
    cfg = EvaluateConfig(num_prompts=1, max_new_tokens=SIDE_BY_SIDE_TOKENS, temperature=0, concurrency=[1],
                         min_verify_steps=8, baseline="attached")
    out = ARTIFACTS / "side-by-side"
    report = evaluate_drafters(ServerConfig(model=str(ensure_model(TINY))), drafters, sets, cfg, log_dir=out,
                               baseline_url=float32_server.url, baseline_api_key=float32_server.api_key)
    raw = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    # Through each drafter the greedy output was the plain server's (the evaluation fails otherwise):
    # the plain server's first tokens are the EAGLE-3 drafter's.
    assert not report["greedy_changed"], report["greedy_changed"]
    served_eagle = Served(ensure_model(TINY), Path(eagle.drafter_dir), "eagle3", "gqa",
                          greedy(float32_server.url, float32_server.api_key), *_probed(eagle_probed))
    return SideBySide(report, raw, Path(eagle.drafter_dir), Path(dflash.drafter_dir), *_probed(probe),
                      dflash.history, served_eagle)


def test_an_eagle3_and_a_dflash_drafter_of_one_store_are_served_side_by_side(side_by_side):
    """Both keep the plain target's greedy output, and each one's figures
    are SGLang's own counts: the first token is the prefill's, each verify
    step commits its accepted drafts and one more (the last may accept past
    the limit), an EAGLE-3 step checking a chain of 3 drafts, a DFlash step
    a block of block_size - 1."""
    from flows.evaluate import trained_for

    report, target = side_by_side.report, ensure_model(TINY)
    assert [(d["name"], d["method"], d["num_steps"]) for d in report["drafters"]] == [
        ("eagle3/drafter", "eagle3", 3), ("dflash/drafter", "dflash", DFLASH_BLOCK - 1)]
    commands = report["settings"]["commands"]
    assert "--speculative-algorithm DFLASH" in commands["dflash/drafter"], commands
    assert "--speculative-algorithm EAGLE3" in commands["eagle3/drafter"], commands
    assert not report["greedy_changed"]
    for d in report["drafters"]:
        (row,) = [r for r in report["acceptance"] if r["drafter"] == d["name"]]
        (request,) = [r for r in side_by_side.raw if r["drafter"] == d["name"]]
        assert row["outputs_equal"] and row["completion_tokens"] == SIDE_BY_SIDE_TOKENS, row
        histogram = request["spec_correct_drafts_histogram"]
        assert sum(histogram) == request["spec_verify_ct"] == row["verify_steps"]
        assert len(row["per_position"]) == d["num_steps"] and len(histogram) <= d["num_steps"] + 1
        committed = 1 + sum((k + 1) * n for k, n in enumerate(histogram))
        assert 0 <= committed - SIDE_BY_SIDE_TOKENS <= d["num_steps"], (d, histogram)
        assert row["pooled"] == SIDE_BY_SIDE_TOKENS / request["spec_verify_ct"]
        # How it was trained, read as flows.evaluate reads it, for this target.
        assert trained_for(Path(d["path"]), ServerConfig(model=str(target)))["config"]["method"] == d["method"]
    assert [(p["drafter"], p["concurrency"]) for p in report["sweep"]] == [("eagle3/drafter", 1),
                                                                         ("dflash/drafter", 1)]


def test_a_dflash_drafter_is_served_while_it_trains(side_by_side):
    """train.serve_every: the last epoch's weights, exported beside the run,
    served by SGLang as a DFlash block (3 drafts a step, not the 2 of an
    EAGLE-3 chain of serve_steps), figures from its own counts; the weights
    are the drafter's the run exported."""
    from tasks.train.served import served_dir

    history = side_by_side.dflash_history
    assert [(m["epoch"], "served" in m) for m in history] == [(0, False), (1, False), (2, True)]
    served, at = history[-1]["served"], served_dir(side_by_side.dflash_dir.parent, 2)
    requests = [json.loads(line) for line in (at / "requests.jsonl").read_text().splitlines()]
    # serve_prompts 2, of a held-out split of one sample.
    assert served["requests"] == len(requests) == 1 and len(served["per_position"]) == DFLASH_BLOCK - 1
    assert served["verify_steps"] == sum(r["spec_verify_ct"] for r in requests)
    assert served["pooled"] == 8 / served["verify_steps"]
    assert "--speculative-algorithm DFLASH" in (at / "server.log").read_text().splitlines()[0]
    assert (at / "drafter" / "model.safetensors").read_bytes() == \
        (side_by_side.dflash_dir / "model.safetensors").read_bytes()


def test_sglang_loads_our_dflash_drafter(side_by_side):
    """Every parameter of SGLang's DFlashDraftModel holds ours (q/k/v and
    gate/up fused as its loader fuses them); the embedding and head it
    drafts with are the target's, which it borrows."""
    ours = load_file(str(side_by_side.dflash_dir / "model.safetensors"))
    pairs = {k: ours[k] for k in ("fc.weight", "hidden_norm.weight", "norm.weight")}
    for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm",
                 "self_attn.o_proj", "mlp.down_proj"):
        pairs[f"layers.0.{name}.weight"] = ours[f"layers.0.{name}.weight"]
    pairs["layers.0.self_attn.qkv_proj.weight"] = torch.cat([ours[f"layers.0.self_attn.{p}_proj.weight"]
                                                            for p in "qkv"])
    pairs["layers.0.mlp.gate_up_proj.weight"] = torch.cat([ours["layers.0.mlp.gate_proj.weight"],
                                                          ours["layers.0.mlp.up_proj.weight"]])
    assert sorted(side_by_side.params) == sorted(pairs)
    for name, want in pairs.items():
        assert torch.equal(side_by_side.params[name], want.float()), name


def test_sglang_feeds_the_dflash_drafter_the_layers_it_was_trained_on(side_by_side):
    """The context SGLang projects for the prompt is the target's states of
    the five layers the drafter was trained on (HF's forward), and its ctx
    is our drafter's."""
    from tasks.train.dflash.export import load_dflash

    target = ensure_model(TINY)
    config = json.loads((side_by_side.dflash_dir / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == list(STORE_LAYER_IDS)
    _, prompt, _ = _first_request(side_by_side)
    n, hidden = (target_sizes(target)[k] for k in ("num_hidden_layers", "hidden_size"))
    reference = load_reference_model(str(target), torch.float32)
    states, _ = reference_states(reference, PROMPT, AuxLayers.for_model(n, STORE_LAYER_IDS))
    fed = prompt["target_hidden"].view(len(PROMPT), len(STORE_LAYER_IDS), hidden)
    torch.testing.assert_close(fed, states.float(), atol=TARGET_ATOL, rtol=TARGET_RTOL)
    with torch.no_grad():
        ctx = load_dflash(side_by_side.dflash_dir, target).context(prompt["target_hidden"])
    torch.testing.assert_close(ctx, prompt["ctx"], atol=ATOL, rtol=RTOL)


def test_the_dflash_draft_blocks_compute_what_we_train(side_by_side):
    """The probe: each of the request's draft blocks is [the token committed
    last, MASK x 3] at the positions after the committed tokens, embedded by
    the target's embedding, and SGLang's output for it (before the target's
    head) is our drafter's, given the same target states as context (the
    training forward, tasks/train/dflash/model.py, one block at its anchor): the
    context SGLang's draft KV cache holds is the committed tokens' and no
    rejected draft's. The first block starts with HF's first greedy token."""
    from tasks.train.dflash.export import load_dflash

    target = ensure_model(TINY)
    mask = json.loads((side_by_side.dflash_dir / "config.json").read_text())["dflash_config"]["mask_token_id"]
    features, _, blocks = _first_request(side_by_side)
    model = load_dflash(side_by_side.dflash_dir, target)
    assert blocks[0]["input_ids"][0].item() == hf_greedy(target, 1)[0]
    with torch.no_grad():
        for block in blocks:
            start = block["positions"][0].item()
            assert block["positions"].tolist() == list(range(start, start + DFLASH_BLOCK))
            assert block["input_ids"][1:].tolist() == [mask] * (DFLASH_BLOCK - 1)
            assert torch.equal(block["embeds"], model.embed_tokens(block["input_ids"]))
            # The context is the committed tokens' states, up to the block (the rest is masked out).
            out = model.blocks(features[None, :start], block["input_ids"][None, None], torch.tensor([[start]]))
            torch.testing.assert_close(out[0, 0], block["out"], atol=ATOL, rtol=RTOL)


def test_sglang_feeds_the_drafter_the_layers_it_was_trained_on(served):
    config = json.loads((served.drafter_dir / "config.json").read_text())
    trained = AUX_LAYER_IDS[served.variant]
    assert config["eagle_config"]["layer_output_ids"] == list(trained)
    n, hidden = (target_sizes(served.target_path)[k] for k in ("num_hidden_layers", "hidden_size"))
    fed = served.forwards[_prefill_extend(served)]["hidden_in"].view(len(PROMPT), 3, hidden)
    reference = load_reference_model(str(served.target_path), torch.float32)
    trained_on, _ = reference_states(reference, PROMPT, AuxLayers.for_model(n, trained))
    torch.testing.assert_close(fed, trained_on.float(), atol=TARGET_ATOL, rtol=TARGET_RTOL)
    default, _ = reference_states(reference, PROMPT, AuxLayers.for_model(n, default_aux_layer_ids(n)))
    # The check tells the two apart.
    assert not torch.allclose(fed, default.float(), atol=TARGET_ATOL, rtol=TARGET_RTOL)


def test_the_draft_extend_computes_what_we_train(served):
    ext = served.forwards[_prefill_extend(served)]
    model = _drafter(served)
    with torch.no_grad():
        ids, pos = ext["input_ids"][None], ext["positions"][None]
        assert pos[0].tolist() == list(range(len(PROMPT)))
        out = model.step(ids, model.project(ext["hidden_in"][None]), pos, [], [],
                         torch.ones_like(ids, dtype=torch.bool))
        torch.testing.assert_close(model.norm(out)[0], ext["out"], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(model.readout(out)[1][0], ext["fed_back"], atol=ATOL, rtol=RTOL)


def test_the_draft_decode_steps_compute_what_we_train(served):
    """Speculative steps 3 make two decode forwards after the extend (the
    third token is read off the second's logits). Step k (k >= 1) at the
    extend's last index t = L-1: the token the step before proposed, its
    output (pre-norm, or normed for eagle3.1), position t+k, attending to the
    extend's keys 0..t and to the chain's own keys at t+1..t+k -- TTT's step
    k at index t."""
    first = _prefill_extend(served)
    ext, decodes = served.forwards[first], served.forwards[first + 1:first + 3]
    assert [f["kind"] for f in decodes] == ["decode", "decode"]
    model = _drafter(served)
    t = len(PROMPT) - 1
    with torch.no_grad():
        before = ext["out"][-1:], ext["fed_back"][-1:]
        # What is fed back: the normed output for eagle3.1 (norm_output),
        # the pre-norm one for eagle3, not what the final norm made of it.
        assert torch.equal(ext["fed_back"], ext["out"]) == (served.variant == "eagle3.1")
        for k, dec in enumerate(decodes, start=1):
            # One request in flight: the same KV cache row as the extend.
            assert torch.equal(dec["req_pool_indices"], ext["req_pool_indices"])
            assert dec["positions"].tolist() == [t + k]
            normed, fed_back = before
            # Fed back: the drafter's greedy proposal (a target id) and its output.
            assert dec["input_ids"].tolist() == model.draft_to_target[model.lm_head(normed).argmax(-1)].tolist()
            assert torch.equal(dec["hidden_in"], fed_back)
            before = dec["out"], dec["fed_back"]

        ids, pos = ext["input_ids"][None], ext["positions"][None]
        valid = torch.ones_like(ids, dtype=torch.bool)
        keys, values = [], []
        out = model.step(ids, model.project(ext["hidden_in"][None]), pos, keys, values, valid)
        for k, dec in enumerate(decodes, start=1):
            # The whole TTT step runs; only index t holds SGLang's chain. The
            # other indices carry what the step before left there, and as each
            # index sees only the extend's keys and its own chain, they cannot
            # change index t.
            ids, hidden = ids.clone(), model.readout(out)[1].clone()
            ids[0, t], hidden[0, t] = dec["input_ids"][0], dec["hidden_in"][0]
            out = model.step(ids, hidden, pos + k, keys, values, valid)
            torch.testing.assert_close(model.norm(out)[0, t:], dec["out"], atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(model.readout(out)[1][0, t:], dec["fed_back"], atol=ATOL, rtol=RTOL)
