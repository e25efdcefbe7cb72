"""Streaming layer-by-layer PTQ driver.

Pipeline (llm-awq ``run_awq`` / GPTQ ``llama_sequential`` structure)::

    x = embed(calibration tokens)                      # float32 [n_blocks, T, D]
    for i in layers:                                   # tqdm bar with ETA
        p   = float32 copy of layer i's weights        # one layer materialized
        x'  = layer(p, x)                              # FP outputs, before any change (AWQ/QuantLRM)
        p_q = method(LayerContext(i, p, x, ...))       # search + fold + clip + quantize this layer
        write p_q back into the model (param dtype)
        x   = x' (propagate="fp")  or  layer(p_q, x) (propagate="quantized", GPTQ reference)

``layer(p, x)`` is the model's own ``DecoderLayer`` run as a pure jitted function of the float32
weights (:mod:`lrmq.ptq.layer_fn`), so methods call it with modified weights (scaled, fake-quantized)
without touching the model; with ``capture=True`` it also returns each Linear's input, recorded
through the linear seam (``attn_in``, ``o_in``, ``mlp_in``, ``down_in``: see ``layer_fn``).

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
import numpy as np

from lrmq.model.config import ModelConfig
from lrmq.ptq.layer_fn import (MODULE_OF, LayerSpec, get_layer_params, layer_forward_jit, layer_run_jit,
                               layer_spec, set_layer_params)


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
    # the layer's output with the params the method returns, when the method computed it (GPTQ, from
    # inputs it captured on the way): run_layerwise's propagate="quantized" then uses it
    output: np.ndarray | None = None

    def forward(self, params=None, capture: bool = False):
        p = self.params if params is None else params
        return chunked(lambda x, pos: layer_forward_jit(p, self.spec, x, pos, capture=capture), self.x,
                       self.positions, batch_size=self.batch_size)

    def inputs(self, params=None) -> dict[str, jax.Array]:
        """Captured Linear inputs; with ``params=None`` (the FP weights) computed once and cached."""
        if params is None:
            if self._captures is None:
                _, self._captures = self.forward(capture=True)
            return self._captures
        return self.forward(params, capture=True)[1]

    def inputs_only(self, names, params=None, given=None) -> dict[str, np.ndarray]:
        """The captured inputs ``names`` (``attn_in`` ...) only; the layer past them is not computed.
        ``given``: exact inputs already captured for these weights (``layer_fn.layer_run``)."""
        return self._run(params, tuple(sorted(set(names))), given)

    def forward_given(self, params, given) -> np.ndarray:
        """The layer's output, its Linears reading the exact inputs ``given`` (``layer_fn.layer_run``)."""
        return self._run(params, None, given)

    def _run(self, params, names, given):
        p = self.params if params is None else params
        keys = tuple(sorted(given or {}))
        return chunked(lambda x, pos, *g: layer_run_jit(p, self.spec, x, pos, names=names, given=dict(zip(keys, g))),
                       self.x, self.positions, *[given[k] for k in keys], batch_size=self.batch_size)

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
            x = ctx.output if ctx.output is not None else ctx.forward(new_p)
        del ctx
        if timings is not None:
            timings.append(time.perf_counter() - t0)
