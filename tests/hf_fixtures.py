"""Tiny random transformers models of each family, saved as HF checkpoints (no network)."""

from __future__ import annotations

import os

import torch

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)

VARIANTS = {
    "qwen3": dict(model_type="qwen3", head_dim=24, tie_word_embeddings=True),
    "qwen3_window": dict(model_type="qwen3", head_dim=16, use_sliding_window=True, sliding_window=4,
                         max_window_layers=1),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),
    "llama3": dict(model_type="llama", rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                            low_freq_factor=1.0, high_freq_factor=4.0,
                                                            original_max_position_embeddings=64)),
    "llama_linear": dict(model_type="llama", attention_bias=True, mlp_bias=True,
                         rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    "llama_yarn": dict(model_type="llama", rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                                original_max_position_embeddings=64)),
    "olmo3": dict(model_type="olmo3", sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                  rms_norm_eps=1e-6),
}

# Qwen3-MoE (kept apart from VARIANTS: PTQ, which every VARIANTS entry also runs, refuses experts for now).
# Routers get weights of std 0.5 (transformers' 0.02 leaves near-ties that float noise could flip).
_MOE = dict(model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MOE_VARIANTS = {
    # layers 0 and 2 sparse, 1 dense (mlp_only_layers); weights renormalised
    "qwen3_moe": dict(_MOE, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True),
    # decoder_sparse_step 2: layer 0 dense, layer 1 sparse; raw softmax weights; tied embeddings
    "qwen3_moe_step": dict(_MOE, decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=True),
    # every router's rows 0 = 1 and 2 = 3: each token's two experts tie exactly (torch.topk and jax.lax.top_k
    # order them differently; the set is the same)
    "qwen3_moe_ties": dict(_MOE, norm_topk_prob=False, router_ties=True),
}


def make_hf_model(variant: str, seed: int = 0):
    import transformers

    kw = dict(BASE, **(VARIANTS[variant] if variant in VARIANTS else MOE_VARIANTS[variant]))
    model_type = kw.pop("model_type")
    router_ties = kw.pop("router_ties", False)
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # random norms and biases so parity tests exercise them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # a Qwen3-MoE router [experts, hidden]
                p.copy_(0.5 * torch.randn_like(p))
                if router_ties:
                    p[1], p[3] = p[0], p[2]
    return model.eval()


def save_hf_model_dir(variant: str, path: str, seed: int = 0, dtype=torch.float32):
    model = make_hf_model(variant, seed).to(dtype)
    model.save_pretrained(path)
    return model
