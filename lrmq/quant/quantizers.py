"""Round-to-nearest integer quantizers on lrmq-orientation weights [K, N] (in, out).

Groups run along K (axis 0): group i covers rows [i*g, (i+1)*g) of every output column, so scales and
zeros are [K/g, N]. llm-awq works on torch weights [out, in] with groups along `in`; that is the same
partition of the same matrix, transposed, so the numbers are identical.

All math is float32 regardless of the weight dtype; results are cast back to `w.dtype`.
`fake_quant(w) == dequantize_codes(quantize_codes(w, *compute_qparams(w)))` holds bit for bit because
fake_quant is literally that composition.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from lrmq.registry import Registry

QUANTIZERS: Registry = Registry("quantizer")  # "nf4" is registered by lrmq.quant.nf4

# llm-awq clamps (max - min) at 1e-5 (asymmetric) and absmax at 1e-5 (symmetric branch) so constant
# groups get a finite scale.
_ASYM_RANGE_MIN = 1e-5
_SYM_ABSMAX_MIN = 1e-5
# paper-1 (rlquant QuantizedLinear) per-tensor scale floor.
_PER_TENSOR_SCALE_MIN = 1e-6


def exact_div(a, b):
    """IEEE a / b elementwise. XLA rewrites `A / broadcast(B)` into `A * broadcast(1 / B)` and
    `a / (b / c)` into `(a * c) / b`, each off by an ulp in many cases (enough to flip a round-half);
    dividing by an opaque full-shape operand keeps the true quotient so codes match torch/llm-awq bit
    for bit. Use it for every division whose result is rounded or compared with a reference."""
    a = jnp.asarray(a)
    b = jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape)
    return a / jax.lax.optimization_barrier(b)


def check_bits(bits) -> int:
    if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an int in 2..8, got {bits!r}")
    return int(bits)


def resolve_group_size(shape, group_size) -> int:
    """Validate a [K, N] weight shape and group size; -1 (or K) means one group per output channel."""
    if len(shape) != 2:
        raise ValueError(f"weight must be 2-D [K, N] (in, out), got shape {tuple(shape)}")
    K = int(shape[0])
    if not isinstance(group_size, (int, np.integer)) or isinstance(group_size, bool):
        raise TypeError(f"group_size must be an int, got {group_size!r}")
    g = K if group_size in (-1, K) else int(group_size)
    if g <= 0 or K % g:
        raise ValueError(
            f"group_size={group_size} must be -1 or a positive divisor of K for weight shape "
            f"{tuple(shape)} (K={K})"
        )
    return g


def _check_float(name, w):
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating array, got dtype {w.dtype}")


def _grouped(w, g):
    K, N = w.shape
    return w.astype(jnp.float32).reshape(K // g, g, N)


def compute_qparams(w, bits: int, group_size: int, symmetric: bool):
    """Per-group scales (f32 [K/g, N]) and unsigned zero points (uint8 [K/g, N]). `group_size` 0: one scale (and
    zero) for the whole tensor, repeated in every column ([1, N]; codes then take group_size -1).

    asymmetric (llm-awq `pseudo_quantize_tensor`, zero_point=True):
        scale = clamp(max - min, 1e-5) / (2^b - 1);  zero = clamp(-round(min / scale), 0, 2^b - 1)
    symmetric:
        scale = clamp(absmax, 1e-5) / (2^(b-1) - 1);  zero = 2^(b-1)
    """
    bits = check_bits(bits)
    _check_float("w", w)
    if isinstance(group_size, (int, np.integer)) and not isinstance(group_size, bool) and group_size == 0:
        resolve_group_size(w.shape, -1)  # the shape check
        s, z = _qparams_impl(w.reshape(-1, 1), bits, int(np.prod(w.shape)), bool(symmetric))
        return jnp.broadcast_to(s, (1, w.shape[1])), jnp.broadcast_to(z, (1, w.shape[1]))
    g = resolve_group_size(w.shape, group_size)
    return _qparams_impl(w, bits, g, bool(symmetric))


# Jitted cores: one compile per (shape, bits, group, mode) instead of one per primitive in eager use.
@partial(jax.jit, static_argnums=(1, 2, 3))
def _qparams_impl(w, bits, g, symmetric):
    wg = _grouped(w, g)
    if symmetric:
        absmax = jnp.max(jnp.abs(wg), axis=1)
        scales = exact_div(jnp.maximum(absmax, _SYM_ABSMAX_MIN), 2 ** (bits - 1) - 1)
        zeros = jnp.full(scales.shape, 2 ** (bits - 1), dtype=jnp.uint8)
    else:
        qmax = 2**bits - 1
        mx, mn = jnp.max(wg, axis=1), jnp.min(wg, axis=1)
        scales = exact_div(jnp.maximum(mx - mn, _ASYM_RANGE_MIN), qmax)
        # Not `mn / scales`: XLA folds a / (b / c) into (a * c) / b, which gives exactly -3.5 (W3) where
        # the reference's f32 quotient is -3.4999998 (every group clipped to [-m, m] is such a tie).
        zeros = jnp.clip(-jnp.round(exact_div(mn, scales)), 0, qmax).astype(jnp.uint8)
    return scales.astype(jnp.float32), zeros


def _check_qparams(w_shape, scales, zeros, g):
    want = (w_shape[0] // g, w_shape[1])
    if tuple(scales.shape) != want:
        raise ValueError(f"scales shape {tuple(scales.shape)} != {want} for weight {tuple(w_shape)}, group_size {g}")
    if tuple(zeros.shape) != want:
        raise ValueError(f"zeros shape {tuple(zeros.shape)} != {want} for weight {tuple(w_shape)}, group_size {g}")


def quantize_codes(w, scales, zeros, bits: int, group_size: int):
    """q = clamp(round(w / scale) + zero, 0, 2^b - 1) as uint8 [K, N] (unpacked)."""
    bits = check_bits(bits)
    _check_float("w", w)
    g = resolve_group_size(w.shape, group_size)
    _check_qparams(w.shape, scales, zeros, g)
    return _codes_impl(w, scales, zeros, bits, g)


@partial(jax.jit, static_argnums=(3, 4))
def _codes_impl(w, scales, zeros, bits, g):
    wg = _grouped(w, g)
    s = scales.astype(jnp.float32)[:, None, :]
    z = zeros.astype(jnp.float32)[:, None, :]
    # Division (not multiply-by-reciprocal) as in llm-awq, so codes match it exactly.
    q = jnp.clip(jnp.round(exact_div(wg, s)) + z, 0, 2**bits - 1)
    return q.reshape(w.shape).astype(jnp.uint8)


def dequantize_codes(codes, scales, zeros, group_size: int, dtype=jnp.float32):
    """w = (q - z) * s in float32, cast to `dtype`; codes uint8 [K, N] unpacked."""
    if codes.ndim != 2:
        raise ValueError(f"codes must be 2-D [K, N], got shape {tuple(codes.shape)}")
    g = resolve_group_size(codes.shape, group_size)
    _check_qparams(codes.shape, scales, zeros, g)
    return _dequant_impl(codes, scales, zeros, g, jnp.dtype(dtype))


@partial(jax.jit, static_argnums=(3, 4))
def _dequant_impl(codes, scales, zeros, g, dtype):
    K, N = codes.shape
    q = codes.astype(jnp.float32).reshape(K // g, g, N)
    w = (q - zeros.astype(jnp.float32)[:, None, :]) * scales.astype(jnp.float32)[:, None, :]
    return w.reshape(K, N).astype(dtype)


def fake_quant(w, bits: int, group_size: int, symmetric: bool):
    """dequantize(quantize(w)) with the same dtype as w (group_size 0: per tensor)."""
    scales, zeros = compute_qparams(w, bits, group_size, symmetric)
    group_size = -1 if group_size == 0 else group_size
    codes = quantize_codes(w, scales, zeros, bits, group_size)
    return dequantize_codes(codes, scales, zeros, group_size, w.dtype)


def pseudo_quantize_awq(w, bits: int = 4, group_size: int = 128):
    """llm-awq `pseudo_quantize_tensor(w, n_bit=bits, zero_point=True, q_group_size=group_size)`.

    llm-awq takes torch [out, in] and groups along `in`; here w is [K, N] = [in, out] with groups along
    K, i.e. `ours(W.T).T == llm_awq(W)`. llm-awq computes in the weight dtype (fp16); we use float32.
    """
    return fake_quant(w, bits, group_size, symmetric=False)


def per_tensor_scale(w, bits: int = 8):
    """Symmetric per-tensor scale max(absmax / (2^(b-1) - 1), 1e-6) (rlquant QuantizedLinear)."""
    bits = check_bits(bits)
    _check_float("w", w)
    absmax = jnp.max(jnp.abs(w.astype(jnp.float32)))
    return jnp.maximum(exact_div(absmax, 2 ** (bits - 1) - 1), _PER_TENSOR_SCALE_MIN)


def per_tensor_codes(w, bits: int = 8, scale=None):
    """(q, S): q = clamp(round(w / S), -2^(b-1), 2^(b-1) - 1) in float32, S = per_tensor_scale(w) unless given."""
    bits = check_bits(bits)
    _check_float("w", w)
    s = per_tensor_scale(w, bits) if scale is None else jnp.asarray(scale, jnp.float32)
    return jnp.clip(jnp.round(exact_div(w.astype(jnp.float32), s)), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1), s


def fake_quant_per_tensor(w, bits: int = 8, scale=None):
    """q * S of `per_tensor_codes`, in w's dtype.

    Paper-1 QAT fixes S from the base weights at load and passes it here on every step.
    """
    q, s = per_tensor_codes(w, bits, scale)
    return (q * s).astype(w.dtype)


@QUANTIZERS.register("rtn_asym")
def rtn_asym(w, *, bits: int = 4, group_size: int = 128):
    return fake_quant(w, bits, group_size, symmetric=False)


@QUANTIZERS.register("rtn_sym")
def rtn_sym(w, *, bits: int = 4, group_size: int = 128):
    return fake_quant(w, bits, group_size, symmetric=True)


@QUANTIZERS.register("int8")
def int8_per_channel(w, *, bits: int = 8, group_size: int = -1):
    """Symmetric int8; per output channel by default."""
    if bits != 8:
        raise ValueError(f"quantizer 'int8' needs bits=8, got bits={bits}")
    return fake_quant(w, 8, group_size, symmetric=True)
