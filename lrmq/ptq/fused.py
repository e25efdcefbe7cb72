"""Fused CPU kernels (numba) for the QuantLRM importance pass.

Each kernel reads a weight pair once, element by element: bf16 widened by a 16-bit shift, ``|a - b|``
in float32, then either the positive-value histograms of the exact median (:func:`hist_positive`) or
the per-input-channel sums of the importance (:func:`importance_sums`).  They replace numpy pipelines
that wrote a block-sized temporary per step (~7-20 ns per value per pass on this project's 2-core
machine; these take ~1-2 ns).

Every float operation is the float32 operation of the numpy path in :mod:`lrmq.ptq.importance`
(same operands, same order, no fast-math), so results are bit-identical; the tests compare them.

Inputs are 1-D (histograms) or 2-D C-contiguous ``[out, in]`` (importance) arrays of ``uint16``
(bfloat16 bit patterns) or ``float32``; :func:`as_kernel_array` makes them.  All kernels release the
GIL, so the drivers run them on a thread pool.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

NBINS = 1 << 16

# mapping ids (importance.MAPPINGS names -> kernel branch)
MAPPING_IDS = {"u_shape": 0, "inverted_u": 1, "increasing": 2, "decreasing": 3, "constant": 4}


def as_kernel_array(w: np.ndarray) -> np.ndarray:
    """C-contiguous kernel input: bfloat16 as its uint16 bit patterns (no copy if contiguous),
    float32 as is, other dtypes converted to float32."""
    if w.dtype.name == "bfloat16":
        return np.ascontiguousarray(w).view(np.uint16)
    return np.ascontiguousarray(w, dtype=np.float32)


# scalar bit casts (numba has array views only; a view-through-buffer blocks vectorisation)
@intrinsic
def _f32_from_bits(typingctx, u):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _bits_of_f32(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


def _f32(v):
    """float32 value of one element: a uint16 is a bfloat16 bit pattern (pure-Python semantics; the
    compiled version below is chosen by the element type, so kernels have no per-element branch)."""
    if isinstance(v, np.uint16):
        return np.uint32(np.uint32(v) << np.uint32(16)).view(np.float32)
    return np.float32(v)


@overload(_f32, inline="always")
def _f32_compiled(v):
    if v == types.uint16:
        # bf16 -> float32 is exact: the bf16 bits become the top half of the float32 pattern
        return lambda v: _f32_from_bits(np.uint32(v) << np.uint32(16))
    return lambda v: np.float32(v)


def _value(sa, sb, j):
    """x[j]: ``sa[j]`` (values) or ``|sa[j] - sb[j]|`` (a weight pair), as float32 (Python meaning;
    kernels use the compiled overload, chosen by whether ``sb`` is None)."""
    if sb is None:
        return _f32(sa[j])
    return abs(_f32(sa[j]) - _f32(sb[j]))


@overload(_value, inline="always")
def _value_compiled(sa, sb, j):
    if isinstance(sb, types.NoneType):
        return lambda sa, sb, j: _f32(sa[j])
    return lambda sa, sb, j: abs(_f32(sa[j]) - _f32(sb[j]))


@nb.njit(inline="always")
def _stage_bits(sa, sb, bits, vmin1, vmax):
    """bits[j] = float32 pattern of x[j] if positive else 0 (vectorised); (#non-positive, min-1, max)."""
    non_pos = 0
    for j in range(sa.size):
        x = _value(sa, sb, j)
        v = _bits_of_f32(x) if x > np.float32(0) else np.uint32(0)
        bits[j] = v
        non_pos += v == np.uint32(0)
        vmin1 = min(vmin1, np.uint32(v - np.uint32(1)))
        vmax = max(vmax, v)
    return non_pos, vmin1, vmax


_STAGE = 1024  # values per staging block of hist_positive (L1-resident)
N_COPIES = 8  # interleaved top histograms: consecutive equal values do not serialise on one counter


@nb.njit(nogil=True, cache=True)
def hist_positive(a, b, top, low, lo_bucket, n_low, mm):
    """Histograms of the positive values of ``|f32(a) - f32(b)|`` (or of ``a`` itself if ``b`` is
    None) over two same-length 1-D arrays.  Zeros and NaN are not positive (as ``x[x > 0]``).

    ``top[N_COPIES * 65536]``: counts by the top 16 bits of the float32 pattern, value j counted in
    copy ``j % N_COPIES`` (sum the copies); non-positive values are counted in bucket 0 and returned,
    so the caller subtracts them.  ``low[n_low * 65536]``: counts by the low 16 bits within the
    top-16 buckets ``lo_bucket .. lo_bucket + n_low - 1`` (the median bracket; non-positives included
    if ``lo_bucket == 0``).  ``mm``: uint32 (min bits, max bits) of the positives, updated in place
    (init 0xFFFFFFFF, 0).  Returns the number of non-positive values.
    """
    # index arithmetic: block slices indexed by range() and unsigned scatter indices let numba skip
    # its negative-index wraparound branch, which otherwise blocks vectorisation (~10x slower)
    lo_bits = np.uint64(lo_bucket) << np.uint64(16)
    n_bracket_bits = np.uint64(n_low) << np.uint64(16)
    vmin1, vmax = mm[0] - np.uint32(1), mm[1]  # min over v - 1: non-positives (v = 0) wrap to the top
    non_pos = 0
    bits = np.empty(_STAGE, np.uint32)
    sel = np.empty(_STAGE, np.uint64)
    n = a.size
    for s in range(0, n, _STAGE):
        m = min(_STAGE, n - s)
        if b is None:  # resolved at compile time (b's type is None or an array)
            z, vmin1, vmax = _stage_bits(a[s : s + m], None, bits, vmin1, vmax)
        else:
            z, vmin1, vmax = _stage_bits(a[s : s + m], b[s : s + m], bits, vmin1, vmax)
        non_pos += z
        k = np.uint64(0)
        for j in range(m):  # top histogram; bracket members compacted branch-free into `sel`
            v = np.uint64(bits[j])
            top[(np.uint64(j % N_COPIES) << np.uint64(16)) | (v >> np.uint64(16))] += 1
            r = v - lo_bits  # wraps above the bracket when v is below it
            sel[k] = r
            k += np.uint64(r < n_bracket_bits)
        for i in range(k):
            low[sel[i]] += 1
    vmin = vmin1 + np.uint32(1)
    mm[0], mm[1] = vmin, vmax
    return non_pos


@nb.njit(inline="always")
def _q(x, mapping, mid, left, right, r1, half_r1):
    # branch-free (selects only) so that the caller's loop vectorises
    one = np.float32(1)
    zero = np.float32(0)
    # u: numpy's min(d, 0)/left + max(d, 0)/right (the other term is +-0), clipped to [-1, 1]
    d = x - mid
    ul = d / left  # both quotients, then a select: a selected divisor compiles to a branch
    ur = d / right
    u = ul if d < zero else ur
    u = -one if u < -one else u
    u = one if u > one else u
    uu = u * u
    t0 = uu * r1  # u_shape: (u*u)*(R-1), as importance.u_shape
    t1 = r1 * (one - uu)  # inverted_u
    t2 = half_r1 * (u + one)  # increasing
    t3 = half_r1 * (one - u)  # decreasing
    t = t0 if mapping == 0 else (t1 if mapping == 1 else (t2 if mapping == 2 else t3))
    # zero updates map to 1 (numpy: t * (x != 0) + 1); "constant" (4) is 1 everywhere
    return (t + one) if (x != zero and mapping != 4) else one


@nb.njit(inline="always")
def _round_fp16(q):
    # nearest float16 value (ties to even) of a float32 in float16's normal range, kept as float32:
    # add half an fp16 ulp minus one (plus the kept lsb, for ties) to the bits, truncate 13 bits
    v = _bits_of_f32(q)
    v = (v + (np.uint32(0x0FFF) + ((v >> np.uint32(13)) & np.uint32(1)))) & np.uint32(0xFFFFE000)
    return _f32_from_bits(v)


@nb.njit(nogil=True, cache=True)
def importance_sums(a, b, mapping, mid, left, right, r1, half_r1, fp16, zero_max, block_rows, acc, zeros):
    """Per-column sums of the mapped ``q(|dW|)`` (float16-rounded if ``fp16``) and zero counts.

    ``a``, ``b``: 2-D C-contiguous ``[out, in]``; ``acc[in]`` float64 and ``zeros[in]`` int64 are
    accumulated in place.  ``mid, left, right``: float32 median and the two floored denominators;
    ``r1 = f32(R - 1)``, ``half_r1 = f32((R - 1) / 2)``; ``zero_max``: 2^-25 (fp16 zero test) or 0;
    ``mapping``: :data:`MAPPING_IDS`.

    The sums are exact, so their order does not matter: q values are multiples of 2^-10 (fp16) or
    2^-23 (fp32) in [1, R], exact in float64.  With ``block_rows > 0`` (caller's promise: fp16 and
    ``block_rows * round16(R) <= 2^14``) each block of rows is summed in float32 first -- exact below
    2^14 -- which keeps the inner loop in 32-bit lanes (about twice as fast).
    """
    rows, cols = a.shape
    step = block_rows if block_rows > 0 else rows
    acc32 = np.zeros(cols, np.float32)
    z32 = np.zeros(cols, np.float32)
    one = np.float32(1)
    zero = np.float32(0)
    for r0 in range(0, rows, max(step, 1)):
        for i in range(r0, min(r0 + step, rows)):
            ra = a[i]
            rb = b[i]
            if block_rows > 0:
                for j in range(cols):
                    x = abs(_f32(ra[j]) - _f32(rb[j]))
                    acc32[j] += _round_fp16(_q(x, mapping, mid, left, right, r1, half_r1))
                    z32[j] += one if x <= zero_max else zero
            else:
                for j in range(cols):
                    x = abs(_f32(ra[j]) - _f32(rb[j]))
                    q = _q(x, mapping, mid, left, right, r1, half_r1)
                    acc[j] += np.float64(_round_fp16(q) if fp16 else q)
                    zeros[j] += np.int64(x <= zero_max)
        if block_rows > 0:
            for j in range(cols):
                acc[j] += np.float64(acc32[j])
                zeros[j] += np.int64(z32[j])
                acc32[j] = zero
                z32[j] = zero


def warm_up() -> None:
    """Load (or compile, the first time) the kernels for the common argument types: numba's
    start-up is ~0.3 s per process even with cached machine code (the benchmark reports it apart)."""
    for dt in (np.uint16, np.float32):
        a = np.zeros(8, dt)
        top = np.zeros(N_COPIES * NBINS, np.int64)
        low = np.zeros(NBINS, np.int64)
        mm = np.array([0xFFFFFFFF, 0], np.uint32)
        hist_positive(a, a, top, low, 0, 1, mm)
        ro = a.copy()
        ro.flags.writeable = False  # mapped checkpoint tensors are read-only: a separate signature
        hist_positive(ro, ro, top, low, 0, 1, mm)
        a2, ro2 = a.reshape(2, 4), ro.reshape(2, 4)
        acc, z = np.zeros(4), np.zeros(4, np.int64)
        f = np.float32(1)
        for x in (a2, ro2):
            for block_rows in (0, 1):
                importance_sums(x, x, 0, f, f, f, f, f, True, f, block_rows, acc, z)
