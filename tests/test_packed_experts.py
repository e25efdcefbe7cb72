"""Packed mixture-of-experts weights (docs/moe.md "Packed experts"): a stacked-experts `QuantizedWeight`
(shape (E, K, N)), the `QuantizedExpertKernel` an `ExpertLinear` runs through `packed_ragged_dot`, the transforms
that select and pack expert projections, and the lrmq packed checkpoint of a model with packed experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lrmq.checkpoint.load import load_model
from lrmq.checkpoint.orbax_io import load_lrmq, save_lrmq
from lrmq.quant.formats import array_axes, dequantize, quantize_weight
from lrmq.quant.qkernel import QuantizedExpertKernel
from lrmq.quant.qmatmul import qragged_dot
from lrmq.quant.qweight import expert_slice, stack_experts
from lrmq.quant.transforms import (DEFAULT_TARGETS, iter_expert_linears, iter_linears, restore_float_kernel,
                                   set_packed_expert_kernel)
from lrmq.sharding import LOGICAL_AXES_KEY

FORMATS = {"int4 asym g32": dict(bits=4, group_size=32), "int8 sym per-channel": dict(bits=8, group_size=-1,
           symmetric=True), "nf4": dict(fmt="nf4", block_size=64)}


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def _logits(model, tokens):
    out = _forward(model, tokens)
    return np.asarray(out[0] if isinstance(out, tuple) else out)


@pytest.fixture(scope="module")
def tiny_moe():
    return load_model("tiny-moe")


@pytest.mark.parametrize("name", list(FORMATS))
def test_stacked_experts_quantize_as_each_expert_alone(name):
    """Quantizing [E, K, N] gives expert e's arrays bit for bit as quantizing w[e] alone; dequantize is [E, K, N];
    expert_slice / stack_experts are inverses; every array's logical axes lead with the expert axis."""
    w = jax.random.normal(jax.random.key(0), (3, 64, 32), jnp.float32) * 0.05
    qw = quantize_weight(w, **FORMATS[name])
    assert qw.shape == (3, 64, 32) and (qw.num_experts, qw.K, qw.N) == (3, 64, 32)
    deq = np.asarray(dequantize(qw))
    assert deq.shape == (3, 64, 32)
    for e in range(3):
        alone = quantize_weight(w[e], **FORMATS[name])
        got = expert_slice(qw, e)
        assert got.static() == alone.static() and set(got.arrays()) == set(alone.arrays())
        for k, a in alone.arrays().items():
            np.testing.assert_array_equal(np.asarray(got.arrays()[k]), np.asarray(a), err_msg=f"expert {e} {k}")
        np.testing.assert_array_equal(deq[e], np.asarray(dequantize(alone)))
    back = stack_experts([expert_slice(qw, e) for e in range(3)])
    assert back.static() == qw.static()
    jax.tree.map(np.testing.assert_array_equal, back, qw)
    axes = array_axes(qw, ("expert", "embed", "mlp"))
    for k, a in qw.arrays().items():
        assert len(getattr(axes, k)) == a.ndim and getattr(axes, k)[0] == "expert", (k, getattr(axes, k))
    assert axes.codes == (("expert", "mlp", "embed") if qw.fmt == "nf4" else ("expert", "embed", "mlp"))


def test_stacking_refuses_mixed_formats_and_out_of_range_experts():
    w = jnp.ones((64, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"expert 1 differs from expert 0 in \['group_size'\]"):
        stack_experts([quantize_weight(w, group_size=32), quantize_weight(w, group_size=64)])
    qw = quantize_weight(jnp.ones((2, 64, 32)), group_size=32)
    with pytest.raises(IndexError, match="expert 2 out of range for a weight of 2 experts"):
        expert_slice(qw, 2)
    with pytest.raises(ValueError, match="expert_slice needs a stacked-experts weight"):
        expert_slice(quantize_weight(w, group_size=32), 0)
    with pytest.raises(ValueError, match="qragged_dot: group_sizes must be \\[2\\]"):
        qragged_dot(jnp.ones((4, 64)), qw, jnp.array([4], jnp.int32))


def test_packed_experts_run_save_and_load_as_the_dequantized_model(tiny_moe, tmp_path):
    """tiny-moe with every expert projection packed int4 g32 (RTN) gives the logits of the model whose expert
    kernels are the dequantized floats (float32: the XLA path is dequantize + ragged_dot); the lrmq packed
    checkpoint stores and restores the packed experts exactly; the kernels can go back to float."""
    model = nnx.clone(tiny_moe)
    ref = nnx.clone(tiny_moe)
    found = iter_expert_linears(model, DEFAULT_TARGETS)
    assert [p for p, _ in found] == [f"layers.{i}.mlp.experts.{n}_proj" for i in (0, 2) for n in ("down", "gate", "up")]
    assert [p for p, _ in iter_expert_linears(model, r".*\.gate_proj$")] == [found[1][0], found[4][0]]
    with pytest.raises(ValueError, match="selects the mixture-of-experts expert weights"):
        iter_linears(model, DEFAULT_TARGETS)  # the other transforms' callers lift this themselves
    ref_experts = dict(iter_expert_linears(ref))
    for path, el in found:
        qw = quantize_weight(el.kernel.get_value(), bits=4, group_size=32)
        set_packed_expert_kernel(el, qw)
        restore_float_kernel(ref, ref_experts[path], dequantize(qw))
        assert isinstance(el.kernel, QuantizedExpertKernel) and el.kernel.get_metadata()[LOGICAL_AXES_KEY] == \
            ("expert", *(("mlp", "embed") if path.endswith("down_proj") else ("embed", "mlp")))
        np.testing.assert_array_equal(np.asarray(el.float_weight()), np.asarray(ref_experts[path].float_weight()))
    with pytest.raises(ValueError, match=r"packed expert weight shape \(8, 128, 64\) != ExpertLinear \(8, 64, 128\)"):
        set_packed_expert_kernel(found[0][1], quantize_weight(jnp.ones((8, 128, 64)), group_size=32))
    tokens = jnp.asarray(np.random.RandomState(0).randint(1, 300, (2, 11)))
    packed_logits = _logits(model, tokens)
    np.testing.assert_allclose(packed_logits, _logits(ref, tokens), rtol=1e-6, atol=1e-6)

    save_lrmq(model, str(tmp_path / "packed"))
    back = load_lrmq(str(tmp_path / "packed"))
    for path, el in iter_expert_linears(back):
        assert isinstance(el.kernel, QuantizedExpertKernel)
        jax.tree.map(np.testing.assert_array_equal, el.kernel.get_value(), dict(found)[path].kernel.get_value())
    np.testing.assert_array_equal(_logits(back, tokens), packed_logits)

    path, el = found[0]
    restore_float_kernel(model, el, el.float_weight())
    assert type(el.kernel) is nnx.Param and el.kernel.get_value().shape == (8, 64, 128)


# ------------------------------------------------------------------------ the grouped TPU kernel
def _grouped_operands(fmt, e, k, n, g, seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=(e, k, n)) * 0.05, jnp.float32)
    qw = quantize_weight(w, bits=4 if fmt == "int4" else 8, group_size=g)
    return qw


@pytest.mark.parametrize("fmt, g, sizes, dtype, tiles", [
    # empty groups, groups that are not a multiple of the 16-row tile, a tile shared by three groups, rows past
    # the groups' sum (zeros), staged scales and zero points (2 group rows per 256-deep K step)
    ("int4", 128, [10, 0, 17, 1, 0, 5], jnp.float32, dict(block_m=16, block_k=256)),
    ("int8", -1, [0, 3, 30, 0, 0, 7], jnp.bfloat16, dict(block_m=16)),
])
def test_grouped_kernel_matches_the_xla_path_in_interpret_mode(fmt, g, sizes, dtype, tiles):
    """The Mosaic grouped kernel (interpret mode on the CPU) against `qragged_dot`'s XLA path (dequantize every
    expert + ragged_dot), forward and the x-gradient of its custom_vjp."""
    import pallas_kernels as pk

    qw = _grouped_operands(fmt, 6, 512, 128, g)
    m = 40
    x = jnp.asarray(np.random.default_rng(1).normal(size=(m, 512)), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    kernel = pk.grouped_int4_matmul if fmt == "int4" else pk.grouped_int8_matmul
    call = lambda x: kernel(x, gs, qw.codes, qw.scales, qw.zeros, impl="tpu", **tiles)  # noqa: E731
    y = np.asarray(call(x), np.float32)
    ref = np.asarray(qragged_dot(x, qw, gs, impl="xla"), np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(y, ref, rtol=tol, atol=tol * np.abs(ref).max())
    assert not y[sum(sizes):].any() and np.abs(y[:sum(sizes)]).min(axis=1).max() > 0
    dy = jnp.asarray(np.random.default_rng(2).normal(size=y.shape), dtype)
    gx = jax.grad(lambda x: jnp.sum(call(x).astype(jnp.float32) * dy))(x)
    gref = jax.grad(lambda x: jnp.sum(qragged_dot(x, qw, gs, impl="xla").astype(jnp.float32) * dy))(x)
    np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(gref, np.float32), rtol=tol,
                               atol=tol * float(jnp.abs(gref).max()))


def test_packed_ragged_dot_takes_the_kernel_on_a_tpu_target():
    """qmatmul's rule: the grouped kernel where the compile target is a TPU (int4 / int8), the XLA path elsewhere
    and for formats without a grouped kernel."""
    import pallas_kernels as pk
    from lrmq.quant.qmatmul import qragged_dot_path

    int4, nf4 = quantize_weight(jnp.ones((2, 128, 128)), group_size=64), \
        quantize_weight(jnp.ones((2, 128, 128)), fmt="nf4")
    assert qragged_dot_path(int4) == "dequant" and qragged_dot_path(nf4) == "dequant"
    with pk.target("tpu", "TPU v5 lite"):
        assert qragged_dot_path(int4) == "int4" and qragged_dot_path(nf4) == "dequant"
        jaxpr = str(jax.make_jaxpr(lambda x, gs: qragged_dot(x, int4, gs))(jnp.ones((8, 128)), jnp.array([3, 5])))
    assert "lrmq_grouped_int4_matmul_tpu" in jaxpr
    assert "pallas_call" not in str(jax.make_jaxpr(lambda x, gs: qragged_dot(x, int4, gs))(jnp.ones((8, 128)),
                                                                                         jnp.array([3, 5])))


def test_grouped_kernel_compiles_ahead_of_time_for_v5e_v5p_v6e():
    """Mosaic accepts the grouped kernel on each generation (libtpu, no TPU): int4 g128 and int8 per channel at a
    small expert shape (int8 on v5e); Qwen3-30B-A3B's shapes: benchmarks/moe_kernel_aot.py (docs/figures/moe_kernel_aot.json)."""
    pytest.importorskip("libtpu") if __import__("sys").version_info >= (3, 12) else __import__("libtpu")
    import benchmarks.moe_kernel_aot as aot

    cases = [(gen, "int4 g128") for gen in ("v5e", "v5p", "v6e")] + [("v5e", "int8 per-channel")]
    for gen, fmt in cases:
        rec = aot.compile_case(gen, fmt, "down", "decode", e=4)
        assert rec["status"] == "compiled" and rec["mosaic_kernel"], rec
