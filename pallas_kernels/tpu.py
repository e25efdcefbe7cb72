"""Mosaic TPU weight-only dequant-matmul kernels (int4, int8, NF4).

Grid (M/bm, N/bn, K/bk) with dimension_semantics ("parallel", "parallel", "arbitrary"): the K
axis is the innermost, sequential reduction into an f32 VMEM accumulator; weights are dequantized
tile by tile in VMEM and never materialised in HBM. See docs/kernels.md for layouts and tiling.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._common import affine_geometry, nf4_lookup, pad_to, round_up, split_even_odd

_HI = jax.lax.Precision.HIGHEST
# Max elements of one dequantized weight tile (bk x bn): its f32 temporaries must fit VMEM.
_TILE_BUDGET = 1024 * 1024
_VMEM_LIMIT = 48 * 1024 * 1024  # under v7x's 64 MiB/core, above the 16/32 MiB scoped default


def _compiler_params(**kw):
    # jax >= 0.6 spells it CompilerParams; older releases had TPUCompilerParams.
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return cls(dimension_semantics=("parallel", "parallel", "arbitrary"), **kw)


def _vmem(shape, dtype):
    mem = getattr(pltpu, "VMEM", None)
    if mem is None:  # very new jax moved the memory spaces under MemorySpace
        mem = pltpu.MemorySpace.VMEM
    return mem(shape, dtype)


@dataclasses.dataclass(frozen=True)
class Tiles:
    bm: int
    bn: int
    bk: int
    mp: int  # padded sizes
    np_: int
    kp: int


def _compute_dtype(dtype):
    # 16-bit activations: dequantize straight to that dtype so the MXU runs natively (f32 acc).
    return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize == 2 else jnp.dtype(jnp.float32)


def choose_tiles(m: int, k: int, n: int, *, x_dtype, k_align: int, block_m=None, block_n=None,
                 block_k=None) -> Tiles:
    """Pick (bm, bn, bk) and padded sizes.

    TPU block rules: last dim a multiple of 128 or the full dim, second-last a multiple of 8 (16
    for bf16, 32 for uint8) or the full dim. `k_align` encodes the K-side rule of the format
    (e.g. int4 g=128: bk/2 lane-aligned and bk/g a multiple of 8 -> bk % 1024 == 0) unless
    bk == K, when every K-dependent block is full-dim."""
    sub = 16 if jnp.dtype(x_dtype).itemsize == 2 else 8
    decode = m <= 16
    bm = block_m or min(round_up(m, sub), 256)
    if block_n is None:
        if n % 128 == 0:
            cands = (1024, 512, 256, 128) if decode else (512, 256, 128)
            block_n = next(c for c in cands if n % c == 0)
        elif n <= 2048:
            block_n = n  # full-dim block: legal for any N and avoids copying (padding) the weight
        else:
            block_n = 512
    bn = block_n
    if block_k is None:
        cands = [c for c in (4096, 2048, 1024, 512, 256) if c % k_align == 0 and c * bn <= _TILE_BUDGET]
        block_k = next((c for c in cands if k % c == 0), None)
        if block_k is None:
            if k * bn <= 4 * _TILE_BUDGET:
                block_k = k
            else:
                block_k = cands[-1] if cands else k_align
    bk = block_k
    return Tiles(bm, bn, bk, round_up(m, bm), round_up(n, bn), round_up(k, bk))


def _lcm(a, b):
    return a * b // math.gcd(a, b)


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


# ---------------------------------------------------------------------------------------- int4
def _int4_kernel(xe_ref, xo_ref, c_ref, s_ref, z_ref, o_ref, acc_ref, *, rpg, cdt):
    c = c_ref[...].astype(jnp.int32)  # [bk/2, bn]; byte i = (k=2i low, k=2i+1 high)
    s, z = s_ref[...], z_ref[...]
    w_even = _affine_dequant(c & 0xF, s, z, rpg, cdt)
    w_odd = _affine_dequant(c >> 4, s, z, rpg, cdt)
    part = _dot(xe_ref[...].astype(cdt), w_even, cdt) + _dot(xo_ref[...].astype(cdt), w_odd, cdt)
    _accumulate(acc_ref, o_ref, part)


def int4_matmul_tpu(x, codes, scales, zeros, group_size, *, interpret=False, block_m=None,
                    block_n=None, block_k=None):
    """x [M, K] @ dequant(codes uint8 [K/2, N], scales/zeros [K/g, N]) -> [M, N] in x.dtype."""
    m, k, n, g, per_channel = affine_geometry("int4", x, codes, scales, group_size)
    k_align = 256 if per_channel else _lcm(256, 8 * g)
    t = choose_tiles(m, k, n, x_dtype=x.dtype, k_align=k_align, block_m=block_m,
                     block_n=block_n, block_k=block_k)
    if not per_channel and t.bk % g:
        raise ValueError(f"int4: block_k={t.bk} must be a multiple of group_size={g}")
    if t.bk % 2:
        raise ValueError("int4: block_k must be even")
    cdt = _compute_dtype(x.dtype)
    xp = pad_to(x, (t.mp, t.kp))
    xe, xo = split_even_odd(xp)
    codes = pad_to(codes, (t.kp // 2, t.np_))
    sg = 1 if per_channel else t.kp // g
    scales = pad_to(scales, (sg, t.np_))
    zeros = pad_to(zeros, (sg, t.np_))
    sb = 1 if per_channel else t.bk // g
    s_map = (lambda i, j, kk: (0, j)) if per_channel else (lambda i, j, kk: (kk, j))
    grid = (t.mp // t.bm, t.np_ // t.bn, t.kp // t.bk)
    bytes_accessed = (xp.size * xp.dtype.itemsize + codes.size + scales.size * scales.dtype.itemsize
                      + zeros.size + t.mp * t.np_ * x.dtype.itemsize)
    out = pl.pallas_call(
        functools.partial(_int4_kernel, rpg=(g // 2) if not per_channel else 1, cdt=cdt),
        out_shape=jax.ShapeDtypeStruct((t.mp, t.np_), x.dtype),
        grid=grid,
        in_specs=[
            pl.BlockSpec((t.bm, t.bk // 2), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((t.bm, t.bk // 2), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((t.bk // 2, t.bn), lambda i, j, kk: (kk, j)),
            pl.BlockSpec((sb, t.bn), s_map),
            pl.BlockSpec((sb, t.bn), s_map),
        ],
        out_specs=pl.BlockSpec((t.bm, t.bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[_vmem((t.bm, t.bn), jnp.float32)],
        compiler_params=_compiler_params(vmem_limit_bytes=_VMEM_LIMIT),
        cost_estimate=pl.CostEstimate(flops=2 * t.mp * t.np_ * t.kp, transcendentals=0,
                                      bytes_accessed=int(bytes_accessed)),
        interpret=interpret,
        name="lrmq_int4_matmul_tpu",
    )(xe, xo, codes, scales, zeros)
    return out[:m, :n]


# ---------------------------------------------------------------------------------------- int8
def _int8_kernel(x_ref, c_ref, s_ref, z_ref, o_ref, acc_ref, *, rpg, cdt):
    w = _affine_dequant(c_ref[...], s_ref[...], z_ref[...], rpg, cdt)
    _accumulate(acc_ref, o_ref, _dot(x_ref[...].astype(cdt), w, cdt))


def int8_matmul_tpu(x, codes, scales, zeros, *, interpret=False, block_m=None, block_n=None,
                    block_k=None):
    """x [M, K] @ dequant(codes uint8 [K, N], scales/zeros [1 or K/g, N]) -> [M, N]."""
    m, k, n, g, per_channel = affine_geometry("int8", x, codes, scales)
    k_align = 128 if per_channel else _lcm(128, 8 * g)
    t = choose_tiles(m, k, n, x_dtype=x.dtype, k_align=k_align, block_m=block_m,
                     block_n=block_n, block_k=block_k)
    if not per_channel and t.bk % g:
        raise ValueError(f"int8: block_k={t.bk} must be a multiple of group_size={g}")
    cdt = _compute_dtype(x.dtype)
    xp = pad_to(x, (t.mp, t.kp))
    codes = pad_to(codes, (t.kp, t.np_))
    sg = 1 if per_channel else t.kp // g
    scales = pad_to(scales, (sg, t.np_))
    zeros = pad_to(zeros, (sg, t.np_))
    sb = 1 if per_channel else t.bk // g
    s_map = (lambda i, j, kk: (0, j)) if per_channel else (lambda i, j, kk: (kk, j))
    out = pl.pallas_call(
        functools.partial(_int8_kernel, rpg=g if not per_channel else 1, cdt=cdt),
        out_shape=jax.ShapeDtypeStruct((t.mp, t.np_), x.dtype),
        grid=(t.mp // t.bm, t.np_ // t.bn, t.kp // t.bk),
        in_specs=[
            pl.BlockSpec((t.bm, t.bk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((t.bk, t.bn), lambda i, j, kk: (kk, j)),
            pl.BlockSpec((sb, t.bn), s_map),
            pl.BlockSpec((sb, t.bn), s_map),
        ],
        out_specs=pl.BlockSpec((t.bm, t.bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[_vmem((t.bm, t.bn), jnp.float32)],
        compiler_params=_compiler_params(vmem_limit_bytes=_VMEM_LIMIT),
        interpret=interpret,
        name="lrmq_int8_matmul_tpu",
    )(xp, codes, scales, zeros)
    return out[:m, :n]


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


def nf4_matmul_tpu(x, codes, absmax, block_size: int = 64, *, interpret=False, block_m=None,
                   block_n=None, block_k=None):
    """x [M, K] @ w_t.T with codes uint8 [N, K/2] (bnb bytes), absmax [N, K/bs] (or flat)."""
    m, k = x.shape
    n = codes.shape[0]
    if codes.shape[1] * 2 != k or k % block_size or block_size % 2:
        raise ValueError(f"nf4: codes {codes.shape} / block_size {block_size} vs K={k}")
    nb = k // block_size
    k_align = _lcm(256, 8 * block_size)
    t = choose_tiles(m, k, n, x_dtype=x.dtype, k_align=k_align, block_m=block_m,
                     block_n=block_n, block_k=block_k)
    if t.bk % block_size:
        raise ValueError(f"nf4: block_k={t.bk} must be a multiple of block_size={block_size}")
    cdt = _compute_dtype(x.dtype)
    xp = pad_to(x, (t.mp, t.kp))
    xe, xo = split_even_odd(xp)
    codes = pad_to(codes, (t.np_, t.kp // 2))
    # [K/bs, N]: small (1/16 of the bf16 weight bytes); lrmq can keep it pre-transposed.
    absmax_t = pad_to(absmax.reshape(n, nb).astype(jnp.float32).T, (t.kp // block_size, t.np_))
    ab = t.bk // block_size
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
        compiler_params=_compiler_params(vmem_limit_bytes=_VMEM_LIMIT),
        interpret=interpret,
        name="lrmq_nf4_matmul_tpu",
    )(xe, xo, codes, absmax_t)
    return out[:m, :n]
