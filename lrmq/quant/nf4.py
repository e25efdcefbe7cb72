"""bitsandbytes NF4 (QLoRA base weights) with double quantization.

"bitsandbytes-exact" here means: 4-bit codes, packed bytes and per-block absmax equal bitsandbytes'
`quantize_4bit(..., quant_type="nf4")` bit for bit (checked against bitsandbytes 0.50.2's CPU backend,
tests/test_nf4.py::test_against_installed_bitsandbytes), and so does the dequantized weight without
double quant. With double quant the offset and a few nested 8-bit codes are not bit-exact (below).

Layout (docs/DESIGN.md): the lrmq weight [K, N] is transposed to torch orientation [N, K] and flattened
row-major; blocks of `block_size` (default 64) consecutive elements share one float32 absmax.

quantize (bnb quantize_4bit; CUDA kQuantizeBlockwise<NF4> agrees on non-zero blocks):
    x = f32(w) * f32(1 / absmax[block]);  q = #{t in NF4_THRESHOLDS : x > t}
  i.e. bucketize on the midpoints between neighbouring code values, a value exactly on a midpoint goes
  to the lower code (bnb's decision tree uses strict `>`, torch.bucketize the same). bnb clamps absmax
  at 1e-38 before the reciprocal: an all-zero block stores absmax 0 and gets x = 0, code 7 (0.0); a
  partial last block is divided, x = w / am, and stores the clamped am (1e-38 when all zero).
pack: two codes per byte, even element in the high nibble; codes stored as uint8 [N, K/2].
double quant (bnb `compress_statistics=True`):
    offset = mean(absmax);  r = absmax - offset
    blockwise over r with block 256: s2 = max|r| per block (f32), x = clamp(r * f32(1/s2), -1, 1),
    absmax_codes = index of the nearest value of bnb's signed dynamic map (ties -> lower index).
dequant:
    absmax = f32(dynamic_map[absmax_codes] * s2[block // 256]) + offset
    w[N, K] = f32(NF4_CODE[q] * absmax[block]) -> cast to dtype -> transpose to [K, N]

Where bnb differs (measured with bitsandbytes 0.50.2 CPU; not reproduced):
  * offset: torch's float32 `mean` (a vectorised cascade sum whose order depends on the CPU's vector
    width and thread count) vs our fixed pairwise tree: equal in ~60% of arrays, else 1-3 ulp. Every
    dequantized absmax then differs by that much, and so do most dequantized weights (last bits).
  * second-level 8-bit codes: bnb's CPU kernel's approximate binary search does not always pick the
    nearest map value; we do (as bnb's torch fallback, argmin |x - code|): ~0.16% of nested codes
    differ, always by one index. A second-level block whose residuals are all zero maps to the 0.0 code.
  * weights that are subnormal: XLA CPU flushes them to zero, so such a block is an all-zero block.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from lrmq.quant.packing import pack_nibbles_high_first, unpack_nibbles_high_first
from lrmq.quant.quantizers import QUANTIZERS, exact_div
from lrmq.quant.qweight import QuantizedWeight

# bnb get_4bit_type("nf4"), index 0..15 (float32 values).
NF4_CODE = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=np.float32,
)
# Midpoints computed in float64 then rounded to float32: the constants of bnb's dQuantizeNF4 tree.
NF4_THRESHOLDS = ((NF4_CODE[:-1].astype(np.float64) + NF4_CODE[1:]) / 2).astype(np.float32)

NESTED_BLOCK_SIZE = 256
_ABSMAX_MIN = 1e-38  # bnb quantize_4bit: absmax.clamp(min=1e-38) before the reciprocal


def _f32_fma(a, b, c):
    # Single-rounded a*b + c in float32 (products of a float32 and a small int are exact in float64).
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _torch_linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace(start, end, steps) in float32 on CPU: step = (end - start) / (steps - 1); the first
    half is start + step*i, the second half end - step*(steps-1-i), each a fused multiply-add."""
    f = np.float32
    start, end = f(start), f(end)
    step = f(f(end - start) / f(steps - 1))
    half = steps // 2
    return np.array(
        [_f32_fma(step, i, start) if i < half else _f32_fma(-step, steps - 1 - i, end) for i in range(steps)],
        dtype=np.float32,
    )


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """bitsandbytes `functional.create_dynamic_map` reproduced in float32 numpy (256 sorted values).

    For each exponent i the fraction grid is linspace(0.1, 1, 2^(i + nsb - meb) + 1) (signed) or
    2^(i + nsb - meb + 1) + 1 (unsigned); the bucket means times 10^(i - meb + 1) (and their negatives
    when signed) are the values; 0 and 1.0 are appended, the rest padded with zeros, then sorted.
    """
    f = np.float32
    data: list[float] = []
    # bnb writes `total_bits - (1 if signed else 1)`: one bit is reserved in both cases.
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        n = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        b = _torch_linspace_f32(0.1, 1.0, int(n))
        means = ((b[:-1] + b[1:]) / f(2.0)).astype(np.float32)
        mult = f(10.0 ** (-(max_exponent_bits - 1) + i))
        data += (mult * means).astype(np.float32).tolist()
        if signed:
            data += (-mult * means).astype(np.float32).tolist()
    if additional_items > 0:
        b = _torch_linspace_f32(0.1, 1.0, additional_items + 1)
        means = ((b[:-1] + b[1:]) / f(2.0)).astype(np.float32)
        mult = f(10.0 ** (-(max_exponent_bits - 1) + i))  # bnb reuses the last loop's i
        data += (mult * means).astype(np.float32).tolist()
        if signed:
            data += (-mult * means).astype(np.float32).tolist()
    data.append(0.0)
    data.append(1.0)
    if len(data) != 2**total_bits:
        raise ValueError(f"dynamic map has {len(data)} values, expected {2**total_bits}")
    data += [0.0] * (256 - len(data))
    return np.sort(np.array(data, dtype=np.float32))


DYNAMIC_MAP = create_dynamic_map(signed=True)


def _pad_to(x, multiple):
    rem = (-x.shape[0]) % multiple
    return jnp.pad(x, (0, rem)) if rem else x


def pairwise_mean_f32(x):
    """Mean of a 1-D float32 array with a fixed pairwise summation tree (zero-padded to a power of 2)."""
    n = x.shape[0]
    p = 1 << max(0, (n - 1).bit_length())
    s = jnp.pad(x.astype(jnp.float32), (0, p - n))
    while s.shape[0] > 1:
        s = s[0::2] + s[1::2]
    return exact_div(s[0], n)


def _blockwise_absmax(flat, block):
    n = flat.shape[0]
    nb = -(-n // block)
    # zero padding does not change max|.| of the partial last block
    return jnp.max(jnp.abs(_pad_to(flat, block).reshape(nb, block)), axis=1)


def quantize_dynamic_blockwise(x, block: int = NESTED_BLOCK_SIZE):
    """bnb `quantize_blockwise(x, code=dynamic map, blocksize=block)`: (uint8 codes, f32 absmax)."""
    x = x.astype(jnp.float32)
    n = x.shape[0]
    absmax = _blockwise_absmax(x, block)
    inv = jnp.float32(1.0) / absmax
    xs = _pad_to(x, block).reshape(-1, block) * inv[:, None]
    xs = jnp.where(absmax[:, None] == 0, 0.0, jnp.clip(xs, -1.0, 1.0)).reshape(-1)[:n]
    code = jnp.asarray(DYNAMIC_MAP)
    # nearest value; the map is sorted and distinct so only the two neighbours can win
    hi = jnp.clip(jnp.searchsorted(code, xs, side="left"), 1, 255)
    lo = hi - 1
    d_lo = jnp.abs(xs - code[lo])
    d_hi = jnp.abs(xs - code[hi])
    idx = jnp.where(d_lo <= d_hi, lo, hi)
    return idx.astype(jnp.uint8), absmax


def dequantize_dynamic_blockwise(codes, absmax, block: int = NESTED_BLOCK_SIZE):
    n = codes.shape[0]
    vals = jnp.asarray(DYNAMIC_MAP)[codes.astype(jnp.int32)]
    return (_pad_to(vals, block).reshape(-1, block) * absmax[:, None]).reshape(-1)[:n]


_dequantize_dynamic_jit = jax.jit(dequantize_dynamic_blockwise, static_argnums=2)


def double_quant_absmax(absmax_codes, absmax_scales, absmax_offset):
    """absmax = f32(code[c] * s2[block // 256]) + offset, the product rounded before the add as in bnb.

    XLA CPU/GPU contract a multiply feeding an add into one FMA inside a compiled computation (an
    optimization_barrier does not stop it), so the product and the add run as separate computations.
    Under an enclosing jit they fuse again and may differ from bnb by 1 ulp.
    """
    prod = _dequantize_dynamic_jit(absmax_codes, absmax_scales, NESTED_BLOCK_SIZE)
    return prod + absmax_offset


def _check_weight(w, block_size):
    if w.ndim != 2:
        raise ValueError(f"NF4 weight must be 2-D [K, N], got shape {tuple(w.shape)}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"NF4 weight must be floating, got dtype {w.dtype}")
    if w.shape[0] % 2:
        raise ValueError(f"NF4 needs an even K to pack two codes per byte, got weight shape {tuple(w.shape)}")
    if not isinstance(block_size, (int, np.integer)) or block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size must be a positive even int, got {block_size!r}")


def nf4_codes(w, block_size: int = 64):
    """Unpacked NF4 codes (uint8 [N*K], torch flat order) and raw absmax (f32 [ceil(N*K/block)])."""
    _check_weight(w, block_size)
    flat = w.T.reshape(-1).astype(jnp.float32)
    n = flat.shape[0]
    full = n - n % block_size
    absmax = _blockwise_absmax(flat, block_size)
    # bnb quantize_4bit: full blocks x = A * (1 / absmax.clamp(min=1e-38)) with the unclamped absmax
    # stored (an all-zero block gives x = 0 -> code 7, value 0); the partial last block divides,
    # A / am, and stores the clamped am.
    # 1e-38 is subnormal and XLA CPU flushes subnormals to zero, so the zero block is selected, not
    # computed: 0 * (1 / 1e-38) = 0 (a block of subnormal weights is flushed to zero all the same).
    zero = absmax == 0
    inv = jnp.float32(1.0) / absmax
    x = _pad_to(flat, block_size).reshape(-1, block_size) * inv[:, None]
    x = jnp.where(zero[:, None], jnp.float32(0), x).reshape(-1)[:n]
    if full < n:
        x = x.at[full:].set(jnp.where(zero[-1], jnp.float32(0), exact_div(flat[full:], absmax[-1])))
        absmax = absmax.at[-1].set(jnp.where(zero[-1], jnp.float32(_ABSMAX_MIN), absmax[-1]))
    # q = #{t : x > t}; searchsorted(side="left") counts t < x (torch.bucketize(x, thresholds)).
    # A NaN weight compares false everywhere in bnb's CUDA tree -> code 0.
    q = jnp.searchsorted(jnp.asarray(NF4_THRESHOLDS), x, side="left")
    q = jnp.where(jnp.isnan(x), 0, q)
    return q.astype(jnp.uint8), absmax


@partial(jax.jit, static_argnums=(1, 2))
def _nf4_quant_impl(w, block_size, double_quant):
    K, N = w.shape
    q, absmax = nf4_codes(w, block_size)
    codes = pack_nibbles_high_first(q.reshape(N, K))
    if not double_quant:
        return codes, absmax, {}
    offset = pairwise_mean_f32(absmax)
    a_codes, a_scales = quantize_dynamic_blockwise(absmax - offset, NESTED_BLOCK_SIZE)
    return codes, absmax, dict(absmax_codes=a_codes, absmax_scales=a_scales, absmax_offset=offset)


def nf4_quantize(w, block_size: int = 64, double_quant: bool = True):
    """Quantize lrmq [K, N] to a bitsandbytes NF4 `QuantizedWeight`."""
    _check_weight(w, block_size)
    K, N = w.shape
    codes, scales, extra = _nf4_quant_impl(w, int(block_size), bool(double_quant))
    if double_quant:  # outside the jit above: see double_quant_absmax
        scales = double_quant_absmax(extra["absmax_codes"], extra["absmax_scales"], extra["absmax_offset"])
    return QuantizedWeight(
        codes=codes,
        scales=scales,
        fmt="nf4",
        bits=4,
        group_size=0,
        shape=(int(K), int(N)),
        dtype=jnp.dtype(w.dtype).name,
        symmetric=False,
        block_size=int(block_size),
        double_quant=bool(double_quant),
        **extra,
    )


def nf4_absmax(qw):
    """Per-block absmax used for dequantization (recomputed from the double-quant state if present)."""
    if qw.double_quant:
        return double_quant_absmax(qw.absmax_codes, qw.absmax_scales, qw.absmax_offset)
    return qw.scales


def nf4_dequantize(qw):
    """NF4 `QuantizedWeight` -> array [K, N] in qw.dtype."""
    if qw.fmt != "nf4":
        raise ValueError(f"nf4_dequantize needs fmt='nf4', got fmt={qw.fmt!r}")
    K, N = qw.shape
    if tuple(qw.codes.shape) != (N, K // 2):
        raise ValueError(f"NF4 codes shape {tuple(qw.codes.shape)} != {(N, K // 2)} for weight shape {(K, N)}")
    # scales == nf4_absmax(qw): the double-quant absmax is stored dequantized
    return _nf4_dequant_impl(qw.codes, qw.scales, qw.block_size, jnp.dtype(qw.dtype))


@partial(jax.jit, static_argnums=(2, 3))
def _nf4_dequant_impl(codes, absmax, bs, dtype):
    N, K = codes.shape[0], codes.shape[1] * 2
    q = unpack_nibbles_high_first(codes).reshape(-1).astype(jnp.int32)
    n = q.shape[0]
    vals = jnp.asarray(NF4_CODE)[q]
    w = (_pad_to(vals, bs).reshape(-1, bs) * absmax.astype(jnp.float32)[:, None]).reshape(-1)[:n]
    return w.astype(dtype).reshape(N, K).T


def nf4_fake_quant(w, block_size: int = 64, double_quant: bool = True):
    return nf4_dequantize(nf4_quantize(w, block_size, double_quant))


@QUANTIZERS.register("nf4")
def nf4(w, *, bits: int = 4, group_size: int = 64):
    """bitsandbytes NF4 with double quantization; group_size is bnb's block size (flattened torch order)."""
    if bits != 4:
        raise ValueError(f"quantizer 'nf4' needs bits=4, got bits={bits}")
    return nf4_fake_quant(w, block_size=group_size, double_quant=True)
