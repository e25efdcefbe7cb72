"""Tile plans of the Mosaic TPU kernels (`pallas_kernels.tpu`): per-generation facts, block
legality, VMEM estimates and the (bm, bn, bk) choice. Pure Python: no kernel is built here, so the
whole grid of plans can be checked in milliseconds (tests/test_tpu_compile.py). See docs/kernels.md.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax.numpy as jnp

from ._common import cdiv, round_up
from .target import current_target

MiB = 1 << 20


# ----------------------------------------------------------------------------------- generations
@dataclasses.dataclass(frozen=True)
class Generation:
    """What tile choice needs to know about one TPU generation (per TensorCore)."""

    name: str
    vmem_bytes: int  # VMEM capacity of one TensorCore
    scoped_default: int  # XLA's scoped-VMEM limit for a kernel that does not set one
    mxu: int  # systolic array width: 128 up to v5, 256 on v6e / 7x
    sublanes16: int  # second-minor HBM tiling of 16-bit arrays: 8 before TPU7x, 16 from 7x
    cores: int  # TensorCores behind one device (2: megacore splits the parallel grid axes)

    @property
    def vmem_limit(self) -> int:
        # 3/4 of capacity: always legal (the old fixed 48 MiB exceeded v4's 16 MiB) and leaves
        # room for Mosaic's internal scratch; above the scoped default everywhere but v4.
        return self.vmem_bytes * 3 // 4


# Capacities and scoped defaults were read off XLA:TPU's own compile errors (libtpu 0.0.42.1,
# ahead-of-time topologies); MXU widths from jax's tpu_info.
GENERATIONS = {
    "v4": Generation("v4", 16 * MiB, 16 * MiB, 128, 8, 2),
    "v5e": Generation("v5e", 128 * MiB, 16 * MiB, 128, 8, 1),
    "v5p": Generation("v5p", 64 * MiB, 16 * MiB, 128, 8, 2),
    "v6e": Generation("v6e", 128 * MiB, 32 * MiB, 256, 8, 1),
    "7x": Generation("7x", 64 * MiB, 32 * MiB, 256, 16, 1),
}
# Unknown kind (jax.export for "tpu", interpret mode): tiles legal on every generation above.
PORTABLE = Generation("portable", 16 * MiB, 16 * MiB, 128, 16, 1)

_KINDS = {
    "TPU v4": "v4", "TPU v4 lite": "v4",
    "TPU v5 lite": "v5e", "TPU v5e": "v5e",
    "TPU v5": "v5p", "TPU v5p": "v5p",
    "TPU v6 lite": "v6e", "TPU v6e": "v6e",
    "TPU7x": "7x", "TPU7": "7x",
}


def generation(device_kind: str | None = None) -> Generation:
    """The Generation of a device kind ("TPU v5 lite", ...); None: the current target's."""
    if device_kind is None:
        device_kind = current_target().device_kind
    return GENERATIONS.get(_KINDS.get(device_kind or ""), PORTABLE)


# ------------------------------------------------------------------------------------- helpers
def _lcm(a, b):
    return a * b // math.gcd(a, b)


def _sublanes(dtype, gen: Generation) -> int:
    """Second-minor tiling of a `dtype` HBM array: a block's rows must be a multiple of it."""
    bits = jnp.dtype(dtype).itemsize * 8
    if bits == 32:
        return 8
    return gen.sublanes16 if bits == 16 else 8 * (32 // bits)


def _buf(rows: int, cols: int, dtype) -> int:
    """VMEM bytes of a [rows, cols] buffer (padded to its native (8*packing, 128) tile)."""
    item = jnp.dtype(dtype).itemsize
    return round_up(max(rows, 1), 8 * (4 // item)) * round_up(max(cols, 1), 128) * item


# ----------------------------------------------------------------------------------------- tiles
@dataclasses.dataclass(frozen=True)
class Tiles:
    bm: int
    bn: int
    bk: int
    mp: int  # padded sizes
    np_: int
    kp: int
    vmem_limit: int = 16 * MiB


_BK_CANDIDATES = (8192, 4096, 2048, 1024, 512, 256, 128)
# Pallas overlaps step s+1's DMA with step s; the first DMA is exposed. Prefer tiles giving at
# least this many grid steps so the exposed part stays <= 1/8 of the weight stream.
_MIN_STEPS = 8
# Fraction of the VMEM limit the tile estimate may use (the estimate is approximate).
_BUDGET = 0.8
# Cap on a dequantized weight tile (bk * bn elements). 1M int4 elements are 512 KiB of codes per
# grid step, enough to amortise the ~0.35 us per-step overhead against 0.8-1.6 TB/s of HBM;
# larger tiles only add f32 temporaries (spilled through VMEM) and Mosaic compile time, which
# grows with the unrolled tile (4M-element tiles took 10-20 s to compile).
_MAX_TILE = 1 << 20
_MAX_BM = 256
# Mosaic's scoped VMEM beyond the double-buffered blocks and scratch (bytes per element), read
# off XLA:TPU's "Scoped allocation with size ..." reports: the dequantized weight tile (int4 /
# int8: 4; NF4: ~30 for the code transpose and select tree), and with f32 activations the bf16x3
# split that HIGHEST-precision dots make of both operands (6 per x and per weight element; e.g.
# int8 g128, M=256, a full-K 9728x256 tile, f32: 53.6 MiB measured). Rounded up: an
# over-estimate only shrinks tiles, an under-estimate fails to compile (E1001 scoped VMEM OOM).
_AFFINE_TEMP_BYTES = 4
_NF4_TEMP_BYTES = 32
_F32_SPLIT_BYTES = 6


def _temporaries(bm, bn, bk, x_dtype, per_weight) -> int:
    t = per_weight * bk * bn
    if jnp.dtype(x_dtype).itemsize == 4:
        t += _F32_SPLIT_BYTES * (bm * bk + bk * bn)
    return t


def _bn_candidates(n: int, decode: bool, gen: Generation, m_blocks: int) -> list[int]:
    if n % 128:
        return [n] if n <= 2048 else [512]  # full-dim block (legal for any N) or pad
    # Decode streams weights: wide tiles move more bytes per grid step. Prefill reuses each
    # dequantized tile over bm rows: narrower tiles keep the f32 temporaries small.
    prefs = (1024, 512, 256, 128) if decode else (512, 256, 128)
    divisors = [c for c in prefs if n % c == 0]
    # v6e / 7x: a 128-wide tile feeds half of the 256-wide MXU; use full-width tiles if N allows.
    cands = [c for c in divisors if c % gen.mxu == 0] or divisors
    if gen.cores > 1 and m_blocks % gen.cores:
        # Megacore splits the parallel axes over 2 cores: keep the N blocks a multiple of 2.
        cands.sort(key=lambda c: (n // c) % gen.cores != 0)
    return cands


def _pick_bk(k, k_align, fits: Callable[[int, int], bool], other_steps: int) -> int | None:
    """bk for one (bm, bn): the largest legal bk (an aligned divisor of K, or K itself: a
    full-dim block is always legal) within the tile cap and VMEM budget that still gives
    >= _MIN_STEPS grid steps, else the fitting one giving the most steps. If none fits, a full-K
    block up to 4x the cap (K=9728 with g=128 has no aligned divisor: the only alternative is
    padding, i.e. copying the weight every call). None if even that does not fit."""
    legal = {c for c in _BK_CANDIDATES if c < k and k % c == 0 and c % k_align == 0} | {k}
    ok = sorted((c for c in legal if fits(c, _MAX_TILE, _BUDGET)), reverse=True)
    if not ok:
        # The last resort before padding may use the whole limit (the estimate's margin is for
        # choosing between legal tiles; K=N=1000 f32 on v4: 10.9 MiB estimated, compiles at 12).
        return k if fits(k, 4 * _MAX_TILE, 1.0) else None
    enough = [c for c in ok if other_steps * (k // c) >= _MIN_STEPS]
    return enough[0] if enough else ok[-1]


def choose_tiles(m: int, k: int, n: int, *, x_dtype, k_align: int, gen: Generation | None = None,
                 vmem_need: Callable[[int, int, int], int] | None = None, block_m=None,
                 block_n=None, block_k=None) -> Tiles:
    """Pick (bm, bn, bk), padded sizes and the VMEM limit for generation `gen`.

    Block rules: last dim a multiple of 128 or the full dim; second-last a multiple of the
    dtype's sublane tiling or the full dim. `k_align` is the format's K-side rule (x halves
    lane-aligned, scale rows per step a multiple of their tiling) unless bk == K (all K blocks
    full-dim). `vmem_need(bm, bn, bk)` estimates the kernel's VMEM bytes."""
    gen = gen or generation()
    need = vmem_need or (lambda bm_, bn_, bk_: bk_ * bn_ * 16)
    sub = 16 if jnp.dtype(x_dtype).itemsize == 2 else 8
    bm = block_m or min(round_up(m, sub), _MAX_BM)
    while True:
        m_blocks = cdiv(m, bm)
        for bn in ([block_n] if block_n else _bn_candidates(n, bm <= 64, gen, m_blocks)):
            other = m_blocks * cdiv(n, bn)
            fits = lambda c, cap, frac: (  # noqa: B023,E731
                c * bn <= cap and need(bm, bn, c) <= frac * gen.vmem_limit)
            bk = block_k or _pick_bk(k, k_align, fits, other)
            if bk is not None:
                return Tiles(bm, bn, bk, round_up(m, bm), round_up(n, bn), round_up(k, bk),
                             gen.vmem_limit)
        if block_m or bm <= sub:
            break
        bm = max(sub, round_up(bm // 2, sub))
    # Nothing legal fits without padding K (copies the weight every call): smallest aligned bk.
    bn = block_n or _bn_candidates(n, bm <= 64, gen, cdiv(m, bm))[-1]
    bk = block_k or round_up(k_align, 256)
    return Tiles(bm, bn, bk, round_up(m, bm), round_up(n, bn), round_up(k, bk), gen.vmem_limit)


# ------------------------------------------------------------------------- affine (int4 / int8)
def _staging_bytes(rows_total, rows, bn) -> int:
    if rows % 8 == 0:
        return _buf(rows_total, bn, jnp.float32)
    return rows_total // rows * _buf(rows, bn, jnp.float32)


def _affine_vmem_need(*, fmt, x_dtype, s_dtype, g, per_channel, k_rows_total, gen):
    """VMEM estimate (bytes) of the int4 / int8 kernel for tiles (bm, bn, bk): double-buffered
    blocks + accumulator + side-array staging + dequant temporaries."""
    xb = jnp.dtype(x_dtype)

    def need(bm, bn, bk):
        code_rows = bk // 2 if fmt == "int4" else bk
        sb = 1 if per_channel else bk // g
        s_st, z_st = staging(per_channel, sb, bk, k_rows_total * g, s_dtype, gen)
        sr, zr = (k_rows_total if s_st else sb), (k_rows_total if z_st else sb)
        io = (_buf(bm, bk, xb) + _buf(code_rows, bn, jnp.uint8) + _buf(sr, bn, s_dtype)
              + _buf(zr, bn, jnp.uint8) + _buf(bm, bn, xb))
        scratch = (_buf(bm, bn, jnp.float32)
                   + (s_st + z_st) * _staging_bytes(k_rows_total, sb, bn))
        return 2 * io + scratch + _temporaries(bm, bn, bk, x_dtype, _AFFINE_TEMP_BYTES)

    return need


def staging(per_channel, sb, bk, k, s_dtype, gen) -> tuple[bool, bool]:
    """(scales, zeros) staged whole per N block: their per-step block would not be tile-legal."""
    if per_channel or bk == k:
        return False, False
    return sb % _sublanes(s_dtype, gen) != 0, sb % _sublanes(jnp.uint8, gen) != 0


def _staged(per_channel, sb, bk, k, gen) -> bool:
    """Whether grouped uint8 zeros must be staged (their per-step block is not tile-legal)."""
    return staging(per_channel, sb, bk, k, jnp.float32, gen)[1]


def _affine_k_align(fmt, g, per_channel, s_dtype, gen, stage_scales=False) -> int:
    # int4: each x half [bm, bk/2] is lane-aligned; every bk a multiple of the MXU depth.
    base = _lcm(256 if fmt == "int4" else 128, gen.mxu)
    if per_channel:
        return base
    if stage_scales:  # any whole number of groups per step
        return _lcm(base, g)
    return _lcm(base, g * _sublanes(s_dtype, gen))  # bk/g scale rows per step, tile-aligned


def plan_affine(fmt: str, m: int, k: int, n: int, g: int, per_channel: bool, *, x_dtype,
                s_dtype, gen: Generation | None = None, block_m=None, block_n=None,
                block_k=None) -> tuple[Tiles, bool]:
    """(tiles, staged) of an int4 / int8 call: the Tiles, and whether the grouped uint8 zero
    points are staged whole per N block (their per-step block would not be tile-legal). Scales
    are staged too where no K step with whole scale tiles fits without padding K (see
    `_staging`)."""
    gen = gen or generation()
    need = _affine_vmem_need(fmt=fmt, x_dtype=x_dtype, s_dtype=s_dtype, g=g,
                             per_channel=per_channel, k_rows_total=k // g, gen=gen)
    t = None
    for stage_scales in (False, True):
        k_align = _affine_k_align(fmt, g, per_channel, s_dtype, gen, stage_scales)
        t = choose_tiles(m, k, n, x_dtype=x_dtype, k_align=k_align, gen=gen, vmem_need=need,
                         block_m=block_m, block_n=block_n, block_k=block_k)
        # Padding K copies the whole weight every call; staged scales (a few KiB) avoid it.
        if t.kp == k or per_channel or block_k:
            break
    if not per_channel and t.bk % g:
        raise ValueError(f"{fmt}: block_k={t.bk} must be a multiple of group_size={g}")
    if fmt == "int4" and t.bk % 2:
        raise ValueError("int4: block_k must be even")
    return t, _staged(per_channel, 1 if per_channel else t.bk // g, t.bk, t.kp, gen)


# ----------------------------------------------------------------------------------------- nf4
def _nf4_vmem_need(x_dtype, block_size):
    xb = jnp.dtype(x_dtype)

    def need(bm, bn, bk):
        io = (_buf(bm, bk, xb) + _buf(bn, bk // 2, jnp.uint8)
              + _buf(bk // block_size, bn, jnp.float32) + _buf(bm, bn, xb))
        return 2 * io + _buf(bm, bn, jnp.float32) + _temporaries(bm, bn, bk, x_dtype,
                                                                  _NF4_TEMP_BYTES)

    return need


def plan_nf4(m: int, k: int, n: int, block_size: int, *, x_dtype, gen: Generation | None = None,
             block_m=None, block_n=None, block_k=None) -> Tiles:
    # x halves and the [bn, bk/2] code tile lane-aligned; bk/bs f32 absmax rows tile-aligned.
    gen = gen or generation()
    k_align = _lcm(_lcm(256, gen.mxu), 8 * block_size)
    t = choose_tiles(m, k, n, x_dtype=x_dtype, k_align=k_align, gen=gen,
                     vmem_need=_nf4_vmem_need(x_dtype, block_size), block_m=block_m,
                     block_n=block_n, block_k=block_k)
    if t.bk % block_size:
        raise ValueError(f"nf4: block_k={t.bk} must be a multiple of block_size={block_size}")
    return t
