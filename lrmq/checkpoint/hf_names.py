"""The Hugging Face <-> lrmq parameter name map: one table for all five families.

Each row: (HF name pattern, lrmq path pattern, transform). `{i}` is the layer index. Transforms:
"T" transposes torch's [out, in] Linear weight to lrmq's [in, out]; "" copies. A row applies to a
model when its lrmq module exists (e.g. q_norm only with qk_norm, biases only when configured).
`{e}` is an expert index: HF stores one tensor per expert, lrmq one stacked parameter whose leading
axis is the expert, the HF tensor (transformed) being its row e.

transformers 5 holds Qwen3-MoE's experts fused in memory (`gate_up_proj` [E, 2 x moe_intermediate, hidden],
`down_proj` [E, hidden, moe_intermediate]) and writes them per expert unless `save_pretrained(...,
save_original_format=False)`; `FUSED_EXPERTS` reads that layout as views of the per-expert tensors. lrmq
writes the per-expert layout (what the published checkpoints hold).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

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
    # mixture-of-experts layers (Qwen3-MoE): the router, and each expert's SwiGLU stacked over experts
    ("model.layers.{i}.mlp.gate.weight",                   "layers.{i}.mlp.router.kernel",              "T"),
    ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight",  "layers.{i}.mlp.experts.gate_proj.kernel",   "T"),
    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight",    "layers.{i}.mlp.experts.up_proj.kernel",     "T"),
    ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",  "layers.{i}.mlp.experts.down_proj.kernel",   "T"),
    # pre-norm families (Llama, Qwen): norms before attention / MLP
    ("model.layers.{i}.input_layernorm.weight",            "layers.{i}.attn_norm.scale",                ""),
    ("model.layers.{i}.post_attention_layernorm.weight",   "layers.{i}.mlp_norm.scale",                 ""),
    # post-norm family (Olmo-3): HF reuses the name post_attention_layernorm for the attention *output* norm
    ("model.layers.{i}.post_attention_layernorm.weight",   "layers.{i}.attn_out_norm.scale",            ""),
    ("model.layers.{i}.post_feedforward_layernorm.weight", "layers.{i}.mlp_out_norm.scale",             ""),
    ("model.norm.weight",                                  "final_norm.scale",                          ""),
    ("lm_head.weight",                                     "lm_head.kernel",                            "T"),
)


# transformers 5's fused expert tensors: (fused name, ((per-expert name, part), ...)). Expert e's tensor of a
# per-expert name is fused[e] split into len(parts) equal blocks along its first axis, block `part`.
FUSED_EXPERTS: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (
    ("model.layers.{i}.mlp.experts.gate_up_proj", (("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", 0),
                                                    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", 1))),
    ("model.layers.{i}.mlp.experts.down_proj", (("model.layers.{i}.mlp.experts.{e}.down_proj.weight", 0),)),
)


class Slot(NamedTuple):
    """Where one HF tensor goes: lrmq parameter `path`, `transform` ("T" or ""), and for a per-expert tensor the
    `expert` row of the stacked parameter it fills (None: the whole parameter)."""

    path: str
    transform: str
    expert: int | None = None


def expand(lrmq_paths: set[str], cfg: ModelConfig) -> dict[str, Slot]:
    """HF name -> Slot for the params this model actually has, in NAME_MAP's order (experts consecutive)."""
    out: dict[str, Slot] = {}
    for hf, ours, tr in NAME_MAP:
        layers = range(cfg.num_layers) if "{i}" in hf else (None,)
        experts = range(cfg.num_experts) if "{e}" in hf else (None,)
        for i in layers:
            o = ours.format(i=i) if i is not None else ours
            if o not in lrmq_paths:
                continue
            for e in experts:
                out[hf.format(i=i, e=e)] = Slot(o, tr, e)
    return out


def fused_views(names: Iterable[str], cfg: ModelConfig) -> dict[str, tuple[str, tuple]]:
    """{per-expert HF name: (fused tensor name, numpy index of its block)} for the FUSED_EXPERTS tensors among
    `names` (the layers of `cfg`): a checkpoint in transformers 5's fused layout, read as the per-expert one."""
    names = set(names)
    out: dict[str, tuple[str, tuple]] = {}
    for fused, parts in FUSED_EXPERTS:
        for i in range(cfg.num_layers):
            f = fused.format(i=i)
            if f not in names:
                continue
            for name, part in parts:
                width = cfg.moe_intermediate_size if len(parts) > 1 else None
                rows = slice(part * width, (part + 1) * width) if width else slice(None)
                for e in range(cfg.num_experts):
                    out[name.format(i=i, e=e)] = (f, (e, rows))
    return out
