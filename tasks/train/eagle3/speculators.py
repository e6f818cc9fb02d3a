"""An EAGLE-3 drafter in the speculators format, the one vLLM serves
(`--speculative-config '{"model": <folder>, "method": "eagle3", ...}'`)
and vLLM's `speculators` trainer writes. Written from speculators 0.9.0's
published schema (speculators/models/eagle3/config.py Eagle3SpeculatorConfig,
speculators/config.py SpeculatorsConfig and VerifierConfig,
speculators/models/eagle3/core.py Eagle3DraftModel): the same weights as
SGLang's export, another config and other tensor names.

    <dir>/config.json        architectures [Eagle3Speculator], speculators_model_type
                             eagle3, transformer_layer_config (a one-layer
                             Llama: our drafter's layer is SGLang's Llama
                             layer whatever the target, no q/k norms),
                             draft_vocab_size, the variant's flags, the aux
                             layers as HF hidden_states indices (vLLM's
                             convention: the input of layer i), speculators_config
                             (greedy proposals of serve_steps tokens, the
                             verifier by the name a user finds it by)
    <dir>/model.safetensors  fc, fc_norm.* (eagle3.1), layers.0.*, norm,
                             lm_head, d2t (the same offsets), t2d (bool), and
                             the target's embed_tokens (export_speculators says why)
    <dir>/README.md          the card, with vLLM's serve command

Only the GQA layout: speculators' EAGLE-3 builds Llama or Qwen3 layers, no
MLA one (an MLA drafter is refused naming why).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tasks.durable import replace_dir_durably
from tasks.target.embeddings import load_target_embeddings
from tasks.train.eagle3.export import attention_of

SPECULATORS_VERSION = "0.9.0"
FOLDER = "drafter-speculators"
# The layer's sizes and the target's token ids, as transformers' LlamaConfig names them.
_LAYER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling",
               "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id")


def speculators_name(name: str) -> str:
    """A tensor's name in speculators' Eagle3DraftModel: SGLang's `midlayer`
    is its first (only) decoder layer."""
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def refusal(rope: dict, num_aux: int) -> str | None:
    """Why vLLM would serve a drafter of this rope and these aux layers
    otherwise than SGLang does, or None."""
    if rope.get("rope_type") == "yarn" and rope.get("mscale") is not None and rope.get("mscale_all_dim") is not None:
        # SGLang (and transformers) scale a YaRN rope by mscale(f, mscale) /
        # mscale(f, mscale_all_dim); vLLM's yarn rope reads neither and takes
        # mscale(f): DeepSeek-V3's and Kimi's ratio 1 becomes 1.37 at factor 40.
        return ("its rope is YaRN with mscale and mscale_all_dim (the target's), which vLLM's YaRN rope does not read: "
                "vLLM would serve it with another attention scale than it was trained with")
    if num_aux != 3:
        return f"it reads {num_aux} aux layers, and vLLM's EAGLE-3 layer takes 3 (fc of 3 x hidden_size)"
    return None


def unexportable(config: dict) -> str | None:
    """Why the EAGLE-3 drafter whose SGLang config.json is `config` has no
    speculators export, or None."""
    if attention_of(config) != "gqa":
        return ("the speculators format has no MLA drafter (speculators 0.9.0's EAGLE-3 builds Llama or Qwen3 "
                "layers)")
    why = refusal(config.get("rope_parameters") or {}, len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]))
    return f"no speculators export: {why}" if why else None


def speculators_config(config: dict, verifier: str, drafts: int) -> dict:
    """The speculators config.json of a drafter whose SGLang config.json is
    `config`, served with `drafts` tokens a step next to `verifier`."""
    why = unexportable(config)
    if why:
        raise ValueError(f"{why}: export this drafter for SGLang only (train.export_formats [sglang])")
    layer = {k: config[k] for k in _LAYER_KEYS if config.get(k) is not None}
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1, attention_bias=False,
                 mlp_bias=False, tie_word_embeddings=False)
    eagle = config["eagle_config"]
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config["draft_vocab_size"],
        # SGLang's layer adds the attention to the hidden state as it came in, not its norm.
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": bool(config.get("fc_norm")),
        "norm_output": bool(config.get("norm_output")),
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(eagle["hf_hidden_state_indices"]),
        "embed_requires_grad": False,
        "torch_dtype": config.get("torch_dtype", "bfloat16"),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafts}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": config.get("target_architectures") or []},
        },
    }


def export_speculators(drafter_dir: Path, out_dir: Path, *, target: Path, verifier: str, drafts: int) -> Path:
    """SGLang's export at `drafter_dir` written again at `out_dir` in the
    speculators format, atomically; the training record goes with it.
    `target`: the local checkpoint (its embeddings, its architectures);
    `verifier`: the name the folder gives it (a hub id where it has one).

    The target's embeddings go in the folder, as speculators' own exports
    carry them: its from_pretrained leaves an absent embed_tokens as
    allocated, not the verifier's (seen with transformers 5.19: the first
    step's logits then differ from run to run)."""
    drafter_dir, target = Path(drafter_dir), Path(target)
    config = json.loads((drafter_dir / "config.json").read_text())
    architectures = json.loads((target / "config.json").read_text()).get("architectures")
    ours = speculators_config({**config, "target_architectures": architectures}, verifier, drafts)
    with safe_open(str(drafter_dir / "model.safetensors"), framework="pt") as f:
        tensors = {speculators_name(k): f.get_tensor(k) for k in f.keys()}
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    tensors["embed_tokens.weight"] = load_target_embeddings(target)[0].to(tensors["fc.weight"].dtype).contiguous()
    if "eagle3_training" in config:
        ours["eagle3_training"] = config["eagle3_training"]

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(ours, indent=2) + "\n")

    return replace_dir_durably(Path(out_dir), fill)


def is_speculators(config: dict) -> bool:
    return config.get("speculators_model_type") == "eagle3"


def export_beside(drafter_dir: Path, target: Path, drafts: int) -> Path:
    """The speculators export of SGLang's at `drafter_dir`, beside it
    (`<out_dir>/drafter-speculators`); its card is the caller's to write
    (tasks/train/model_card.py reads this module)."""
    from tasks.train.record import FILL_IN, is_hub_id, target_name

    drafter_dir = Path(drafter_dir)
    record = json.loads((drafter_dir / "config.json").read_text()).get("eagle3_training") or {}
    name = record.get("target") or target_name(target)
    # vLLM loads the verifier this names as the target: a folder's name would be no model there.
    return export_speculators(drafter_dir, drafter_dir.parent / FOLDER, target=target,
                              verifier=name if is_hub_id(name) else FILL_IN, drafts=drafts)
