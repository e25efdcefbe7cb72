"""`Decoder.hidden(scan=True)` (`model.scan_layers`): the same forward and gradients as the unrolled layer
loop, with remat, with LoRA adapters (dropout on), with packed and QAT weights; runs of unequal layers
(Olmo-3's sliding/full pattern) split into several scans; and the compiled program holds one layer body."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder
from lrmq.quant.lora import apply_lora, set_lora_dropout
from lrmq.quant.qat import apply_qat, path_salt
from lrmq.quant.training import pack_base, trainable_filter
from lrmq.quant.transforms import DEFAULT_TARGETS, iter_linears
from lrmq.rl.step import completion_logprobs

CFG = dict(model_type="qwen3", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
           tie_word_embeddings=True)


def _model(**over):
    return Decoder(ModelConfig.from_hf_dict(dict(CFG, **over), dtype="float32", param_dtype="float32"), nnx.Rngs(3))


def _batch(s=4, p=6, n=9, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 300, (s, p + n)).astype(np.int32)
    mask = np.ones((s, p + n), np.int32)
    mask[0, :3] = 0
    mask[1, p + 5:] = 0
    return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(tokens[:, p:])


def _grads(model, wrt, *, scan, remat="none", explicit=False):
    tokens, mask, comp = _batch()
    graphdef, params, rest = nnx.split(model, wrt, ...)

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        if explicit:  # LoRA dropout in the forward itself, differentiated by plain autodiff
            set_lora_dropout(m, "always")
        logp, ent = completion_logprobs(m, tokens, mask, comp, 0.7, remat=remat, chunk=4, scan=scan)
        return (logp * jnp.arange(1, 10)).sum() + 0.1 * ent.sum(), logp

    return jax.jit(jax.grad(loss, has_aux=True))(params)


def _assert_same(a, b):
    (ga, la), (gb, lb) = a, b
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=1e-5, atol=1e-5)
    fa, fb = nnx.to_flat_state(ga), nnx.to_flat_state(gb)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, x), (_, y) in zip(fa, fb):
        x, y = np.asarray(x.get_value()), np.asarray(y.get_value())
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(y).max())), err_msg=str(path))


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_scan_matches_the_unrolled_loop(remat):
    model = _model()
    _assert_same(_grads(model, nnx.Param, scan=True, remat=remat), _grads(model, nnx.Param, scan=False, remat=remat))


def test_lora_dropout_rule_holds_under_scan(remat="full"):
    """LoRA's dropout exists only in differentiated forwards (a custom_vjp whose primal has none). Under a
    layer scan the update must still be exactly dropout-in-the-forward differentiated by autodiff.
    (Scan and loop cannot be compared with dropout on: masks are keyed on each layer input's bits, which
    the two programs round differently in the last place.)"""
    model = _model()
    apply_lora(model, rank=4, alpha=8.0, dropout=0.3, seed=5)
    for _, lin in iter_linears(model, None):  # b = 0 would hide the forward's dropout
        lin.lora.b.set_value(0.3 * jax.random.normal(jax.random.key(lin.in_features), lin.lora.b.shape))
    qlora = trainable_filter("qlora")
    implicit = _grads(model, qlora, scan=True, remat=remat)
    _assert_same(implicit, _grads(model, qlora, scan=True, remat=remat, explicit=True))
    no_dropout = nnx.clone(model)
    set_lora_dropout(no_dropout, "off")
    assert not np.allclose(np.asarray(implicit[1]), np.asarray(_grads(no_dropout, qlora, scan=True)[1]))
    # q/k/v read the same input, so their salts must differ; one projection shares its salt across layers
    assert len({path_salt(f"layers.0.attn.{n}_proj") for n in "qkv"}) == 3
    assert path_salt("layers.0.attn.q_proj") == path_salt("layers.1.attn.q_proj")


def test_scan_with_aqt_qat_matches(scheme="int4"):
    model = _model()
    apply_qat(model, scheme)
    _assert_same(_grads(model, nnx.Param, scan=True), _grads(model, nnx.Param, scan=False))


def test_scan_with_a_packed_base_matches(base="nf4"):
    model = _model()
    pack_base(model, DEFAULT_TARGETS, base, 16)
    apply_lora(model, rank=4, alpha=8.0, seed=1)
    qlora = trainable_filter("qlora")
    _assert_same(_grads(model, qlora, scan=True, remat="full"), _grads(model, qlora, scan=False, remat="full"))


def test_paper_int8_layers_scan_as_one_run():
    """paper_int8's frozen per-layer scales are state, not graphdef constants: one run, same result."""
    model = _model()
    apply_qat(model, "paper_int8")
    assert len({nnx.split(layer)[0] for layer in model.layers}) == 1
    _assert_same(_grads(model, nnx.Param, scan=True), _grads(model, nnx.Param, scan=False))


def test_unequal_layers_are_split_into_runs():
    """Olmo-3's sliding/full attention pattern: layers with different windows form separate runs."""
    types = ["sliding_attention", "sliding_attention", "full_attention"]
    model = _model(model_type="olmo3", num_hidden_layers=3, sliding_window=4, layer_types=types)
    assert len({nnx.split(layer)[0] for layer in model.layers}) == 2
    _assert_same(_grads(model, nnx.Param, scan=True, remat="full"), _grads(model, nnx.Param, scan=False, remat="full"))


def test_scanned_program_holds_one_layer_body():
    """The point of scanning: the compiled program's size stops growing with depth."""
    def ops(layers):
        model = _model(num_hidden_layers=layers)
        tokens, mask, comp = _batch()
        graphdef, state = nnx.split(model)

        def f(state, scan):
            m = nnx.merge(graphdef, state)
            return completion_logprobs(m, tokens, mask, comp, 1.0, scan=scan)[0].sum()

        return [jax.jit(f, static_argnums=1).lower(state, s).as_text().count("dot_general") for s in (True, False)]

    (scan2, loop2), (scan6, loop6) = ops(2), ops(6)
    assert scan6 == scan2 and loop6 > loop2


def test_scan_is_an_option_of_the_forward_without_a_cache():
    """`scan` belongs to `hidden`, which takes no cache; the cached forward (prefill, decoding) is `hidden_runs`,
    which always scans its layer runs and has no such option, so the two cannot be combined."""
    import inspect

    model = _model()
    assert "cache" not in inspect.signature(model.hidden).parameters
    assert "scan" not in inspect.signature(model.hidden_runs).parameters
    with pytest.raises(TypeError):
        model.hidden(jnp.ones((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32), object(), scan=True)


def test_moe_layers_scan_and_differentiate():
    """Qwen3-MoE: a dense layer among sparse ones splits the runs; scan and loop agree on the forward and on
    every gradient, the router's and the stacked experts' (through ragged_dot) included."""
    model = _model(model_type="qwen3_moe", num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=16, mlp_only_layers=[0], norm_topk_prob=True)
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["MLP", "MoE", "MoE"]
    assert len({nnx.split(layer)[0] for layer in model.layers}) == 2
    scanned = _grads(model, nnx.Param, scan=True)
    _assert_same(scanned, _grads(model, nnx.Param, scan=False))
    grads = nnx.to_flat_state(scanned[0])
    for name in ("router", "gate_proj", "up_proj", "down_proj"):
        g = [np.asarray(v.get_value()) for p, v in grads if p[:2] == ("layers", 2) and name in p]
        assert g and np.abs(g[0]).max() > 0, name
