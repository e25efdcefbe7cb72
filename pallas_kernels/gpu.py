"""Pallas GPU (Triton backend) weight-only dequant-matmul kernels (int4, int8, NF4).

Triton has no cross-program accumulator scratch, so each program owns one (bm, bn) output tile
and runs the K reduction itself (`lax.fori_loop`, which Triton software-pipelines with
`num_stages`). For decode shapes the (M/bm, N/bn) grid has too few programs to fill an H100/H200
(132 SMs), so the K range is optionally split over a third grid axis ("split-K"); each split
writes an f32 partial [S, M, N] that the wrapper sums.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .target import Gpu, target_gpu
from ._common import affine_geometry, cdiv, nf4_lookup, pad_to, round_up, split_even_odd

try:  # the Triton backend module moved between releases
    from jax.experimental.pallas import triton as _pltriton
except ImportError:  # pragma: no cover - pre-0.4.31 layout
    from jax.experimental.pallas import gpu as _pltriton

_HI = jax.lax.Precision.HIGHEST
_TARGET_PROGRAMS = 264  # ~2 waves on a 132-SM H100/H200
SMEM_SLACK = 4096  # bytes Triton may add beyond `smem_bytes`'s terms (barriers, alignment)


def smem_bytes(fmt: str, bm: int, bn: int, bk: int, x_dtype, num_stages: int, gpu: Gpu) -> int:
    """Shared memory one program of a dequant-matmul kernel takes, an upper bound on what Triton allocates.

    Terms (read off the compiled kernels' allocations for H200 and A100, 78 tiles each: benchmarks/
    gpu_aot_kernels.py, docs/kernels.md): (num_stages - 1) copies of one K step's loads (x, codes, a scale row) for
    the software pipeline, the dequantized weight tile in the compute dtype (a dot operand), on sm_90 the 16-bit
    x tile too, and SMEM_SLACK; at least the f32 accumulator tile, which the epilogue's layout conversion may stage
    in shared memory."""
    xb = jnp.dtype(x_dtype).itemsize
    cb = _cdt(x_dtype).itemsize
    if fmt == "int4":
        step = bm * bk * xb + bk // 2 * bn + bn * (xb + 1)
    elif fmt == "int8":
        step = bm * bk * xb + bk * bn + bn * (xb + 1)
    elif fmt == "nf4":
        step = bm * bk * xb + bn * bk // 2 + bn * 4
    else:
        raise ValueError(f"unknown format {fmt!r}")
    x_operand = bm * bk * cb if cb == 2 and gpu.capability >= (9, 0) else 0
    return max((num_stages - 1) * step + bk * bn * cb + x_operand + SMEM_SLACK, bm * bn * 4)


def _pow2(v) -> bool:
    return isinstance(v, int) and v >= 1 and v & (v - 1) == 0


def check_tiles(fmt: str, bm: int, bn: int, bk: int, x_dtype, num_stages: int, num_warps: int | None,
                gpu: Gpu) -> None:
    """ValueError naming the rule a tile plan breaks, before Triton sees it: power-of-two blocks (Triton's
    tensors), 1 <= num_warps <= 32 a power of two, num_stages >= 1, and `smem_bytes` within the GPU's per-block
    shared memory (past it XLA fails with RESOURCE_EXHAUSTED: Shared memory size limit exceeded)."""
    for name, v in (("block_m", bm), ("block_n", bn), ("block_k", bk)):
        if not _pow2(v):
            raise ValueError(f"{fmt} GPU kernel: {name}={v}: Triton tiles must be powers of two")
    if num_warps is not None and not (_pow2(num_warps) and num_warps <= 32):
        raise ValueError(f"{fmt} GPU kernel: num_warps={num_warps}: a power of two from 1 to 32")
    if not (isinstance(num_stages, int) and num_stages >= 1):
        raise ValueError(f"{fmt} GPU kernel: num_stages={num_stages}: at least 1")
    need = smem_bytes(fmt, bm, bn, bk, x_dtype, num_stages, gpu)
    if need > gpu.smem_per_block:
        raise ValueError(
            f"{fmt} GPU kernel: tile {bm}x{bn}x{bk} (block_m x block_n x block_k) with num_stages={num_stages} and "
            f"{jnp.dtype(x_dtype).name} activations needs ~{need // 1024} KiB of shared memory per block, past the "
            f"{gpu.name}'s {gpu.smem_per_block // 1024} KiB: take a smaller block_m / block_n / block_k or fewer "
            f"num_stages")


def _compiler_params(num_warps, num_stages):
    cls = getattr(_pltriton, "CompilerParams", None) or getattr(_pltriton, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


@dataclasses.dataclass(frozen=True)
class Tiles:
    bm: int
    bn: int
    bk: int
    splits: int
    mp: int
    np_: int
    kp: int


def _pow2_floor(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def choose_tiles(m: int, k: int, n: int, *, k_unit: int, block_m=None, block_n=None,
                 block_k=None, splits=None, fmt: str | None = None, x_dtype=jnp.bfloat16, num_stages: int = 3,
                 num_warps: int | None = None, gpu: Gpu | None = None) -> Tiles:
    """Triton tensors must have power-of-two shapes and tl.dot needs every dim >= 16.

    `k_unit` is the format's largest legal K step (the group / block size, so one scale row per
    step); bk is a power of two dividing it. With `fmt`, the tiles are fitted to `gpu`'s shared memory
    (`smem_bytes`; default `target_gpu()`): a default bk, then bn, is halved until they fit, and a plan that
    still does not fit (or an override that breaks a rule) is refused by `check_tiles`."""
    gpu = gpu or target_gpu()
    bm = block_m or max(16, min(128 if m >= 128 else 64, 1 << (max(m, 1) - 1).bit_length()))
    bn = block_n or (64 if m <= 16 else 128)
    bk_cap = 128 if m > 64 else 256
    if m > 64 and fmt in ("int4", "nf4") and gpu.capability < (9, 0):
        # no wgmma before sm_90: a 128x128 tile's mma.sync operands, the two dequantized nibble planes and their
        # int32 codes live in registers, and at bk=64 / 128 ptxas spills (A100: 76 B to 11 KB per thread,
        # docs/kernels.md); bk=32 does not
        bk_cap = 32
    bk = block_k or min(_pow2_floor(k_unit), bk_cap)
    if fmt is not None:
        fits = lambda: smem_bytes(fmt, bm, bn, bk, x_dtype, num_stages, gpu) <= gpu.smem_per_block  # noqa: E731
        while block_k is None and bk > 32 and not fits():
            bk //= 2
        while block_n is None and bn > 32 and not fits():
            bn //= 2
        check_tiles(fmt, bm, bn, bk, x_dtype, num_stages, num_warps, gpu)
    mp, np_ = round_up(m, bm), round_up(n, bn)
    kp = round_up(k, bk)
    nk = kp // bk
    if splits is None:
        programs = (mp // bm) * (np_ // bn)
        want = max(1, min(cdiv(_TARGET_PROGRAMS, programs), nk // 4 or 1))
        splits = max(s for s in range(1, want + 1) if nk % s == 0)
    if nk % splits:
        raise ValueError(f"splits={splits} must divide the {nk} K steps")
    return Tiles(bm, bn, bk, splits, mp, np_, kp)


def _cdt(dtype):
    return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize == 2 else jnp.dtype(jnp.float32)


def _dot(a, b, cdt, transpose_b=False):
    # f32 inputs: IEEE (Triton would otherwise be free to use TF32).
    prec = _HI if cdt == jnp.float32 else None
    dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _call(kernel, t: Tiles, in_specs, args, out_dtype, m, n, name, num_warps=None, num_stages=3,
          interpret=False):
    if num_warps is None:  # a 128x128 f32 accumulator needs 8 warps to stay in registers
        num_warps = 8 if t.bm * t.bn >= 128 * 128 else 4
    partial = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((t.splits, t.mp, t.np_), jnp.float32),
        grid=(t.mp // t.bm, t.np_ // t.bn, t.splits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, t.bm, t.bn), lambda i, j, s: (s, i, j)),
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(*args)
    out = partial[0] if t.splits == 1 else partial.sum(axis=0)
    return out[:m, :n].astype(out_dtype)


def _steps(t: Tiles):
    """(first K step, number of K steps) of this program's split."""
    per = (t.kp // t.bk) // t.splits
    return pl.program_id(2) * per, per


# ---------------------------------------------------------------------------------------- int4
def _int4_kernel(xe_ref, xo_ref, c_ref, s_ref, z_ref, o_ref, *, t: Tiles, g, cdt):
    h = t.bk // 2
    first, count = _steps(t)

    def body(step, acc):
        kk = first + step
        off = pl.multiple_of(kk * h, h)
        row = 0 if g is None else (kk * t.bk) // g  # bk divides g: one scale row per step
        s = s_ref[pl.ds(row, 1), :].astype(jnp.float32)  # [1, bn]
        z = z_ref[pl.ds(row, 1), :].astype(jnp.float32)
        c = c_ref[pl.ds(off, h), :].astype(jnp.int32)  # [bk/2, bn]
        w_even = (((c & 0xF).astype(jnp.float32) - z) * s).astype(cdt)
        w_odd = (((c >> 4).astype(jnp.float32) - z) * s).astype(cdt)
        acc += _dot(xe_ref[:, pl.ds(off, h)].astype(cdt), w_even, cdt)
        acc += _dot(xo_ref[:, pl.ds(off, h)].astype(cdt), w_odd, cdt)
        return acc

    acc = jax.lax.fori_loop(0, count, body, jnp.zeros((t.bm, t.bn), jnp.float32))
    o_ref[...] = acc


def int4_matmul_gpu(x, codes, scales, zeros, group_size, *, interpret=False, block_m=None,
                    block_n=None, block_k=None, splits=None, num_warps=None, num_stages=3):
    m, k, n, g, per_channel = affine_geometry("int4", x, codes, scales, group_size)
    if not per_channel and (g & -g) < 32:
        raise NotImplementedError(f"int4 GPU kernel needs a group size divisible by 32, got {g}")
    t = choose_tiles(m, k, n, k_unit=256 if per_channel else (g & -g), block_m=block_m,
                     block_n=block_n, block_k=block_k, splits=splits, fmt="int4", x_dtype=x.dtype,
                     num_stages=num_stages, num_warps=num_warps)
    if not per_channel and g % t.bk:
        raise ValueError(f"int4: block_k={t.bk} must divide group_size={g}")
    xe, xo = split_even_odd(pad_to(x, (t.mp, t.kp)))
    codes = pad_to(codes, (t.kp // 2, t.np_))
    sg = 1 if per_channel else t.kp // g
    scales, zeros = pad_to(scales, (sg, t.np_)), pad_to(zeros, (sg, t.np_))
    kernel = functools.partial(_int4_kernel, t=t, g=None if per_channel else g, cdt=_cdt(x.dtype))
    in_specs = [
        pl.BlockSpec((t.bm, t.kp // 2), lambda i, j, s: (i, 0)),
        pl.BlockSpec((t.bm, t.kp // 2), lambda i, j, s: (i, 0)),
        pl.BlockSpec((t.kp // 2, t.bn), lambda i, j, s: (0, j)),
        pl.BlockSpec((sg, t.bn), lambda i, j, s: (0, j)),
        pl.BlockSpec((sg, t.bn), lambda i, j, s: (0, j)),
    ]
    return _call(kernel, t, in_specs, (xe, xo, codes, scales, zeros), x.dtype, m, n,
                 "lrmq_int4_matmul_gpu", num_warps, num_stages, interpret)


# ---------------------------------------------------------------------------------------- int8
def _int8_kernel(x_ref, c_ref, s_ref, z_ref, o_ref, *, t: Tiles, g, cdt):
    first, count = _steps(t)

    def body(step, acc):
        kk = first + step
        off = pl.multiple_of(kk * t.bk, t.bk)
        row = 0 if g is None else (kk * t.bk) // g
        s = s_ref[pl.ds(row, 1), :].astype(jnp.float32)
        z = z_ref[pl.ds(row, 1), :].astype(jnp.float32)
        w = ((c_ref[pl.ds(off, t.bk), :].astype(jnp.float32) - z) * s).astype(cdt)
        return acc + _dot(x_ref[:, pl.ds(off, t.bk)].astype(cdt), w, cdt)

    o_ref[...] = jax.lax.fori_loop(0, count, body, jnp.zeros((t.bm, t.bn), jnp.float32))


def int8_matmul_gpu(x, codes, scales, zeros, *, interpret=False, block_m=None, block_n=None,
                    block_k=None, splits=None, num_warps=None, num_stages=3):
    m, k, n, g, per_channel = affine_geometry("int8", x, codes, scales)
    if not per_channel and (g & -g) < 16:
        raise NotImplementedError(f"int8 GPU kernel needs a group size divisible by 16, got {g}")
    t = choose_tiles(m, k, n, k_unit=128 if per_channel else (g & -g), block_m=block_m,
                     block_n=block_n, block_k=block_k, splits=splits, fmt="int8", x_dtype=x.dtype,
                     num_stages=num_stages, num_warps=num_warps)
    if not per_channel and g % t.bk:
        raise ValueError(f"int8: block_k={t.bk} must divide group_size={g}")
    xp = pad_to(x, (t.mp, t.kp))
    codes = pad_to(codes, (t.kp, t.np_))
    sg = 1 if per_channel else t.kp // g
    scales, zeros = pad_to(scales, (sg, t.np_)), pad_to(zeros, (sg, t.np_))
    kernel = functools.partial(_int8_kernel, t=t, g=None if per_channel else g, cdt=_cdt(x.dtype))
    in_specs = [
        pl.BlockSpec((t.bm, t.kp), lambda i, j, s: (i, 0)),
        pl.BlockSpec((t.kp, t.bn), lambda i, j, s: (0, j)),
        pl.BlockSpec((sg, t.bn), lambda i, j, s: (0, j)),
        pl.BlockSpec((sg, t.bn), lambda i, j, s: (0, j)),
    ]
    return _call(kernel, t, in_specs, (xp, codes, scales, zeros), x.dtype, m, n,
                 "lrmq_int8_matmul_gpu", num_warps, num_stages, interpret)


# ----------------------------------------------------------------------------------------- nf4
def _nf4_kernel(xe_ref, xo_ref, c_ref, a_ref, o_ref, *, t: Tiles, bs, cdt):
    h = t.bk // 2
    first, count = _steps(t)

    def body(step, acc):
        kk = first + step
        off = pl.multiple_of(kk * h, h)
        a = a_ref[:, pl.ds((kk * t.bk) // bs, 1)].astype(jnp.float32)  # [bn, 1]
        c = c_ref[:, pl.ds(off, h)].astype(jnp.int32)  # [bn, bk/2] torch orientation
        w_even = (nf4_lookup(c >> 4) * a).astype(cdt)  # bnb: even k in the high nibble
        w_odd = (nf4_lookup(c & 0xF) * a).astype(cdt)
        acc += _dot(xe_ref[:, pl.ds(off, h)].astype(cdt), w_even, cdt, transpose_b=True)
        acc += _dot(xo_ref[:, pl.ds(off, h)].astype(cdt), w_odd, cdt, transpose_b=True)
        return acc

    o_ref[...] = jax.lax.fori_loop(0, count, body, jnp.zeros((t.bm, t.bn), jnp.float32))


def nf4_matmul_gpu(x, codes, absmax, block_size: int = 64, *, interpret=False, block_m=None,
                   block_n=None, block_k=None, splits=None, num_warps=None, num_stages=3):
    m, k = x.shape
    n = codes.shape[0]
    if codes.shape[1] * 2 != k or k % block_size:
        raise ValueError(f"nf4: codes {codes.shape} / block_size {block_size} vs K={k}")
    if (block_size & -block_size) < 32:
        raise NotImplementedError(f"nf4 GPU kernel needs block_size divisible by 32, got {block_size}")
    t = choose_tiles(m, k, n, k_unit=block_size & -block_size, block_m=block_m, block_n=block_n,
                     block_k=block_k, splits=splits, fmt="nf4", x_dtype=x.dtype, num_stages=num_stages,
                     num_warps=num_warps)
    if block_size % t.bk:
        raise ValueError(f"nf4: block_k={t.bk} must divide block_size={block_size}")
    xe, xo = split_even_odd(pad_to(x, (t.mp, t.kp)))
    codes = pad_to(codes, (t.np_, t.kp // 2))
    nbp = t.kp // block_size
    absmax = pad_to(absmax.reshape(n, k // block_size).astype(jnp.float32), (t.np_, nbp))
    kernel = functools.partial(_nf4_kernel, t=t, bs=block_size, cdt=_cdt(x.dtype))
    in_specs = [
        pl.BlockSpec((t.bm, t.kp // 2), lambda i, j, s: (i, 0)),
        pl.BlockSpec((t.bm, t.kp // 2), lambda i, j, s: (i, 0)),
        pl.BlockSpec((t.bn, t.kp // 2), lambda i, j, s: (j, 0)),
        pl.BlockSpec((t.bn, nbp), lambda i, j, s: (j, 0)),
    ]
    return _call(kernel, t, in_specs, (xe, xo, codes, absmax), x.dtype, m, n,
                 "lrmq_nf4_matmul_gpu", num_warps, num_stages, interpret)
