"""Our drafter inside SGLang's own classes, `LlamaForCausalLMEagle3` (attention
gqa) and `Eagle3DeepseekV2ForCausalLM` (mla), in a real speculative server
(one launch per target, layout and variant, for the module): the
parameters it loaded are ours, the aux states it is fed are the target's
states of the layers the drafter was trained on (not SGLang's default ones),
they are aligned as training assumes (aux state of token t with the embedding
of token t+1), and its forwards equal our drafter's: the draft extend, and
the draft decode steps that follow it, which feed back the drafter's own
hidden state (pre-norm for eagle3, normed for eagle3.1) and attend to the
extend's keys plus the chain's own (the TTT unroll of tasks/train/ttt.py).
The greedy output through the drafter is the target's own. The Llama
target's store is captured by a real server with five layers and checked
against HF before a drafter trains on a triple of it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tasks.server.config import ServerConfig
from tasks.server.launch import SpeculativeSpec, launch_server
from tasks.sglang_api import auth_headers
from tasks.target.layers import AuxLayers, default_aux_layer_ids
from tasks.target.reference import load_reference_model, reference_states
from tasks.train.config import TrainConfig
from tasks.target.embeddings import load_target_embeddings
from tasks.train.drafter import Eagle3Drafter, target_sizes
from tasks.train.export import export_weights, load_exported
from tasks.train.loop import train
from tests.conftest import ARTIFACTS, FIVE_LAYER_IDS, random_store
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
PROMPT = list(range(40, 90))
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


@dataclass
class Served:
    target_path: Path
    drafter_dir: Path
    variant: str
    attention: str
    output_ids: list[int]
    forwards: list[dict]  # the probe's files in call order, each with its "kind"
    params: dict[str, torch.Tensor]  # the drafter's parameters as SGLang loaded them


def _read(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return {"kind": f.metadata()["kind"], **{k: f.get_tensor(k) for k in f.keys()}}


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
    quality) on its AUX_LAYER_IDS of a five-layer store (the Llama target's
    captured; the MLA targets' random states),
    served with the probe, and one greedy request through it."""
    target, variant, attention = request.param
    target_path = ensure_model(target)
    d = tmp_path_factory.mktemp(f"served-{target}-{variant}-{attention}")
    store = request.getfixturevalue("llama_store") if target == TINY else \
        random_store(d, target_path, 8, max_length=64, aux_layer_ids=STORE_LAYER_IDS)
    result = train(TrainConfig(out_dir=str(d / "train"), variant=variant, attention=attention,
                               aux_layer_ids=list(AUX_LAYER_IDS[variant]), draft_vocab_size=256, ttt_steps=2,
                               epochs=1, tokens_per_batch=512, heldout_fraction=0.25, eval_max_samples=4), store)
    if variant == "eagle3.1":
        _distinct_fc_norms(Path(result.drafter_dir))
    probe = d / "probe"
    hooks = [{"name": "draft_probe", "target_modules": ["model"],
              "hook_factory": "tests.sglang_draft_probe:make_probe", "config": {"out_dir": str(probe)}}]
    cfg = SpeculativeSpec(ServerConfig(model=str(target_path), dtype="float32", max_total_tokens=8192,
                                       extra_args=["--forward-hooks", json.dumps(hooks)]),
                          draft_model_path=result.drafter_dir)
    log = ARTIFACTS / f"draft-probe-server-{target}-{variant}-{attention}.log"
    with launch_server(cfg, log, timeout_s=600) as server:
        reply = httpx.post(f"{server.url}/generate", timeout=300, headers=auth_headers(server.api_key), json={
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    with safe_open(str(probe / "params.safetensors"), framework="pt") as f:
        params = {k: f.get_tensor(k) for k in f.keys()}
    return Served(target_path, Path(result.drafter_dir), variant, attention, reply["output_ids"],
                  [_read(p) for p in sorted(probe.glob("forward-*.safetensors"))], params)


def _prefill_extend(served: Served) -> int:
    """Index of the draft extend after our prefill: token t+1's embedding goes
    with token t's aux state, the last position with the token the target just
    chose. (Other extends are SGLang's warm-up request, or follow a verify.)"""
    want = PROMPT[1:] + [served.output_ids[0]]
    found = [i for i, f in enumerate(served.forwards) if f["kind"] == "extend" and f["input_ids"].tolist() == want]
    assert len(found) == 1, [(f["kind"], f["input_ids"][:6].tolist()) for f in served.forwards]
    return found[0]


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


def hf_greedy(target_path: Path, n: int) -> list[int]:
    """HF's greedy tokens after PROMPT, each checked to lead its runner-up by
    far more than SGLang's target differs from HF's (TARGET_ATOL on states):
    a near tie would make a comparison a coin toss, and is reported as such."""
    reference = load_reference_model(str(target_path), torch.float32)
    ids = list(PROMPT)
    with torch.inference_mode():
        for _ in range(n):
            top = torch.topk(reference(input_ids=torch.tensor([ids])).logits[0, -1], 2)
            assert top.values[0] - top.values[1] > 1e-2, f"near tie after {len(ids)} tokens: change PROMPT"
            ids.append(int(top.indices[0]))
    return ids[len(PROMPT):]


def test_the_greedy_output_through_the_drafter_is_the_targets_own(served):
    assert served.output_ids == hf_greedy(served.target_path, len(served.output_ids))


def test_a_dflash_drafter_of_the_llama_store_is_served_with_the_targets_greedy_output(llama_store, tmp_path):
    """A DFlash drafter trained (briefly) on all five layers of the captured
    store, served by SGLang's DFLASH path on this CPU (its stand-ins:
    tasks/server/cpu/spec_ops.py dflash_on_cpu): the greedy output is HF's,
    and SGLang verified its blocks (a verify step per block, fewer steps than
    tokens once a draft is accepted)."""
    target = ensure_model(TINY)
    result = train(TrainConfig(out_dir=str(tmp_path / "train"), method="dflash", block_size=4, max_anchors=16,
                               epochs=2, tokens_per_batch=512, heldout_fraction=0.25, eval_max_samples=4), llama_store)
    cfg = SpeculativeSpec.dflash(ServerConfig(model=str(target), dtype="float32", max_total_tokens=8192),
                                 result.drafter_dir)
    with launch_server(cfg, ARTIFACTS / "dflash-server.log", timeout_s=600) as server:
        reply = httpx.post(f"{server.url}/generate", timeout=300, headers=auth_headers(server.api_key), json={
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}).json()
    assert reply["output_ids"] == hf_greedy(target, 12), reply
    # SGLang's own counts: the first token is the prefill's, each verify step
    # commits its accepted drafts and one more, and proposes block_size - 1.
    meta = reply["meta_info"]
    assert meta["spec_verify_ct"] + meta["spec_num_correct_drafts"] == 11, meta
    assert meta["spec_num_proposed_drafts"] == 3 * meta["spec_verify_ct"], meta


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
