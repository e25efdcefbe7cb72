"""AWQ (mit-han-lab/llm-awq ``pre_quant.run_awq`` + ``pseudo_quantize_model_weight``), model level.

Per decoder layer (driven by :func:`lrmq.ptq.layerwise.run_layerwise`, inputs of layer i+1 = FP
outputs of layer i computed before scaling):

1. capture every Linear's input on the FP layer;
2. for each scale group (``prev_op -> linears``, inspected module) search
   ``s = clamp(stat^alpha, 1e-4)`` [``/ sqrt(max(s) min(s))``] over ``alpha = i / n_grid``,
   ``i = 0..n_grid-1``, scoring ``mean((f(X) - f_q(X))^2)`` where ``f_q`` has every Linear of the group
   replaced by ``Q(W diag(s)) diag(s)^-1``; all groups are searched on the unscaled layer (as llm-awq);
3. fold the chosen scales: ``prev_op /= s`` (RMSNorm scale, or output columns + bias of the previous
   Linear), ``W *= s`` (input rows), captured inputs ``/= s``;
4. auto-clip every Linear except q/k: per (group, output column) ``max_val = m0 (1 - i/n_grid)`` for
   ``i < max_shrink * n_grid``, error = mean over sampled tokens of ``(x_g . (w_g - Q(clip(w_g))))^2``;
5. quantize all seven Linears with the llm-awq quantizer (``lrmq.quant.quantizers``); the packed
   ``QuantizedWeight`` and the fake-quant float weight come from the same codes (bit-identical).

Scale groups: pre-norm families (Llama/Qwen) ``attn_norm -> q,k,v`` (inspect attention incl. o_proj,
RoPE, q/k norms, causal mask), ``v_proj -> o_proj`` (inspect o_proj; only when the v and o weights
have the same shape -- llm-awq skips it for GQA -- unless ``gqa_vo="downsample"``, QuantLRM's
variant), ``mlp_norm -> gate,up`` (inspect MLP), ``up_proj -> down_proj`` (inspect down_proj).
Olmo-3 (post-norm) has only the groups with a Linear before them: ``v_proj -> o_proj`` and
``up_proj -> down_proj`` (as llm-compressor and QuantLRM).

A mixture-of-experts layer (Qwen3-MoE; llmcompressor's ``_moe_default_mappings``): ``mlp_norm -> router, every
expert's gate/up`` is one scale (statistic over every token's ``mlp_in``, inspected part the sparse block; every
expert's slice fake-quantized alone; the router is not quantized, and at the fold its rows are multiplied by the
scale as llmcompressor's ``_smooth`` does, so routing is unchanged), and ``up_proj -> down_proj`` one scale per
expert (statistic and loss over the expert's tokens: every token or the routed ones, ``moe_calibration``; inspected
part the expert's down_proj); clipping and quantization per expert slice.

The per-channel statistic is a pluggable function: AWQ's is ``mean_tokens |x|``; QuantLRM passes its
fine-tuning importance (see :mod:`lrmq.ptq.quantlrm`) with ``normalize=False``.

Differences from the reference, all options: computation in float32 (llm-awq: fp16 model);
``symmetric=True`` uses lrmq's symmetric quantizer (llm-awq is asymmetric only); when there are fewer
than ``n_sample_token`` calibration tokens the clip search uses all of them (llm-awq's stride would be 0).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lrmq.ptq import layer_fn as lf
from lrmq.ptq import layerwise as lw
from lrmq.ptq.result import PTQResult
from lrmq.ptq.stream import LayerOut
from lrmq.ptq.rtn import quantize_experts, quantize_linear
from lrmq.ptq.shard import UnitRunner, ptq_mesh
from lrmq.quant.quantizers import exact_div, fake_quant, resolve_group_size


@dataclasses.dataclass(frozen=True)
class AWQOptions:
    bits: int = 4
    group_size: int = 128
    symmetric: bool = False  # llm-awq: asymmetric (zero point) only
    n_grid: int = 20  # alpha = i / n_grid, i = 0..n_grid-1
    normalize: bool = True  # s / sqrt(max(s) * min(s)) (AWQ); QuantLRM: False
    scale: bool = True  # False: no scale search (clip + quantize only)
    clip: bool = True
    max_shrink: float = 0.5
    n_sample_token: int = 512
    gqa_vo: str = "skip"  # skip (llm-awq) | downsample (QuantLRM) v->o scaling for GQA / shape mismatch
    oc_batch: int = 1024  # output columns per clip-search chunk (memory bound)
    propagate: str = "fp"  # fp (llm-awq) | quantized
    batch_size: int = 8  # calibration blocks per forward chunk
    moe_calibration: str = "all"  # all | routed: the tokens an expert's up -> down statistic and loss run over

    def __post_init__(self):
        if self.gqa_vo not in ("skip", "downsample"):
            raise ValueError(f"gqa_vo must be 'skip' or 'downsample', got {self.gqa_vo!r}")
        if self.n_grid < 1:
            raise ValueError(f"n_grid must be >= 1, got {self.n_grid}")
        if self.moe_calibration not in ("all", "routed"):
            raise ValueError(f"moe_calibration must be 'all' or 'routed', got {self.moe_calibration!r}")


@dataclasses.dataclass(frozen=True)
class ScaleGroup:
    name: str  # attn_in | attn_out | mlp_in | mlp_out
    prev: str  # attn_norm | v_proj | mlp_norm | up_proj
    linears: tuple[str, ...]
    inp: str  # capture key of the linears' input
    inspect: str  # attn | o_proj | mlp | down_proj
    source: str  # the Linear whose QuantLRM importance feeds this group


ATTN_IN = ScaleGroup("attn_in", "attn_norm", ("q_proj", "k_proj", "v_proj"), "attn_in", "attn", "q_proj")
ATTN_OUT = ScaleGroup("attn_out", "v_proj", ("o_proj",), "o_in", "o_proj", "o_proj")
MLP_IN = ScaleGroup("mlp_in", "mlp_norm", ("gate_proj", "up_proj"), "mlp_in", "mlp", "gate_proj")
MLP_OUT = ScaleGroup("mlp_out", "up_proj", ("down_proj",), "down_in", "down_proj", "down_proj")


def scale_groups(spec: lf.LayerSpec) -> list[ScaleGroup]:
    if spec.post_norm:
        return [ATTN_OUT, MLP_OUT]
    return [ATTN_IN, ATTN_OUT, MLP_IN, MLP_OUT]


# ----------------------------------------------------------------------------- statistics

StatFn = Callable[[lw.LayerContext, ScaleGroup, jax.Array], "np.ndarray | None"]


def unit_abs_sum(x):
    """One unit's per-input-channel sum over tokens of |x|."""
    return jnp.sum(jnp.abs(x.reshape(-1, x.shape[-1])), axis=0)


def activation_stat(ctx: lw.LayerContext, group: ScaleGroup, x) -> np.ndarray:
    """llm-awq ``get_act_scale``: per input channel mean over tokens of |x| (unit sums added in unit order)."""
    tokens = int(np.prod(np.shape(x)[:-1]))
    return ctx.runner.sum(unit_abs_sum, (), (x,)) / np.float32(tokens)


# ----------------------------------------------------------------------------- scale search


def _inspect(kind: str, p, spec, x, pos):
    return lf.part_forward(p, spec, kind, x, pos)


@partial(jax.jit, static_argnames=("bits", "group_size", "symmetric"))
def scaled_fake_quant(w, s, bits, group_size, symmetric):
    """``Q(W diag(s)) diag(s)^-1`` on an lrmq ``[K, N]`` weight (s scales the K input rows)."""
    if w.ndim == 3:  # stacked experts [E, K, N]: each expert's slice quantized alone
        return jax.vmap(lambda we: scaled_fake_quant(we, s, bits, group_size, symmetric))(w)
    ws = w * s[:, None]
    q = fake_quant(ws, bits, group_size, symmetric)
    return exact_div(q, s[:, None])


@partial(jax.jit, static_argnames=("normalize",))
def grid_scales(stat, ratio, normalize):
    s = jnp.maximum(jnp.power(stat.astype(jnp.float32), ratio), 1e-4)
    if normalize:
        s = exact_div(s, jnp.sqrt(jnp.max(s) * jnp.min(s)))  # a true division, as torch (not * 1/x)
    return s


def unit_grid_losses(p0, stat, x, pos, *, group, spec, n_grid, normalize, bits, group_size, symmetric):
    """One unit's ``sum((f(X) - f_q(X))^2)`` for every alpha = i / n_grid: [n_grid] (one compiled program per group
    kind; the fake-quant weights of one alpha at a time)."""
    ys = _inspect(group.inspect, p0, spec, x, pos)

    def one(ratio):
        s = grid_scales(stat, ratio, normalize)
        p = dict(p0)
        for fc in group.linears:
            p[fc] = scaled_fake_quant(p0[fc], s, bits, group_size, symmetric)
        d = _inspect(group.inspect, p, spec, x, pos) - ys
        return jnp.sum(d * d)

    # llm-awq: ratio = i * 1 / n_grid as a python float, used as a float32 exponent
    ratios = np.asarray([i * 1 / n_grid for i in range(n_grid)], np.float32)
    return jax.lax.map(one, jnp.asarray(ratios))


def grid_losses(ctx: lw.LayerContext, group: ScaleGroup, x, stat, opts: "AWQOptions", params=None) -> np.ndarray:
    """Loss ``mean((f(X) - f_q(X))^2)`` per alpha: unit sums added in unit order, over the output size."""
    p = ctx.on_chips(params)
    tot = ctx.runner.sum(unit_grid_losses, (p, ctx.runner.replicate(np.asarray(stat, np.float32))),
                         (x, ctx.positions), group=group, spec=ctx.spec, n_grid=opts.n_grid, normalize=opts.normalize,
                         bits=opts.bits, group_size=opts.group_size, symmetric=opts.symmetric)
    return tot / np.float32(_inspect_size(ctx, x))


def _inspect_size(ctx: lw.LayerContext, x) -> int:
    """Elements of the inspected part's output over all blocks: every part (attn, o_proj, mlp, down_proj)
    writes the residual stream, [n, T, hidden]."""
    n, t = np.shape(x)[:2]
    return int(n) * int(t) * int(ctx.cfg.hidden_size)


def search_scale(ctx: lw.LayerContext, group: ScaleGroup, x, stat, opts: AWQOptions):
    """Grid search of one group's scales; returns (best_scales [K], best_ratio, loss history)."""
    stat = np.asarray(stat, np.float32)
    losses = grid_losses(ctx, group, x, stat, opts)
    history = [float(v) for v in losses]
    finite = np.isfinite(losses)
    if not finite.any():
        raise FloatingPointError(f"layer {ctx.index} group {group.name}: no finite loss (losses {history})")
    best_i = int(np.argmin(np.where(finite, losses, np.inf)))  # first minimum, as llm-awq's strict '<'
    ratio = best_i * 1 / opts.n_grid
    s = grid_scales(jnp.asarray(stat), jnp.float32(ratio), opts.normalize)
    if not np.all(np.isfinite(np.asarray(s))):
        raise FloatingPointError(f"layer {ctx.index} group {group.name}: non-finite scales at alpha={ratio}")
    return s, ratio, history


def _vo_shapes_match(p) -> bool:
    return tuple(p["v_proj"].shape) == tuple(p["o_proj"].shape)


def downsample_vo(s, spec: lf.LayerSpec):
    """QuantLRM GQA: o-input scales [H*D] -> v-output scales [KVH*D] (mean over the query heads
    sharing each kv head). HF GQA maps query head h to kv head h // (H / KVH)."""
    g = spec.num_heads // spec.num_kv_heads
    return s.reshape(spec.num_kv_heads, g, spec.head_dim).mean(axis=1).reshape(-1)


def upsample_vo(s_v, spec: lf.LayerSpec):
    g = spec.num_heads // spec.num_kv_heads
    return jnp.repeat(s_v.reshape(spec.num_kv_heads, 1, spec.head_dim), g, axis=1).reshape(-1)


def fold_scale(p: dict, s_prev, s_fc, group: ScaleGroup) -> dict:
    """Fold into a layer's params: prev_op /= s_prev (norm scale, or output columns + bias of a Linear);
    W *= s_fc (rows). Returns a new dict (the rollout copy folds fixed scales with it: lrmq.rl.rollout_copy).
    A sparse layer's ``mlp_in`` group also scales the router's rows (llmcompressor's Qwen3-MoE mapping lists
    ``mlp.gate`` among the balance layers: it reads the scaled norm's output, so its kernel is multiplied by s
    and the routing is unchanged; it is never quantized); its stacked experts [E, K, N] scale every expert's rows."""
    p = dict(p)
    if group.name == "mlp_in" and "router" in p:
        p["router"] = p["router"] * s_fc[:, None]
    if group.prev in lf.LINEARS:
        p[group.prev] = exact_div(p[group.prev], s_prev[None, :])
        if group.prev + ".bias" in p:
            p[group.prev + ".bias"] = exact_div(p[group.prev + ".bias"], s_prev)
    else:
        p[group.prev] = exact_div(p[group.prev], s_prev)
    for fc in group.linears:
        p[fc] = p[fc] * s_fc[:, None]
    return p


@partial(jax.jit, static_argnames=("group",))
def apply_scale(p: dict, caps: dict, s_prev, s_fc, group: ScaleGroup):
    """`fold_scale`, and the group's captured input /= s_fc. Returns new (params, captures) dicts."""
    caps = dict(caps)
    caps[group.inp] = exact_div(caps[group.inp], s_fc)
    return fold_scale(p, s_prev, s_fc, group), caps


# ----------------------------------------------------------------------------- clipping


def clip_search(w, x, bits, group_size, symmetric, n_grid, n_shrink):
    """llm-awq ``auto_clip_layer`` on w [K, N] (groups along K) with sampled inputs x [t, K]:
    best max_val per (group, column), [K/g, N]. Columns are independent: the search runs on equal column
    chunks, one per chip."""
    K, N = w.shape
    G = K // group_size
    wg = w.reshape(G, group_size, N)
    xg = x.reshape(x.shape[0], G, group_size)
    org_out = jnp.einsum("tGg,Ggn->tGn", xg, wg, preferred_element_type=jnp.float32)
    org_max = jnp.max(jnp.abs(wg), axis=1)  # [G, N]
    factors = jnp.asarray(np.asarray([1 - i_s / n_grid for i_s in range(n_shrink)], np.float32))

    def body(carry, f):
        best, min_err = carry
        max_val = org_max * f
        cur = jnp.clip(wg, -max_val[:, None, :], max_val[:, None, :])
        q = fake_quant(cur.reshape(K, N), bits, group_size, symmetric).reshape(G, group_size, N)
        out = jnp.einsum("tGg,Ggn->tGn", xg, q, preferred_element_type=jnp.float32)
        err = jnp.mean((out - org_out) ** 2, axis=0)
        better = err < min_err
        return (jnp.where(better, max_val, best), jnp.where(better, err, min_err)), None

    init = (org_max, jnp.full(org_max.shape, 1e9, jnp.float32))
    (best, _), _ = jax.lax.scan(body, init, factors)
    return best


_clip_search = jax.jit(clip_search, static_argnames=("bits", "group_size", "symmetric", "n_grid", "n_shrink"))


def sample_tokens(x, n_sample_token: int):
    """llm-awq: flatten to [tokens, K] and keep every (tokens // n_sample_token)-th token."""
    x = x.reshape(-1, x.shape[-1])
    step = x.shape[0] // n_sample_token
    return x[::max(step, 1)]


def column_chunks(w: np.ndarray, width: int) -> np.ndarray:
    """[K, N] -> [C, K, width] equal column chunks, the last one padded with zero columns."""
    K, N = w.shape
    c = -(-N // width)
    padded = np.zeros((K, c * width), np.float32)
    padded[:, :N] = w
    return np.ascontiguousarray(padded.reshape(K, c, width).transpose(1, 0, 2))


def auto_clip(w, x, opts: AWQOptions, runner=None):
    """Best clipping max_val [K/g, N] of w [K, N] for its captured input x (host arrays). ``runner``: the
    layer's :class:`lrmq.ptq.shard.UnitRunner` (column chunks over its chips); None: one device."""
    w = np.asarray(w, np.float32)
    xs = np.ascontiguousarray(sample_tokens(np.asarray(x), opts.n_sample_token), np.float32)
    N = w.shape[1]
    width = min(opts.oc_batch, N)
    runner = runner or UnitRunner(ptq_mesh(1), 1, 1)
    parts = runner.map_items(_clip_chunk, (runner.replicate(xs),), (column_chunks(w, width),), bits=opts.bits,
                             group_size=opts.group_size, symmetric=opts.symmetric, n_grid=opts.n_grid,
                             n_shrink=int(opts.max_shrink * opts.n_grid))
    return np.concatenate(list(parts), axis=1)[:, :N]


def _clip_chunk(xs, w, **kw):
    return clip_search(w, xs, **kw)


def apply_clip(w, max_val, group_size):
    K, N = w.shape
    wg = np.asarray(w).reshape(K // group_size, group_size, N)
    return np.clip(wg, -max_val[:, None, :], max_val[:, None, :]).reshape(K, N)


CLIP_SKIP = ("q_", "k_", "query", "key", "Wqkv")


# ----------------------------------------------------------------------------- experts (up_proj -> down_proj)


def _expert_kw(ctx: lw.LayerContext, opts: AWQOptions) -> dict:
    cfg = ctx.cfg
    return dict(top_k=cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob, calibration=opts.moe_calibration)


def unit_expert_abs_sum(router, gate, up, x, *, top_k, normalize, calibration):
    """One unit's per-expert sum of |h_e| over the expert's tokens [E, F] and their count [E]
    (``h_e = silu(x W_gate[e]) * (x W_up[e])``, the expert's down_proj input; tokens: ``expert_token_mask``)."""
    m = lf.expert_token_mask(x, router, top_k, normalize, calibration)
    h = lf.expert_hidden(x, gate, up)
    return jnp.einsum("em,emf->ef", m, jnp.abs(h)), jnp.sum(m, axis=1)


def expert_activation_stat(ctx: lw.LayerContext, p: dict, mlp_in, opts: AWQOptions):
    """AWQ's statistic per expert: mean over the expert's tokens of |h_e| [E, F] (0 for an expert with none),
    and the token counts [E]."""
    rep = ctx.runner.replicate(tuple(np.asarray(p[k], np.float32) for k in ("router", "gate_proj", "up_proj")))
    tot, count = ctx.runner.sum(unit_expert_abs_sum, rep, (mlp_in,), **_expert_kw(ctx, opts))
    return tot / np.maximum(count, np.float32(1))[:, None], count


def unit_expert_grid_losses(router, gate, up, down, stat, x, *, top_k, normalize, calibration, n_grid, norm, bits,
                            group_size, symmetric):
    """One unit's [n_grid, E] ``sum over the expert's tokens of |h_e W_down[e] - h_e Q(W_down[e] s_e) / s_e|^2``
    for every alpha (llm-awq's up_proj -> down_proj group, whose inspected part is down_proj alone, per expert)."""
    m = lf.expert_token_mask(x, router, top_k, normalize, calibration)
    h = lf.expert_hidden(x, gate, up)  # [E, M, F]
    ys = jnp.einsum("emf,efd->emd", h, down)

    def one(ratio):
        s = jax.vmap(lambda st: grid_scales(st, ratio, norm))(stat)  # [E, F]
        q = jax.vmap(lambda w, se: scaled_fake_quant(w, se, bits, group_size, symmetric))(down, s)
        d = jnp.einsum("emf,efd->emd", h, q) - ys
        return jnp.einsum("em,emd->e", m, d * d)

    ratios = np.asarray([i * 1 / n_grid for i in range(n_grid)], np.float32)
    return jax.lax.map(one, jnp.asarray(ratios))


def search_expert_scales(ctx: lw.LayerContext, p: dict, mlp_in, stat, count, opts: AWQOptions):
    """Each expert's up_proj -> down_proj scales [E, F] (the first minimum over alpha per expert), its ratios and
    [n_grid, E] losses (mean over the expert's tokens and the output size). An expert with no token (routed) has
    zero loss everywhere: alpha 0, its RTN."""
    weights = tuple(np.asarray(p[k], np.float32) for k in ("router", "gate_proj", "up_proj", "down_proj"))
    rep = ctx.runner.replicate(weights + (np.asarray(stat, np.float32),))
    g = resolve_group_size(np.shape(p["down_proj"])[1:], opts.group_size)
    tot = ctx.runner.sum(unit_expert_grid_losses, rep, (mlp_in,), **_expert_kw(ctx, opts), n_grid=opts.n_grid,
                         norm=opts.normalize, bits=opts.bits, group_size=g, symmetric=opts.symmetric)
    losses = tot / (np.maximum(count, np.float32(1)) * np.float32(ctx.cfg.hidden_size))[None, :]
    if not np.all(np.isfinite(losses).any(axis=0)):
        raise FloatingPointError(f"layer {ctx.index} group mlp_out: an expert has no finite loss")
    best = np.argmin(np.where(np.isfinite(losses), losses, np.inf), axis=0)
    ratios = np.asarray([i * 1 / opts.n_grid for i in best], np.float32)
    s = np.stack([np.asarray(grid_scales(jnp.asarray(st), jnp.float32(r), opts.normalize))
                  for st, r in zip(np.asarray(stat, np.float32), ratios)])
    if not np.all(np.isfinite(s)):
        raise FloatingPointError(f"layer {ctx.index} group mlp_out: non-finite expert scales")
    return s, ratios, losses


def fold_expert_scales(p: dict, s) -> dict:
    """Fold per-expert up -> down scales s [E, F]: every expert's up_proj output columns /= s_e, its down_proj
    rows *= s_e (its function unchanged: silu(x W_gate) * (x W_up / s) then (W_down * s))."""
    p = dict(p)
    s = jnp.asarray(s, jnp.float32)
    p["up_proj"] = exact_div(jnp.asarray(p["up_proj"]), s[:, None, :])
    p["down_proj"] = jnp.asarray(p["down_proj"]) * s[:, :, None]
    return p


def expert_clip_inputs(ctx: lw.LayerContext, p: dict, mlp_in, opts: AWQOptions):
    """The sampled clip-search inputs of each expert: (gate/up input [E] list of [t_e, D], down input [E] list of
    [t_e, F]) from the (scaled) ``mlp_in`` and the folded weights; with ``all`` every expert's tokens are the
    same sample (llm-awq's stride over all tokens), with ``routed`` a sample of the tokens routed to it."""
    x = np.asarray(mlp_in, np.float32).reshape(-1, mlp_in.shape[-1])
    cfg = ctx.cfg
    if opts.moe_calibration == "all":
        xs = [sample_tokens(x, opts.n_sample_token)] * cfg.num_experts
    else:
        m = np.asarray(lf.expert_token_mask(x, p["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob, "routed"))
        xs = [sample_tokens(x[m[e] > 0], opts.n_sample_token) for e in range(cfg.num_experts)]
    hs = [np.asarray(lf.expert_hidden(xe, p["gate_proj"][e:e + 1], p["up_proj"][e:e + 1]))[0] if len(xe) else
          np.zeros((0, p["down_proj"].shape[1]), np.float32) for e, xe in enumerate(xs)]
    return xs, hs


# ----------------------------------------------------------------------------- per layer


_fold = jax.jit(fold_scale, static_argnames=("group",))


def awq_layer(ctx: lw.LayerContext, opts: AWQOptions, stat_fn: StatFn = activation_stat,
              result: PTQResult | None = None) -> LayerOut:
    """Scale search + fold + clip + quantize for one layer; returns its :class:`LayerOut` (new float32 params and
    the packed weights); the searched scales and losses go to ``result``."""
    p = dict(ctx.params)
    caps = dict(ctx.inputs())
    moe = lf.is_moe_params(p)  # sparse layer: one norm -> router + experts' gate/up scale, up -> down per expert
    layer_info = {"groups": {}}
    searched = []
    expert_s = None
    if opts.scale:
        if moe and not ctx.spec.post_norm:
            # the FP statistic and losses, on the unscaled layer as every other group
            stat, count = expert_activation_stat(ctx, p, caps["mlp_in"], opts)
            if stat_fn is not activation_stat:  # QuantLRM: the experts' own down_proj importance [E, F]
                stat = stat_fn(ctx, MLP_OUT, None)
            if stat is None:
                layer_info["groups"]["mlp_out"] = "skipped (no statistic)"
            else:
                expert_s, ratios, losses = search_expert_scales(ctx, p, caps["mlp_in"], stat, count, opts)
                layer_info["groups"]["mlp_out"] = {"ratio": [float(r) for r in ratios],
                                                   "loss": [float(v) for v in losses.min(axis=0)],
                                                   "loss_rtn": [float(v) for v in losses[0]],
                                                   "tokens": [float(c) for c in count]}
        for group in scale_groups(ctx.spec):
            if moe and group.name == "mlp_out":
                continue  # per expert, above
            downsample = False
            if group.name == "attn_out" and not _vo_shapes_match(p):
                if opts.gqa_vo == "skip":
                    layer_info["groups"][group.name] = "skipped (v/o shapes differ)"
                    continue
                downsample = True
            x = caps[group.inp]
            stat = stat_fn(ctx, group, x)
            if stat is None:
                layer_info["groups"][group.name] = "skipped (no statistic)"
                continue
            s, ratio, hist = search_scale(ctx, group, x, stat, opts)
            layer_info["groups"][group.name] = {"ratio": ratio, "loss": min(hist), "loss_rtn": hist[0]}
            searched.append((group, s, downsample))
        for group, s, downsample in searched:  # all searched on the unscaled layer, then applied
            if downsample:
                s_prev = downsample_vo(s, ctx.spec)
                s_fc = upsample_vo(s_prev, ctx.spec)
            else:
                s_prev = s_fc = s
            p = {k: np.asarray(v) for k, v in _fold(p, s_prev, s_fc, group).items()}
            # IEEE division on the host, in place: the FP captures are not read again (no second copy held)
            np.divide(caps[group.inp], np.asarray(s_fc, np.float32), out=caps[group.inp])
            if result is not None:
                result.scales.setdefault(ctx.index, {})[group.name] = (np.asarray(s_prev), np.asarray(s_fc))
        if expert_s is not None:
            p = {k: np.asarray(v) for k, v in fold_expert_scales(p, expert_s).items()}
            if result is not None:
                result.scales.setdefault(ctx.index, {})["mlp_out"] = (expert_s, expert_s)
    if opts.clip:
        expert_in = expert_clip_inputs(ctx, p, caps["mlp_in"], opts) if moe else None
        for name in lf.LINEARS:
            if any(t in name for t in CLIP_SKIP):
                continue
            g = resolve_group_size(np.shape(p[name])[-2:], opts.group_size)
            o = dataclasses.replace(opts, group_size=g)
            if moe and name in lf.EXPERT_PROJS:  # each expert's slice on its own tokens' inputs
                ins = expert_in[1] if name == "down_proj" else expert_in[0]
                p[name] = np.stack([apply_clip(w, auto_clip(w, xe, o, ctx.runner), g) if len(xe) else np.asarray(w)
                                    for w, xe in zip(p[name], ins)])
                continue
            mv = auto_clip(p[name], caps[lf.INPUT_OF[name]], o, ctx.runner)
            p[name] = apply_clip(p[name], mv, g)
    packed = {}
    for name in lf.LINEARS:
        quantize = quantize_experts if np.ndim(p[name]) == 3 else quantize_linear
        fq, packed[name] = quantize(p[name], opts.bits, opts.group_size, opts.symmetric)
        p[name] = np.asarray(fq)
    if result is not None:
        result.info.setdefault("layers", {})[ctx.index] = layer_info
    return LayerOut(index=ctx.index, params=p, packed=packed)


def awq_quantize_model(source, tokens, opts: AWQOptions = AWQOptions(), *, stat_fn: StatFn = activation_stat,
                       method: str = "awq", progress: bool = True, emit=None, mesh=None) -> PTQResult:
    """Run AWQ (or QuantLRM with its ``stat_fn``) over ``source`` (a model, quantized in place, or a
    :mod:`lrmq.ptq.source` source whose layers go to ``emit``); ``tokens`` int [n_blocks, T]; ``mesh``: the PTQ
    mesh (default: all local devices)."""
    result = PTQResult(method=method, packed={}, bits=opts.bits, group_size=opts.group_size,
                       symmetric=opts.symmetric)
    timings: list[float] = []
    lw.run_layerwise(source, tokens, lambda ctx: awq_layer(ctx, opts, stat_fn, result), emit=result.collector(source, emit),
                     propagate=opts.propagate, batch_size=opts.batch_size, mesh=mesh, desc=method.upper(),
                     progress=progress, timings=timings)
    result.info["seconds_per_layer"] = timings
    return result
