"""The Hugging Face <-> lrmq parameter name map: one table for all four families.

Each row: (HF name pattern, lrmq path pattern, transform). `{i}` is the layer index. Transforms:
"T" transposes torch's [out, in] Linear weight to lrmq's [in, out]; "" copies. A row applies to a
model when its lrmq module exists (e.g. q_norm only with qk_norm, biases only when configured).
"""

from __future__ import annotations

from lrmq.model.config import ModelConfig

NAME_MAP: tuple[tuple[str, str, str], ...] = (
    # HF name                                               lrmq path                                   transform
    ("model.embed_tokens.weight",                          "embed.embedding",                           ""),
    ("model.layers.{i}.self_attn.q_proj.weight",           "layers.{i}.attn.q_proj.kernel",             "T"),
    ("model.layers.{i}.self_attn.k_proj.weight",           "layers.{i}.attn.k_proj.kernel",             "T"),
    ("model.layers.{i}.self_attn.v_proj.weight",           "layers.{i}.attn.v_proj.kernel",             "T"),
    ("model.layers.{i}.self_attn.o_proj.weight",           "layers.{i}.attn.o_proj.kernel",             "T"),
    ("model.layers.{i}.self_attn.q_proj.bias",             "layers.{i}.attn.q_proj.bias",               ""),
    ("model.layers.{i}.self_attn.k_proj.bias",             "layers.{i}.attn.k_proj.bias",               ""),
    ("model.layers.{i}.self_attn.v_proj.bias",             "layers.{i}.attn.v_proj.bias",               ""),
    ("model.layers.{i}.self_attn.o_proj.bias",             "layers.{i}.attn.o_proj.bias",               ""),
    ("model.layers.{i}.self_attn.q_norm.weight",           "layers.{i}.attn.q_norm.scale",              ""),
    ("model.layers.{i}.self_attn.k_norm.weight",           "layers.{i}.attn.k_norm.scale",              ""),
    ("model.layers.{i}.mlp.gate_proj.weight",              "layers.{i}.mlp.gate_proj.kernel",           "T"),
    ("model.layers.{i}.mlp.up_proj.weight",                "layers.{i}.mlp.up_proj.kernel",             "T"),
    ("model.layers.{i}.mlp.down_proj.weight",              "layers.{i}.mlp.down_proj.kernel",           "T"),
    ("model.layers.{i}.mlp.gate_proj.bias",                "layers.{i}.mlp.gate_proj.bias",             ""),
    ("model.layers.{i}.mlp.up_proj.bias",                  "layers.{i}.mlp.up_proj.bias",               ""),
    ("model.layers.{i}.mlp.down_proj.bias",                "layers.{i}.mlp.down_proj.bias",             ""),
    # pre-norm families (Llama, Qwen): norms before attention / MLP
    ("model.layers.{i}.input_layernorm.weight",            "layers.{i}.attn_norm.scale",                ""),
    ("model.layers.{i}.post_attention_layernorm.weight",   "layers.{i}.mlp_norm.scale",                 ""),
    # post-norm family (Olmo-3): HF reuses the name post_attention_layernorm for the attention *output* norm
    ("model.layers.{i}.post_attention_layernorm.weight",   "layers.{i}.attn_out_norm.scale",            ""),
    ("model.layers.{i}.post_feedforward_layernorm.weight", "layers.{i}.mlp_out_norm.scale",             ""),
    ("model.norm.weight",                                  "final_norm.scale",                          ""),
    ("lm_head.weight",                                     "lm_head.kernel",                            "T"),
)


def expand(lrmq_paths: set[str], cfg: ModelConfig) -> dict[str, tuple[str, str]]:
    """HF name -> (lrmq path, transform) for the params this model actually has."""
    out: dict[str, tuple[str, str]] = {}
    for hf, ours, tr in NAME_MAP:
        layers = range(cfg.num_layers) if "{i}" in hf else (None,)
        for i in layers:
            h = hf.format(i=i) if i is not None else hf
            o = ours.format(i=i) if i is not None else ours
            if o in lrmq_paths:
                out[h] = (o, tr)
    return out
