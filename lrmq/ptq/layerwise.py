"""Streaming layer-by-layer PTQ driver, sharded over the host's chips.

Pipeline (llm-awq ``run_awq`` / GPTQ ``llama_sequential`` structure)::

    x = embed(calibration tokens)                      # float32 [n_blocks, T, D], on the host
    for i in layers:                                   # tqdm bar with ETA
        p   = layer i's float32 weights from the source  # read when its turn comes; i+1 prefetched meanwhile
        x'  = layer(p, x)                              # FP outputs, before any change (AWQ/QuantLRM)
        out = method(LayerContext(i, p, x, ...))       # search + fold + clip + quantize this layer: a LayerOut
        emit(out)                                      # into the model in place, or the streamed exports
        x   = x' (propagate="fp")  or  layer(out.params, x) (propagate="quantized", GPTQ reference)

The **source** (:mod:`lrmq.ptq.source`) is an in-memory model or a checkpoint read layer by layer: the
Decoder is then never built, and the host holds one layer (plus the next one, prefetched) besides the
calibration activations. ``layer(p, x)`` is the model's own ``DecoderLayer`` run as a pure function of
the float32 weights (:mod:`lrmq.ptq.layer_fn`), so methods call it with modified weights (scaled,
fake-quantized); with ``capture=True`` it also returns each Linear's input, recorded through the
linear seam (``attn_in``, ``o_in``, ``mlp_in``, ``down_in``: see ``layer_fn``).

Every pass over the calibration blocks runs through :class:`lrmq.ptq.shard.UnitRunner`: units of a fixed
number of blocks, one per chip per step, results concatenated or summed on the host in unit order, so
1 and N chips give the same bytes. Activations (``x``, ``x'`` and the captures) live on the host; a chip
holds the layer's weights and one unit's activations.

Everything here computes in float32 whatever the model's compute dtype (llm-awq searches in fp16).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import numpy as np

from lrmq.model.config import ModelConfig
from lrmq.ptq import layer_fn as lf
from lrmq.ptq.layer_fn import MODULE_OF, LayerSpec, layer_spec
from lrmq.ptq.shard import UnitRunner, ptq_mesh
from lrmq.ptq.source import as_source
from lrmq.ptq.stream import LayerOut


def positions_for(n: int, t: int) -> np.ndarray:
    return np.ascontiguousarray(np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)))


# ----------------------------------------------------------------------------- per-unit functions


def unit_forward(p, x, pos, *, spec, capture):
    """One unit's layer output (and captures): the body :class:`UnitRunner` runs on every chip."""
    return lf.layer_forward(p, spec, x, pos, capture=capture)


def unit_run(p, x, pos, *given, spec, names, keys):
    return lf.layer_run(p, spec, x, pos, names=names, given=dict(zip(keys, given)))


@dataclasses.dataclass
class LayerContext:
    """What a PTQ method sees for one layer."""

    index: int
    spec: LayerSpec
    params: dict[str, np.ndarray]  # float32, original (FP) weights of this layer (host)
    x: np.ndarray  # [n, T, D] float32 layer input (host)
    positions: np.ndarray  # [n, T]
    runner: UnitRunner
    cfg: ModelConfig
    _captures: dict | None = None
    _fp_out: np.ndarray | None = None
    _replicated: tuple | None = None  # (the params dict's arrays, their copy on every chip)
    # the layer's output with the params the method returns, when the method computed it (GPTQ, from
    # inputs it captured on the way): run_layerwise's propagate="quantized" then uses it
    output: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return self.runner.size

    def on_chips(self, params=None):
        """``params`` (default: the FP weights) replicated on the mesh, cached for the last dict given."""
        p = self.params if params is None else params
        held = self._replicated
        if held is None or held[0].keys() != p.keys() or any(held[0][k] is not v for k, v in p.items()):
            self._replicated = held = (dict(p), self.runner.replicate(p))  # keyed by the arrays (dicts get updated)
        return held[1]

    def forward(self, params=None, capture: bool = False):
        out = self.runner.concat(unit_forward, (self.on_chips(params),), (self.x, self.positions), spec=self.spec,
                                 capture=capture)
        return out

    def inputs(self, params=None) -> dict[str, np.ndarray]:
        """Captured Linear inputs; with ``params=None`` (the FP weights) computed once and cached, with the
        FP output (:meth:`fp_output`) from the same pass."""
        if params is None:
            if self._captures is None:
                self._fp_out, self._captures = self.forward(capture=True)
            return self._captures
        return self.forward(params, capture=True)[1]

    def fp_output(self) -> np.ndarray:
        """The FP layer's output (from the capture pass when it ran)."""
        if self._fp_out is None:
            self._fp_out = self.forward()
        return self._fp_out

    def inputs_only(self, names, params=None, given=None) -> dict[str, np.ndarray]:
        """The captured inputs ``names`` (``attn_in`` ...) only; the layer past them is not computed.
        ``given``: exact inputs already captured for these weights (``layer_fn.layer_run``)."""
        return self._run(params, tuple(sorted(set(names))), given)

    def forward_given(self, params, given) -> np.ndarray:
        """The layer's output, its Linears reading the exact inputs ``given`` (``layer_fn.layer_run``)."""
        return self._run(params, None, given)

    def _run(self, params, names, given):
        keys = tuple(sorted(given or {}))
        return self.runner.concat(unit_run, (self.on_chips(params),),
                                  (self.x, self.positions, *[given[k] for k in keys]), spec=self.spec, names=names,
                                  keys=keys)

    @property
    def prefix(self) -> str:
        return f"layers.{self.index}"


def linear_path(i: int, name: str, moe: bool = False) -> str:
    """``layers.3.attn.q_proj``; in a sparse layer (``moe``) the stacked experts ``layers.3.mlp.experts.gate_proj``."""
    return f"layers.{i}.{lf.module_path(name, moe)}"


def embed_tokens(source, tokens) -> np.ndarray:
    emb = as_source(source).embedding()
    return np.asarray(emb)[np.asarray(tokens)].astype(np.float32)


def check_tokens(tokens, vocab_size: int) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.size == 0:
        raise ValueError(f"calibration tokens must be a non-empty [n_blocks, T] array, got shape {tokens.shape}")
    if tokens.max() >= vocab_size:
        raise ValueError(f"calibration token id {int(tokens.max())} >= vocab_size {vocab_size}")
    return tokens


def run_layerwise(source, tokens, process_layer: Callable[[LayerContext], "LayerOut | dict"], *,
                  emit: Callable[[LayerOut], None] | None = None, propagate: str = "fp", batch_size: int = 8,
                  mesh=None, desc: str = "PTQ", progress: bool = True, timings: list | None = None) -> None:
    """Drive ``process_layer`` over every decoder layer of ``source`` (a model, or a
    :mod:`lrmq.ptq.source` source; see module doc). ``tokens``: int [n, T]; ``mesh``: the PTQ mesh
    (default: all local devices, :func:`lrmq.ptq.shard.ptq_mesh`).

    ``process_layer(ctx)`` returns the layer's :class:`LayerOut` (or a dict of its new float32 params). Each
    is handed to ``emit``; the default (a model source) writes the params back into the model in place.
    ``timings`` (a list) receives seconds per layer.
    """
    if propagate not in ("fp", "quantized"):
        raise ValueError(f"propagate must be 'fp' or 'quantized', got {propagate!r}")
    src = as_source(source)
    cfg = src.cfg
    tokens = check_tokens(tokens, cfg.vocab_size)
    emit = emit or src.write_back
    x = embed_tokens(src, tokens)
    pos = positions_for(*tokens.shape)
    runner = UnitRunner.for_blocks(mesh if mesh is not None else ptq_mesh(), tokens.shape[0], batch_size)
    from tqdm.auto import tqdm

    bar = tqdm(range(cfg.num_layers), desc=desc, unit="layer", disable=not progress)
    layers = src.layers()
    for i in bar:
        t0 = time.perf_counter()
        ctx = LayerContext(index=i, spec=layer_spec(cfg, i), params=next(layers), x=x, positions=pos, runner=runner,
                           cfg=cfg)
        out = process_layer(ctx)
        if not isinstance(out, LayerOut):
            out = LayerOut(index=i, params=dict(out), packed={})
        emit(out)
        if propagate == "fp":
            x = ctx.fp_output()
        else:
            x = ctx.output if ctx.output is not None else ctx.forward(out.params)
        del ctx, out
        if timings is not None:
            timings.append(time.perf_counter() - t0)
    layers.close()
