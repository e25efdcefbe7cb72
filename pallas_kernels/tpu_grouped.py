"""Mosaic TPU grouped dequant-matmul (mixture-of-experts experts, int4 / int8): rows sorted by expert.

    y[r] = x[r] @ dequant(codes[e], scales[e], zeros[e])   for every row r of group e,

where `group_sizes[e]` consecutive rows of x belong to expert e (expert 0's first), as `jax.lax.ragged_dot`;
rows past `sum(group_sizes)` give 0. Expert weights are stacked on a leading axis in the dense kernels' layouts
(int4 codes uint8 [E, K/2, N], K-packed, element 2i in the low nibble; int8 codes [E, K, N]; scales [E, K/g, N]
(or [E, 1, N] per channel), zero points uint8 of the same shape) and are dequantized tile by tile in VMEM, never in
HBM.

The grid is (N tiles, work items, K tiles), ("parallel", "arbitrary", "arbitrary"). A work item is one (row tile,
expert) pair whose rows intersect: a row tile that holds the end of one group and the start of the next is visited
once per group, each visit multiplying the whole tile by that expert's weight and storing only the group's rows. The
items are computed in XLA from `group_sizes` (`group_metadata`) and prefetched into SMEM: each item's row tile, its
expert, whether it is the tile's first visit (which zeroes the rows no group owns) and whether it is real. Items go
in row order, so the visits of one output tile are consecutive and the tile stays in VMEM between them. The item
axis has a static length, `row tiles + E - 1` (the most (tile, group) pairs E groups over the row tiles can make);
the unused items at the end repeat the last real item's blocks (no new DMA) and compute nothing. Empty groups have
no items.

Tiles come from the dense kernels' plan (`tpu_tiles.plan_affine` for one expert's [K, N] weight, so the same
legality rules and VMEM estimate hold; the M tile capped at `MAX_BM` rows, since a tile shared by groups is
multiplied once per group). See docs/kernels.md ("Grouped (mixture-of-experts) kernel").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._common import affine_geometry, cdiv, pad_to, split_even_odd
from .tpu import _affine_dequant, _compute_dtype, _dot, _side_rows, _staging_shape, _vmem
from .tpu_tiles import generation, plan_affine, staging

MAX_BM = 128


def grouped_geometry(fmt: str, x, group_sizes, codes, scales, group_size=None):
    """(M, K, N, E, group size, per_channel) of a grouped call; ValueError naming what does not match."""
    if x.ndim != 2:
        raise ValueError(f"grouped {fmt}: x must be [M, K], got shape {tuple(x.shape)}")
    if codes.ndim != 3 or scales.ndim != 3 or codes.shape[0] != scales.shape[0]:
        raise ValueError(f"grouped {fmt}: codes {tuple(codes.shape)} / scales {tuple(scales.shape)} must be stacked "
                         "[E, rows, N] with the same E")
    e = codes.shape[0]
    if tuple(group_sizes.shape) != (e,):
        raise ValueError(f"grouped {fmt}: group_sizes must be [{e}] (one per expert), got {tuple(group_sizes.shape)}")
    m, k, n, g, per_channel = affine_geometry(fmt, x, codes[0], scales[0], group_size)
    return m, k, n, e, g, per_channel


def group_metadata(group_sizes, m: int, bm: int):
    """The work items of a grouped call over `m` rows in tiles of `bm` (module docstring): int32 arrays
    (tile, expert, first visit of its tile, real) of static length `cdiv(m, bm) + E - 1`, and the groups' row
    offsets [E + 1]. Groups are clipped to the m rows (as `ragged_dot`, rows past m do not exist)."""
    e = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    offsets = jnp.concatenate([starts, ends[-1:]])
    nonempty = ends > starts
    first_tile = starts // bm
    count = jnp.where(nonempty, (jnp.maximum(ends, 1) - 1) // bm - first_tile + 1, 0)
    cum = jnp.cumsum(count)
    total = cum[-1]
    n_items = cdiv(m, bm) + e - 1
    i = jnp.arange(n_items, dtype=jnp.int32)
    last = jnp.maximum(total - 1, 0)
    j = jnp.minimum(i, last)  # unused items repeat the last real one
    grp = jnp.searchsorted(cum, j, side="right").astype(jnp.int32)
    grp = jnp.minimum(grp, e - 1)
    tile = first_tile[grp] + j - (cum[grp] - count[grp])
    real = (i < total).astype(jnp.int32)
    first = jnp.concatenate([jnp.ones((1,), jnp.int32), (tile[1:] != tile[:-1]).astype(jnp.int32)])
    return tile.astype(jnp.int32), grp, first * real, real, offsets


def _grouped_kernel(tile_ref, grp_ref, first_ref, real_ref, off_ref, *refs, fmt, rpg, cdt, staged, sb, bm, nk):
    n_x = 2 if fmt == "int4" else 1
    x_refs, (c_ref, s_ref, z_ref, o_ref, acc_ref), scratch = refs[:n_x], refs[n_x:n_x + 5], refs[n_x + 5:]
    it, kk = pl.program_id(1), pl.program_id(2)

    @pl.when(real_ref[it] == 1)
    def _():
        @pl.when(kk == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        s, z = _side_rows((s_ref, z_ref), scratch, staged, sb, kk)
        if fmt == "int4":
            c = c_ref[...].astype(jnp.int32)  # [bk/2, bn]; byte i = (k=2i low, k=2i+1 high)
            part = (_dot(x_refs[0][...].astype(cdt), _affine_dequant(c & 0xF, s, z, rpg, cdt), cdt)
                    + _dot(x_refs[1][...].astype(cdt), _affine_dequant(c >> 4, s, z, rpg, cdt), cdt))
        else:
            part = _dot(x_refs[0][...].astype(cdt), _affine_dequant(c_ref[...], s, z, rpg, cdt), cdt)
        acc_ref[...] += part

        @pl.when(kk == nk - 1)
        def _():
            g = grp_ref[it]
            rows = tile_ref[it] * bm + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
            mine = (rows >= off_ref[g]) & (rows < off_ref[g + 1])
            prev = o_ref[...]
            prev = jnp.where(first_ref[it] == 1, jnp.zeros_like(prev), prev)
            o_ref[...] = jnp.where(mine, acc_ref[...].astype(o_ref.dtype), prev)


def _compiler_params(vmem_limit: int):
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return cls(dimension_semantics=("parallel", "arbitrary", "arbitrary"), vmem_limit_bytes=int(vmem_limit))


def plan_grouped(fmt: str, m: int, k: int, n: int, g: int, per_channel: bool, *, x_dtype, s_dtype, gen=None,
                 block_m=None, block_n=None, block_k=None):
    """(Tiles, staged) of a grouped call: one expert's dense plan (`plan_affine`) with the M tile capped at
    `MAX_BM`."""
    sub = 16 if jnp.dtype(x_dtype).itemsize == 2 else 8
    bm = block_m or min(-(-m // sub) * sub, MAX_BM)
    return plan_affine(fmt, m, k, n, g, per_channel, x_dtype=x_dtype, s_dtype=s_dtype, gen=gen, block_m=bm,
                       block_n=block_n, block_k=block_k)


def grouped_matmul_tpu(fmt: str, x, group_sizes, codes, scales, zeros, group_size=None, *, interpret=False,
                       gen=None, block_m=None, block_n=None, block_k=None):
    """x [M, K] (rows sorted by expert) -> [M, N] in x.dtype; `fmt` "int4" or "int8" (module docstring)."""
    m, k, n, e, g, per_channel = grouped_geometry(fmt, x, group_sizes, codes, scales, group_size)
    t, _ = plan_grouped(fmt, m, k, n, g, per_channel, x_dtype=x.dtype, s_dtype=scales.dtype, gen=gen,
                        block_m=block_m, block_n=block_n, block_k=block_k)
    cdt = _compute_dtype(x.dtype)
    xp = pad_to(x, (t.mp, t.kp))
    code_rows = t.kp // 2 if fmt == "int4" else t.kp
    codes = pad_to(codes, (e, code_rows, t.np_))
    sg = 1 if per_channel else t.kp // g
    scales, zeros = pad_to(scales, (e, sg, t.np_)), pad_to(zeros, (e, sg, t.np_))
    sb = 1 if per_channel else t.bk // g
    staged = staging(per_channel, sb, t.bk, t.kp, scales.dtype, gen or generation())
    nk = t.kp // t.bk
    tile, grp, first, real, offsets = group_metadata(group_sizes, m, t.bm)

    def kstep(it, kk, real_ref):  # an unused item keeps the last real item's K block: no DMA
        return jnp.where(real_ref[it] == 1, kk, nk - 1)

    kb = t.bk // 2 if fmt == "int4" else t.bk
    x_spec = pl.BlockSpec((t.bm, kb), lambda j, it, kk, tl, gr, fi, re, of: (tl[it], kstep(it, kk, re)))
    c_spec = pl.BlockSpec((None, kb, t.bn), lambda j, it, kk, tl, gr, fi, re, of: (gr[it], kstep(it, kk, re), j))
    if per_channel:
        side = pl.BlockSpec((None, 1, t.bn), lambda j, it, kk, tl, gr, fi, re, of: (gr[it], 0, j))
        s_spec = z_spec = side
    else:
        step = pl.BlockSpec((None, sb, t.bn), lambda j, it, kk, tl, gr, fi, re, of: (gr[it], kstep(it, kk, re), j))
        whole = pl.BlockSpec((None, sg, t.bn), lambda j, it, kk, tl, gr, fi, re, of: (gr[it], 0, j))
        s_spec, z_spec = (whole if st else step for st in staged)
    x_args = split_even_odd(xp) if fmt == "int4" else (xp,)
    scratch = ([_vmem((t.bm, t.bn), jnp.float32)]
               + [_vmem(_staging_shape(sg, sb, t.bn), jnp.float32)] * sum(staged))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(t.np_ // t.bn, tile.shape[0], nk),
        in_specs=[x_spec] * len(x_args) + [c_spec, s_spec, z_spec],
        out_specs=pl.BlockSpec((t.bm, t.bn), lambda j, it, kk, tl, gr, fi, re, of: (tl[it], j)),
        scratch_shapes=scratch,
    )
    rpg = 1 if per_channel else (g // 2 if fmt == "int4" else g)
    bytes_accessed = (xp.size * xp.dtype.itemsize + codes.size + scales.size * scales.dtype.itemsize + zeros.size
                      + t.mp * t.np_ * x.dtype.itemsize)
    out = pl.pallas_call(
        functools.partial(_grouped_kernel, fmt=fmt, rpg=rpg, cdt=cdt, staged=staged, sb=sb, bm=t.bm, nk=nk),
        out_shape=jax.ShapeDtypeStruct((t.mp, t.np_), x.dtype),
        grid_spec=grid_spec,
        compiler_params=_compiler_params(t.vmem_limit),
        cost_estimate=pl.CostEstimate(flops=2 * t.mp * t.np_ * t.kp, transcendentals=0,
                                      bytes_accessed=int(bytes_accessed)),
        interpret=interpret,
        name=f"lrmq_grouped_{fmt}_matmul_tpu",
    )(tile, grp, first, real, offsets, *x_args, codes, scales, zeros)
    # rows no group owns (past sum(group_sizes)) sit in tiles no item visits, or were zeroed on a first visit
    rows = jnp.arange(m)[:, None]
    return jnp.where(rows < offsets[-1], out[:m, :n], jnp.zeros((), x.dtype))
