"""GPTQ over a whole model (IST-DASLab ``llama.py::llama_sequential`` structure).

Per decoder layer, with ``true_sequential`` (the reference ``--true-sequential``) the Linears are
quantized in four stages, re-running the layer on its inputs before each stage so every stage's
Hessians see the already-quantized earlier stages::

    [k_proj, v_proj, q_proj] -> [o_proj] -> [up_proj, gate_proj] -> [down_proj]

without it, all seven Hessians come from one forward of the FP layer. Each stage's forward computes
only what its inputs need (XLA drops the rest: the ``o_proj`` stage runs the attention, not the MLP)
and gets back the captures of earlier stages that are still exact (``layer_fn.UPSTREAM`` unchanged), so
the gate/up stage starts from ``o_in``, the down stage from ``mlp_in``, and the propagated output is
computed from ``o_in`` and ``down_in`` (bit-identical to full forwards); Linears that read one input
share its Hessian and ``Hinv``. For each Linear
``H = 2/n_seq * sum_tokens x x^T`` (the reference's running average ends at exactly this; its scale
does not change the result) and :func:`lrmq.ptq.gptq.gptq_quantize` quantizes the ``[K, N]`` weight
(blocksize 128, percdamp 0.01, group 128, optional act-order / static groups).

Propagation: the reference feeds layer i+1 with the outputs of the *quantized* layer i
(``propagate="quantized"``, default); ``propagate="fp"`` uses the FP outputs instead.

Mixture-of-experts layers (Qwen3-MoE): the router is never quantized; each expert's gate/up/down is GPTQ'd
on its own [K, N] slice with its own Hessian, the result one stacked-experts ``QuantizedWeight`` (E, K, N).
``moe_calibration="all"`` (default, llmcompressor's ``moe_calibrate_all_experts``): every calibration token
goes through every expert for the statistics -- gate/up of every expert share the Hessian of ``mlp_in`` over
all tokens, expert e's down_proj gets ``X_e^T X_e`` of ``silu(x W_gate[e]) * (x W_up[e])`` over all tokens --
while the layer's output (propagation) uses only the routed experts, as inference does. ``"routed"``: each
expert's statistics over the tokens its router sends it (an expert routed no token then has dead inputs
everywhere: GPTQ's dead-input rule zeroes it, so "all" is the default).

Packed weights: GPTQ's grids (min/max including 0) are representable as ``QuantizedWeight`` (unsigned
zero in [0, 2^b-1]); the codes reproduce GPTQ's fake-quant weights exactly. With ``act_order`` and
without ``static_groups`` a group is not a run of consecutive input rows (non-monotone ``g_idx``):
such a result is kept as fake-quant weights plus ``g_idx``; packed lrmq/AutoAWQ exports refuse it
(use ``static_groups=True``, as GPTQ's own fast kernels require too).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lrmq.ptq import layer_fn as lf
from lrmq.ptq import layerwise as lw
from lrmq.ptq.layer_fn import INPUT_OF, UPSTREAM
from lrmq.ptq.result import PTQResult
from lrmq.ptq.shard import UnitRunner, ptq_mesh
from lrmq.ptq.stream import LayerOut
from lrmq.ptq.gptq import gptq_codes, gptq_quantize, prepare_hessian
from lrmq.quant import packing
from lrmq.quant.qweight import QuantizedWeight, stack_experts

TRUE_SEQUENTIAL = (("k_proj", "v_proj", "q_proj"), ("o_proj",), ("up_proj", "gate_proj"), ("down_proj",))


@dataclasses.dataclass(frozen=True)
class GPTQOptions:
    bits: int = 4
    group_size: int = 128  # -1: per output channel
    symmetric: bool = False
    block_size: int = 128
    percdamp: float = 0.01
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = True
    propagate: str = "quantized"  # quantized (reference) | fp
    batch_size: int = 8
    moe_calibration: str = "all"  # all | routed: the tokens an expert's Hessian sums over (module doc)


def unit_xtx(x):
    """One unit's ``X^T X`` over its tokens: [K, K] float32."""
    x = x.reshape(-1, x.shape[-1])
    return jnp.einsum("tk,tl->kl", x, x, preferred_element_type=jnp.float32)


def hessian(x, runner: UnitRunner | None = None) -> np.ndarray:
    """``2/n_seq * X^T X`` over all tokens of x [n_seq, T, K] (the reference's H after n_seq batches): unit
    products summed in unit order on the host (:mod:`lrmq.ptq.shard`); ``runner`` None: one device, one unit."""
    x = np.asarray(x, np.float32)
    runner = runner or UnitRunner(ptq_mesh(1), x.shape[0], x.shape[0])
    return runner.sum(unit_xtx, (), (x,)) * np.float32(2.0 / x.shape[0])


def unit_expert_mlp_in_xtx(router, x, *, top_k, normalize, calibration):
    """One unit's per-expert gate/up input ``X^T X`` [E, D, D] (``layer_fn.expert_mlp_in_xtx``)."""
    return lf.expert_mlp_in_xtx(x, router, top_k=top_k, normalize=normalize, calibration=calibration)


def unit_expert_down_xtx(router, gate, up, x, *, top_k, normalize, calibration):
    """One unit's per-expert down_proj input ``X^T X`` [E, F, F] (``layer_fn.expert_down_xtx``)."""
    return lf.expert_down_xtx(x, router, gate, up, top_k=top_k, normalize=normalize, calibration=calibration)


def expert_hessians(name: str, mlp_in, p, ctx: lw.LayerContext, calibration: str) -> list:
    """The E Hessians (``2/n_seq X^T X``, as :func:`hessian`) of the stacked expert projection ``name`` of a sparse
    layer, from its ``mlp_in`` [n, T, D] and the current weights ``p`` (down_proj reads gate/up); with
    ``calibration`` "all" every expert's gate/up Hessian is the one of ``mlp_in`` itself."""
    cfg = ctx.cfg
    kw = dict(top_k=cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob, calibration=calibration)
    scale = np.float32(2.0 / mlp_in.shape[0])
    router = np.asarray(p["router"], np.float32)
    if name != "down_proj":
        if calibration == "all":
            return [hessian(mlp_in, ctx.runner)] * cfg.num_experts
        return list(ctx.runner.sum(unit_expert_mlp_in_xtx, ctx.runner.replicate((router,)), (mlp_in,), **kw) * scale)
    rep = ctx.runner.replicate((router, np.asarray(p["gate_proj"], np.float32), np.asarray(p["up_proj"], np.float32)))
    return list(ctx.runner.sum(unit_expert_down_xtx, rep, (mlp_in,), **kw) * scale)


def _packed_from_result(res, bits: int, group_size: int, symmetric: bool) -> QuantizedWeight | None:
    K, N = res.w_q.shape
    natural = np.array_equal(res.g_idx, np.arange(K) // (K // res.scales.shape[0]))
    if not natural:
        return None
    codes = gptq_codes(res, bits)
    return QuantizedWeight(codes=jnp.asarray(packing.pack(codes, bits)), scales=jnp.asarray(res.scales, jnp.float32),
                           zeros=jnp.asarray(res.zeros), fmt="int", bits=bits, group_size=K // res.scales.shape[0],
                           shape=(K, N), dtype="float32", symmetric=bool(symmetric), double_quant=False)


def _gptq_one(w, h, opts: GPTQOptions):
    """GPTQ of one [K, N] weight: (fake-quant float32 weight, packed weight or None, g_idx)."""
    res = gptq_quantize(np.asarray(w), h, bits=opts.bits, group_size=None if opts.group_size == -1 else opts.group_size,
                        symmetric=opts.symmetric, block_size=opts.block_size, percdamp=opts.percdamp,
                        act_order=opts.act_order, static_groups=opts.static_groups)
    return np.asarray(res.w_q, np.float32), _packed_from_result(res, opts.bits, opts.group_size, opts.symmetric), \
        res.g_idx


def gptq_layer(ctx: lw.LayerContext, opts: GPTQOptions, result: PTQResult) -> LayerOut:
    p = dict(ctx.params)
    moe = lf.is_moe_params(p)  # a sparse layer: router (kept float) + stacked experts (per expert, module doc)
    stages = TRUE_SEQUENTIAL if opts.true_sequential else (tuple(n for s in TRUE_SEQUENTIAL for n in s),)
    info = {}
    packed, g_idx = {}, {}
    # captured inputs still exact for the current weights (none of their UPSTREAM Linears changed since),
    # handed back to later forwards so they skip the work before them (attn_in is left out: a norm)
    exact: dict[str, np.ndarray] = {}
    for stage in stages:
        # only the inputs this stage reads (the layer past them is not computed); one Hessian and one
        # Hinv per input (q/k/v share attn_in, gate/up share mlp_in). A sparse layer's expert statistics are
        # computed from mlp_in (an expert's down_proj input depends on the expert)
        need = {INPUT_OF[name] for name in stage}
        if moe:
            need = {"mlp_in" if inp in ("mlp_in", "down_in") else inp for inp in need}
        caps = ctx.inputs_only(need, p, given={k: v for k, v in exact.items() if k not in need})
        prep = lambda h: prepare_hessian(h, percdamp=opts.percdamp, act_order=opts.act_order)  # noqa: E731
        # a sparse layer's mlp_in Hessian is every expert's gate/up Hessian with "all" (one Hinv for all of them);
        # with "routed" each expert's is its own, and down_proj's always is (expert_hessians)
        shared = moe and opts.moe_calibration == "all" and bool({"gate_proj", "up_proj"} & set(stage))
        h_of = {inp: prep(hessian(x, ctx.runner)) for inp, x in caps.items()
                if not (moe and inp == "mlp_in") or shared}
        hs = {}
        for name in stage:
            if moe and name in lf.EXPERT_PROJS:
                hs[name] = ([h_of["mlp_in"]] * ctx.cfg.num_experts if shared and name != "down_proj" else
                            [prep(h) for h in expert_hessians(name, caps["mlp_in"], p, ctx, opts.moe_calibration)])
            else:
                hs[name] = h_of[INPUT_OF[name]]
        exact.update((k, v) for k, v in caps.items() if k != "attn_in")
        exact = {k: v for k, v in exact.items() if not set(stage) & set(UPSTREAM[k])}
        del caps, h_of
        for name in stage:
            if isinstance(hs[name], list):  # stacked experts: one GPTQ per expert slice, stacked back
                outs = [_gptq_one(w, h, opts) for w, h in zip(p[name], hs[name])]
                p[name] = np.stack([o[0] for o in outs])
                qw = stack_experts([o[1] for o in outs]) if all(o[1] is not None for o in outs) else None
                gi = None if qw is not None else np.stack([o[2] for o in outs])
            else:
                p[name], qw, gi = _gptq_one(p[name], hs[name], opts)
            if qw is not None:
                packed[name] = qw
            else:
                g_idx[name] = gi
            info[name] = "packed" if qw is not None else "act-order g_idx (fake-quant only)"
    result.info.setdefault("layers", {})[ctx.index] = info
    if opts.propagate == "quantized":  # the next layer's input, from the exact inputs kept
        ctx.output = ctx.forward_given(p, exact)
    return LayerOut(index=ctx.index, params=p, packed=packed, g_idx=g_idx)


def gptq_quantize_model(source, tokens, opts: GPTQOptions = GPTQOptions(), *, progress: bool = True, emit=None,
                        mesh=None) -> PTQResult:
    """GPTQ the seven projections of every layer of ``source`` (a model, in place, or a :mod:`lrmq.ptq.source`
    source whose layers go to ``emit``); ``tokens`` int [n_seq, T]; ``mesh``: the PTQ mesh (default: all local
    devices)."""
    result = PTQResult(method="gptq", packed={}, bits=opts.bits, group_size=opts.group_size,
                       symmetric=opts.symmetric, actorder="static" if opts.act_order and opts.static_groups else None)
    timings: list[float] = []
    lw.run_layerwise(source, tokens, lambda ctx: gptq_layer(ctx, opts, result), emit=result.collector(source, emit),
                     propagate=opts.propagate, batch_size=opts.batch_size, mesh=mesh, desc="GPTQ", progress=progress,
                     timings=timings)
    result.info["seconds_per_layer"] = timings
    return result
