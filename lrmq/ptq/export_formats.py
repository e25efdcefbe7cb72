"""Pure array conversions from lrmq int codes to interchange checkpoint formats.

Input everywhere: unpacked unsigned ``codes`` uint8 ``[K, N]`` (lrmq orientation, in x out),
``scales`` float32 ``[K/g, N]``, unsigned ``zeros`` ``[K/g, N]``; dequant ``w = (code - zero) * scale``.
Model-level writing (names, safetensors, config.json) lives elsewhere.

* AutoAWQ GEMM (``quant_method: awq``, 4-bit only): ``qweight`` int32 ``[K, N/8]``, ``qzeros`` int32
  ``[K/g, N/8]``, nibble ``i`` (bits 4i..4i+3) of word ``[r, c]`` holds column ``8c + AWQ_ORDER[i]``;
  ``scales`` float16 ``[K/g, N]``.  Zeros unsigned, no offset.
* compressed-tensors ``pack-quantized`` (``pack_to_int32``): ``32 // b`` values per int32 word
  (3-bit: 10 values, the top 2 bits unused -- values never straddle words), little-endian (value
  ``i`` of a word at bits ``b*i``), zero-padded to a whole word.  Weights are torch-oriented
  ``[N, K]`` and packed along K: ``weight_packed`` ``[N, ceil(K / (32//b))]``.  Values are signed
  ``[-2^(b-1), 2^(b-1)-1]`` stored ``+ 2^(b-1)``, i.e. our unsigned code with a symmetric zero of
  ``2^(b-1)``.  Asymmetric zero points are signed ``z - 2^(b-1)``, stored (offset back) as
  ``weight_zero_point`` ``[ceil(N / (32//b)), K/g]`` packed along N.  ``weight_scale`` ``[N, K/g]`` in the
  model dtype, ``weight_shape`` int64 ``[N, K]``, optional ``weight_g_idx`` int32 ``[K]``.
"""

from __future__ import annotations

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def _scale_dtype(dtype):
    if dtype in ("float16", "fp16", np.float16):
        return np.dtype(np.float16)
    if dtype in ("bfloat16", "bf16"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    d = np.dtype(dtype)
    if d.name not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"unsupported scale dtype {dtype!r}")
    return d


def _check(codes, scales, zeros, bits):
    codes = np.asarray(codes)
    scales = np.asarray(scales)
    zeros = np.asarray(zeros)
    K, N = codes.shape
    if scales.shape != zeros.shape or scales.ndim != 2 or scales.shape[1] != N:
        raise ValueError(f"scales {scales.shape} / zeros {zeros.shape} do not fit codes {codes.shape}")
    if K % scales.shape[0]:
        raise ValueError(f"K={K} is not a multiple of the {scales.shape[0]} groups")
    hi = 2**bits - 1
    if codes.size and (codes.min() < 0 or codes.max() > hi):
        raise ValueError(f"codes outside [0, {hi}] for {bits}-bit")
    if zeros.size and (zeros.min() < 0 or zeros.max() > hi):
        raise ValueError(f"zero points outside [0, {hi}] for {bits}-bit")
    return codes.astype(np.uint32), scales, zeros.astype(np.uint32), K // scales.shape[0]


def dequantize(codes, scales, zeros, *, dtype="float16", g_idx=None) -> np.ndarray:
    """``(code - zero) * scale`` ``[K, N]`` with scales first rounded to the export ``dtype``; float32
    arithmetic, result in ``dtype`` -- bit-identical to a loader computing in that dtype, since the
    integer difference and its product with a ``dtype`` scale are exact in float32."""
    codes, scales, zeros, g = _check(codes, scales, zeros, 8)
    d = _scale_dtype(dtype)
    gi = np.arange(codes.shape[0]) // g if g_idx is None else np.asarray(g_idx)
    s = scales.astype(d).astype(np.float32)[gi]
    diff = codes.astype(np.float32) - zeros.astype(np.float32)[gi]
    return (diff * s).astype(d)


# ---------------------------------------------------------------- AutoAWQ GEMM


def pack_awq(values) -> np.ndarray:
    """uint4 ``[R, N]`` -> int32 ``[R, N/8]`` in AutoAWQ's interleaved nibble order."""
    v = np.asarray(values).astype(np.uint32)
    R, N = v.shape
    if N % 8:
        raise ValueError(f"AutoAWQ GEMM packs 8 output columns per int32: N={N} is not a multiple of 8")
    v = v.reshape(R, N // 8, 8)
    out = np.zeros((R, N // 8), np.uint32)
    for i, col in enumerate(AWQ_ORDER):
        out |= v[:, :, col] << np.uint32(4 * i)
    return out.view(np.int32)


def awq_gemm_export(codes, scales, zeros) -> dict[str, np.ndarray]:
    """AutoAWQ ``WQLinear_GEMM`` tensors from 4-bit codes: ``qweight``, ``qzeros``, ``scales`` (fp16)."""
    codes, scales, zeros, _ = _check(codes, scales, zeros, 4)
    return {
        "qweight": pack_awq(codes),
        "qzeros": pack_awq(zeros),
        "scales": scales.astype(np.float16),
    }


def awq_quantization_config(bits: int = 4, group_size: int = 128) -> dict:
    """``config.json`` ``quantization_config`` as AutoAWQ's ``AwqConfig.to_transformers_dict`` writes it."""
    if bits != 4:
        raise ValueError(f"AutoAWQ GEMM is 4-bit only, got bits={bits}")
    return {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": int(group_size),
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }


# ---------------------------------------------------------------- compressed-tensors pack-quantized


def pack_to_int32(values, bits: int, axis: int) -> np.ndarray:
    """Unsigned ``bits``-bit values -> int32, ``32 // bits`` per word along ``axis`` (0 or 1), value ``i``
    of a word at bits ``bits*i``, zero padding (compressed-tensors ``pack_to_int32`` after its offset)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    v = np.asarray(values).astype(np.uint32)
    if axis == 0:
        return pack_to_int32(v.T, bits, 1).T.copy()
    pf = 32 // bits
    rows, n = v.shape
    words = -(-n // pf)
    v = np.pad(v, ((0, 0), (0, words * pf - n)))
    out = np.zeros((rows, words), np.uint32)
    for i in range(pf):
        out |= v[:, i::pf] << np.uint32(bits * i)
    return out.view(np.int32)


def ct_pack_quantized_export(
    codes, scales, zeros, *, bits: int, symmetric: bool, dtype="float16", g_idx=None
) -> dict[str, np.ndarray]:
    """compressed-tensors ``pack-quantized`` tensors for one Linear (torch orientation)."""
    codes, scales, zeros, _ = _check(codes, scales, zeros, bits)
    K, N = codes.shape
    offset = 1 << (bits - 1)
    if symmetric and np.any(zeros != offset):
        raise ValueError(f"symmetric export needs every zero point == {offset} (2^(bits-1))")
    out = {
        "weight_packed": pack_to_int32(codes.T, bits, axis=1),
        "weight_scale": scales.T.astype(_scale_dtype(dtype)),
        "weight_shape": np.array([N, K], np.int64),
    }
    if not symmetric:
        # signed zero z - 2^(b-1), stored with the offset added back == the unsigned zero
        out["weight_zero_point"] = pack_to_int32(zeros.T, bits, axis=0)
    if g_idx is not None:
        out["weight_g_idx"] = np.asarray(g_idx, np.int32)
    return out


def ct_quantization_config(
    bits: int, group_size: int, symmetric: bool, ignore=("lm_head",), *, actorder=None
) -> dict:
    """``config.json`` ``quantization_config`` for a WNA16 group-quantized pack-quantized checkpoint."""
    if not 2 <= bits <= 8:
        raise ValueError(f"pack-quantized supports 2..8 bits, got {bits}")
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "weights": {
                    "num_bits": int(bits),
                    "type": "int",
                    "symmetric": bool(symmetric),
                    "strategy": "group",
                    "group_size": int(group_size),
                    "actorder": actorder,
                    "dynamic": False,
                },
            }
        },
    }
