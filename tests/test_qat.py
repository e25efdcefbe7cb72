"""QAT dot_generals: forward = fake-quant of the weights (each scheme); gradient = the float gradient at the
quantized point (STE); paper_int8's scale is frozen at load; stochastic rounding only touches the backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder
from lrmq.quant.qat import apply_qat, fake_quant_activations, fake_quant_weight, is_qat
from lrmq.quant.quantizers import fake_quant_per_tensor, per_tensor_scale
from lrmq.quant.transforms import iter_linears

CFG = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
           num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
           max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)
TOK = (jnp.arange(12).reshape(2, 6) * 5) % 64


def tiny(seed=0):
    return Decoder(ModelConfig.from_hf_dict(dict(CFG)), nnx.Rngs(seed))


def float_with_fake_quant(model, scheme, group_size=0, scales=None):
    """A float copy of `model` whose targeted kernels are replaced by their fake-quantized values."""
    ref = tiny()
    nnx.update(ref, nnx.state(model))
    for path, lin in iter_linears(ref):
        w = lin.kernel.get_value()
        lin.kernel.set_value(fake_quant_weight(w, scheme, group_size, scale=None if scales is None else scales[path]))
    return ref


CASES = [("paper_int8", 0), ("int8", 0), ("int8", 16), ("int4", 0), ("int4", 16)]


@pytest.mark.parametrize("scheme,g", CASES)
def test_forward_equals_fake_quant(scheme, g):
    m = tiny()
    touched = apply_qat(m, scheme, group_size=g)
    assert len(touched) == 7 and m.lm_head.dot_general.__name__ == "default_dot_general"  # lm_head untouched
    ref = float_with_fake_quant(m, scheme, g)
    y, y_ref, y_float = m(TOK), ref(TOK), tiny()(TOK)
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


@pytest.mark.parametrize("scheme,g", [("paper_int8", 0), ("int8", 0), ("int4", 16)])
def test_gradient_is_float_gradient_at_quantized_point(scheme, g):
    m = tiny()
    apply_qat(m, scheme, group_size=g)
    ref = float_with_fake_quant(m, scheme, g)
    grad = nnx.grad(_loss)(m)
    grad_ref = nnx.grad(_loss)(ref)
    flat, flat_ref = dict(nnx.to_flat_state(grad)), dict(nnx.to_flat_state(grad_ref))
    assert flat.keys() == flat_ref.keys()
    for k in flat:
        np.testing.assert_allclose(flat[k].get_value(), flat_ref[k].get_value(), atol=1e-6, rtol=2e-4, err_msg=str(k))
    # straight-through: the targeted kernels receive non-zero gradients
    assert float(jnp.abs(m.layers[0].attn.q_proj.kernel.get_value()).max()) > 0
    assert float(jnp.abs(grad["layers"][0]["attn"]["q_proj"]["kernel"].get_value()).max()) > 0


def test_paper_int8_scale_is_frozen_from_the_base_weights():
    m = tiny()
    apply_qat(m, "paper_int8")
    lin = m.layers[0].attn.q_proj
    w0 = lin.kernel.get_value()
    s0 = float(per_tensor_scale(w0, 8))
    assert lin.dot_general.scale == s0 and is_qat(lin)
    lin.kernel.set_value(w0 * 3.0)  # training moved the weights: the scale must not follow
    x = jax.random.normal(jax.random.key(1), (3, 32))
    np.testing.assert_allclose(lin(x), x @ fake_quant_per_tensor(w0 * 3.0, 8, scale=s0), atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(lin(x) - x @ fake_quant_per_tensor(w0 * 3.0, 8)).max()) > 1e-3  # recomputed scale differs
    # weights beyond the frozen range clip to [-128 S, 127 S]
    fq = fake_quant_per_tensor(w0 * 3.0, 8, scale=s0)
    assert float(fq.max()) <= 127 * s0 * (1 + 1e-6) and float(fq.min()) >= -128 * s0 * (1 + 1e-6)


def test_stochastic_rounding_changes_backward_only():
    m, plain = tiny(), tiny()
    apply_qat(m, "int8", stochastic_rounding=True, seed=1)
    apply_qat(plain, "int8")
    np.testing.assert_allclose(m(TOK), plain(TOK), atol=1e-6)  # forward (rollouts) unchanged, deterministic
    gfn = nnx.jit(nnx.grad(_loss))
    g1 = gfn(m)["layers"][0]["mlp"]["down_proj"]["kernel"].get_value()
    g1b = gfn(m)["layers"][0]["mlp"]["down_proj"]["kernel"].get_value()
    g0 = nnx.grad(_loss)(plain)["layers"][0]["mlp"]["down_proj"]["kernel"].get_value()
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
