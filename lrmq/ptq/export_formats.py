"""Pure array conversions from lrmq int codes to interchange checkpoint formats.

Input everywhere: unpacked unsigned ``codes`` uint8 ``[K, N]`` (lrmq orientation, in x out),
``scales`` float32 ``[K/g, N]``, unsigned ``zeros`` ``[K/g, N]``; dequant ``w = (code - zero) * scale``.
Model-level writing (names, safetensors, config.json) lives elsewhere.

* AutoAWQ GEMM (``quant_method: awq``, 4-bit only): ``qweight`` int32 ``[K, N/8]``, ``qzeros`` int32
  ``[K/g, N/8]``, nibble ``i`` (bits 4i..4i+3) of word ``[r, c]`` holds column ``8c + AWQ_ORDER[i]``;
  ``scales`` float16 ``[K/g, N]``.  Zeros unsigned, no offset.
* compressed-tensors ``pack-quantized`` (its ``pack_to_int32``, 0.19+): dense little-endian bit stream
  per row -- value ``i`` at bit ``b*i`` of the row, so for 3/5/6/7-bit values straddle int32 words
  (bit ``b*i`` is bit ``b*i % 32`` of word ``b*i // 32``); 32 values fill exactly ``b`` words; the row is
  zero-padded to ``ceil(n*b/32)`` words.  (4- and 8-bit are the same as ``32 // b`` values per word;
  lrmq before this layout wrote 3-bit as 10 values per word with 2 unused bits, which
  compressed-tensors reads as garbage.)  Weights are torch-oriented ``[N, K]`` and packed along K:
  ``weight_packed`` ``[N, ceil(K*b/32)]``.  Values are signed ``[-2^(b-1), 2^(b-1)-1]`` stored
  ``+ 2^(b-1)``, i.e. our unsigned code with a symmetric zero of ``2^(b-1)``.  Asymmetric zero points
  are signed ``z - 2^(b-1)``, stored (offset back) as ``weight_zero_point`` ``[ceil(N*b/32), K/g]``
  packed along N.  ``weight_scale`` ``[N, K/g]`` in the model dtype, ``weight_shape`` int64 ``[N, K]``,
  optional ``weight_g_idx`` int32 ``[K]``.  Bit widths: compressed-tensors packs 1..8; lrmq exports
  2..8 (what ``QuantizedWeight`` holds) and refuses anything else.
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


def unpack_awq(packed) -> np.ndarray:
    """Inverse of :func:`pack_awq`: int32 ``[R, N/8]`` -> uint8 ``[R, N]`` (nibble ``i`` of a word is column
    ``8c + AWQ_ORDER[i]``)."""
    w = np.asarray(packed)
    if w.ndim != 2 or w.dtype.kind not in "iu" or w.dtype.itemsize != 4:
        raise ValueError(f"AutoAWQ packs 4-bit values into 2-D int32 words, got {w.dtype}{list(w.shape)}")
    w = w.view(np.uint32)
    R, C = w.shape
    out = np.zeros((R, C, 8), np.uint8)
    for i, col in enumerate(AWQ_ORDER):
        out[:, :, col] = (w >> np.uint32(4 * i)) & np.uint32(0xF)
    return out.reshape(R, C * 8)


def awq_gemm_export(codes, scales, zeros) -> dict[str, np.ndarray]:
    """AutoAWQ ``WQLinear_GEMM`` tensors from 4-bit codes: ``qweight``, ``qzeros``, ``scales`` (fp16)."""
    codes, scales, zeros, _ = _check(codes, scales, zeros, 4)
    return {
        "qweight": pack_awq(codes),
        "qzeros": pack_awq(zeros),
        "scales": scales.astype(np.float16),
    }


def awq_gemm_import(qweight, qzeros, scales):
    """Inverse of :func:`awq_gemm_export`: ``(codes [K, N] uint8, scales [K/g, N] float32, zeros [K/g, N]
    uint8)`` -- the fp16 scales widened exactly."""
    codes, zeros, scales = unpack_awq(qweight), unpack_awq(qzeros), np.asarray(scales)
    if scales.shape != zeros.shape:
        raise ValueError(f"scales {list(scales.shape)} and qzeros (unpacked {list(zeros.shape)}) differ in shape")
    _check(codes, scales, zeros, 4)
    return codes, scales.astype(np.float32), zeros


def awq_quantization_config(bits: int = 4, group_size: int = 128,
                            modules_to_not_convert: list[str] | None = None) -> dict:
    """``config.json`` ``quantization_config`` as AutoAWQ's ``AwqConfig.to_transformers_dict`` writes it;
    ``modules_to_not_convert``: the Linears left float (a mixture-of-experts model's routers: ``["mlp.gate"]``)."""
    if bits != 4:
        raise ValueError(f"AutoAWQ GEMM is 4-bit only, got bits={bits}")
    return {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": int(group_size),
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": modules_to_not_convert,
    }


# ---------------------------------------------------------------- compressed-tensors pack-quantized


CT_BITS = range(2, 9)  # pack-quantized widths lrmq exports (compressed-tensors itself packs 1..8)


def _check_ct_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in CT_BITS:
        raise ValueError(f"compressed-tensors pack-quantized export supports {CT_BITS.start}..{CT_BITS.stop - 1}-bit "
                         f"integer weights, got bits={bits!r}")
    return int(bits)


def pack_to_int32(values, bits: int, axis: int) -> np.ndarray:
    """Unsigned ``bits``-bit values -> int32 packed densely along ``axis`` (0 or 1), as compressed-tensors'
    ``pack_to_int32`` (after its ``+2^(b-1)`` offset): value ``i`` of a row at bit ``bits*i`` of the row's
    little-endian bit stream, crossing word boundaries, zero-padded to ``ceil(n*bits/32)`` words."""
    bits = _check_ct_bits(bits)
    v = np.asarray(values)
    if v.ndim != 2 or axis not in (0, 1):
        raise ValueError(f"pack_to_int32 packs 2-D arrays along axis 0 or 1, got shape {v.shape}, axis={axis}")
    if axis == 0:
        return np.ascontiguousarray(pack_to_int32(v.T, bits, 1).T)
    v = v.astype(np.uint64) & np.uint64((1 << bits) - 1)
    rows, n = v.shape
    groups = -(-n // 32)  # 32 values fill exactly `bits` words
    v = np.pad(v, ((0, 0), (0, groups * 32 - n))).reshape(rows, groups, 32)
    out = np.zeros((rows, groups, bits + 1), np.uint64)  # one spare word for the last straddler
    for i in range(32):
        word, off = divmod(bits * i, 32)
        # value straddling a boundary: its low bits end word `word`, its high bits start word `word + 1`
        out[:, :, word] |= (v[:, :, i] << np.uint64(off)) & np.uint64(0xFFFFFFFF)
        if off + bits > 32:
            out[:, :, word + 1] |= v[:, :, i] >> np.uint64(32 - off)
    out = out[:, :, :bits].reshape(rows, groups * bits)[:, : -(-n * bits // 32)]
    return np.ascontiguousarray(out.astype(np.uint32).view(np.int32))


def unpack_from_int32(packed, bits: int, n: int, axis: int) -> np.ndarray:
    """Inverse of :func:`pack_to_int32`: int32 -> unsigned uint8 values, ``n`` of them along ``axis``."""
    bits = _check_ct_bits(bits)
    p = np.asarray(packed)
    if axis == 0:
        return np.ascontiguousarray(unpack_from_int32(p.T, bits, n, 1).T)
    w = p.astype(np.int32).view(np.uint32).astype(np.uint64)
    if w.shape[1] != -(-n * bits // 32):
        raise ValueError(f"{w.shape[1]} int32 words do not hold {n} {bits}-bit values")
    w = np.concatenate([w, np.zeros((w.shape[0], 1), np.uint64)], axis=1)  # spare word for the straddler
    i = np.arange(n)
    word, off = (bits * i) // 32, ((bits * i) % 32).astype(np.uint64)
    two = w[:, word] | (w[:, word + 1] << np.uint64(32))
    return ((two >> off) & np.uint64((1 << bits) - 1)).astype(np.uint8)


def ct_pack_quantized_export(
    codes, scales, zeros, *, bits: int, symmetric: bool, dtype="float16", g_idx=None
) -> dict[str, np.ndarray]:
    """compressed-tensors ``pack-quantized`` tensors for one Linear (torch orientation)."""
    bits = _check_ct_bits(bits)
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


def ct_pack_quantized_import(tensors, *, bits: int, symmetric: bool):
    """Inverse of :func:`ct_pack_quantized_export`: one Linear's tensors (``weight_packed``, ``weight_scale``,
    ``weight_shape``, ``weight_zero_point`` when asymmetric, optional ``weight_g_idx``; the keys without the
    module prefix) -> ``(codes [K, N] uint8, scales [K/g, N] float32, zeros [K/g, N] uint8, g_idx or None)``,
    lrmq orientation, unsigned zeros (symmetric: ``2^(b-1)``), scales widened exactly from the stored dtype."""
    bits = _check_ct_bits(bits)
    missing = [k for k in ("weight_packed", "weight_scale", "weight_shape") if k not in tensors]
    if not symmetric and "weight_zero_point" not in tensors:
        missing.append("weight_zero_point")
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    N, K = (int(x) for x in np.asarray(tensors["weight_shape"]).reshape(-1))
    scales = np.asarray(tensors["weight_scale"])
    if scales.ndim != 2 or scales.shape[0] != N:
        raise ValueError(f"weight_scale {list(scales.shape)} does not fit weight_shape [{N}, {K}]")
    codes = unpack_from_int32(tensors["weight_packed"], bits, K, axis=1).T
    if "weight_zero_point" in tensors:
        zeros = unpack_from_int32(tensors["weight_zero_point"], bits, N, axis=0).T
    else:
        zeros = np.full(scales.T.shape, 1 << (bits - 1), np.uint8)
    if symmetric and np.any(zeros != 1 << (bits - 1)):
        raise ValueError(f"a symmetric scheme with zero points other than {1 << (bits - 1)}")
    g_idx = np.asarray(tensors["weight_g_idx"]) if "weight_g_idx" in tensors else None
    scales = scales.T.astype(np.float32)
    if g_idx is None:
        _check(codes, scales, zeros, bits)
    return np.ascontiguousarray(codes), np.ascontiguousarray(scales), np.ascontiguousarray(zeros), g_idx


def ct_quantization_config(
    bits: int, group_size: int, symmetric: bool, ignore=("lm_head",), *, actorder=None
) -> dict:
    """``config.json`` ``quantization_config`` for a WNA16 pack-quantized checkpoint: strategy ``group``,
    or ``channel`` (one scale per output row, ``weight_scale`` ``[N, 1]``) for ``group_size`` -1.

    Key for key what llmcompressor 0.14.0.1 (compressed-tensors 0.19.0's ``ModelCompressor.update_config``)
    writes for the same scheme, except five keys of its own: ``version`` (the compressed-tensors version
    that wrote the file), ``weights.observer`` / ``weights.observer_kwargs`` (llmcompressor's calibration
    observer, ``memoryless_minmax`` / ``{}``) and ``weights.zp_dtype`` / ``weights.scale_dtype``
    (``"torch.int8"`` for asymmetric, else null / null): compressed-tensors 0.19 / 0.20.1 fill in the same
    values when they are absent, and 0.11 .. 0.12.2 (whose ``QuantizationArgs`` forbids unknown keys and
    has neither field) refuse to parse them. Checked against llmcompressor's own output by
    ``benchmarks/ct_export_vs_llmcompressor.py`` (and ``tests/test_exports_consumers.py`` where a side venv
    has llmcompressor), and against compressed-tensors 0.20.1's own ``ModelCompressor`` output in
    ``tests/test_exports_consumers.py``."""
    bits = _check_ct_bits(bits)
    channel = int(group_size) == -1
    if not channel and int(group_size) <= 0:
        raise ValueError(f"group_size must be -1 (per channel) or positive, got {group_size}")
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": int(bits),
                    "type": "int",
                    "symmetric": bool(symmetric),
                    "strategy": "channel" if channel else "group",
                    "group_size": None if channel else int(group_size),
                    "block_structure": None,
                    "actorder": actorder,
                    "dynamic": False,
                },
            }
        },
    }
