import numpy as np
import pytest

from lrmq.ptq import export_formats as ef

torch = pytest.importorskip("torch")


def _quantized(bits, K, N, g, symmetric, seed=0):
    """Codes / scales / zeros from an independent asym/sym min-max RTN (float32)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((K, N)).astype(np.float32) * 0.02
    wg = w.reshape(K // g, g, N)
    maxq = 2**bits - 1
    if symmetric:
        scales = np.abs(wg).max(1) / (maxq / 2 + 0.5)
        zeros = np.full_like(scales, 2 ** (bits - 1))
    else:
        lo, hi = wg.min(1), wg.max(1)
        scales = np.maximum(hi - lo, 1e-5) / maxq
        zeros = np.clip(-np.round(lo / scales), 0, maxq)
    codes = np.clip(np.round(wg / scales[:, None]) + zeros[:, None], 0, maxq).reshape(K, N)
    return codes.astype(np.uint8), scales.astype(np.float32), zeros.astype(np.uint8)


# ---- independent unpackers, written from the published layouts (AutoAWQ / compressed-tensors)

AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def _awq_dequant_torch(qweight, qzeros, scales, group_size, bits=4):
    qweight, qzeros, scales = (torch.from_numpy(np.ascontiguousarray(a)) for a in (qweight, qzeros, scales))
    shifts = torch.arange(0, 32, bits)
    iw = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iw = iw.view(iw.shape[0], -1)
    iz = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    iz = iz.view(iz.shape[0], -1)
    order = torch.arange(iw.shape[-1], dtype=torch.int32).view(-1, 32 // bits)[:, AWQ_REVERSE_ORDER].view(-1)
    iw, iz = iw[:, order], iz[:, order]
    iw = torch.bitwise_and(iw, 2**bits - 1)
    iz = torch.bitwise_and(iz, 2**bits - 1)
    sc = scales.repeat_interleave(group_size, dim=0)
    iz = iz.repeat_interleave(group_size, dim=0)
    return (iw - iz) * sc  # fp16 result, [K, N]


def _unpack_from_int32(value, num_bits, shape, packed_dim=1):
    """compressed-tensors 0.19+ layout: value i of a row at bit num_bits*i of the row's little-endian bit
    stream (crossing int32 words), rows zero-padded to ceil(n*num_bits/32) words; signed = stored - 2^(b-1)."""
    if packed_dim == 0:
        return _unpack_from_int32(value.T, num_bits, (shape[1], shape[0])).T
    n = int(shape[1])
    assert value.shape[1] == -(-n * num_bits // 32)
    # bit stream: word w's bit j is stream bit 32*w + j
    words = value.to(torch.int64) & 0xFFFFFFFF
    stream = ((words[:, :, None] >> torch.arange(32)) & 1).reshape(value.shape[0], -1)
    bits = stream[:, : n * num_bits].reshape(value.shape[0], n, num_bits)
    out = (bits << torch.arange(num_bits)).sum(-1)
    return (out - (2**num_bits) // 2).to(torch.int8)


def _ct_dequant_torch(t, bits, symmetric, group_size):
    shape = torch.from_numpy(t["weight_shape"])
    scale = torch.from_numpy(np.ascontiguousarray(t["weight_scale"]).view(np.uint16)).view(
        torch.bfloat16 if t["weight_scale"].dtype.name == "bfloat16" else torch.float16)
    xq = _unpack_from_int32(torch.from_numpy(t["weight_packed"]), bits, shape)
    if symmetric:
        zp = torch.zeros_like(scale, dtype=torch.int8)
    else:
        zp = _unpack_from_int32(torch.from_numpy(t["weight_zero_point"]), bits,
                                (int(shape[0]), scale.shape[-1]), packed_dim=0)
    zp = zp.repeat_interleave(group_size, dim=1)
    sc = scale.repeat_interleave(group_size, dim=1)
    return (xq.to(sc.dtype) - zp.to(sc.dtype)) * sc  # torch orientation [N, K]


def _bits_equal(a_torch, b_np):
    a = a_torch.contiguous().view(torch.int16).numpy()
    b = np.ascontiguousarray(b_np).view(np.int16)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("symmetric", [False, True])
def test_awq_gemm_roundtrip(symmetric):
    K, N, g = 64, 48, 16
    codes, scales, zeros = _quantized(4, K, N, g, symmetric)
    t = ef.awq_gemm_export(codes, scales, zeros)
    assert t["qweight"].shape == (K, N // 8) and t["qweight"].dtype == np.int32
    assert t["qzeros"].shape == (K // g, N // 8) and t["qzeros"].dtype == np.int32
    assert t["scales"].shape == (K // g, N) and t["scales"].dtype == np.float16
    ref = _awq_dequant_torch(t["qweight"], t["qzeros"], t["scales"], g)
    assert ref.dtype == torch.float16
    _bits_equal(ref, ef.dequantize(codes, scales, zeros, dtype="float16"))


def test_awq_nibble_layout_explicit():
    codes = np.zeros((1, 8), np.uint8)
    codes[0] = np.arange(8) + 1  # column c holds c + 1
    word = int(ef.pack_awq(codes)[0, 0].view(np.uint32))
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [c + 1 for c in ef.AWQ_ORDER]  # [1, 3, 5, 7, 2, 4, 6, 8]
    assert ef.awq_quantization_config(4, 128) == {
        "quant_method": "awq", "zero_point": True, "group_size": 128, "bits": 4,
        "version": "gemm", "modules_to_not_convert": None}
    with pytest.raises(ValueError):
        ef.awq_quantization_config(3, 128)
    with pytest.raises(ValueError, match="multiple of 8"):
        ef.awq_gemm_export(np.zeros((4, 12), np.uint8), np.ones((1, 12)), np.zeros((1, 12)))
    with pytest.raises(ValueError, match="codes outside"):
        ef.awq_gemm_export(np.full((4, 8), 16), np.ones((1, 8)), np.zeros((1, 8)))


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ct_pack_quantized_roundtrip(bits, symmetric, dtype):
    K, N, g = 72, 35, 24  # K*b and N*b not multiples of 32 (but 4/8-bit K): both packed dims pad a last word
    codes, scales, zeros = _quantized(bits, K, N, g, symmetric, seed=bits)
    t = ef.ct_pack_quantized_export(codes, scales, zeros, bits=bits, symmetric=symmetric, dtype=dtype)
    assert t["weight_packed"].shape == (N, -(-K * bits // 32)) and t["weight_packed"].dtype == np.int32
    assert t["weight_scale"].shape == (N, K // g) and t["weight_scale"].dtype.name == dtype
    assert t["weight_shape"].tolist() == [N, K] and t["weight_shape"].dtype == np.int64
    if symmetric:
        assert "weight_zero_point" not in t
    else:
        assert t["weight_zero_point"].shape == (-(-N * bits // 32), K // g)
    ref = _ct_dequant_torch(t, bits, symmetric, g)
    _bits_equal(ref.T, ef.dequantize(codes, scales, zeros, dtype=dtype))


def test_ct_3bit_word_layout_and_config():
    vals = np.arange(12, dtype=np.uint8)[None] % 8  # 12 3-bit values = 36 bits -> 2 words, value 10 straddles
    w = ef.pack_to_int32(vals, 3, axis=1).view(np.uint32)
    assert w.shape == (1, 2)
    stream = sum(int(v) << (3 * i) for i, v in enumerate(vals[0]))  # dense little-endian bit stream
    assert int(w[0, 0]) == stream & 0xFFFFFFFF and int(w[0, 1]) == stream >> 32
    assert int(w[0, 0]) >> 30 == int(vals[0, 10]) & 3  # low 2 bits of value 10 top word 0 ...
    assert int(w[0, 1]) & 1 == int(vals[0, 10]) >> 2  # ... its high bit starts word 1
    np.testing.assert_array_equal(ef.unpack_from_int32(ef.pack_to_int32(vals, 3, 1), 3, 12, 1), vals)
    for bad in (1, 9, 16, 4.0):
        with pytest.raises(ValueError, match=f"compressed-tensors pack-quantized.*bits={bad!r}"):
            ef.pack_to_int32(vals, bad, 1)
        with pytest.raises(ValueError, match=f"compressed-tensors pack-quantized.*bits={bad!r}"):
            ef.ct_quantization_config(bad, 128, True)
    with pytest.raises(ValueError, match="symmetric"):
        ef.ct_pack_quantized_export(np.zeros((4, 2)), np.ones((1, 2)), np.zeros((1, 2)), bits=4,
                                    symmetric=True)
    cfg = ef.ct_quantization_config(3, 128, True)
    assert cfg["format"] == "pack-quantized" and cfg["ignore"] == ["lm_head"]
    assert cfg["config_groups"]["group_0"]["weights"] == {
        "num_bits": 3, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
        "block_structure": None, "actorder": None, "dynamic": False}
    assert cfg["config_groups"]["group_0"]["format"] == "pack-quantized"
    w = ef.ct_quantization_config(4, -1, False)["config_groups"]["group_0"]["weights"]
    assert w["strategy"] == "channel" and w["group_size"] is None
    with pytest.raises(ValueError, match="group_size"):
        ef.ct_quantization_config(4, 0, False)


def test_ct_g_idx_dequant():
    K, N, g = 32, 8, 8
    codes, scales, zeros = _quantized(4, K, N, g, False)
    g_idx = np.random.default_rng(0).permutation(np.arange(K) // g).astype(np.int32)
    t = ef.ct_pack_quantized_export(codes, scales, zeros, bits=4, symmetric=False, g_idx=g_idx)
    np.testing.assert_array_equal(t["weight_g_idx"], g_idx)
    d = ef.dequantize(codes, scales, zeros, g_idx=g_idx, dtype="float32")
    k = 5
    np.testing.assert_array_equal(d[k], (codes[k].astype(np.float32) - zeros[g_idx[k]]) * scales[g_idx[k]])
