"""PTQ runs the model's own decoder layer and captures Linear inputs through the linear seam.

The activations PTQ's layer-by-layer driver captures must equal, bit for bit, the inputs every
Linear receives in the model's own forward, for every family of the HF parity fixtures (Qwen3
tied/untied + sliding window, Qwen2 bias, Llama 3 rope variants, Olmo-3 post-norm + window). A
PTQ-side copy of the layer that drifted from the decoder (a missed norm, mask, bias or rope
detail) fails here.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import VARIANTS

from lrmq.ptq import layerwise as lw
from lrmq.ptq.layer_fn import LINEARS, linears_of, recording_inputs, shared_inputs


def model_forward_inputs(model, tokens) -> list[dict]:
    """Per layer, {linear name: input} from the model's own forward, jitted as training and scoring run it.
    (Eager op-by-op execution fuses differently and differs from any jitted program in the last ulp.)"""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens):
        m = nnx.merge(graphdef, state)
        with contextlib.ExitStack() as stack:
            seen = [stack.enter_context(recording_inputs(linears_of(layer))) for layer in m.layers]
            m(tokens)
        return seen

    return run(state, jnp.asarray(tokens))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_ptq_captures_equal_model_forward(hf_checkpoint, variant):
    from lrmq.checkpoint.hf import load_hf_model

    model = load_hf_model(hf_checkpoint(variant)[0])
    assert model.cfg.dtype == "float32"  # PTQ computes in float32: only then can the two agree bit for bit
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (3, 24))  # 24 > the windows of 4
    ptq: dict = {}

    def keep(ctx):
        ptq[ctx.index] = ctx.inputs()
        return ctx.params

    # one chunk of all 3 blocks, as the model's forward: XLA:CPU vectorizes a reduction differently for
    # another batch shape (chunks of 2 + 1 differ in the last ulp), whatever code runs the layer
    lw.run_layerwise(model, tokens, keep, batch_size=3, progress=False)
    ref = model_forward_inputs(model, tokens)
    assert len(ref) == len(ptq) == model.cfg.num_layers
    for i, seen in enumerate(ref):
        assert sorted(seen) == sorted(LINEARS)
        np.testing.assert_array_equal(seen["q_proj"], seen["v_proj"])  # q/k/v (and gate/up) read one tensor
        np.testing.assert_array_equal(seen["gate_proj"], seen["up_proj"])
        want = shared_inputs(seen)
        assert sorted(ptq[i]) == sorted(want) == ["attn_in", "down_in", "mlp_in", "o_in"]
        for key, x in want.items():
            np.testing.assert_array_equal(ptq[i][key], np.asarray(x), err_msg=f"{variant} layer {i} {key}")


def test_recording_chains_the_current_dot_general_and_restores_it():
    """The recorder wraps whatever dot_general is installed (e.g. QAT's) and puts it back."""
    from lrmq.model.linear import Linear

    lin = Linear(4, 3, use_bias=False, axes=(None, None), dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs=nnx.Rngs(0))
    calls = []

    def doubled(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        calls.append(lhs.shape)
        return 2 * jax.lax.dot_general(lhs, rhs, dimension_numbers)

    lin.dot_general = doubled
    x = jnp.arange(8, dtype=jnp.float32).reshape(2, 4)
    with recording_inputs({"q_proj": lin}) as seen:
        y = lin(x)
    assert lin.dot_general is doubled and calls == [(2, 4)]
    np.testing.assert_array_equal(seen["q_proj"], x)
    np.testing.assert_array_equal(y, 2 * x @ lin.kernel[...])


def test_layer_forward_ignores_the_model_compute_dtype(hf_checkpoint):
    """A bf16 model is still searched in float32: the spec's layer is built with float32 compute."""
    import dataclasses

    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.ptq.layer_fn import get_layer_params, layer_forward, layer_spec

    model = load_hf_model(hf_checkpoint("qwen3")[0])
    cfg16 = dataclasses.replace(model.cfg, dtype="bfloat16", param_dtype="bfloat16")
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 8, model.cfg.hidden_size)), jnp.float32)
    pos = jnp.arange(8)[None]
    p = get_layer_params(model.layers[0])
    out, caps = layer_forward(p, layer_spec(cfg16, 0), x, pos, capture=True)
    ref = layer_forward(p, layer_spec(model.cfg, 0), x, pos)
    assert out.dtype == jnp.float32 and all(c.dtype == jnp.float32 for c in caps.values())
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("variant", ["qwen3", "olmo3"])
@pytest.mark.slow(reason="compiles the full capture forward and each inputs-only program of every layer")
def test_inputs_only_equal_full_captures(hf_checkpoint, variant):
    """``LayerContext.inputs_only`` (a program returning just some captures, the rest of the layer
    dead code for XLA: GPTQ's true-sequential stages) gives the full capture forward's inputs bit for bit."""
    from lrmq.checkpoint.hf import load_hf_model

    model = load_hf_model(hf_checkpoint(variant)[0])
    tokens = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (3, 24))

    def check(ctx):
        full = ctx.inputs()
        for names in (("attn_in",), ("o_in",), ("mlp_in",), ("down_in",), ("attn_in", "mlp_in"), tuple(full)):
            got = ctx.inputs_only(names)
            assert sorted(got) == sorted(names)
            for key in names:
                np.testing.assert_array_equal(got[key], np.asarray(full[key]), err_msg=f"{variant} {ctx.index} {key}")
        return ctx.params

    lw.run_layerwise(model, tokens, check, batch_size=2, progress=False)  # chunks of 2 + 1


@pytest.mark.parametrize("variant", ["qwen3", "qwen2", "llama_linear", "olmo3"])
def test_given_inputs_change_nothing(hf_checkpoint, variant):
    """``layer_fn.layer_run`` with exact inputs handed back (``given``: the attention, or the MLP's first
    half, becomes dead code) returns the layer's output and captures bit for bit (GPTQ's true-sequential
    stages and its propagated output rely on it); biases (qwen2, llama_linear) and post-norm (olmo3)."""
    from lrmq.checkpoint.hf import load_hf_model

    model = load_hf_model(hf_checkpoint(variant)[0])
    tokens = np.random.default_rng(2).integers(0, model.cfg.vocab_size, (3, 24))

    def check(ctx):
        full = ctx.inputs()
        out = np.asarray(ctx.forward())
        np.testing.assert_array_equal(ctx.forward_given(None, {}), out)
        for given in ({"o_in": full["o_in"]}, {"o_in": full["o_in"], "down_in": full["down_in"]},
                      {"o_in": full["o_in"], "mlp_in": full["mlp_in"], "down_in": full["down_in"]},
                      {k: full[k] for k in ("attn_in", "o_in", "mlp_in", "down_in")}):
            np.testing.assert_array_equal(ctx.forward_given(None, given), out, err_msg=f"{variant} {sorted(given)}")
        np.testing.assert_array_equal(ctx.inputs_only(("mlp_in",), given={"o_in": full["o_in"]})["mlp_in"],
                                      np.asarray(full["mlp_in"]))
        np.testing.assert_array_equal(ctx.inputs_only(("down_in",), given={"mlp_in": full["mlp_in"]})["down_in"],
                                      np.asarray(full["down_in"]))
        return ctx.params

    lw.run_layerwise(model, tokens, check, batch_size=3, progress=False)
