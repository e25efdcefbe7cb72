"""NF4 vs an independent loop-style numpy reference written from bitsandbytes' semantics, plus a torch
port of bnb's reference (default) backend and of `create_dynamic_map`."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from lrmq.quant.nf4 import DYNAMIC_MAP, NF4_CODE, NF4_THRESHOLDS, nf4_absmax, nf4_dequantize, nf4_fake_quant, nf4_quantize
from lrmq.quant.packing import unpack_nibbles_high_first
from lrmq.quant.formats import dequantize, quantize_weight

f32 = np.float32

# bitsandbytes csrc kernels.cu dQuantizeNF4 decision tree: (threshold, code) literals as written there.
_BNB_TREE_THRESHOLDS = [
    -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
    -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
    0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
    0.5016634166240692, 0.6427869200706482, 0.8614784181118011,
]


def _bnb_tree(x: np.float32) -> int:
    t = [f32(v) for v in _BNB_TREE_THRESHOLDS]
    if x > t[7]:
        if x > t[11]:
            if x > t[13]:
                return 15 if x > t[14] else 14
            return 13 if x > t[12] else 12
        if x > t[9]:
            return 11 if x > t[10] else 10
        return 9 if x > t[8] else 8
    if x > t[3]:
        if x > t[5]:
            return 7 if x > t[6] else 6
        return 5 if x > t[4] else 4
    if x > t[1]:
        return 3 if x > t[2] else 2
    return 1 if x > t[0] else 0


def _torch_dynamic_map():
    # bitsandbytes functional.create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8), in torch
    data = []
    for i in range(7):
        boundaries = torch.linspace(0.1, 1, 2**i + 1)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    data.sort()
    return torch.Tensor(data)


def _pairwise_sum(xs):
    if len(xs) == 1:
        return f32(xs[0])
    p = 1 << (len(xs) - 1).bit_length()
    xs = list(xs) + [f32(0)] * (p - len(xs))
    return _pairwise_sum([f32(xs[2 * i] + xs[2 * i + 1]) for i in range(p // 2)])


def ref_nf4(w_kn: np.ndarray, block=64, double_quant=True):
    """Returns (codes per element, packed bytes [N, K/2], absmax used for dequant, dequantized [K, N] f32
    before the final dtype cast, nested codes, nested scales, offset)."""
    K, N = w_kn.shape
    flat = w_kn.astype(np.float32).T.reshape(-1)  # torch orientation [N, K], row-major
    n = flat.size
    nb = math.ceil(n / block)
    absmax = np.zeros(nb, f32)
    q = np.zeros(n, np.uint8)
    for b in range(nb):
        blk = flat[b * block : (b + 1) * block]
        absmax[b] = np.max(np.abs(blk))
        am = max(absmax[b], f32(1e-38))  # bnb quantize_4bit clamps before the reciprocal / division
        partial = blk.size < block
        if partial:  # bnb divides the partial last block by its (clamped, stored) absmax
            absmax[b] = am
        for j, v in enumerate(blk):
            x = f32(v / am) if partial else f32(v * f32(f32(1.0) / am))
            q[b * block + j] = _bnb_tree(x)
    packed = np.zeros(n // 2, np.uint8)
    for i in range(n // 2):
        packed[i] = (int(q[2 * i]) << 4) | int(q[2 * i + 1])
    dyn = _torch_dynamic_map().numpy()
    a_codes = a_scales = offset = None
    absmax_dq = absmax
    if double_quant:
        offset = f32(_pairwise_sum(list(absmax)) / f32(nb))
        r = (absmax - offset).astype(f32)
        nb2 = math.ceil(nb / 256)
        a_scales = np.zeros(nb2, f32)
        a_codes = np.zeros(nb, np.uint8)
        absmax_dq = np.zeros(nb, f32)
        for b2 in range(nb2):
            blk = r[b2 * 256 : (b2 + 1) * 256]
            a_scales[b2] = np.max(np.abs(blk))
            for j, v in enumerate(blk):
                x = f32(0) if a_scales[b2] == 0 else np.clip(f32(v * (f32(1) / a_scales[b2])), -1, 1)
                c = int(np.argmin(np.abs(x - dyn)))  # nearest, first index on ties
                a_codes[b2 * 256 + j] = c
                absmax_dq[b2 * 256 + j] = f32(f32(dyn[c] * a_scales[b2]) + offset)
    deq = np.zeros(n, f32)
    for i in range(n):
        deq[i] = f32(NF4_CODE_REF[q[i]] * absmax_dq[i // block])
    return q, packed.reshape(N, K // 2), absmax_dq, deq.reshape(N, K).T, a_codes, a_scales, offset


NF4_CODE_REF = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0], dtype=f32)


def test_constants_match_bnb():
    np.testing.assert_array_equal(NF4_CODE, NF4_CODE_REF)
    np.testing.assert_array_equal(NF4_THRESHOLDS, np.array(_BNB_TREE_THRESHOLDS, f32))
    np.testing.assert_array_equal(DYNAMIC_MAP, _torch_dynamic_map().numpy())
    assert DYNAMIC_MAP.shape == (256,) and np.all(np.diff(DYNAMIC_MAP) > 0)


@pytest.mark.parametrize(
    "K,N,dtype,dq",
    [(128, 260, np.float32, True), (64, 6, ml_dtypes.bfloat16, True), (6, 5, np.float32, True), (32, 8, np.float32, False)],
)
def test_bit_exact_vs_reference(K, N, dtype, dq):
    # (128, 260): 520 blocks -> 3 second-level blocks, the last partial; (6, 5): one partial NF4 block
    rng = np.random.default_rng(K * N)
    w = (rng.standard_t(5, size=(K, N)) * 0.05).astype(dtype)
    qw = nf4_quantize(jnp.asarray(w), block_size=64, double_quant=dq)
    q, packed, absmax_dq, deq, a_codes, a_scales, offset = ref_nf4(np.asarray(w, np.float32), 64, dq)
    assert qw.codes.shape == (N, K // 2) and qw.codes.dtype == jnp.uint8
    np.testing.assert_array_equal(unpack_nibbles_high_first(np.asarray(qw.codes)).reshape(-1), q)
    np.testing.assert_array_equal(qw.codes, packed)
    np.testing.assert_array_equal(qw.scales, absmax_dq)
    if dq:
        np.testing.assert_array_equal(qw.absmax_codes, a_codes)
        np.testing.assert_array_equal(qw.absmax_scales, a_scales)
        assert float(qw.absmax_offset) == float(offset)
        np.testing.assert_array_equal(nf4_absmax(qw), absmax_dq)
    out = nf4_dequantize(qw)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (K, N)
    np.testing.assert_array_equal(np.asarray(out), deq.astype(dtype))
    np.testing.assert_array_equal(out, nf4_fake_quant(jnp.asarray(w), 64, dq))
    np.testing.assert_array_equal(out, dequantize(quantize_weight(jnp.asarray(w), fmt="nf4", double_quant=dq)))


def test_matches_torch_default_backend():
    # bnb backends/default quantize_4bit: argmin |clamp(x * (1/absmax), -1, 1) - code|; equals the CUDA
    # midpoint tree except within an ulp of a midpoint. The torch mean may differ from our pairwise
    # mean by an ulp only.
    rng = np.random.default_rng(1)
    w = rng.normal(size=(64, 96)).astype(np.float32)
    A = torch.from_numpy(w.T.copy()).reshape(-1, 64)
    absmax = A.abs().max(dim=-1)[0]
    scaled = torch.clamp(A * (1 / absmax.view(-1, 1)), -1, 1).reshape(-1)
    tq = torch.argmin(torch.abs(scaled.view(-1, 1) - torch.from_numpy(NF4_CODE_REF)), dim=-1).to(torch.uint8)
    packed = (tq[::2] << 4 | tq[1::2]).numpy()
    qw = nf4_quantize(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(qw.codes).reshape(-1), packed)
    np.testing.assert_allclose(float(qw.absmax_offset), float(absmax.mean()), rtol=2.4e-7)
    # second level: quantize_blockwise with the dynamic map, blocksize 256
    r = absmax - torch.tensor(float(qw.absmax_offset))
    s2 = r.abs().max()
    x = torch.clamp(r * (1 / s2), -1, 1)
    tcodes = torch.argmin(torch.abs(x.view(-1, 1) - _torch_dynamic_map()), dim=-1).to(torch.uint8)
    np.testing.assert_array_equal(qw.absmax_codes, tcodes.numpy())


def test_midpoint_ties_go_low_and_zero_block():
    # absmax 1 (last element) so x == w: a value exactly on threshold j gets the lower code j
    w = np.zeros((64, 2), f32)
    w[:15, 0] = NF4_THRESHOLDS
    w[63, 0] = 1.0
    qw = nf4_quantize(jnp.asarray(w), double_quant=False)
    q = unpack_nibbles_high_first(np.asarray(qw.codes)).reshape(-1)
    np.testing.assert_array_equal(q[:15], np.arange(15))
    # column 1 is an all-zero block: bnb (quantize_4bit, absmax clamped to 1e-38, stored 0) scales it to
    # 0 -> code 7 (0.0), dequantized +0.0
    np.testing.assert_array_equal(q[64:], 7)
    np.testing.assert_array_equal(np.asarray(qw.scales)[1], 0.0)
    out = np.asarray(nf4_dequantize(qw))[:, 1]
    np.testing.assert_array_equal(out, 0.0)
    assert not np.signbit(out).any()
    # a partial last block of zeros stores the clamped absmax 1e-38, as bnb
    w2 = np.ones((14, 5), f32)  # 70 elements: one full block, then 6 = w2[8:, 4] (torch order) all zero
    w2[8:, 4] = 0
    qw = nf4_quantize(jnp.asarray(w2), double_quant=False)
    np.testing.assert_array_equal(np.asarray(qw.scales), np.array([1.0, 1e-38], f32))
    np.testing.assert_array_equal(unpack_nibbles_high_first(np.asarray(qw.codes)).reshape(-1)[64:], 7)


def test_jit_and_errors():
    w = jnp.asarray(np.random.default_rng(3).normal(size=(64, 4)).astype(np.float32))
    a = jax.jit(lambda w: nf4_quantize(w).codes)(w)
    np.testing.assert_array_equal(a, nf4_quantize(w).codes)
    with pytest.raises(ValueError, match="even K"):
        nf4_quantize(jnp.ones((3, 4)))
    with pytest.raises(ValueError, match="2-D"):
        nf4_quantize(jnp.ones((4,)))
    with pytest.raises(ValueError, match="bits=4"):
        quantize_weight(w, fmt="nf4", bits=3)


def test_against_installed_bitsandbytes():
    """Runs only where bitsandbytes imports (verified with bitsandbytes 0.50.2 CPU, torch 2.13 CPU, in a
    side venv). Exact: 4-bit codes, packed bytes, absmax (all-zero and partial blocks included). Not
    exact, bounded: the double-quant offset (torch.mean's reduction order, <= 4 ulp) and the nested
    8-bit codes (bnb's CPU kernel's approximate binary search: a neighbouring code, ~0.2% of entries)."""
    F = pytest.importorskip("bitsandbytes.functional")
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((256, 200)) * 0.02).astype(f32)
    w[:, 7] = 0  # four all-zero blocks
    w2 = rng.standard_normal((10, 13)).astype(f32)  # 130 elements: partial last block
    w2[4:, 12] = 0  # ... of zeros
    for x in (w, w2):
        t = torch.from_numpy(np.ascontiguousarray(x.T))
        packed, st = F.quantize_4bit(t, blocksize=64, compress_statistics=False, quant_type="nf4")
        qw = nf4_quantize(jnp.asarray(x), 64, double_quant=False)
        np.testing.assert_array_equal(np.asarray(qw.codes).reshape(-1), packed.numpy().reshape(-1))
        np.testing.assert_array_equal(np.asarray(qw.scales), st.absmax.numpy())
        np.testing.assert_array_equal(np.asarray(nf4_dequantize(qw)).T, F.dequantize_4bit(packed, st).numpy())
        packed, st = F.quantize_4bit(t, blocksize=64, compress_statistics=True, quant_type="nf4")
        qw = nf4_quantize(jnp.asarray(x), 64, double_quant=True)
        np.testing.assert_array_equal(np.asarray(qw.codes).reshape(-1), packed.numpy().reshape(-1))
        ulp = abs(int(np.float32(qw.absmax_offset).view(np.int32)) - int(np.float32(st.offset.item()).view(np.int32)))
        assert ulp <= 4
        a = np.asarray(qw.absmax_codes).astype(int) - st.absmax.numpy().astype(int)
        assert np.abs(a).max() <= 1 and np.count_nonzero(a) <= max(2, a.size // 100)
