"""pallas_kernels: TPU (Mosaic) and GPU (Triton) kernels in interpret mode vs the jnp reference.

Tolerance (see _bound): with identical f32 dequantized weights, any f32 summation order obeys
|fl(sum) - sum| <= gamma_K * sum|x*w| (gamma_K = K*u/(1-K*u), u = 2^-24), so kernel and reference
differ by at most 2*gamma_K*sum|x*w|. For bf16 activations the kernels (and the XLA path) also
round the dequantized weight to bf16 (relative 2^-9 per term -> 2^-9 * sum|x*w|) and both round
the output to bf16 (half an ulp each -> 2^-8 * |y|).
"""
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

# The package's public API lives in dispatch (re-exported by __init__, checked below). Import it
# directly: a stale editable install can register pallas_kernels as a namespace package, in
# which case __init__ is not run under pytest.
from pallas_kernels import dispatch as pk
from pallas_kernels import gpu as pk_gpu
from pallas_kernels import reference as ref
from pallas_kernels import tpu as pk_tpu
from pallas_kernels import tpu_tiles

U32 = 2.0 ** -24
IMPLS = ["tpu", "gpu"]


def _rng(*key):
    # a digest of the key, not hash(): str hashes change with PYTHONHASHSEED, so data would differ per run
    return np.random.default_rng(int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little"))


def _bound(x, w_kn, y_ref):
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    s = np.abs(x64) @ np.abs(np.asarray(w_kn, np.float64))
    k = x64.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    tol = 2 * gamma * s + 1e-30
    if jnp.dtype(x.dtype) == jnp.bfloat16:
        tol = tol + 2.0 ** -9 * s + 2.0 ** -8 * np.abs(np.asarray(y_ref, np.float64))
    return tol


def _check(y, y_ref, x, w_kn):
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    err = np.abs(np.asarray(y, np.float64) - np.asarray(y_ref, np.float64))
    tol = _bound(x, w_kn, y_ref)
    assert np.all(err <= tol), f"max err {err.max()} vs tol {tol[np.argmax(err - tol)] if err.size else 0}"


def _int4_inputs(m, k, n, g, dtype, seed=0):
    r = _rng("int4", m, k, n, g, seed)
    q = r.integers(0, 16, (k, n))
    codes = jnp.asarray(ref.pack_int4(q))
    scales = jnp.asarray(r.uniform(0.01, 0.1, (k // g, n)), jnp.float32)
    zeros = jnp.asarray(r.integers(0, 16, (k // g, n)), jnp.uint8)
    x = jnp.asarray(r.standard_normal((m, k)), dtype)
    return x, codes, scales, zeros, q


def _int8_inputs(m, k, n, g, dtype, seed=0):
    r = _rng("int8", m, k, n, g, seed)
    codes = jnp.asarray(r.integers(0, 256, (k, n)), jnp.uint8)
    scales = jnp.asarray(r.uniform(1e-3, 1e-2, (k // g, n)), jnp.float32)
    zeros = jnp.asarray(r.integers(100, 156, (k // g, n)), jnp.uint8)
    x = jnp.asarray(r.standard_normal((m, k)), dtype)
    return x, codes, scales, zeros


def _nf4_inputs(m, k, n, dtype, bs=64, seed=0):
    r = _rng("nf4", m, k, n, bs, seed)
    q = r.integers(0, 16, (n, k))
    codes = jnp.asarray(ref.pack_nf4(q))
    absmax = jnp.asarray(r.uniform(0.5, 2.0, (n, k // bs)), jnp.float32)
    x = jnp.asarray(r.standard_normal((m, k)), dtype)
    return x, codes, absmax, q


def _kernel(fmt, impl):
    return getattr(pk_tpu if impl == "tpu" else pk_gpu, f"{fmt}_matmul_{impl}")


# ------------------------------------------------------------------ reference vs the layout spec
def test_int4_reference_matches_layout_spec():
    x, codes, scales, zeros, q = _int4_inputs(3, 256, 130, 64, jnp.float32)
    c = np.asarray(codes)
    # element 2i is the low nibble, 2i+1 the high nibble
    np.testing.assert_array_equal(c[5, 7] & 0xF, q[10, 7])
    np.testing.assert_array_equal(c[5, 7] >> 4, q[11, 7])
    s = np.repeat(np.asarray(scales), 64, axis=0)
    z = np.repeat(np.asarray(zeros, np.float32), 64, axis=0)
    w = (q.astype(np.float32) - z) * s
    np.testing.assert_array_equal(np.asarray(ref.dequantize_int4(codes, scales, zeros, 64)), w)
    np.testing.assert_array_equal(np.asarray(ref.unpack_int4(codes)), q)


def test_nf4_reference_matches_bnb_layout():
    x, codes, absmax, q = _nf4_inputs(2, 128, 6, jnp.float32)
    c = np.asarray(codes)
    # bitsandbytes: even element of the flattened [N, K] tensor in the HIGH nibble
    assert c[3, 9] >> 4 == q[3, 18] and c[3, 9] & 0xF == q[3, 19]
    table = np.asarray(ref.NF4_TABLE, np.float32)
    w_t = table[q] * np.repeat(np.asarray(absmax), 64, axis=1)
    np.testing.assert_array_equal(np.asarray(ref.dequantize_nf4(codes, absmax)), w_t)
    # the flat [N*K/64] absmax of DESIGN.md is accepted too
    np.testing.assert_array_equal(np.asarray(ref.dequantize_nf4(codes, absmax.reshape(-1))), w_t)
    assert table[0] == -1.0 and table[7] == 0.0 and table[15] == 1.0


def test_int8_reference_per_channel_and_grouped():
    x, codes, scales, zeros = _int8_inputs(2, 256, 8, 256, jnp.float32)
    w = (np.asarray(codes, np.float32) - np.asarray(zeros, np.float32)) * np.asarray(scales)
    np.testing.assert_array_equal(np.asarray(ref.dequantize_int8(codes, scales, zeros)), w)
    x, codes, scales, zeros = _int8_inputs(2, 256, 8, 128, jnp.float32)
    w = (np.asarray(codes, np.float32) - np.repeat(np.asarray(zeros, np.float32), 128, 0)) \
        * np.repeat(np.asarray(scales), 128, 0)
    np.testing.assert_array_equal(np.asarray(ref.dequantize_int8(codes, scales, zeros)), w)


# ---------------------------------------------------------------------------- kernels vs reference
# (M, K, N, group, dtype, tile overrides). K=384/g=128 and N=200 are not tile multiples; the
# overrides force several K steps (and split-K on GPU) while keeping the interpret grid small.
INT4_CASES = [
    (1, 384, 200, 128, jnp.float32, {}),
    (7, 384, 200, 128, jnp.bfloat16, {"tpu": {"block_n": 128}}),  # TPU pads N 200 -> 256
    (16, 512, 256, 64, jnp.bfloat16, {"block_k": 64, "tpu": {"block_k": 256, "block_n": 128}}),
    (128, 256, 128, 64, jnp.float32, {}),
    (7, 384, 200, 384, jnp.float32, {}),  # per-channel: group == K
]


def _overrides(kw, impl):
    out = {k: v for k, v in kw.items() if k not in ("tpu", "gpu")}
    out.update(kw.get(impl, {}))
    if impl == "tpu":
        out.pop("splits", None)
        if "tpu" in kw:
            out = dict(kw["tpu"])
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m,k,n,g,dtype,kw", INT4_CASES)
def test_int4_kernel(impl, m, k, n, g, dtype, kw):
    x, codes, scales, zeros, _ = _int4_inputs(m, k, n, g, dtype)
    y = _kernel("int4", impl)(x, codes, scales, zeros, g, interpret=True, **_overrides(kw, impl))
    y_ref = ref.int4_matmul_reference(x, codes, scales, zeros, g)
    _check(y, y_ref, x, ref.dequantize_int4(codes, scales, zeros, g))


INT8_CASES = [
    (1, 384, 200, 384, jnp.bfloat16, {}),  # per-channel scales [1, N]
    (16, 512, 256, 128, jnp.float32, {"block_k": 64, "splits": 2, "tpu": {"block_k": 256}}),
    (128, 256, 128, 64, jnp.bfloat16, {}),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m,k,n,g,dtype,kw", INT8_CASES)
def test_int8_kernel(impl, m, k, n, g, dtype, kw):
    x, codes, scales, zeros = _int8_inputs(m, k, n, g, dtype)
    y = _kernel("int8", impl)(x, codes, scales, zeros, interpret=True, **_overrides(kw, impl))
    y_ref = ref.int8_matmul_reference(x, codes, scales, zeros)
    _check(y, y_ref, x, ref.dequantize_int8(codes, scales, zeros))


NF4_CASES = [
    (1, 384, 200, jnp.float32, {}),
    (7, 512, 256, jnp.bfloat16, {"splits": 2, "tpu": {"block_k": 512, "block_n": 128}}),
    (16, 256, 128, jnp.float32, {}),
    (128, 256, 128, jnp.bfloat16, {}),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m,k,n,dtype,kw", NF4_CASES)
def test_nf4_kernel(impl, m, k, n, dtype, kw):
    x, codes, absmax, _ = _nf4_inputs(m, k, n, dtype)
    y = _kernel("nf4", impl)(x, codes, absmax, 64, interpret=True, **_overrides(kw, impl))
    y_ref = ref.nf4_matmul_reference(x, codes, absmax, 64)
    _check(y, y_ref, x, ref.dequantize_nf4(codes, absmax).T)


def test_tile_choice_decode_vs_prefill():
    v5e = pk_tpu.GENERATIONS["v5e"]
    dec = pk_tpu.choose_tiles(4, 4096, 4096, x_dtype=jnp.bfloat16, k_align=1024, gen=v5e)
    pre = pk_tpu.choose_tiles(512, 4096, 4096, x_dtype=jnp.bfloat16, k_align=1024, gen=v5e)
    assert (dec.bm, dec.bn) == (16, 1024) and dec.bk % 1024 == 0 and 4096 % dec.bk == 0
    assert pre.bm == 256 and pre.bn == 512 and pre.mp == 512
    odd = pk_tpu.choose_tiles(7, 384, 200, x_dtype=jnp.float32, k_align=1024, gen=v5e)
    assert (odd.bk, odd.bn, odd.kp, odd.np_) == (384, 200, 384, 200)  # full-dim blocks, no padding
    assert dec.vmem_limit == 96 << 20  # 3/4 of v5e's 128 MiB VMEM
    gdec = pk_gpu.choose_tiles(1, 4096, 4096, k_unit=128)
    assert gdec.bm == 16 and gdec.bk == 128 and gdec.splits > 1  # split-K fills the SMs at decode
    gpre = pk_gpu.choose_tiles(2048, 4096, 4096, k_unit=128)
    assert gpre.splits == 1 and gpre.bm == 128


@pytest.mark.parametrize("fmt,g,block_k", [("int4", 64, 256), ("int4", 128, 1024),
                                            ("int4", 128, 512), ("int8", 128, 256),
                                            ("int8", 32, 256)])
def test_staged_zero_points_are_exact(fmt, g, block_k):
    """Grouped uint8 zero points are staged whole per N block (a bk/g-row uint8 block is not
    tile-legal on TPU) and widened to f32 in VMEM; so are f32 scales when bk/g is not a multiple
    of 8 (K=9728 g=128 on v4: the only alternative is padding K), then per K step in a
    [steps, bk/g, bn] scratch. With integer activations, power-of-two scales
    and K=2048 every product and partial sum is exact in f32, so the kernel must equal the
    reference bit for bit whatever the tiling."""
    k, n, m = 2048, 256, 8
    r = _rng("staged", fmt, g)
    x = jnp.asarray(r.integers(-4, 5, (m, k)), jnp.float32)
    scales = jnp.asarray(2.0 ** r.integers(-6, -2, (k // g, n)), jnp.float32)
    zeros = jnp.asarray(r.integers(0, 16, (k // g, n)), jnp.uint8)
    if fmt == "int4":
        codes = jnp.asarray(ref.pack_int4(r.integers(0, 16, (k, n))))
        t, staged = pk_tpu.plan_affine("int4", m, k, n, g, False, x_dtype=x.dtype,
                                       s_dtype=scales.dtype, block_k=block_k)
        y = pk_tpu.int4_matmul_tpu(x, codes, scales, zeros, g, interpret=True, block_k=block_k)
        y_ref = ref.int4_matmul_reference(x, codes, scales, zeros, g)
    else:
        codes = jnp.asarray(r.integers(0, 16, (k, n)), jnp.uint8)
        t, staged = pk_tpu.plan_affine("int8", m, k, n, g, False, x_dtype=x.dtype,
                                       s_dtype=scales.dtype, block_k=block_k)
        y = pk_tpu.int8_matmul_tpu(x, codes, scales, zeros, interpret=True, block_k=block_k)
        y_ref = ref.int8_matmul_reference(x, codes, scales, zeros)
    assert t.kp // t.bk > 1 and staged == ((block_k // g) % 32 != 0)
    scales_staged, _ = tpu_tiles.staging(False, block_k // g, t.bk, t.kp, scales.dtype,
                                       pk_tpu.generation())
    assert scales_staged == ((block_k // g) % 8 != 0)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))


# ------------------------------------------------------------------------- dispatch and gradients
def test_resolve_impl_on_cpu():
    assert jax.default_backend() == "cpu"
    assert pk.resolve_impl("auto") == ("xla", False)
    assert pk.resolve_impl("tpu") == ("tpu", True)
    assert pk.resolve_impl("gpu") == ("gpu", True)
    with pytest.raises(ValueError):
        pk.resolve_impl("cuda")


@pytest.mark.parametrize("impl", ["auto", "tpu"])
def test_public_api_batch_dims_and_jit(impl):
    x, codes, scales, zeros, _ = _int4_inputs(6, 256, 128, 64, jnp.bfloat16)
    xb = x.reshape(2, 3, 256)
    f = jax.jit(lambda a: pk.int4_matmul(a, codes, scales, zeros, 64, impl=impl))
    y = f(xb)
    assert y.shape == (2, 3, 128) and y.dtype == jnp.bfloat16
    y_ref = ref.int4_matmul_reference(x, codes, scales, zeros, 64)
    _check(y.reshape(6, 128), y_ref, x, ref.dequantize_int4(codes, scales, zeros, 64))

    x8, c8, s8, z8 = _int8_inputs(4, 256, 128, 256, jnp.float32)
    y8 = pk.int8_matmul(x8.reshape(2, 2, 256), c8, s8, z8, impl=impl)
    _check(y8.reshape(4, 128), ref.int8_matmul_reference(x8, c8, s8, z8), x8,
           ref.dequantize_int8(c8, s8, z8))

    xn, cn, an, _ = _nf4_inputs(4, 256, 128, jnp.float32)
    yn = pk.nf4_matmul(xn.reshape(2, 2, 256), cn, an.reshape(-1), impl=impl)
    _check(yn.reshape(4, 128), ref.nf4_matmul_reference(xn, cn, an), xn, ref.dequantize_nf4(cn, an).T)


def _grad_case(fmt, dtype):
    if fmt == "int4":
        x, codes, scales, zeros, _ = _int4_inputs(5, 256, 128, 64, dtype)
        return x, lambda a, **kw: pk.int4_matmul(a, codes, scales, zeros, 64, **kw), \
            lambda a: ref.int4_matmul_reference(a, codes, scales, zeros, 64)
    if fmt == "int8":
        x, codes, scales, zeros = _int8_inputs(5, 256, 128, 128, dtype)
        return x, lambda a, **kw: pk.int8_matmul(a, codes, scales, zeros, **kw), \
            lambda a: ref.int8_matmul_reference(a, codes, scales, zeros)
    x, codes, absmax, _ = _nf4_inputs(5, 256, 128, dtype)
    return x, lambda a, **kw: pk.nf4_matmul(a, codes, absmax, **kw), \
        lambda a: ref.nf4_matmul_reference(a, codes, absmax)


@pytest.mark.parametrize("fmt", ["int4", "int8", "nf4"])
@pytest.mark.parametrize("impl,dtype", [("tpu", jnp.float32), ("gpu", jnp.bfloat16),
                                        ("xla", jnp.float32)])
def test_grad_wrt_x_matches_reference(fmt, impl, dtype):
    x, f, f_ref = _grad_case(fmt, dtype)
    ct = jnp.asarray(_rng("ct", fmt).standard_normal((x.shape[0], 128)), jnp.float32)

    def loss(fn):
        return lambda a: jnp.sum(fn(a).astype(jnp.float32) * ct)

    g = jax.grad(loss(lambda a: f(a, impl=impl)))(x)
    g_ref = jax.grad(loss(f_ref))(x)
    assert g.dtype == x.dtype
    # dx = ct @ W^T: same f32 weights, f32 sums over N=128 terms (+ bf16 rounding of dx).
    w_nk = np.asarray(jax.jacobian(lambda a: f_ref(a.astype(jnp.float32)).astype(jnp.float32))(
        jnp.zeros((1, x.shape[1]), jnp.float32)))[0, :, 0, :]  # [N, K]
    s = np.abs(np.asarray(ct, np.float64)) @ np.abs(w_nk.astype(np.float64))
    tol = 2 * 128 * U32 * s * 1.01 + 1e-30
    if dtype == jnp.bfloat16:  # bf16 weights in the backward dot (2^-9 relative each) and bf16 dx
        tol = tol + 2.0 ** -9 * s + 2.0 ** -8 * np.abs(np.asarray(g_ref, np.float64))
    err = np.abs(np.asarray(g, np.float64) - np.asarray(g_ref, np.float64))
    assert np.all(err <= tol), err.max()


@pytest.mark.parametrize("fmt", ["int4", "nf4"])
def test_16_bit_backward_runs_in_16_bit(fmt):
    """bf16 activations: dx = dy @ W^T with W in bf16 and f32 accumulation (the forward's arithmetic and
    bitsandbytes'), not an f32 HIGHEST-precision dot (6 MXU passes on TPU, an f32 copy of the weight)."""
    x, f, f_ref = _grad_case(fmt, jnp.bfloat16)
    dy = jnp.asarray(_rng("dy", fmt).standard_normal((x.shape[0], 128)), jnp.bfloat16)
    _, vjp = jax.vjp(lambda a: f(a, impl="xla"), x)
    jaxpr = str(jax.make_jaxpr(vjp)(dy))
    dots = [l for l in jaxpr.splitlines() if "dot_general" in l]
    assert dots and all("HIGHEST" not in l for l in dots), dots
    w = jax.jacobian(lambda a: f_ref(a.astype(jnp.float32)).astype(jnp.float32))(
        jnp.zeros((1, x.shape[1]), jnp.float32))[0, :, 0, :]  # [N, K] f32
    want = jnp.dot(dy, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(vjp(dy)[0], np.float32), np.asarray(want, np.float32))


def test_no_gradient_into_frozen_quantized_base():
    x, codes, scales, zeros, _ = _int4_inputs(3, 256, 128, 64, jnp.float32)
    gs = jax.grad(lambda s: jnp.sum(pk.int4_matmul(x, codes, s, zeros, 64)))(scales)
    assert gs.shape == scales.shape and not np.any(np.asarray(gs))
    xn, cn, an, _ = _nf4_inputs(3, 256, 128, jnp.float32)
    ga = jax.grad(lambda a: jnp.sum(pk.nf4_matmul(xn, cn, a)))(an)
    assert not np.any(np.asarray(ga))


def test_package_reexports_public_api():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import pallas_kernels as p, pallas_kernels.dispatch as d\n"
            "assert p.__file__ and p.int4_matmul is d.int4_matmul and p.nf4_matmul is d.nf4_matmul\n"
            "assert p.int8_matmul is d.int8_matmul and 'lrmq' not in __import__('sys').modules\n")
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})


# ------------------------------------------------------------- real-backend lowering (no device)
# jax.export lowers for a platform without its hardware. This runs the Pallas -> Mosaic and
# Pallas -> Triton lowerings (catching unsupported ops / block shapes); it does not run the
# device compilers (Mosaic layout passes, ptxas), so it is a necessary, not sufficient, check.
_DC = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("m", [1, 64])
def test_kernels_lower_for_device(platform, m):
    sd = jax.ShapeDtypeStruct
    k, n = 2048, 1024
    x = sd((m, k), jnp.bfloat16)
    impl = "tpu" if platform == "tpu" else "gpu"
    cases = [
        (lambda *a: pk.int4_matmul(*a, 128, impl=impl, interpret=False),
         (x, sd((k // 2, n), jnp.uint8), sd((k // 128, n), jnp.bfloat16), sd((k // 128, n), jnp.uint8))),
        (lambda *a: pk.int8_matmul(*a, impl=impl, interpret=False),
         (x, sd((k, n), jnp.uint8), sd((1, n), jnp.float32), sd((1, n), jnp.uint8))),
        (lambda *a: pk.nf4_matmul(*a, impl=impl, interpret=False),
         (x, sd((n, k // 2), jnp.uint8), sd((n, k // 64), jnp.float32))),
    ]
    for fn, args in cases:
        exp = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=_DC)(*args)
        text = exp.mlir_module()
        assert ("tpu_custom_call" in text) if platform == "tpu" else ("triton" in text)
