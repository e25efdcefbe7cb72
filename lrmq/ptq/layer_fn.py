"""The model's own decoder layer as a pure function of float32 weights, with every Linear's input
captured through the linear seam.

PTQ never re-implements the layer: :func:`layer_spec` builds the model's ``DecoderLayer`` for the
model config with float32 compute and params (abstractly: no weights are allocated) and keeps its
``GraphDef``; :func:`layer_module` merges a flat dict of float32 weights into it, so a fix to the
decoder, or a new family taught to it, reaches PTQ unchanged. With ``capture=True`` each Linear's
``dot_general`` (the seam of ``lrmq.model.linear``: a plain function with ``jax.lax.dot_general``'s
signature) is swapped for one that records its ``lhs`` -- the Linear's input, cast to the compute
dtype -- and calls the original.

The weights dict (``get_layer_params``) is keyed by owner name: ``q_proj`` .. ``down_proj`` kernels
``[K, N]``, ``<linear>.bias``, and the norms' scales under the norm's name (``attn_norm``,
``q_norm``, ...). Linears that read the same tensor share one captured input:

* ``attn_in``: input of q/k/v (``attn_norm(x)`` for pre-norm families, ``x`` for Olmo-3 post-norm)
* ``o_in``: the attention output before ``o_proj`` ([.., heads*head_dim])
* ``mlp_in``: input of gate/up (``mlp_norm(h)`` pre-norm, ``h`` post-norm)
* ``down_in``: ``silu(gate(x)) * up(x)``

A mixture-of-experts layer (Qwen3-MoE) holds ``router`` ([D, E], a Linear: never quantized) and the stacked
expert kernels under the dense names: ``gate_proj`` / ``up_proj`` [E, D, F], ``down_proj`` [E, F, D]
(``ExpertLinear``). Its ``mlp_in`` is the router's input (every expert's gate/up input), captured through the
router's seam; an expert's ``down_in`` depends on the expert, so it is not a capture: :func:`expert_down_xtx`
computes each expert's ``X^T X`` from ``mlp_in`` and the expert's gate/up weights (:func:`expert_token_mask`:
over every calibration token, or only the tokens routed to the expert).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lrmq.model.config import ModelConfig
from lrmq.model.decoder import DecoderLayer, RMSNorm
from lrmq.model.linear import ExpertLinear, Linear
from lrmq.model.moe import route

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# which captured input feeds which Linear
INPUT_OF = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "o_in",
            "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "down_in"}
# the Linears each captured input depends on (every decoder lrmq has runs the attention, then the MLP):
# a capture stays exact while none of these changes
UPSTREAM = {"attn_in": (), "o_in": ("q_proj", "k_proj", "v_proj"),
            "mlp_in": ("q_proj", "k_proj", "v_proj", "o_proj"),
            "down_in": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")}
MODULE_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # a sparse layer's stacked expert kernels


def is_moe_params(p) -> bool:
    """A layer weights dict of a mixture-of-experts layer (its router and stacked [E, K, N] experts)."""
    return "router" in p


def module_path(name: str, moe: bool) -> str:
    """The module path of a projection inside its layer: ``attn.q_proj``, ``mlp.gate_proj``; in a sparse layer
    the stacked experts ``mlp.experts.gate_proj``."""
    return f"mlp.experts.{name}" if moe and name in EXPERT_PROJS else f"{MODULE_OF[name]}.{name}"


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Static (hashable) description of one decoder layer: a jit static argument.

    ``graphdef`` is what runs (the model's own `DecoderLayer`). The other fields are what PTQ reads
    about the layer: AWQ's scale groups read ``post_norm``, its GQA down/upsampling the head counts.
    """

    post_norm: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    graphdef: Any = None  # nnx GraphDef of the float32 DecoderLayer
    param_paths: tuple = ()  # ((weights-dict key, state path), ...) to merge a weights dict into graphdef


def param_key(path: tuple) -> str:
    """Weights-dict key of a state path: ('attn', 'q_proj', 'kernel') -> 'q_proj', ... 'bias' ->
    'q_proj.bias', ('attn_norm', 'scale') -> 'attn_norm'."""
    owner, leaf = str(path[-2]), str(path[-1])
    return owner if leaf in ("kernel", "scale") else f"{owner}.{leaf}"


def layer_spec(cfg: ModelConfig, i: int) -> LayerSpec:
    lt = cfg.layer_types[i]
    cfg32 = dataclasses.replace(cfg, dtype="float32", param_dtype="float32")  # all PTQ math is float32
    moe = cfg.is_moe_layer(i)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DecoderLayer(cfg32, lt, nnx.Rngs(0), moe=moe)))
    paths = tuple((param_key(p), tuple(p)) for p, _ in nnx.to_flat_state(state))
    keys = [k for k, _ in paths]
    if len(set(keys)) != len(keys):
        raise ValueError(f"decoder layer weights do not have unique owner names: {keys}")
    return LayerSpec(post_norm=cfg.norm_placement == "post", num_heads=cfg.num_heads,
                     num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, graphdef=graphdef,
                     param_paths=paths)


# ----------------------------------------------------------------------------- weights <-> module


def _weight_vars(layer):
    """(key, variable, Linear / ExpertLinear whose kernel it is or None) of every weight: Linear and ExpertLinear
    kernels, biases, norm scales."""
    for path, m in nnx.iter_modules(layer):
        if isinstance(m, ExpertLinear):
            yield str(path[-1]), m.kernel, m
        elif isinstance(m, Linear):
            yield str(path[-1]), m.kernel, m
            if m.bias is not None:
                yield f"{path[-1]}.bias", m.bias, None
        elif isinstance(m, RMSNorm):
            yield str(path[-1]), m.scale, None


def get_layer_params(layer) -> dict[str, jax.Array]:
    """Float32 copies of the layer's weights (packed kernels dequantized), keyed as the module doc says."""
    return {key: jnp.asarray(var.get_value() if lin is None else lin.float_weight(), jnp.float32)
            for key, var, lin in _weight_vars(layer)}


def set_layer_params(layer, p: dict[str, jax.Array], names=None) -> None:
    """Write float weights back (cast to each variable's dtype). ``names``: restrict to these keys."""
    variables = {key: var for key, var, _ in _weight_vars(layer)}
    for key, val in p.items():
        if names is not None and key not in names:
            continue
        var = variables[key]
        var.set_value(jnp.asarray(val).astype(var.get_value().dtype))


def layer_module(spec: LayerSpec, p: dict[str, jax.Array]) -> DecoderLayer:
    """The float32 DecoderLayer holding the weights ``p`` (traceable: ``p`` may hold tracers)."""
    tree: dict = {}
    for key, path in spec.param_paths:
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = p[key]
    return nnx.merge(spec.graphdef, tree)


def linears_of(module) -> dict[str, Linear]:
    """Every Linear under ``module`` by attribute name (``q_proj`` ...)."""
    return {str(path[-1]): m for path, m in nnx.iter_modules(module) if isinstance(m, Linear)}


# ----------------------------------------------------------------------------- capture through the seam


def _recorder(name: str, dot_general, seen: dict):
    def record(lhs, rhs, *args, **kwargs):
        seen[name] = lhs
        return dot_general(lhs, rhs, *args, **kwargs)

    return record


@contextlib.contextmanager
def recording_inputs(linears: dict[str, Linear]):
    """Within the block, each Linear's input (the ``lhs`` its ``dot_general`` receives) is stored in
    the yielded dict under the Linear's name; the original ``dot_general`` runs and is put back on
    exit. Packed kernels bypass ``dot_general`` (qmatmul) and record nothing."""
    seen: dict = {}
    saved = {name: lin.dot_general for name, lin in linears.items()}
    try:
        for name, lin in linears.items():
            lin.dot_general = _recorder(name, saved[name], seen)
        yield seen
    finally:
        for name, lin in linears.items():
            lin.dot_general = saved[name]


def _replayer(given, dot_general):
    def replay(lhs, rhs, *args, **kwargs):
        if given.shape != lhs.shape:
            raise ValueError(f"given input has shape {given.shape}, the Linear receives {lhs.shape}")
        return dot_general(given.astype(lhs.dtype), rhs, *args, **kwargs)

    return replay


@contextlib.contextmanager
def replaying_inputs(linears: dict[str, Linear], given: dict):
    """Within the block, each Linear whose captured input (``INPUT_OF``) is in ``given`` computes on that
    array instead of what it receives (the same shape). When the arrays are the very inputs those Linears
    would receive, the layer's results are unchanged and whatever only fed them is dead code that XLA
    drops (GPTQ re-runs a layer whose attention it already ran: see ``layer_run``)."""
    saved = {name: lin.dot_general for name, lin in linears.items() if INPUT_OF.get(name) in given}
    try:
        for name in saved:
            linears[name].dot_general = _replayer(given[INPUT_OF[name]], saved[name])
        yield
    finally:
        for name, dot_general in saved.items():
            linears[name].dot_general = dot_general


def shared_inputs(seen: dict, lead: tuple | None = None) -> dict:
    """Per-Linear inputs -> per-input captures (``attn_in`` ...): q/k/v read one tensor, gate/up another. A sparse
    layer's router reads ``mlp_in`` flattened to [B*T, D]: given back as ``lead`` [B, T] + (D,)."""
    caps: dict = {}
    for name in LINEARS:
        if name in seen:
            caps.setdefault(INPUT_OF[name], seen[name])
    if "router" in seen and "mlp_in" not in caps:
        r = seen["router"]
        caps["mlp_in"] = r.reshape(*(lead or r.shape[:-1]), r.shape[-1])
    return caps


def expert_token_mask(x, router, top_k: int, normalize: bool, calibration: str):
    """[E, M] float32 weights of the M tokens of x [..., D] in each expert's statistics: every token (``"all"``,
    llmcompressor's ``moe_calibrate_all_experts``) or the tokens the router sends to the expert (``"routed"``,
    its top-k of ``router`` [D, E]: what the expert sees in inference)."""
    x = jnp.asarray(x, jnp.float32).reshape(-1, x.shape[-1])
    e = router.shape[-1]
    if calibration == "all":
        return jnp.ones((e, x.shape[0]), jnp.float32)
    if calibration != "routed":
        raise ValueError(f"expert calibration must be 'all' or 'routed', got {calibration!r}")
    _, chosen = route(x @ jnp.asarray(router, jnp.float32), top_k, normalize)
    return jnp.sum(jax.nn.one_hot(chosen, e, dtype=jnp.float32), axis=1).T


def expert_hidden(x, gate, up):
    """[E, M, F] every expert's ``silu(x W_gate[e]) * (x W_up[e])`` (its down_proj input) of x [..., D], float32."""
    x = jnp.asarray(x, jnp.float32).reshape(-1, x.shape[-1])
    g = jnp.einsum("md,edf->emf", x, jnp.asarray(gate, jnp.float32))
    u = jnp.einsum("md,edf->emf", x, jnp.asarray(up, jnp.float32))
    return jax.nn.silu(g) * u


def expert_mlp_in_xtx(x, router, *, top_k: int, normalize: bool, calibration: str):
    """[E, D, D] each expert's gate/up input ``X^T X`` over its tokens (``expert_token_mask``) of x [..., D]."""
    m = expert_token_mask(x, router, top_k, normalize, calibration)
    x = jnp.asarray(x, jnp.float32).reshape(-1, x.shape[-1])
    return jnp.einsum("em,md,mk->edk", m, x, x, preferred_element_type=jnp.float32)


def expert_down_xtx(x, router, gate, up, *, top_k: int, normalize: bool, calibration: str):
    """[E, F, F] each expert's down_proj input ``X^T X`` over its tokens of x [..., D] (``mlp_in``)."""
    m = expert_token_mask(x, router, top_k, normalize, calibration)
    h = expert_hidden(x, gate, up) * m[..., None]
    return jnp.einsum("emf,emg->efg", h, h, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- forwards


def layer_forward(p, spec: LayerSpec, x, positions, capture: bool = False):
    """The layer on x [B, T, D] in float32; with ``capture`` also its Linears' inputs (module doc)."""
    layer = layer_module(spec, p)
    x, positions = jnp.asarray(x, jnp.float32), jnp.asarray(positions)
    if not capture:
        return layer(x, positions)[0]
    with recording_inputs(linears_of(layer)) as seen:
        out, _ = layer(x, positions)
    return out, shared_inputs(seen, x.shape[:-1])


def part_forward(p, spec: LayerSpec, part: str, x, positions):
    """One part of the layer, as llm-awq inspects it: ``attn`` (q/k/v -> attention -> o_proj),
    ``mlp`` (gate/up -> down), or a single Linear by name."""
    layer = layer_module(spec, p)
    if part == "attn":
        return layer.attn(x, positions)[0]
    if part == "mlp":
        return layer.mlp(x)
    return linears_of(layer)[part](x)


def layer_run(p, spec: LayerSpec, x, positions, names: tuple | None = None, given: dict | None = None):
    """The layer on x [B, T, D] in float32: its output (``names=None``) or only the captured inputs
    ``names`` (e.g. ``("o_in",)``); what the layer computes past them is dead code that XLA drops (GPTQ's
    true-sequential o_proj stage runs the attention, not the MLP). ``given`` (``{"o_in": array, ...}``):
    the Linears reading those inputs compute on these arrays (``replaying_inputs``); they must be the
    exact inputs for these weights (captured earlier with the same upstream weights), so that only the
    work the layer did before them is skipped."""
    layer = layer_module(spec, p)
    x, positions = jnp.asarray(x, jnp.float32), jnp.asarray(positions)
    linears = linears_of(layer)
    with recording_inputs(linears) as seen, replaying_inputs(linears, given or {}):
        out, _ = layer(x, positions)
    if names is None:
        return out
    caps = shared_inputs(seen, x.shape[:-1])
    return {name: caps[name] for name in names}


layer_forward_jit = jax.jit(layer_forward, static_argnames=("spec", "capture"))
layer_run_jit = jax.jit(layer_run, static_argnames=("spec", "names"))
