"""Architectures of the models the paper recipes train, as their Hugging Face `config.json` fields.

Used where the shapes are needed but the weights are not: `--compile-only` on a machine that has no
copy of the checkpoint (`model.shapes: qwen3-8b` in a recipe, `lrmq.quantize --compile-only --shapes`). Values
are the public config.json files of the named repositories (Qwen/Qwen3-*-Base, meta-llama/Llama-3.1-8B; the
QuantLRM paper's models: deepseek-ai/DeepSeek-R1-Distill-Qwen-32B (Qwen2.5-32B's shapes),
deepseek-ai/DeepSeek-R1-Distill-Llama-70B (Llama-3.3-70B's), allenai/Olmo-3-7B-Think; DeepSeek-R1-0528-Qwen3-8B
has qwen3-8b's); only fields lrmq reads are kept.
"""

from __future__ import annotations

import copy
from typing import Any

from lrmq.model.config import ConfigError, ModelConfig

_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, num_key_value_heads=8, rms_norm_eps=1e-6,
              rope_theta=1000000.0, max_position_embeddings=32768, hidden_act="silu", attention_bias=False,
              torch_dtype="bfloat16")

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=False),
    "llama3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                        rope_theta=500000.0, max_position_embeddings=131072, hidden_act="silu",
                        tie_word_embeddings=False, torch_dtype="bfloat16",
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "r1-distill-qwen-32b": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                                num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                                rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=131072,
                                hidden_act="silu", use_sliding_window=False, tie_word_embeddings=False,
                                torch_dtype="bfloat16"),
    "r1-distill-llama-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                 num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                 rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                                 hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16",
                                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                   high_freq_factor=4.0, original_max_position_embeddings=8192)),
    # Qwen/Qwen3-30B-A3B-Base: 128 experts of width 768, top-8, every layer sparse (30.5B parameters, 3.3B active)
    "qwen3-30b-a3b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
                          model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001),
    # post-norm, q/k norms over all heads, 3 sliding-window layers then 1 full-attention layer
    "olmo-3-7b": dict(model_type="olmo3", vocab_size=100278, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-6,
                      rope_theta=500000, max_position_embeddings=65536, hidden_act="silu", sliding_window=4096,
                      tie_word_embeddings=False, torch_dtype="bfloat16",
                      rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=8192,
                                        attention_factor=1.2079441541679836, beta_fast=32, beta_slow=1)),
}


def preset_config(name: str, *, dtype: str | None = None, param_dtype: str | None = None) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"model.shapes={name!r} is not a known architecture; known: {sorted(PRESETS)}")
    return ModelConfig.from_hf_dict(copy.deepcopy(PRESETS[name]), source=f"preset {name}", dtype=dtype,
                                    param_dtype=param_dtype)
