"""Quantized training and rollouts on mixture-of-experts expert weights (docs/moe.md, 'Quantization in RL'): QAT's
per-expert fake-quant with a straight-through gradient, the refusals (stochastic rounding), and a
rollout copy that packs the experts (router float) which the paged engine decodes as the full forward does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lrmq.checkpoint.load import TINY_MOE_DIR, load_model
from lrmq.quant.formats import dequantize, quantize_weight
from lrmq.quant.qat import (ExpertSTERaggedDot, PerExpertTensorSTERaggedDot, apply_qat, fake_quant_activations,
                            remove_qat, sym_weight_codes)
from lrmq.quant.quantizers import per_tensor_scale


@pytest.fixture(scope="module")
def moe_rows():
    """Rows sorted by expert for one expert projection of tiny-moe (8 experts, hidden 128, expert width 64): x [M, 128]
    and group sizes with empty experts among them."""
    sizes = jnp.asarray([3, 0, 2, 5, 0, 1, 4, 1], jnp.int32)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(int(sizes.sum()), 128)), jnp.float32)
    return x, sizes


def _tiny_moe():
    return load_model(TINY_MOE_DIR, dtype="float32", param_dtype="float32")


@pytest.mark.parametrize("scheme,group", [("int4_asym", 32), ("int4", 0), ("w8a8", 32), ("paper_int8", 0)])
def test_qat_experts_run_the_dequantized_weight_with_a_straight_through_gradient(scheme, group, moe_rows):
    x, sizes = moe_rows
    model = _tiny_moe()
    touched = apply_qat(model, scheme, group_size=group)  # the default targets: every projection, experts included
    assert "layers.0.mlp.experts.gate_proj" in touched and "layers.2.mlp.experts.down_proj" in touched
    assert not any("router" in p for p in touched)  # the router stays float
    el = model.layers[0].mlp.experts.gate_proj
    w = el.kernel.get_value()  # the float master weight [E, K, N] stays a Param
    assert isinstance(el.kernel, nnx.Param) and w.shape == (8, 128, 64)
    # the weight the forward multiplies by, per expert, from the scheme's own quantizer
    if scheme == "int4_asym":  # lrmq.quantize --method rtn's packed codes, dequantized (stacked: each expert alone)
        assert isinstance(el.ragged_dot, ExpertSTERaggedDot)
        wq = dequantize(quantize_weight(w, fmt="int", bits=4, group_size=group, symmetric=False))
    elif scheme == "paper_int8":  # a per-tensor scale per expert, frozen at load
        assert isinstance(el.ragged_dot, PerExpertTensorSTERaggedDot) and el.ragged_dot.scale[...].shape == (8,)
        s = jnp.stack([per_tensor_scale(w[e], 8) for e in range(8)])
        wq = jnp.clip(jnp.round(w / s[:, None, None]), -128, 127) * s[:, None, None]
    else:  # AQT's symmetric absmax codes and scales, per output channel or per group of input rows
        bits = 4 if scheme == "int4" else 8
        g = group or 128
        codes = [sym_weight_codes(w[e], bits, group) for e in range(8)]
        wq = jnp.stack([(q.reshape(128 // g, g, 64) * s[:, None, :]).reshape(128, 64) for q, s in codes])
    xq = fake_quant_activations(x) if scheme == "w8a8" else x  # w8a8: the expert inputs per token too
    want = jax.lax.ragged_dot(xq, wq, sizes)
    np.testing.assert_allclose(np.asarray(el(x, sizes)), np.asarray(want), atol=2e-6, rtol=1e-6)
    assert not np.allclose(np.asarray(el(x, sizes)), np.asarray(jax.lax.ragged_dot(x, w, sizes)), atol=1e-4)
    # STE: the gradient of the float master weight is the gradient of the dequantized one
    cot = jnp.asarray(np.random.default_rng(1).normal(size=want.shape), jnp.float32)
    g_w = jax.grad(lambda v: jnp.sum(el.ragged_dot(x, v, sizes) * cot))(w)
    g_ref = jax.grad(lambda v: jnp.sum(jax.lax.ragged_dot(xq, v, sizes) * cot))(wq)
    np.testing.assert_allclose(np.asarray(g_w), np.asarray(g_ref), atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(g_w[1]).max()) == 0.0 and float(jnp.abs(g_w[0]).max()) > 0  # expert 1 got no rows
    remove_qat(model)
    np.testing.assert_allclose(np.asarray(el(x, sizes)), np.asarray(jax.lax.ragged_dot(x, w, sizes)), atol=1e-5)


def test_qat_gradients_reach_every_routed_expert_through_the_model():
    model = _tiny_moe()
    apply_qat(model, "int4_asym", group_size=32)
    tokens = jnp.asarray(np.random.default_rng(2).integers(1, 300, (2, 12)), jnp.int32)

    @nnx.jit
    def grads(m):
        return nnx.grad(lambda m: jnp.mean(jax.nn.log_softmax(m(tokens))[..., 7]))(m)

    g = grads(model)
    for layer in (0, 2):
        experts = g.layers[layer].mlp.experts
        for proj in ("gate_proj", "up_proj", "down_proj"):
            kernel = np.asarray(getattr(experts, proj).kernel.get_value())
            assert np.isfinite(kernel).all() and (np.abs(kernel).reshape(8, -1).max(1) > 0).sum() >= 2, (layer, proj)


def test_expert_refusals_are_one_line():
    model = _tiny_moe()
    expert = r"layers\.0\.mlp\.experts\.(gate|up|down)_proj"
    with pytest.raises(ValueError, match=r"^apply_qat: qat_stochastic_rounding .* " + expert):
        apply_qat(model, "int8", stochastic_rounding=True)
    apply_qat(model, "int8", pattern=r".*\.(q|k|v|o)_proj$", stochastic_rounding=True)  # experts left out: fine
    with pytest.raises(ValueError, match=r"qat_group_size=48 does not divide layers\.0\.mlp\.experts\.down_proj"):
        apply_qat(_tiny_moe(), "int4", pattern=r".*experts\.down_proj$", group_size=48)


def _greedy_full_forward(model, prompts, n_new: int):
    """Greedy tokens of the full forward (no KV cache) over a fixed left-padded buffer (one compiled shape)."""
    from lrmq.generation.engine import left_pad
    from lrmq.model.decoder import positions_from_mask

    p = max(map(len, prompts))
    tokens, mask = left_pad(prompts, p, 0)
    buf = np.zeros((len(prompts), p + n_new), np.int32)
    buf_mask = np.zeros_like(buf)
    buf[:, :p], buf_mask[:, :p] = tokens, mask
    step = nnx.jit(lambda m, t, k: jnp.argmax(m(t, positions_from_mask(k)), axis=-1))
    for i in range(n_new):
        buf[:, p + i] = np.asarray(step(model, jnp.asarray(buf), jnp.asarray(buf_mask)))[:, p + i - 1]
        buf_mask[:, p + i] = 1
    return buf[:, p:]


def test_rollout_copy_packs_the_experts_and_the_engine_decodes_them():
    from lrmq.generation.engine import Engine, EngineConfig
    from lrmq.generation.sampling import SamplingConfig
    from lrmq.quant.qkernel import QuantizedExpertKernel
    from lrmq.rl.rollout_copy import RolloutCopy, RolloutQuant

    model = _tiny_moe()
    graphdef, trainable, rest = nnx.split(model, nnx.Param, ...)
    copy = RolloutCopy(graphdef, trainable, rest, RolloutQuant("int4", group_size=32))
    copy.refresh(trainable, rest)
    packed = nnx.merge(copy.graphdef, *copy.states(trainable, rest))
    el = packed.layers[2].mlp.experts.down_proj
    assert isinstance(el.kernel, QuantizedExpertKernel)
    want = quantize_weight(model.layers[2].mlp.experts.down_proj.kernel.get_value(), fmt="int", bits=4, group_size=32)
    np.testing.assert_array_equal(np.asarray(el.kernel.get_value().codes), np.asarray(want.codes))
    np.testing.assert_array_equal(np.asarray(el.kernel.get_value().scales), np.asarray(want.scales))
    assert isinstance(packed.layers[0].mlp.router.kernel, nnx.Param)  # the router stays float, the policy's own
    assert not any("router" in ".".join(map(str, p)) for p, _ in nnx.to_flat_state(copy.packed))
    # the paged engine on the packed copy decodes what the full forward of the same packed model decodes
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    eng = Engine(None, eos_ids=[model.cfg.vocab_size], pad_id=0, graphdef=copy.graphdef, model_cfg=model.cfg,
                 config=EngineConfig(slots=4, page_size=4))
    out = eng.generate(copy.states(trainable, rest), prompts, max_new_tokens=10, sampling=SamplingConfig(greedy=True))
    np.testing.assert_array_equal(np.asarray(out.tokens), _greedy_full_forward(packed, prompts, 10))


def test_qat_experts_under_expert_parallelism_take_their_chip_s_share():
    """In an expert-parallel shard_map each chip's call holds its contiguous block of experts and, with tensor > 1,
    part of down_proj's input rows: paper_int8 takes those experts' frozen scales (by the expert axis' index; here a
    vmap named like the axis stands in for the 4 chips), and a scheme whose scale groups would straddle chips is
    refused at trace time in one line."""
    from lrmq.sharding import EXPERT_AXIS

    model = _tiny_moe()
    apply_qat(model, "paper_int8")
    rd = model.layers[0].mlp.experts.down_proj.ragged_dot
    w = model.layers[0].mlp.experts.down_proj.kernel.get_value()  # [8, 64, 128]
    whole = rd.quantize(w)
    chips = jax.vmap(rd.quantize, axis_name=EXPERT_AXIS)(w.reshape(4, 2, 64, 128))
    np.testing.assert_array_equal(np.asarray(chips.reshape(w.shape)), np.asarray(whole))
    h = jnp.ones((3, 32), jnp.float32)
    sizes = jnp.asarray([1, 2], jnp.int32)
    for scheme, group, what in (("int4", 0, "per-output-channel scales"), ("w8a8", 16, "activation scales")):
        rd = ExpertSTERaggedDot(scheme, group, 8 if scheme == "w8a8" else None, in_features=64)
        with pytest.raises(ValueError, match=f"^QAT {scheme} on expert weights: .*{what} .* holds 32 of them"):
            rd(h, w[:2, :32], sizes)
    ExpertSTERaggedDot("int4", 16, in_features=64)(h, w[:2, :32], sizes)  # groups within a chip's rows: exact


@pytest.mark.parametrize("scheme, group", [("int4_asym", 32), ("int4", 0), ("paper_int8", 0)])
def test_qat_expert_weights_export_as_the_forward_rounds_them(scheme, group):
    """A QAT policy's quantized export covers the experts (`qat_export.qat_result`): each expert's packed codes
    dequantize to the weight its QAT forward multiplied by, and the exported model computes the QAT forward's
    logits."""
    from lrmq.ptq.qat_export import qat_result

    model = _tiny_moe()
    apply_qat(model, scheme, group_size=group)
    toks = jnp.arange(12)[None] % 300
    want = np.asarray(model(toks))
    el = model.layers[0].mlp.experts.down_proj
    result = qat_result(model)
    qw = result.packed["layers.0.mlp.experts.down_proj"]
    assert qw.shape == tuple(el.kernel.get_value().shape) and qw.bits == (8 if scheme == "paper_int8" else 4)
    np.testing.assert_array_equal(np.asarray(dequantize(qw)), np.asarray(el.kernel.get_value(), np.float32))
    np.testing.assert_allclose(np.asarray(model(toks)), want, atol=1e-5)
