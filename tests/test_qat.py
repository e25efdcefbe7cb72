"""QAT dot_generals: forward = fake-quant of the weights (each scheme); gradient = the float gradient at the
quantized point (STE); paper_int8's scale is frozen at load; stochastic rounding only touches the backward."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import jit_forward
from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder
from lrmq.quant.qat import apply_qat, fake_quant_activations, fake_quant_weight, is_qat, make_dot_general
from lrmq.quant.transforms import iter_linears

CFG = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
           num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
           max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)
TOK = (jnp.arange(12).reshape(2, 6) * 5) % 64


def tiny(seed=0):
    return Decoder(ModelConfig.from_hf_dict(dict(CFG)), nnx.Rngs(seed))


def paper_int8_scale(w0) -> np.float32:
    """Paper 1's frozen scale, written independently of lrmq (numpy, float32): S = max(max|W0| / 127, 1e-6),
    per tensor (rlquant `QuantizedLinear`; shared/reference/papers.md, "QAFT / STE, 8-bit")."""
    return np.maximum(np.abs(np.asarray(w0, np.float32)).max() / np.float32(127), np.float32(1e-6))


def paper_int8_reference(w, w0) -> np.ndarray:
    """W_q = clamp(round(W / S), -128, 127) * S with S frozen from the base weights W0 (numpy reference)."""
    s = paper_int8_scale(w0)
    return (np.clip(np.round(np.asarray(w, np.float32) / s), -128, 127) * s).astype(np.float32)


def float_with_fake_quant(model, scheme, group_size=0, base=None):
    """A float copy of `model` whose targeted kernels are replaced by their fake-quantized values.

    paper_int8 uses the numpy reference above (scale frozen from `base`'s kernels, default: the current
    ones), not lrmq's quantizer, so the test does not compare qat.py with itself. The AQT schemes compare
    AQT's dot_general with lrmq's own symmetric fake-quant: already two implementations.
    """
    ref = tiny()
    nnx.update(ref, nnx.state(model, nnx.Param))
    base_kernels = {p: lin.kernel.get_value() for p, lin in iter_linears(base if base is not None else ref)}
    for path, lin in iter_linears(ref):
        w = lin.kernel.get_value()
        if scheme == "paper_int8":
            lin.kernel.set_value(jnp.asarray(paper_int8_reference(w, base_kernels[path])))
        else:
            lin.kernel.set_value(fake_quant_weight(w, scheme, group_size))
    return ref


CASES = [("paper_int8", 0), ("int8", 0), ("int8", 16), ("int4", 0), ("int4", 16), ("int4_asym", 16)]


@pytest.mark.parametrize("scheme,g", CASES)
def test_forward_equals_fake_quant(scheme, g):
    m = tiny()
    touched = apply_qat(m, scheme, group_size=g)
    assert len(touched) == 7 and m.lm_head.dot_general.__name__ == "default_dot_general"  # lm_head untouched
    ref = float_with_fake_quant(m, scheme, g)
    y, y_ref, y_float = jit_forward(m, TOK), jit_forward(ref, TOK), jit_forward(tiny(), TOK)
    np.testing.assert_allclose(y, y_ref, atol=2e-5, rtol=1e-5)
    assert float(jnp.abs(y - y_float).max()) > 1e-4  # quantization really happens


def test_w8a8_forward_quantizes_weights_and_activations():
    m = tiny()
    apply_qat(m, "w8a8")
    lin = m.layers[0].mlp.up_proj
    x = jax.random.normal(jax.random.key(3), (2, 5, 32))
    w = lin.kernel.get_value()
    want = fake_quant_activations(x, 8) @ fake_quant_weight(w, "w8a8")
    np.testing.assert_allclose(lin(x), want, atol=2e-5, rtol=1e-5)
    assert float(jnp.abs(lin(x) - x @ fake_quant_weight(w, "int8")).max()) > 1e-5  # activations quantized too


def _loss(model):
    return jnp.mean(model(TOK) ** 2)


grad_loss = nnx.jit(nnx.grad(_loss))  # one compiled program per model structure, not op by op


@pytest.mark.parametrize("scheme,g", [("paper_int8", 0), ("int8", 0), ("int4", 16), ("int4_asym", 16)])
def test_gradient_is_float_gradient_at_quantized_point(scheme, g):
    m = tiny()
    apply_qat(m, scheme, group_size=g)
    ref = float_with_fake_quant(m, scheme, g)
    grad = grad_loss(m)
    grad_ref = grad_loss(ref)
    flat, flat_ref = dict(nnx.to_flat_state(grad)), dict(nnx.to_flat_state(grad_ref))
    assert flat.keys() == flat_ref.keys()
    for k in flat:
        np.testing.assert_allclose(flat[k].get_value(), flat_ref[k].get_value(), atol=1e-6, rtol=2e-4, err_msg=str(k))
    # straight-through: the targeted kernels receive non-zero gradients
    assert float(jnp.abs(m.layers[0].attn.q_proj.kernel.get_value()).max()) > 0
    assert float(jnp.abs(grad["layers"][0]["attn"]["q_proj"]["kernel"].get_value()).max()) > 0


def test_paper_int8_scale_is_frozen_from_the_base_weights():
    m = tiny()
    base = tiny()
    apply_qat(m, "paper_int8")
    for path, lin in iter_linears(m):
        assert is_qat(lin) and float(lin.dot_general.scale[...]) == float(paper_int8_scale(lin.kernel.get_value())), path
    lin = m.layers[0].attn.q_proj
    w0 = lin.kernel.get_value()
    lin.kernel.set_value(w0 * 3.0)  # training moved the weights: the scale must not follow
    x = jax.random.normal(jax.random.key(1), (3, 32))
    np.testing.assert_allclose(lin(x), x @ paper_int8_reference(w0 * 3.0, w0), atol=1e-5, rtol=1e-5)
    recomputed = paper_int8_reference(w0 * 3.0, w0 * 3.0)
    assert float(jnp.abs(lin(x) - x @ recomputed).max()) > 1e-3  # a scale that followed the weights differs
    # ... and the whole model: every kernel moved, each forward still uses its frozen scale
    for _, l in iter_linears(m):
        l.kernel.set_value(l.kernel.get_value() * 1.7 + 0.01)
    want = jit_forward(float_with_fake_quant(m, "paper_int8", base=base), TOK)
    np.testing.assert_allclose(jit_forward(m, TOK), want, atol=2e-5, rtol=1e-5)


def test_paper_int8_hand_computed():
    """S = 1.27 / 127 = 0.01; round-to-nearest, clamp to [-128, 127] (asymmetric int8 range), identity
    backward even where the value clipped."""
    w0 = jnp.asarray([[1.27, -0.5], [0.3, 0.004]], jnp.float32)
    dg = make_dot_general("paper_int8", w0)
    assert float(dg.scale[...]) == pytest.approx(0.01, rel=1e-6)
    w = jnp.asarray([[2.0, -1.5], [0.304, 0.0049]], jnp.float32)  # 200 -> 127, -150 -> -128, 30.4 -> 30, 0.49 -> 0
    dims = (((1,), (0,)), ((), ()))
    np.testing.assert_allclose(dg(jnp.eye(2), w, dims), [[1.27, -1.28], [0.30, 0.0]], rtol=1e-6, atol=1e-7)
    x = jnp.asarray([[1.0, 2.0], [3.0, -1.0]], jnp.float32)
    c = jnp.asarray([[0.5, -2.0], [1.5, 1.0]], jnp.float32)
    gw = jax.grad(lambda w: jnp.sum(dg(x, w, dims) * c))(w)
    np.testing.assert_allclose(gw, x.T @ c, rtol=1e-6)  # straight-through: d/dW of x @ W


def test_stochastic_rounding_changes_backward_only():
    m, plain = tiny(), tiny()
    apply_qat(m, "int8", stochastic_rounding=True, seed=1)
    apply_qat(plain, "int8")
    # the forward (rollouts) unchanged, deterministic
    np.testing.assert_allclose(jit_forward(m, TOK), jit_forward(plain, TOK), atol=1e-6)
    g1 = grad_loss(m)["layers"][0]["mlp"]["down_proj"]["kernel"].get_value()
    g1b = grad_loss(m)["layers"][0]["mlp"]["down_proj"]["kernel"].get_value()
    g0 = grad_loss(plain)["layers"][0]["mlp"]["down_proj"]["kernel"].get_value()
    np.testing.assert_array_equal(g1, g1b)  # same inputs -> same key -> same gradient (reproducible)
    assert float(jnp.abs(g1 - g0).max()) > 0  # the incoming gradient was stochastically rounded
    assert float(jnp.linalg.norm(g1 - g0) / jnp.linalg.norm(g0)) < 0.2  # ... and is close to the STE gradient
    # the key follows the data: a different batch (or layer input) gives a different key
    from lrmq.quant.qat import data_key

    x = jax.random.normal(jax.random.key(0), (4, 8))
    kd = lambda a, salt=0: jax.random.key_data(data_key(1, salt, a))
    assert np.array_equal(kd(x), kd(x + 0.0))
    assert not np.array_equal(kd(x), kd(x.at[2, 3].add(1e-3)))
    assert not np.array_equal(kd(x), kd(x, salt=5))


def test_qat_bad_input():
    m = tiny()
    with pytest.raises(ValueError, match="qat_scheme"):
        apply_qat(m, "int3")
    with pytest.raises(ValueError, match="does not divide"):
        apply_qat(m, "int4", group_size=24)
    with pytest.raises(ValueError, match="matches no Linear"):
        apply_qat(m, "int8", pattern=r"nothing")
    with pytest.raises(ValueError, match="stochastic"):
        apply_qat(m, "paper_int8", stochastic_rounding=True)


@pytest.mark.parametrize("scheme", ["paper_int8", "int4"])
def test_a_qat_model_exports_its_float_weights(tmp_path, scheme):
    """The trainer's HF export of a QAT run: plain dot_generals back, no QAT state left in the model (paper_int8's
    frozen scales are state), and the written tensors are the float master weights."""
    from lrmq.checkpoint.hf import save_hf_model
    from lrmq.checkpoint.load import load_model
    from lrmq.quant.qat import remove_qat
    from lrmq.quant.training import export_float_model

    m = tiny()
    apply_qat(m, scheme)
    want = {p: np.asarray(lin.kernel.get_value()) for p, lin in iter_linears(m)}
    export_float_model(m)
    assert not any(is_qat(lin) for _, lin in iter_linears(m))
    assert {type(v) for _, v in nnx.to_flat_state(nnx.state(m, nnx.Not(nnx.RngState)))} == {nnx.Param}
    save_hf_model(m, str(tmp_path / "hf"))
    back = load_model(str(tmp_path / "hf"), dtype="float32")
    for p, lin in iter_linears(back):
        np.testing.assert_array_equal(np.asarray(lin.kernel.get_value()), want[p], err_msg=p)
    apply_qat(m, scheme)  # and removing QAT leaves no state behind either
    remove_qat(m)
    assert {type(v) for _, v in nnx.to_flat_state(nnx.state(m, nnx.Not(nnx.RngState)))} == {nnx.Param}


def test_asym_qat_export_is_rtn_bit_for_bit():
    """int4_asym g128's exported codes, zero points and scales are lrmq.quantize's default RTN of the same weights
    (int4 asym g128), its forward multiplies by exactly their dequantization, and its recorded format is the one
    `lrmq.quantize` writes with the flags it names (its defaults)."""
    from lrmq.model.linear import Linear
    from lrmq.ptq.qat_export import qat_weight
    from lrmq.quant.formats import WeightFormat, dequantize, quantize_weight, unpacked_codes
    from lrmq.quant.qat import make_dot_general, qat_weight_format, set_dot_general

    lin = Linear(256, 8, use_bias=False, axes=(None, None), dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs=nnx.Rngs(0))
    w = lin.kernel.get_value()
    set_dot_general(lin, make_dot_general("int4_asym", w, group_size=128))
    fmt = qat_weight_format("int4_asym", 128)
    assert fmt.describe() == "int4 asym g128 f32-scale (qat:int4_asym)"
    assert fmt.quantize_args() == ["--method", "rtn", "--bits", "4", "--group-size", "128"]  # lrmq.quantize's defaults
    fq, qw = qat_weight(lin, "lin")
    rtn = quantize_weight(w)  # lrmq.quantize --method rtn's quantizer, its defaults
    np.testing.assert_array_equal(unpacked_codes(qw), unpacked_codes(rtn))
    np.testing.assert_array_equal(qw.zeros, rtn.zeros)
    np.testing.assert_array_equal(qw.scales, rtn.scales)
    assert int(jnp.min(qw.zeros)) != int(jnp.max(qw.zeros))  # real zero points, not a symmetric midpoint
    np.testing.assert_array_equal(fq, dequantize(rtn))
    np.testing.assert_array_equal(lin.dot_general.quantize(w), fq)  # the forward's weight
    assert WeightFormat.of_weight(qw, "rtn").same_format(fmt) and WeightFormat.of_weight(rtn, "rtn").same_format(fmt)


def test_asym_qat_policy_export_end_to_end(tmp_path):
    """int4_asym's quantized export through the QAT exporters: the packed checkpoint computes the QAT forward, and
    qat_policy.json, the packed metadata and the compressed-tensors config all name its asymmetric format."""
    import json

    from lrmq.checkpoint.load import load_model
    from lrmq.checkpoint.orbax_io import read_weight_formats
    from lrmq.ptq.qat_export import export_qat_policy
    from lrmq.quant.qat import qat_weight_format

    m = tiny()
    apply_qat(m, "int4_asym", group_size=16)
    y_qat = jit_forward(m, TOK)
    out = export_qat_policy(m, str(tmp_path / "q"), scheme="int4_asym", group_size=16)
    np.testing.assert_allclose(jit_forward(load_model(os.path.join(out, "packed")), TOK), y_qat, atol=2e-5, rtol=1e-5)
    fmt = qat_weight_format("int4_asym", 16)
    info = json.load(open(os.path.join(out, "qat_policy.json")))
    assert info["weight_format"]["name"] == "int4 asym g16 f32-scale (qat:int4_asym)" and info["symmetric"] is False
    assert info["same_format_ptq"].endswith("--method rtn --bits 4 --group-size 16 --out OUT")
    assert read_weight_formats(os.path.join(out, "packed")) == [fmt]
    qc = json.load(open(os.path.join(out, "compressed_tensors", "config.json")))["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["symmetric"], w["group_size"]) == (4, False, 16), w
