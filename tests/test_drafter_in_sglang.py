"""The exported drafter inside SGLang's own `LlamaForCausalLMEagle3`, in a real
speculative server: the parameters it loaded are ours, the inputs it is given
are aligned as training assumes (aux state of token t with the embedding of
token t+1), and its forward equals our drafter's on those inputs."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors import safe_open

from tasks.server.launch import ServerConfig, auth_headers, launch_server
from tasks.train.drafter import load_target_embeddings
from tasks.train.export import export_random_drafter, export_weights, load_exported
from tasks.target.models import TINY, TINY_KIMI_K25, ensure_model
from tests.conftest import ARTIFACTS

pytestmark = pytest.mark.server


# Kimi-K2.5: a wrapper target whose embedding sits under language_model.,
# an MLA target on a CPU, and a YaRN rope the drafter takes over.
@pytest.mark.parametrize("target", [TINY, TINY_KIMI_K25])
def test_sglang_loads_our_drafter_and_computes_what_we_train(target, tmp_path):
    tiny_model = ensure_model(target)
    drafter_dir = export_random_drafter(tiny_model, tmp_path / "drafter", draft_vocab_size=256, seed=3)
    probe = tmp_path / "probe"
    hooks = [{"name": "draft_probe", "target_modules": ["model"],
              "hook_factory": "tests.sglang_draft_probe:make_probe", "config": {"out_dir": str(probe)}}]
    cfg = ServerConfig(model_path=str(tiny_model), dump_dir=tmp_path / "unused", capture=False, dtype="float32",
                       max_total_tokens=8192, draft_model_path=str(drafter_dir),
                       extra_args=("--forward-hooks", json.dumps(hooks)))
    prompt = list(range(40, 90))
    with launch_server(cfg, ARTIFACTS / f"draft-probe-server-{target}.log", timeout_s=600) as server:
        reply = httpx.post(f"{server.url}/generate", timeout=300, headers=auth_headers(server.api_key), json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    first_token = reply["output_ids"][0]

    dumps = []
    for path in sorted(probe.glob("forward-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            dumps.append({k: f.get_tensor(k) for k in f.keys()})
    # Draft extend after our prefill: token t+1's embedding goes with token
    # t's aux state, the last position with the token the target just chose.
    # (Other dumps are SGLang's warm-up request.)
    ours = [d for d in dumps if d["input_ids"].tolist() == prompt[1:] + [first_token]]
    assert len(ours) == 1, [d["input_ids"][:6].tolist() for d in dumps]
    dump = ours[0]
    assert dump["aux"].shape == (len(prompt), 3 * 128)

    model = load_exported(drafter_dir, tiny_model)
    ours = export_weights(model)
    with safe_open(str(probe / "params.safetensors"), framework="pt") as f:
        loaded = {k: f.get_tensor(k) for k in f.keys()}
    pairs = {
        "fc.weight": ours["fc.weight"], "norm.weight": ours["norm.weight"],
        "layers.0.self_attn.qkv_proj.weight": torch.cat([ours[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"]),
        "layers.0.self_attn.o_proj.weight": ours["midlayer.self_attn.o_proj.weight"],
        "layers.0.mlp.gate_up_proj.weight": torch.cat([ours["midlayer.mlp.gate_proj.weight"],
                                                       ours["midlayer.mlp.up_proj.weight"]]),
        "layers.0.mlp.down_proj.weight": ours["midlayer.mlp.down_proj.weight"],
        "layers.0.input_layernorm.weight": ours["midlayer.input_layernorm.weight"],
        "layers.0.hidden_norm.weight": ours["midlayer.hidden_norm.weight"],
        "layers.0.post_attention_layernorm.weight": ours["midlayer.post_attention_layernorm.weight"],
        "embed_tokens.weight": load_target_embeddings(tiny_model)[0],  # shared from the target
    }
    for name, want in pairs.items():
        assert torch.equal(loaded[name], want.float()), name

    with torch.no_grad():
        ids, pos = dump["input_ids"][None], dump["positions"][None]
        out = model.step(ids, model.fc(dump["aux"][None]), pos, [], [], torch.ones_like(ids, dtype=torch.bool))
        ours_out = model.norm(out)[0]
    assert torch.allclose(ours_out, dump["out"], atol=2e-4, rtol=1e-3), (ours_out - dump["out"]).abs().max()
