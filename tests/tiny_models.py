"""The tiny random models the tests run on (and the benches, given a tiny
model's name), built in seconds into the model cache with the product's
atomic, idempotent build (tasks.target.models.build_cached). The product is
given one as a checkpoint folder: `str(ensure_model(TINY))`.

- `tiny-llama`: a random 8-layer Llama with its own byte-level BPE tokenizer
  and ChatML template (8 layers make SGLang's three default aux layers
  distinct).
- `tiny-qwen3`, `tiny-qwen3-moe`: the same tokenizer and sizes as Qwen3
  and Qwen3-MoE (8 experts, top-2), for the per-architecture capture tests.
- `tiny-deepseek-v3`: MLA (q and kv LoRA ranks), YaRN rope, MoE with a shared
  expert and sigmoid routing with a correction bias, one dense first layer.
- `tiny-glm4-moe`: GLM-4.5's layout (partial rotary, q/k norms, attention
  bias, a dense first layer, shared expert, sigmoid routing with a bias).
- `tiny-gpt-oss`: gpt-oss's layout (alternating sliding-window and full
  attention, attention sinks, biased experts with its clamped SwiGLU, YaRN).
- `tiny-kimi-k25`: Kimi-K2.5's multimodal wrapper (SGLang's `kimi_k25`
  config, a tiny vision config) around tiny-deepseek-v3's text model and
  weights, stored under `language_model.` as the real checkpoint has them.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tasks.paths import DATA_DIR
from tasks.target.models import build_cached, resolve_model

TINY = "tiny-llama"
TINY_QWEN3 = "tiny-qwen3"
TINY_QWEN3_MOE = "tiny-qwen3-moe"
TINY_DEEPSEEK_V3 = "tiny-deepseek-v3"
TINY_KIMI_K25 = "tiny-kimi-k25"
TINY_GLM4_MOE = "tiny-glm4-moe"
TINY_GPT_OSS = "tiny-gpt-oss"
# The tiny Llama whose answers end: its head leans to its end-of-turn token,
# so greedy answers stop after some tokens, as a chat model's do (the
# random model's never do); regeneration's multi-turn tests need that.
TINY_ENDS = "tiny-llama-ends"
# A tiny Llama that reads back whatever it writes: one token a character
# (no merges, no whitespace), Kimi-K2.5's published template, answers of
# printable characters that end (its special tokens never win but its end
# of turn): decoding its answers and rendering them again gives its very
# ids, so a regenerated row and a capture of the same answers can be
# compared token for token.
TINY_CHARS = "tiny-llama-chars"

# ChatML, with `generation` markers so transformers can return the assistant
# token mask (the loss mask) straight from the template.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Bumped when a builder changes, so a cached model built by an older one is
# rebuilt (a folder without a stamp counts as version 1).
BUILD_VERSIONS = {TINY: 3, TINY_QWEN3: 1, TINY_QWEN3_MOE: 1, TINY_DEEPSEEK_V3: 1, TINY_KIMI_K25: 1, TINY_GLM4_MOE: 1,
                  TINY_GPT_OSS: 1, TINY_ENDS: 1, TINY_CHARS: 1}


def ensure_model(name: str) -> Path:
    """The checkpoint folder of the tiny model `name`, built on first use."""
    if name not in BUILDERS:
        raise ValueError(f"unknown tiny model {name!r}; known: {sorted(BUILDERS)}")
    return build_cached(name, BUILDERS[name], BUILD_VERSIONS[name])


def resolve_model_or_tiny(name_or_path: str) -> Path:
    """For the benches, which run on a tiny model or a real one: a tiny
    model's name, or what the product's resolve_model takes."""
    return ensure_model(name_or_path) if name_or_path in BUILDERS else resolve_model(name_or_path)


def _local_text() -> list[str]:
    """Text to train the tiny tokenizer on: the bundled prompts (fixed, so
    the tiny model is the same on every machine)."""
    path = DATA_DIR / "demo_prompts.jsonl"
    return [m["content"] for line in path.read_text().splitlines() for m in json.loads(line)["messages"]]


def _tiny_tokenizer(out: Path, vocab: int):
    """A byte-level BPE trained on the bundled prompts, with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _local_text(),
        trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


def _tiny_sizes(tokenizer, hidden: int, num_layers: int) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                torch_dtype="bfloat16", bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def _save_peaked(model, out: Path) -> None:
    """Save in bf16 after giving the random model a peaked head and larger
    embeddings.

    With every weight at std 0.02, a random model is a poor target for a
    drafter: its logits are all near zero (a near-uniform distribution,
    greedy ties decided by rounding), and its residual stream is mostly
    context average, so the greedy token repeats from one position to the
    next about half the time, and a drafter trained off by one position
    would look right. A larger head makes the distribution peaked (logit
    std ~3) and larger embeddings make the next token depend on the current
    one (P(greedy[t] == greedy[t+1]) ~0.01) and on context, like a trained
    model's."""
    import torch

    with torch.no_grad():  # continues the builder's seeded RNG
        model.lm_head.weight.normal_(std=0.3)
        model.model.embed_tokens.weight.normal_(std=0.1)
    model.to(torch.bfloat16).save_pretrained(out)


def build_tiny_llama(out: Path, *, num_layers: int = 8, hidden: int = 128, vocab: int = 2048, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tiny_tokenizer(out, vocab)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**_tiny_sizes(tokenizer, hidden, num_layers)))
    _save_peaked(model, out)


def build_tiny_qwen3(out: Path, *, moe: bool = False, num_layers: int = 8, hidden: int = 128, vocab: int = 2048,
                     seed: int = 0) -> None:
    """Qwen3 (q/k norms, head_dim set apart from hidden/heads) or Qwen3-MoE
    (8 experts, top-2, every layer sparse)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = _tiny_tokenizer(out, vocab)
    sizes = _tiny_sizes(tokenizer, hidden, num_layers)
    torch.manual_seed(seed)
    if moe:
        config = Qwen3MoeConfig(**sizes, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                decoder_sparse_step=1, norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**sizes))
    _save_peaked(model, out)


def build_tiny_deepseek_v3(out: Path, *, num_layers: int = 8, hidden: int = 128, vocab: int = 2048,
                           seed: int = 0) -> None:
    """DeepSeek-V3 in small: everything SGLang's DeepseekV3 path branches on
    is present (MLA with both LoRA ranks, YaRN, shared expert, noaux_tc
    sigmoid routing with a non-zero correction bias, first_k_dense_replace)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    tokenizer = _tiny_tokenizer(out, vocab)
    sizes = _tiny_sizes(tokenizer, hidden, num_layers)
    for key in ("num_key_value_heads", "head_dim", "intermediate_size"):
        sizes.pop(key)
    # SGLang's CPU rotary factory needs a rope_scaling (the real configs use
    # YaRN); factor 4 over 1024 positions changes the low frequencies, so
    # the test compares YaRN too. transformers 5 reads rope_parameters,
    # SGLang rope_scaling: both are written.
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    config = DeepseekV3Config(**sizes, num_key_value_heads=4, intermediate_size=hidden * 2, moe_intermediate_size=64,
                              q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                              v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                              n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                              norm_topk_prob=True, rope_parameters=yarn)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config)
    _randomise_routers(model)
    _save_peaked(model, out)
    saved = json.loads((out / "config.json").read_text())
    # Read by SGLang, not defined by HF's config class.
    saved.update(rope_scaling=dict(yarn), moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc")
    (out / "config.json").write_text(json.dumps(saved, indent=2) + "\n")


def _randomise_routers(model) -> None:
    """HF initialises sigmoid routers and their correction bias to zeros:
    every expert would tie, and the routing would be decided by rounding."""
    import torch

    with torch.no_grad():  # continues the builder's seeded RNG
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.weight.normal_(std=0.1)
                module.e_score_correction_bias.uniform_(-0.05, 0.05)


def build_tiny_glm4_moe(out: Path, *, num_layers: int = 8, hidden: int = 128, vocab: int = 2048,
                        seed: int = 0) -> None:
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    tokenizer = _tiny_tokenizer(out, vocab)
    sizes = _tiny_sizes(tokenizer, hidden, num_layers)
    config = Glm4MoeConfig(**sizes, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
                           n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                           routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                           partial_rotary_factor=0.5)
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(config)
    _randomise_routers(model)
    _save_peaked(model, out)


def build_tiny_gpt_oss(out: Path, *, num_layers: int = 8, hidden: int = 128, vocab: int = 2048,
                       seed: int = 0) -> None:
    """A 32-token window, so the test's longer prompts reach past it.

    Every token goes to all 4 experts (top-4 of 4): SGLang runs gpt-oss's
    attention in bf16 whatever --dtype says, and a random router's near-ties
    then flip under bf16 rounding (seen: one token of 70 routed differently
    at the first layer, cosine 0.988 from there on). With nothing to choose,
    the routing weights stay continuous; top-k choice itself is tested on
    the fp32 MoE models."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    tokenizer = _tiny_tokenizer(out, vocab)
    sizes = _tiny_sizes(tokenizer, hidden, num_layers)
    yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    config = GptOssConfig(**{**sizes, "intermediate_size": hidden}, num_local_experts=4, num_experts_per_tok=4,
                          sliding_window=32, rope_parameters=yarn,
                          layer_types=["sliding_attention", "full_attention"] * (num_layers // 2))
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config)
    with torch.no_grad():  # HF starts sinks at zero and the router small; make both matter
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(std=1.0)
            elif "router" in name:
                param.normal_(std=0.1)
    _save_peaked(model, out)
    saved = json.loads((out / "config.json").read_text())
    saved["rope_scaling"] = dict(yarn)  # read by SGLang; transformers 5 writes rope_parameters only
    (out / "config.json").write_text(json.dumps(saved, indent=2) + "\n")


def build_tiny_kimi_k25(out: Path) -> None:
    """SGLang's KimiK25ForConditionalGeneration around tiny-deepseek-v3: its
    config as text_config, a one-layer vision config, the text weights under
    `language_model.` (the vision tower gets no weights: only text is
    served), and the processor SGLang's multimodal path insists on."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

    text_dir = ensure_model(TINY_DEEPSEEK_V3)
    text = json.loads((text_dir / "config.json").read_text())
    vision = dict(patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4,
                  num_attention_heads=2, num_hidden_layers=1, hidden_size=32, vt_hidden_size=32,
                  intermediate_size=64, merge_kernel_size=[2, 2], text_hidden_size=text["hidden_size"])
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text, "vision_config": vision, "torch_dtype": "bfloat16",
              "media_placeholder_token_id": text["pad_token_id"], "pad_token_id": text["pad_token_id"],
              "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"]}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = load_file(text_dir / "model.safetensors")
    save_file({f"language_model.{k}": v for k, v in weights.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.save_pretrained(out)
    shutil.copy(Path(__file__).with_name("tiny_kimi_processor.py"), out / "processing_tiny_kimi_k25.py")
    processor = {"image_processor": Kimi_K25ImageProcessor().to_dict(),
                 "video_processor": Kimi_K25VideoProcessor().to_dict(),
                 "processor_class": "TinyKimiK25Processor",
                 "auto_map": {"AutoProcessor": "processing_tiny_kimi_k25.TinyKimiK25Processor"}}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2, default=list) + "\n")


def build_tiny_llama_ends(out: Path, eos_lean: float = 3.5) -> None:
    """The tiny Llama (the same seed) with its end-of-turn row of the head
    scaled by `eos_lean`: greedy answers of ~5-20 tokens on most prompts."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    build_tiny_llama(out)
    eos = AutoTokenizer.from_pretrained(out).eos_token_id
    weights = load_file(out / "model.safetensors")
    head = weights["lm_head.weight"].float()
    head[eos] *= eos_lean
    weights["lm_head.weight"] = head.to(torch.bfloat16)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})


def build_tiny_llama_chars(out: Path, eos_lean: float = 2.5, seed: int = 0) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
    chars = [chr(c) for c in range(33, 127)]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[],
                               unk_token="<|endoftext|>"))
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="<|endoftext|>", additional_special_tokens=specials[2:])
    tokenizer.chat_template = (Path(__file__).with_name("chat_templates") / "kimi-k2.5.jinja").read_text()
    tokenizer.save_pretrained(out)
    torch.manual_seed(seed)
    sizes = _tiny_sizes(tokenizer, 128, 8)
    model = LlamaForCausalLM(LlamaConfig(**{**sizes, "bos_token_id": None}))
    with torch.no_grad():  # continues the seeded RNG
        model.lm_head.weight.normal_(std=0.3)
        model.model.embed_tokens.weight.normal_(std=0.1)
        # A zero row's logit is 0, below the best of ~94 random ones but with odds 2^-94.
        model.lm_head.weight[[i for i, t in enumerate(specials) if t != "<|im_end|>"]] = 0
        model.lm_head.weight[tokenizer.eos_token_id] *= eos_lean
    model.to(torch.bfloat16).save_pretrained(out)


BUILDERS = {TINY: build_tiny_llama, TINY_QWEN3: build_tiny_qwen3, TINY_ENDS: build_tiny_llama_ends,
            TINY_QWEN3_MOE: lambda out: build_tiny_qwen3(out, moe=True), TINY_DEEPSEEK_V3: build_tiny_deepseek_v3,
            TINY_KIMI_K25: build_tiny_kimi_k25, TINY_GLM4_MOE: build_tiny_glm4_moe, TINY_GPT_OSS: build_tiny_gpt_oss,
            TINY_CHARS: build_tiny_llama_chars}
