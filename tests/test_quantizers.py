import numpy as np
import jax
import jax.numpy as jnp
import pytest

from test_quantizers_halfway import _torch_pseudo_quantize

from lrmq.quant.nf4 import nf4_fake_quant
from lrmq.quant.quantizers import (
    QUANTIZERS,
    compute_qparams,
    dequantize_codes,
    fake_quant,
    fake_quant_per_tensor,
    per_tensor_scale,
    pseudo_quantize_awq,
    quantize_codes,
)


def _w(K=256, N=6, seed=0, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(K, N)).astype(np.float32) * scale)


def test_hand_computed_asym_2bit():
    # col 0: min -1, max 2 -> scale 3/3 = 1, zero = -round(-1) = 1; col 1: min 0, max 1.5 -> scale 0.5, zero 0
    w = jnp.array([[-1.0, 0.0], [0.0, 0.5], [1.0, 1.0], [2.0, 1.5]])
    s, z = compute_qparams(w, 2, -1, symmetric=False)
    np.testing.assert_array_equal(s, [[1.0, 0.5]])
    np.testing.assert_array_equal(z, [[1, 0]])
    assert z.dtype == jnp.uint8 and s.dtype == jnp.float32
    q = quantize_codes(w, s, z, 2, -1)
    np.testing.assert_array_equal(q, [[0, 0], [1, 1], [2, 2], [3, 3]])
    np.testing.assert_array_equal(dequantize_codes(q, s, z, -1), w)  # every value on the grid


def test_hand_computed_sym_2bit_half_to_even():
    # absmax 2 -> scale 2/(2^1-1) = 2, zero 2; w/s = [-0.5, 0, 0.5, 1] rounds half-to-even to [0, 0, 0, 1]
    w = jnp.array([[-1.0], [0.0], [1.0], [2.0]])
    s, z = compute_qparams(w, 2, 4, symmetric=True)
    np.testing.assert_array_equal(s, [[2.0]])
    np.testing.assert_array_equal(z, [[2]])
    q = quantize_codes(w, s, z, 2, 4)
    np.testing.assert_array_equal(q[:, 0], [2, 2, 2, 3])
    np.testing.assert_array_equal(fake_quant(w, 2, 4, True)[:, 0], [0.0, 0.0, 0.0, 2.0])


@pytest.mark.parametrize("bits,g", [(4, 128), (3, 128), (4, 64), (8, 32), (2, 256)])
def test_matches_llm_awq_bit_for_bit(bits, g):
    w = _w(256, 10, seed=bits) * jnp.linspace(0.1, 3.0, 10)  # varied column ranges
    ours = pseudo_quantize_awq(w, bits, g)
    ref = _torch_pseudo_quantize(np.asarray(w), bits, g)[3]  # llm-awq pseudo_quantize_tensor, torch
    np.testing.assert_array_equal(np.asarray(ours), ref)


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_error_bound_and_zero(bits, sym):
    # Random normal groups of 64 contain both signs, so min <= 0 <= max in every group. Then
    # |w - fq(w)| <= scale/2 (asym: zero is not clamped; sym: |w/s| <= 2^(b-1)-1 never clips).
    w = _w(256, 6, seed=bits)
    w = w.at[5, :].set(0.0)
    s, z = compute_qparams(w, bits, 64, sym)
    fq = fake_quant(w, bits, 64, sym)
    err = jnp.abs(w - fq).reshape(4, 64, 6)
    assert bool(jnp.all(err <= s[:, None, :] * 0.5 * (1 + 1e-5)))
    # zero is exactly representable when 0 lies in the group's [min, max]
    np.testing.assert_array_equal(fq[5], 0.0)


def test_asym_error_bound_fails_without_zero_in_range():
    # all-positive group: zero clamps to 0 and the top of the range clips; the bound above is only
    # stated for min <= 0 <= max
    w = jnp.linspace(10.0, 11.0, 16).reshape(16, 1)
    s, z = compute_qparams(w, 2, -1, False)
    assert int(z[0, 0]) == 0
    assert float(jnp.max(jnp.abs(w - fake_quant(w, 2, -1, False)))) > float(s[0, 0])


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_idempotent(bits, sym):
    # fq(fq(w)) gives the same codes and zeros; values agree up to float rounding of the recomputed
    # scale (e.g. (qmax*s)/qmax != s in float32), so only to a few ulps.
    w = _w(256, 6, seed=10 + bits)
    fq = fake_quant(w, bits, 64, sym)
    s1, z1 = compute_qparams(w, bits, 64, sym)
    s2, z2 = compute_qparams(fq, bits, 64, sym)
    np.testing.assert_array_equal(z1, z2)
    np.testing.assert_allclose(s1, s2, rtol=1e-6)
    np.testing.assert_array_equal(quantize_codes(w, s1, z1, bits, 64), quantize_codes(fq, s2, z2, bits, 64))
    ulp = float(jnp.max(jnp.abs(fq))) * 2.0**-23
    np.testing.assert_allclose(fake_quant(fq, bits, 64, sym), fq, rtol=0, atol=4 * ulp)


def test_jit_dtype_and_per_channel():
    w = _w(128, 4).astype(jnp.bfloat16)
    fq = fake_quant(w, 4, 32, False)
    assert fq.dtype == jnp.bfloat16 and fq.shape == w.shape
    f = jax.jit(fake_quant, static_argnums=(1, 2, 3))
    np.testing.assert_array_equal(f(w, 4, 32, False), fq)
    np.testing.assert_array_equal(fake_quant(w, 4, -1, True), fake_quant(w, 4, 128, True))
    s, _ = compute_qparams(w, 4, -1, True)
    assert s.shape == (1, 4)


def test_validation_errors():
    w = _w(96, 4)
    with pytest.raises(ValueError, match="group_size=64.*96"):
        compute_qparams(w, 4, 64, False)
    for bad in (1, 9, 4.0, True):
        with pytest.raises(ValueError, match="bits"):
            fake_quant(w, bad, 32, False)
    with pytest.raises(ValueError, match="2-D"):
        fake_quant(w.reshape(-1), 4, 32, False)
    with pytest.raises(TypeError, match="floating"):
        fake_quant(jnp.ones((4, 4), jnp.int32), 4, -1, False)
    s, z = compute_qparams(w, 4, 32, False)
    with pytest.raises(ValueError, match="scales shape"):
        quantize_codes(w, s[:1], z, 4, 32)


def test_per_tensor():
    w = jnp.array([[-2.54, 0.0], [1.0, 0.02]])
    s = per_tensor_scale(w)
    np.testing.assert_allclose(s, 2.54 / 127, rtol=1e-7)
    fq = fake_quant_per_tensor(w)
    np.testing.assert_allclose(fq, jnp.round(w / s) * s, rtol=0, atol=0)
    assert fq.dtype == w.dtype
    # floor 1e-6 for an all-zero tensor; a given scale clips to [-128, 127]
    np.testing.assert_allclose(per_tensor_scale(jnp.zeros((2, 2))), 1e-6)
    s = np.float32(0.01)
    np.testing.assert_array_equal(fake_quant_per_tensor(jnp.array([[-10.0, 10.0]]), scale=s), [[-128 * s, 127 * s]])


def test_registry():
    assert {"rtn_asym", "rtn_sym", "nf4", "int8"} <= set(QUANTIZERS.names())
    w = _w(128, 4)
    np.testing.assert_array_equal(QUANTIZERS.get("rtn_asym")(w, bits=3, group_size=64), fake_quant(w, 3, 64, False))
    np.testing.assert_array_equal(QUANTIZERS.get("rtn_sym")(w, bits=4, group_size=32), fake_quant(w, 4, 32, True))
    np.testing.assert_array_equal(QUANTIZERS.get("int8")(w, bits=8, group_size=-1), fake_quant(w, 8, -1, True))
    np.testing.assert_array_equal(QUANTIZERS.get("nf4")(w, bits=4, group_size=64), nf4_fake_quant(w, 64))
    with pytest.raises(ValueError, match="bits=8"):
        QUANTIZERS.get("int8")(w, bits=4, group_size=-1)
    with pytest.raises(KeyError, match="rtn_asym"):
        QUANTIZERS.get("nope")
