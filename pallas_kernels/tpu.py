"""Mosaic TPU weight-only dequant-matmul kernels (int4, int8, NF4).

Grid (M/bm, N/bn, K/bk) with dimension_semantics ("parallel", "parallel", "arbitrary"): the K
axis is the innermost, sequential reduction into an f32 VMEM accumulator; weights are dequantized
tile by tile in VMEM and never materialised in HBM. Tiles and the VMEM limit follow the target
TPU generation (`Generation`, from the target's device kind). See docs/kernels.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._common import affine_geometry, nf4_lookup, pad_to, split_even_odd
from .tpu_tiles import (  # noqa: F401  (Generation, GENERATIONS, PORTABLE, Tiles: public API)
    GENERATIONS,
    PORTABLE,
    Generation,
    Tiles,
    choose_tiles,
    generation,
    plan_affine,
    plan_nf4,
    staging,
)

_HI = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------------------------- helpers
def _compiler_params(vmem_limit: int):
    # jax >= 0.6 spells it CompilerParams; older releases had TPUCompilerParams.
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return cls(dimension_semantics=("parallel", "parallel", "arbitrary"),
               vmem_limit_bytes=int(vmem_limit))


def _vmem(shape, dtype):
    mem = getattr(pltpu, "VMEM", None)
    if mem is None:  # very new jax moved the memory spaces under MemorySpace
        mem = pltpu.MemorySpace.VMEM
    return mem(shape, dtype)


def _compute_dtype(dtype):
    # 16-bit activations: dequantize straight to that dtype so the MXU runs natively (f32 acc).
    return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize == 2 else jnp.dtype(jnp.float32)


# ------------------------------------------------------------------------------- kernel pieces
def _affine_dequant(q, s, z, rows_per_group, dtype):
    """(q - z) * s for a [r, bn] tile with scale rows covering `rows_per_group` rows each."""
    q = q.astype(jnp.float32)
    s = s.astype(jnp.float32)
    z = z.astype(jnp.float32)
    r, bn = q.shape
    if s.shape[0] == 1:  # per-channel (or one group per tile): plain row broadcast
        w = (q - z) * s
    else:
        w = ((q.reshape(r // rows_per_group, rows_per_group, bn) - z[:, None]) * s[:, None])
        w = w.reshape(r, bn)
    return w.astype(dtype)


def _dot(a, b, dtype):
    prec = _HI if dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=prec, preferred_element_type=jnp.float32)


def _accumulate(acc_ref, o_ref, partial):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += partial

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _step_rows(ref, staged_ref, rows, kk=None):
    """This K step's `rows` rows of a grouped side array (scales or zero points) as f32.

    Per-step blocks of bk/g rows must be a multiple of the array's HBM row tiling: 32 for uint8
    zero points (bk/g is typically 8: E2002), 8 for f32 scales (K=9728 with g=128 has no such bk
    but K itself). Such arrays are staged instead: the wrapper hands the whole [K/g, bn] column
    block (full dim: legal, fetched once per N block), widened to f32 into a VMEM scratch at the
    first K step and read per step after that. Values are exact, so results are unchanged.
    With rows a multiple of 8 the scratch is [K/g, bn], sliced at 8-aligned offsets; otherwise
    Mosaic cannot prove a dynamic row offset aligned (E2003), so the scratch is
    [steps, rows, bn], filled by static slices and indexed on its leading axis. `kk`: the K step (default
    `pl.program_id(2)`; a kernel that reads it under `pl.when` passes it in, as interpret mode cannot lower a
    program id there)."""
    if staged_ref is None:
        return ref[...]
    kk = pl.program_id(2) if kk is None else kk
    per_step = staged_ref.ndim == 3

    @pl.when(kk == 0)
    def _():
        v = ref[...].astype(jnp.float32)
        if not per_step:
            staged_ref[...] = v
            return
        for i in range(staged_ref.shape[0]):
            staged_ref[i] = v[i * rows:(i + 1) * rows]

    if per_step:
        return staged_ref[kk]
    if staged_ref.shape[0] == rows:
        return staged_ref[...]
    return staged_ref[pl.ds(pl.multiple_of(kk * rows, rows), rows), :]


def _staging_shape(rows_total, rows, bn) -> tuple[int, ...]:
    """Shape of one staging scratch (see `_step_rows`)."""
    return (rows_total, bn) if rows % 8 == 0 else (rows_total // rows, rows, bn)


def _side_specs(per_channel, staged, sb, rows_total, bn):
    """BlockSpecs for (scales, zeros): per-channel [1, bn]; grouped ones [bk/g, bn] per K step,
    or (staged: `staged` = (scales, zeros) flags) the whole [K/g, bn] column."""
    if per_channel:
        spec = pl.BlockSpec((1, bn), lambda i, j, kk: (0, j))
        return spec, spec
    step = pl.BlockSpec((sb, bn), lambda i, j, kk: (kk, j))
    whole = pl.BlockSpec((rows_total, bn), lambda i, j, kk: (0, j))
    return tuple(whole if st else step for st in staged)


def _side_rows(refs, scratch, staged, sb, kk=None):
    """(scale rows, zero rows) of this K step; `scratch` holds the staging buffers in order."""
    it = iter(scratch)
    return tuple(_step_rows(r, next(it) if st else None, sb, kk) for r, st in zip(refs, staged))


# ---------------------------------------------------------------------------------------- int4
def _int4_kernel(xe_ref, xo_ref, c_ref, s_ref, z_ref, o_ref, acc_ref, *scratch, rpg, cdt,
                 staged, sb):
    c = c_ref[...].astype(jnp.int32)  # [bk/2, bn]; byte i = (k=2i low, k=2i+1 high)
    s, z = _side_rows((s_ref, z_ref), scratch, staged, sb)
    w_even = _affine_dequant(c & 0xF, s, z, rpg, cdt)
    w_odd = _affine_dequant(c >> 4, s, z, rpg, cdt)
    part = _dot(xe_ref[...].astype(cdt), w_even, cdt) + _dot(xo_ref[...].astype(cdt), w_odd, cdt)
    _accumulate(acc_ref, o_ref, part)


def _affine_call(fmt, kernel, x, codes, scales, zeros, g, per_channel, *, interpret, gen,
                 block_m, block_n, block_k):
    """Shared int4 / int8 wrapper: tiles, padding, block specs, the pallas_call."""
    m, k = x.shape
    n = codes.shape[1]
    t, _ = plan_affine(fmt, m, k, n, g, per_channel, x_dtype=x.dtype, s_dtype=scales.dtype,
                            gen=gen, block_m=block_m, block_n=block_n, block_k=block_k)
    cdt = _compute_dtype(x.dtype)
    xp = pad_to(x, (t.mp, t.kp))
    code_rows = t.kp // 2 if fmt == "int4" else t.kp
    codes = pad_to(codes, (code_rows, t.np_))
    sg = 1 if per_channel else t.kp // g
    scales = pad_to(scales, (sg, t.np_))
    zeros = pad_to(zeros, (sg, t.np_))
    sb = 1 if per_channel else t.bk // g
    staged = staging(per_channel, sb, t.bk, t.kp, scales.dtype, gen or generation())
    s_spec, z_spec = _side_specs(per_channel, staged, sb, sg, t.bn)
    kb = t.bk // 2 if fmt == "int4" else t.bk
    x_specs = [pl.BlockSpec((t.bm, kb), lambda i, j, kk: (i, kk))] * (2 if fmt == "int4" else 1)
    x_args = split_even_odd(xp) if fmt == "int4" else (xp,)
    scratch = ([_vmem((t.bm, t.bn), jnp.float32)]
               + [_vmem(_staging_shape(sg, sb, t.bn), jnp.float32)] * sum(staged))
    bytes_accessed = (xp.size * xp.dtype.itemsize + codes.size + scales.size * scales.dtype.itemsize
                      + zeros.size + t.mp * t.np_ * x.dtype.itemsize)
    rpg = 1 if per_channel else (g // 2 if fmt == "int4" else g)
    out = pl.pallas_call(
        functools.partial(kernel, rpg=rpg, cdt=cdt, staged=staged, sb=sb),
        out_shape=jax.ShapeDtypeStruct((t.mp, t.np_), x.dtype),
        grid=(t.mp // t.bm, t.np_ // t.bn, t.kp // t.bk),
        in_specs=[*x_specs, pl.BlockSpec((kb, t.bn), lambda i, j, kk: (kk, j)), s_spec, z_spec],
        out_specs=pl.BlockSpec((t.bm, t.bn), lambda i, j, kk: (i, j)),
        scratch_shapes=scratch,
        compiler_params=_compiler_params(t.vmem_limit),
        cost_estimate=pl.CostEstimate(flops=2 * t.mp * t.np_ * t.kp, transcendentals=0,
                                      bytes_accessed=int(bytes_accessed)),
        interpret=interpret,
        name=f"lrmq_{fmt}_matmul_tpu",
    )(*x_args, codes, scales, zeros)
    return out[:m, :n]


def int4_matmul_tpu(x, codes, scales, zeros, group_size, *, interpret=False, gen=None,
                    block_m=None, block_n=None, block_k=None):
    """x [M, K] @ dequant(codes uint8 [K/2, N], scales/zeros [K/g, N]) -> [M, N] in x.dtype.

    `gen`: the TPU Generation to tile for (default: the current target's)."""
    _, _, _, g, per_channel = affine_geometry("int4", x, codes, scales, group_size)
    return _affine_call("int4", _int4_kernel, x, codes, scales, zeros, g, per_channel,
                        interpret=interpret, gen=gen, block_m=block_m, block_n=block_n,
                        block_k=block_k)


# ---------------------------------------------------------------------------------------- int8
def _int8_kernel(x_ref, c_ref, s_ref, z_ref, o_ref, acc_ref, *scratch, rpg, cdt, staged, sb):
    s, z = _side_rows((s_ref, z_ref), scratch, staged, sb)
    w = _affine_dequant(c_ref[...], s, z, rpg, cdt)
    _accumulate(acc_ref, o_ref, _dot(x_ref[...].astype(cdt), w, cdt))


def int8_matmul_tpu(x, codes, scales, zeros, *, interpret=False, gen=None, block_m=None,
                    block_n=None, block_k=None):
    """x [M, K] @ dequant(codes uint8 [K, N], scales/zeros [1 or K/g, N]) -> [M, N]."""
    _, _, _, g, per_channel = affine_geometry("int8", x, codes, scales)
    return _affine_call("int8", _int8_kernel, x, codes, scales, zeros, g, per_channel,
                        interpret=interpret, gen=gen, block_m=block_m, block_n=block_n,
                        block_k=block_k)


# ----------------------------------------------------------------------------------------- nf4
def _nf4_kernel(xe_ref, xo_ref, c_ref, a_ref, o_ref, acc_ref, *, half_block, cdt):
    # Codes arrive torch-oriented [bn, bk/2]; absmax varies along K, which is the lane dim there.
    # Transpose the (int32) code tile once so K is on sublanes and the per-block absmax becomes a
    # sublane-group broadcast, exactly like the int formats; then a plain NN dot.
    c = c_ref[...].astype(jnp.int32).T  # [bk/2, bn]
    a = a_ref[...].astype(jnp.float32)  # [bk/bs, bn] (absmax pre-transposed by the wrapper)
    r, bn = c.shape

    def deq(q):
        v = nf4_lookup(q).reshape(r // half_block, half_block, bn) * a[:, None]
        return v.reshape(r, bn).astype(cdt)

    part = _dot(xe_ref[...].astype(cdt), deq(c >> 4), cdt)  # even k: high nibble
    part += _dot(xo_ref[...].astype(cdt), deq(c & 0xF), cdt)
    _accumulate(acc_ref, o_ref, part)


def nf4_matmul_tpu(x, codes, absmax, block_size: int = 64, *, interpret=False, gen=None,
                   block_m=None, block_n=None, block_k=None):
    """x [M, K] @ w_t.T with codes uint8 [N, K/2] (bnb bytes), absmax [N, K/bs] (or flat)."""
    m, k = x.shape
    n = codes.shape[0]
    if codes.shape[1] * 2 != k or k % block_size or block_size % 2:
        raise ValueError(f"nf4: codes {codes.shape} / block_size {block_size} vs K={k}")
    nb = k // block_size
    t = plan_nf4(m, k, n, block_size, x_dtype=x.dtype, gen=gen, block_m=block_m, block_n=block_n,
                 block_k=block_k)
    cdt = _compute_dtype(x.dtype)
    xp = pad_to(x, (t.mp, t.kp))
    xe, xo = split_even_odd(xp)
    codes = pad_to(codes, (t.np_, t.kp // 2))
    # [K/bs, N]: small (1/16 of the bf16 weight bytes); lrmq can keep it pre-transposed.
    absmax_t = pad_to(absmax.reshape(n, nb).astype(jnp.float32).T, (t.kp // block_size, t.np_))
    ab = t.bk // block_size
    bytes_accessed = (xp.size * xp.dtype.itemsize + codes.size + absmax_t.size * 4
                      + t.mp * t.np_ * x.dtype.itemsize)
    out = pl.pallas_call(
        functools.partial(_nf4_kernel, half_block=block_size // 2, cdt=cdt),
        out_shape=jax.ShapeDtypeStruct((t.mp, t.np_), x.dtype),
        grid=(t.mp // t.bm, t.np_ // t.bn, t.kp // t.bk),
        in_specs=[
            pl.BlockSpec((t.bm, t.bk // 2), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((t.bm, t.bk // 2), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((t.bn, t.bk // 2), lambda i, j, kk: (j, kk)),
            pl.BlockSpec((ab, t.bn), lambda i, j, kk: (kk, j)),
        ],
        out_specs=pl.BlockSpec((t.bm, t.bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[_vmem((t.bm, t.bn), jnp.float32)],
        compiler_params=_compiler_params(t.vmem_limit),
        cost_estimate=pl.CostEstimate(flops=2 * t.mp * t.np_ * t.kp, transcendentals=0,
                                      bytes_accessed=int(bytes_accessed)),
        interpret=interpret,
        name="lrmq_nf4_matmul_tpu",
    )(xe, xo, codes, absmax_t)
    return out[:m, :n]
