"""The Hugging Face architectures jaxtron converts: their class names, model types, and the
config defaults transformers assumes for fields a config.json may omit."""

from __future__ import annotations

LLAMA, MIXTRAL = "LlamaForCausalLM", "MixtralForCausalLM"
QWEN3_MOE, DEEPSEEK_V3 = "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"
QWEN3, MISTRAL, QWEN2 = "Qwen3ForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"
MODEL_TYPES = {LLAMA: "llama", MIXTRAL: "mixtral", QWEN3_MOE: "qwen3_moe",
               DEEPSEEK_V3: "deepseek_v3", QWEN3: "qwen3", MISTRAL: "mistral", QWEN2: "qwen2"}
# HF config defaults for fields a config.json may omit (transformers' config classes).
DEFAULTS = {LLAMA: {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                    "rope_theta": 10000.0},
            MIXTRAL: {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
                      "rope_theta": 1e6, "sliding_window": None},
            QWEN3: {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                    "rope_theta": 10000.0, "sliding_window": 4096},
            QWEN2: {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                    "rope_theta": 10000.0, "sliding_window": 4096},
            MISTRAL: {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6,
                      "rope_theta": 10000.0, "sliding_window": 4096},
            QWEN3_MOE: {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                        "rope_theta": 10000.0, "norm_topk_prob": False,
                        "sliding_window": 4096},
            DEEPSEEK_V3: {"max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
                          "rope_theta": 10000.0, "norm_topk_prob": True,
                          "first_k_dense_replace": 3, "n_shared_experts": 1, "n_group": 8,
                          "topk_group": 4, "routed_scaling_factor": 2.5, "q_lora_rank": 1536,
                          "rope_interleave": True}}
