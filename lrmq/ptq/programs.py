"""Every program a layer-by-layer PTQ run compiles, at a model's real shapes, for ahead-of-time compiling.

:func:`layer_programs` lists, for one decoder layer of each distinct layer type, the programs the driver
(:mod:`lrmq.ptq.layerwise`) and the method (AWQ / QuantLRM / GPTQ) run on the PTQ mesh: the very functions
and shardings of a real run (:func:`lrmq.ptq.shard.unit_program`), with abstract arguments
(``jax.ShapeDtypeStruct`` placed on ``mesh``). ``prog.fn.lower(*prog.args).compile()`` compiles one for the
mesh's devices (a TPU topology through libtpu, a GPU one through the CUDA plugin: ``lrmq.quantize
--compile-only``), and ``calls`` says how many times a layer runs it (for time estimates).

A mixture-of-experts model's sparse layers (:func:`layer_kinds`: one set per layer type and sparse / dense kind) list
the per-expert programs their method runs: GPTQ's stage forwards through the router and grouped expert forward, and
each chip's [E, F, F] expert down_proj Hessians (``gptq_model.unit_expert_down_xtx``); AWQ / QuantLRM's per-expert
up -> down statistic and grid losses (``awq.unit_expert_abs_sum`` / ``unit_expert_grid_losses``), and the clip search
and quantizer once per expert slice.

:func:`host_bytes` is what the host holds during the run (the driver's accounting: activations stay on the
host, one layer's weights plus the prefetched next one).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lrmq.model.config import ModelConfig
from lrmq.model.decoder import DecoderLayer
from lrmq.ptq import layer_fn as lf
from lrmq.ptq import layerwise as lw
from lrmq.ptq.awq import (_clip_chunk, _fold, _vo_shapes_match, scale_groups, unit_abs_sum, unit_expert_abs_sum,
                          unit_expert_grid_losses, unit_grid_losses)
from lrmq.ptq.gptq_model import TRUE_SEQUENTIAL, unit_expert_down_xtx, unit_expert_mlp_in_xtx, unit_xtx
from lrmq.ptq.rtn import _quantize_jit
from lrmq.ptq.shard import AXIS, unit_program, unit_size
from lrmq.quant.quantizers import resolve_group_size

F32 = np.dtype(np.float32)


@dataclasses.dataclass
class Program:
    name: str  # e.g. "awq grid losses mlp_in (layer type full_attention)"
    fn: Callable  # jitted: fn.lower(*args).compile()
    args: tuple  # ShapeDtypeStructs with shardings on the mesh
    calls: int = 1  # times one layer runs it


def abstract_layer_params(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Shapes of layer i's float32 weights, keyed as ``layer_fn.get_layer_params``."""
    cfg32 = dataclasses.replace(cfg, dtype="float32", param_dtype="float32")
    state = nnx.state(nnx.eval_shape(lambda: DecoderLayer(cfg32, cfg.layer_types[i], nnx.Rngs(0),
                                                                  moe=cfg.is_moe_layer(i))), nnx.Param)
    return {lf.param_key(tuple(p)): tuple(v.get_value().shape) for p, v in nnx.to_flat_state(state)}


def _sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def capture_widths(cfg: ModelConfig, moe: bool = False) -> dict[str, int]:
    """Last-axis width of each captured Linear input; a sparse layer (``moe``) captures no ``down_in`` (an expert's
    down_proj input depends on the expert: ``layer_fn.expert_down_xtx`` computes it from ``mlp_in``)."""
    w = {"attn_in": cfg.hidden_size, "o_in": cfg.num_heads * cfg.head_dim, "mlp_in": cfg.hidden_size,
         "down_in": cfg.intermediate_size}
    if moe:
        del w["down_in"]
    return w


def layer_kinds(cfg: ModelConfig) -> dict[tuple[str, bool], int]:
    """The distinct (layer type, sparse) pairs of a model, each with its first layer's index."""
    kinds: dict[tuple[str, bool], int] = {}
    for i, lt in enumerate(cfg.layer_types):
        kinds.setdefault((lt, cfg.is_moe_layer(i)), i)
    return kinds


def layer_tag(lt: str, moe: bool) -> str:
    """The suffix naming a program's layer kind: "(layer type full_attention)", "(layer type full_attention,
    experts)" for a sparse layer (``lrmq.ptq_aot.layer_type_of`` reads it back)."""
    return f"(layer type {lt}{', experts' if moe else ''})"


def layer_programs(cfg: ModelConfig, qcfg, mesh, n_blocks: int, block_size: int) -> list[Program]:
    """The per-layer programs of ``qcfg.method`` (awq, quantlrm, gptq) on ``mesh`` for ``n_blocks`` calibration
    blocks of ``block_size`` tokens (module doc). One set per distinct layer type."""
    method = qcfg.method
    if method not in ("awq", "quantlrm", "gptq"):
        raise ValueError(f"method {method}: only the calibrated layer-by-layer methods (awq, quantlrm, gptq) run "
                         "programs over the calibration blocks")
    d = mesh.devices.size
    u = unit_size(n_blocks, qcfg.calibration.batch_size)
    units = n_blocks // u
    steps = -(-units // d)
    rep, shd = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    one = NamedSharding(mesh, P())  # single-device programs (fold, quantize) take replicated inputs here
    x_of = lambda width: _sds((d, u, block_size, width), F32, shd)  # noqa: E731 one unit per chip
    pos = _sds((d, u, block_size), np.dtype(np.int32), shd)
    out: list[Program] = []
    for (lt, moe), i in layer_kinds(cfg).items():
        widths = capture_widths(cfg, moe)
        spec = lf.layer_spec(cfg, i)
        shapes = abstract_layer_params(cfg, i)
        p = {k: _sds(s, F32, rep) for k, s in shapes.items()}
        tag = layer_tag(lt, moe)
        e = shapes["gate_proj"][0] if moe else 1
        kw = dict(top_k=cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob,
                  calibration=qcfg.calibration.moe_experts)
        if method in ("awq", "quantlrm"):
            out.append(Program(f"forward + captures {tag}", unit_program(lw.unit_forward, mesh, 1, 2, spec=spec,
                                                                         capture=True),
                               (p, x_of(cfg.hidden_size), pos), steps))
            a = qcfg.awq
            bits, g, sym = qcfg.bits, qcfg.group_size, qcfg.symmetric
            gqa_vo = qcfg.quantlrm.gqa_vo if method == "quantlrm" else a.gqa_vo
            normalize = qcfg.quantlrm.normalize if method == "quantlrm" else a.normalize
            if a.scale and moe and not spec.post_norm:  # awq_layer: up -> down per expert (QuantLRM: the counts)
                f, dd = cfg.moe_intermediate_size, cfg.hidden_size
                w4 = tuple(p[k] for k in ("router", "gate_proj", "up_proj", "down_proj"))
                out.append(Program(f"expert activation statistic mlp_out [{e}, {f}] {tag}",
                                   unit_program(unit_expert_abs_sum, mesh, 3, 1, **kw), (*w4[:3], x_of(dd)), steps))
                fn = unit_program(unit_expert_grid_losses, mesh, 5, 1, **kw, n_grid=a.n_grid, norm=normalize,
                                  bits=bits, group_size=resolve_group_size(shapes["down_proj"][1:], g),
                                  symmetric=sym)
                out.append(Program(f"expert grid losses mlp_out [{e}, {f}] {tag}", fn,
                                   (*w4, _sds((e, f), F32, rep), x_of(dd)), steps))
            for group in scale_groups(spec) if a.scale else ():
                if group.name == "attn_out" and not _vo_shapes_match(p) and gqa_vo == "skip":
                    continue
                if moe and group.name == "mlp_out":  # per expert, above
                    continue
                k = widths[group.inp]
                if method == "awq":
                    out.append(Program(f"activation statistic {group.name} {tag}",
                                       unit_program(unit_abs_sum, mesh, 0, 1), (x_of(k),), steps))
                fn = unit_program(unit_grid_losses, mesh, 2, 2, group=group, spec=spec, n_grid=a.n_grid,
                                  normalize=normalize, bits=bits, group_size=g, symmetric=sym)
                out.append(Program(f"grid losses {group.name} {tag}", fn,
                                   (p, _sds((k,), F32, rep), x_of(k), pos), steps))
                # fold: a one-device program on the layer's weights (GQA v -> o: v's scales are downsampled)
                s_fc = _sds((k,), F32, one)
                s_prev = _sds((shapes[group.prev][-1],), F32, one) if group.prev in lf.LINEARS else s_fc
                out.append(Program(f"fold scales {group.name} {tag}", _bind(_fold, group=group),
                                   ({kk: _sds(v, F32, one) for kk, v in shapes.items()}, s_prev, s_fc), 1))
            if a.clip:
                seen = set()
                for name in lf.LINEARS:
                    if name in ("q_proj", "k_proj"):
                        continue
                    K, N = shapes[name][-2:]
                    gs = resolve_group_size((K, N), g)
                    # a stacked expert projection: each expert's slice searched alone on its inputs (E times; with
                    # calibration.moe_experts=routed an expert's sample may be smaller than the one compiled)
                    experts = shapes[name][0] if len(shapes[name]) == 3 else 1
                    if (K, N, gs, experts) in seen:
                        continue
                    seen.add((K, N, gs, experts))
                    width = min(a.oc_batch, N)
                    chunks = -(-N // width)
                    n_tok = min(a.n_sample_token, n_blocks * block_size)
                    fn = unit_program(_clip_chunk, mesh, 1, 1, bits=bits, group_size=gs, symmetric=sym,
                                      n_grid=a.n_grid, n_shrink=int(a.max_shrink * a.n_grid))
                    out.append(Program(f"clip search {name} [{K}, {N}]{f' x {experts} experts' * (experts > 1)} "
                                       f"{tag}", fn, (_sds((n_tok, K), F32, rep), _sds((d, K, width), F32, shd)),
                                       experts * -(-chunks // d)))
            if a.propagate == "quantized":
                out.append(Program(f"forward {tag}", unit_program(lw.unit_forward, mesh, 1, 2, spec=spec,
                                                                  capture=False),
                                   (p, x_of(cfg.hidden_size), pos), steps))
        else:
            gq = qcfg.gptq
            stages = TRUE_SEQUENTIAL if gq.true_sequential else (tuple(n for s in TRUE_SEQUENTIAL for n in s),)
            exact: set[str] = set()
            for k, stage in enumerate(stages):
                need = {lf.INPUT_OF[n] for n in stage}
                if moe:  # gptq_layer: a sparse layer's expert statistics are computed from mlp_in
                    need = {"mlp_in" if inp in ("mlp_in", "down_in") else inp for inp in need}
                need = tuple(sorted(need))
                keys = tuple(sorted(exact - set(need)))
                fn = unit_program(lw.unit_run, mesh, 1, 2 + len(keys), spec=spec, names=need, keys=keys)
                out.append(Program(f"stage {k} inputs {'/'.join(need)} {tag}", fn,
                                   (p, x_of(cfg.hidden_size), pos, *[x_of(widths[kk]) for kk in keys]), steps))
                exact |= {n for n in need if n != "attn_in"}
                exact = {kk for kk in exact if not set(stage) & set(lf.UPSTREAM[kk])}
            for inp in widths:  # one Hessian per captured input (a sparse layer's mlp_in: every expert's gate/up)
                if moe and inp == "mlp_in" and qcfg.calibration.moe_experts != "all":
                    continue
                out.append(Program(f"X^T X {inp} [{widths[inp]}] {tag}", unit_program(unit_xtx, mesh, 0, 1),
                                   (x_of(widths[inp]),), steps))
            if moe:  # gptq_model.expert_hessians: the E per-expert Hessians, every expert's over a unit on a chip
                f, dd = cfg.moe_intermediate_size, cfg.hidden_size
                router = _sds(shapes["router"], F32, rep)
                if qcfg.calibration.moe_experts != "all":
                    out.append(Program(f"expert X^T X mlp_in [{e}, {dd}, {dd}] {tag}",
                                       unit_program(unit_expert_mlp_in_xtx, mesh, 1, 1, **kw),
                                       (router, x_of(dd)), steps))
                out.append(Program(f"expert X^T X down_in [{e}, {f}, {f}] {tag}",
                                   unit_program(unit_expert_down_xtx, mesh, 3, 1, **kw),
                                   (router, p["gate_proj"], p["up_proj"], x_of(dd)), steps))
            if gq.propagate == "quantized":
                keys = tuple(sorted(exact))
                fn = unit_program(lw.unit_run, mesh, 1, 2 + len(keys), spec=spec, names=None, keys=keys)
                out.append(Program(f"forward {tag}", fn,
                                   (p, x_of(cfg.hidden_size), pos, *[x_of(widths[kk]) for kk in keys]), steps))
        if method in ("awq", "quantlrm"):
            for name in dict.fromkeys(lf.LINEARS):  # a stacked expert projection: each slice (rtn.quantize_experts)
                K, N = shapes[name][-2:]
                experts = shapes[name][0] if len(shapes[name]) == 3 else 1
                gs = resolve_group_size((K, N), qcfg.group_size)
                out.append(Program(f"quantize {name} [{K}, {N}]{f' x {experts} experts' * (experts > 1)} {tag}",
                                   _bind(_quantize_jit, bits=qcfg.bits, group_size=gs, symmetric=qcfg.symmetric),
                                   (_sds((K, N), F32, one),), experts))
    return out


class _bind:
    """A jitted function with some static keyword arguments fixed: ``lower(*args)`` as the program's own."""

    def __init__(self, fn, **static):
        self.fn, self.static = fn, static

    def lower(self, *args):
        return self.fn.lower(*args, **self.static)

    def __call__(self, *args):
        return self.fn(*args, **self.static)


def host_bytes(cfg: ModelConfig, qcfg, n_blocks: int, block_size: int, *, prefetch: bool = True) -> dict[str, int]:
    """What the host holds at the peak of a streamed run, by part (bytes): the calibration activations (layer
    input and FP output, the captures, float32), the largest layer's float32 weights (current, working copy and
    the prefetched next one), the embedding in the param dtype, and for GPTQ the float64 Hessian work (a sparse
    layer: also its E per-expert down_proj Hessians, summed [E, F, F] float32 and each expert's prepared Hinv)."""
    tokens = n_blocks * block_size
    kinds = layer_kinds(cfg)
    caps = max(sum(capture_widths(cfg, moe).values()) for _, moe in kinds)
    layer = max(sum(int(np.prod(s)) for s in abstract_layer_params(cfg, i).values()) for i in kinds.values()) * 4
    itemsize = 2 if cfg.param_dtype in ("bfloat16", "float16") else 4
    parts = {
        "activations (input, output, captures; float32)": tokens * (2 * cfg.hidden_size + caps) * 4,
        "layer weights (float32: current, quantized copy" + (", next prefetched)" if prefetch else ")"):
            layer * (3 if prefetch else 2),
        "embedding": cfg.vocab_size * cfg.hidden_size * itemsize,
    }
    if qcfg.method == "gptq":
        k = max(max(capture_widths(cfg, moe).values()) for _, moe in kinds)
        parts["GPTQ Hessian work (float64 Cholesky, float32 H / Hinv of the widest input)"] = k * k * (8 * 2 + 4 * 2)
        if any(moe for _, moe in kinds):
            f, e = cfg.moe_intermediate_size, cfg.num_experts
            # down_proj: the summed [E, F, F] and E prepared Hinv; "routed": gate's and up's E Hinv [D, D] each too,
            # beside one summed [E, D, D] (gptq_layer prepares each projection's list)
            routed = 0 if qcfg.calibration.moe_experts == "all" else 3 * cfg.hidden_size ** 2
            parts[f"GPTQ per-expert Hessians ({e} experts: summed H and prepared Hinv, float32)"] = \
                e * 4 * (2 * f * f + routed)
    return parts
