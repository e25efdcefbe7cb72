"""Streaming layer-by-layer PTQ driver and a functional decoder-layer forward that exposes every
Linear's input.

Pipeline (llm-awq ``run_awq`` / GPTQ ``llama_sequential`` structure)::

    x = embed(calibration tokens)                      # float32 [n_blocks, T, D]
    for i in layers:                                   # tqdm bar with ETA
        p   = float32 copy of layer i's weights        # one layer materialized
        x'  = layer(p, x)                              # FP outputs, before any change (AWQ/QuantLRM)
        p_q = method(LayerContext(i, p, x, ...))       # search + fold + clip + quantize this layer
        write p_q back into the model (param dtype)
        x   = x' (propagate="fp")  or  layer(p_q, x) (propagate="quantized", GPTQ reference)

The per-layer forward is a pure jitted function of a flat dict of float32 arrays, so methods call it
with modified weights (scaled, fake-quantized) without touching the model. With ``capture=True`` it
also returns each Linear's input:

* ``attn_in``: input of q/k/v (``attn_norm(x)`` for pre-norm families, ``x`` for Olmo-3 post-norm)
* ``o_in``: the attention output before ``o_proj`` ([.., heads*head_dim])
* ``mlp_in``: input of gate/up (``mlp_norm(h)`` pre-norm, ``h`` post-norm)
* ``down_in``: ``silu(gate(x)) * up(x)``

Everything here computes in float32 whatever the model's compute dtype (llm-awq searches in fp16).

Memory actually held: the model itself (one copy, in its param dtype: the quantized layers are
written back in place, so there is never a second full float copy), the calibration hidden states
``x`` and ``x'`` ([n_blocks, T, D] float32 each), one layer's float32 weights and that layer's
captured inputs (``mlp_in``/``down_in`` are [n_blocks, T, D] and [n_blocks, T, intermediate]).
Packed results are kept per Linear (small).  The layer forward runs over chunks of ``batch_size``
blocks so the attention scores stay [batch_size, heads, T, T].
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lrmq.model.config import ModelConfig
from lrmq.model.decoder import attend
from lrmq.model.rope import apply_rope, inv_frequencies, rope_cos_sin

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# which captured input feeds which Linear
INPUT_OF = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "o_in",
            "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "down_in"}
MODULE_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
NORMS = ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Static (hashable) description of one decoder layer for the functional forward."""

    post_norm: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: str
    eps: float
    inv_freq: tuple
    rope_scale: float
    window: int | None


def layer_spec(cfg: ModelConfig, i: int) -> LayerSpec:
    lt = cfg.layer_types[i]
    inv, scale = inv_frequencies(cfg.rope[lt], cfg.head_dim)
    return LayerSpec(post_norm=cfg.norm_placement == "post", num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, qk_norm=cfg.qk_norm, eps=float(cfg.rms_norm_eps),
                     inv_freq=tuple(float(v) for v in inv), rope_scale=float(scale),
                     window=cfg.sliding_window if lt == "sliding_attention" else None)


# ----------------------------------------------------------------------------- params <-> module


def _linear_of(layer, name):
    return getattr(getattr(layer, MODULE_OF[name]), name)


def get_layer_params(layer) -> dict[str, jax.Array]:
    """Float32 copies: ``q_proj`` .. ``down_proj`` kernels [K, N], ``<name>.bias``, norms' scales."""
    p: dict[str, jax.Array] = {}
    for name in LINEARS:
        lin = _linear_of(layer, name)
        p[name] = jnp.asarray(lin.float_weight(), jnp.float32)
        if lin.bias is not None:
            p[name + ".bias"] = jnp.asarray(lin.bias[...], jnp.float32)
    for n in NORMS:
        if hasattr(layer, n):
            p[n] = jnp.asarray(getattr(layer, n).scale[...], jnp.float32)
    for n in ("q_norm", "k_norm"):
        m = getattr(layer.attn, n, None)
        if m is not None:
            p[n] = jnp.asarray(m.scale[...], jnp.float32)
    return p


def set_layer_params(layer, p: dict[str, jax.Array], names=None) -> None:
    """Write float weights back (cast to each variable's dtype). ``names``: restrict to these keys."""
    for key, val in p.items():
        if names is not None and key not in names:
            continue
        base, _, sub = key.partition(".")
        if base in LINEARS:
            lin = _linear_of(layer, base)
            var = lin.bias if sub == "bias" else lin.kernel
        elif base in ("q_norm", "k_norm"):
            var = getattr(layer.attn, base).scale
        else:
            var = getattr(layer, base).scale
        old = var.get_value()
        var.set_value(jnp.asarray(val).astype(old.dtype))


# ----------------------------------------------------------------------------- functional forward


def rms_norm(x, scale, eps):
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return scale * h


def linear(p, name, x):
    y = jnp.einsum("...k,kn->...n", x, p[name], preferred_element_type=jnp.float32)
    b = p.get(name + ".bias")
    return y if b is None else y + b


def attn_core(p, spec: LayerSpec, x, positions):
    """Attention output before o_proj, [B, T, H*D] (q/k norms, RoPE, GQA, causal/sliding mask)."""
    b, t, _ = x.shape
    q, k, v = linear(p, "q_proj", x), linear(p, "k_proj", x), linear(p, "v_proj", x)
    if spec.qk_norm == "full":
        q, k = rms_norm(q, p["q_norm"], spec.eps), rms_norm(k, p["k_norm"], spec.eps)
    q = q.reshape(b, t, spec.num_heads, spec.head_dim)
    k = k.reshape(b, t, spec.num_kv_heads, spec.head_dim)
    v = v.reshape(b, t, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm == "head":
        q, k = rms_norm(q, p["q_norm"], spec.eps), rms_norm(k, p["k_norm"], spec.eps)
    cos, sin = rope_cos_sin(positions, np.asarray(spec.inv_freq, np.float32), spec.rope_scale, jnp.float32)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = attend(q, k, v, positions, positions, spec.window)
    return out.reshape(b, t, -1)


def attn_block(p, spec, x, positions):
    """The attention module (llm-awq inspects ``self_attn``: q/k/v -> attention -> o_proj)."""
    return linear(p, "o_proj", attn_core(p, spec, x, positions))


def mlp_act(p, x):
    return jax.nn.silu(linear(p, "gate_proj", x)) * linear(p, "up_proj", x)


def mlp_block(p, x):
    return linear(p, "down_proj", mlp_act(p, x))


def layer_forward(p, spec: LayerSpec, x, positions, capture: bool = False):
    """One decoder layer in float32; with ``capture`` also the Linear inputs (see module doc)."""
    if spec.post_norm:
        attn_in = x
        o_in = attn_core(p, spec, attn_in, positions)
        h = x + rms_norm(linear(p, "o_proj", o_in), p["attn_out_norm"], spec.eps)
        mlp_in = h
        down_in = mlp_act(p, mlp_in)
        out = h + rms_norm(linear(p, "down_proj", down_in), p["mlp_out_norm"], spec.eps)
    else:
        attn_in = rms_norm(x, p["attn_norm"], spec.eps)
        o_in = attn_core(p, spec, attn_in, positions)
        h = x + linear(p, "o_proj", o_in)
        mlp_in = rms_norm(h, p["mlp_norm"], spec.eps)
        down_in = mlp_act(p, mlp_in)
        out = h + linear(p, "down_proj", down_in)
    if not capture:
        return out
    return out, {"attn_in": attn_in, "o_in": o_in, "mlp_in": mlp_in, "down_in": down_in}


_layer_forward_jit = jax.jit(layer_forward, static_argnames=("spec", "capture"))


def chunked(fn: Callable, *arrays, batch_size: int):
    """Apply ``fn`` to chunks of ``batch_size`` along axis 0 of every array and concatenate outputs
    (pytrees of arrays)."""
    arrays = [np.asarray(a) for a in arrays]  # host slicing: no per-shape XLA slice programs
    n = arrays[0].shape[0]
    outs = [fn(*(a[s:s + batch_size] for a in arrays)) for s in range(0, n, batch_size)]
    if len(outs) == 1:
        return jax.tree.map(np.asarray, outs[0])
    return jax.tree.map(lambda *xs: np.concatenate([np.asarray(v) for v in xs], axis=0), *outs)


def positions_for(n: int, t: int) -> np.ndarray:
    return np.broadcast_to(np.arange(t, dtype=np.int32), (n, t))


@dataclasses.dataclass
class LayerContext:
    """What a PTQ method sees for one layer."""

    index: int
    spec: LayerSpec
    params: dict[str, jax.Array]  # float32, original (FP) weights of this layer
    x: jax.Array  # [n, T, D] float32 layer input
    positions: jax.Array  # [n, T]
    batch_size: int
    cfg: ModelConfig
    _captures: dict | None = None

    def forward(self, params=None, capture: bool = False):
        p = self.params if params is None else params
        return chunked(lambda x, pos: _layer_forward_jit(p, self.spec, x, pos, capture=capture), self.x,
                       self.positions, batch_size=self.batch_size)

    def inputs(self, params=None) -> dict[str, jax.Array]:
        """Captured Linear inputs; with ``params=None`` (the FP weights) computed once and cached."""
        if params is None:
            if self._captures is None:
                _, self._captures = self.forward(capture=True)
            return self._captures
        return self.forward(params, capture=True)[1]

    @property
    def prefix(self) -> str:
        return f"layers.{self.index}"


def linear_path(i: int, name: str) -> str:
    return f"layers.{i}.{MODULE_OF[name]}.{name}"


def embed_tokens(model, tokens) -> jax.Array:
    emb = np.asarray(model.embed.embedding[...])
    return emb[np.asarray(tokens)].astype(np.float32)


def run_layerwise(model, tokens, process_layer: Callable[[LayerContext], dict[str, jax.Array]], *,
                  propagate: str = "fp", batch_size: int = 8, desc: str = "PTQ", progress: bool = True,
                  timings: list | None = None) -> None:
    """Drive ``process_layer`` over every decoder layer (see module doc). ``tokens``: int [n, T].

    ``process_layer(ctx)`` returns the layer's new float32 params (dict as ``get_layer_params``);
    they are written back into ``model`` in place. ``timings`` (a list) receives seconds per layer.
    """
    if propagate not in ("fp", "quantized"):
        raise ValueError(f"propagate must be 'fp' or 'quantized', got {propagate!r}")
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.size == 0:
        raise ValueError(f"calibration tokens must be a non-empty [n_blocks, T] array, got shape {tokens.shape}")
    if tokens.max() >= model.cfg.vocab_size:
        raise ValueError(f"calibration token id {int(tokens.max())} >= vocab_size {model.cfg.vocab_size}")
    cfg = model.cfg
    x = embed_tokens(model, tokens)
    pos = positions_for(*tokens.shape)
    from tqdm.auto import tqdm

    bar = tqdm(range(cfg.num_layers), desc=desc, unit="layer", disable=not progress)
    for i in bar:
        t0 = time.perf_counter()
        layer = model.layers[i]
        ctx = LayerContext(index=i, spec=layer_spec(cfg, i), params=get_layer_params(layer), x=x, positions=pos,
                           batch_size=batch_size, cfg=cfg)
        x_fp = ctx.forward() if propagate == "fp" else None
        new_p = process_layer(ctx)
        set_layer_params(layer, new_p)
        if propagate == "fp":
            x = x_fp
        else:
            x = ctx.forward(new_p)
        del ctx
        if timings is not None:
            timings.append(time.perf_counter() - t0)
