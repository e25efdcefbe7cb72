"""The train step's memory measures change nothing numerically: chunked vocab log-probs, layer remat,
strided micro-batches, and sharded optimizer state (8-device layout checks run in a subprocess)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder
from lrmq.rl.step import completion_logprobs, micro_batches

CFG = dict(model_type="qwen3", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
           tie_word_embeddings=True)


def _model():
    return Decoder(ModelConfig.from_hf_dict(dict(CFG), dtype="float32", param_dtype="float32"), nnx.Rngs(3))


def _batch(s=4, p=6, n=11, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 300, (s, p + n)).astype(np.int32)
    mask = np.ones((s, p + n), np.int32)
    mask[0, :3] = 0  # left padding
    mask[1, p + 7:] = 0  # an early-ended completion
    return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(tokens[:, p:])


def _loss(model, remat, chunk):
    tokens, mask, comp = _batch()
    logp, ent = completion_logprobs(model, tokens, mask, comp, 0.7, remat=remat, chunk=chunk)
    return (logp * jnp.arange(1, 12)).sum() + 0.1 * ent.sum(), (logp, ent)


_GRADS: dict = {}


def _grads(remat, chunk):
    """(grads, (logp, entropy)) of `_loss` on a fresh `_model()`, compiled as the trainer runs it (one jitted
    program, not op by op); the plain reference is computed once for every case."""
    if (remat, chunk) not in _GRADS:
        _GRADS[remat, chunk] = nnx.jit(lambda m: nnx.grad(lambda m: _loss(m, remat, chunk), has_aux=True)(m))(_model())
    return _GRADS[remat, chunk]


@pytest.mark.parametrize("remat,chunk", [("none", 4), ("none", 5), ("full", 0), ("dots", 3), ("full", 11)])
def test_chunked_logprobs_and_remat_match_plain(remat, chunk):
    ref_grads, (ref_lp, ref_ent) = _grads("none", 0)
    grads, (lp, ent) = _grads(remat, chunk)
    assert lp.shape == (4, 11)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref_lp), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent), np.asarray(ref_ent), rtol=1e-6, atol=1e-6)
    for (path, g), (_, r) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        np.testing.assert_allclose(np.asarray(g.get_value()), np.asarray(r.get_value()), rtol=2e-5, atol=2e-5 * float(np.abs(np.asarray(r.get_value())).max()),
                                   err_msg=str(path))


def test_logprobs_match_a_full_log_softmax():
    tokens, mask, comp = _batch()

    @nnx.jit
    def both(model):  # one compiled program, not op by op
        logp, _ = completion_logprobs(model, tokens, mask, comp, 1.0, chunk=4)
        logits = model(tokens, jnp.where(mask > 0, jnp.cumsum(mask, -1) - 1, -1))[:, -12:-1]
        return logp, jnp.take_along_axis(jax.nn.log_softmax(logits, -1), comp[..., None], -1)[..., 0]

    logp, want = both(_model())
    np.testing.assert_allclose(np.asarray(logp), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_micro_batches_are_strided_and_cover_every_row_once():
    x = jnp.arange(12)
    mb = micro_batches(x, 3)
    assert mb.tolist() == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]


def test_remat_is_an_option_of_the_forward_without_a_cache():
    """`remat` (and packed `segments`) belong to `hidden`, which takes no cache; the cached forward is
    `hidden_runs`, which has neither option, so a cached forward is never rematerialised."""
    import inspect

    model = _model()
    assert "cache" not in inspect.signature(model.hidden).parameters
    assert not {"remat", "segments"} & set(inspect.signature(model.hidden_runs).parameters)
    with pytest.raises(TypeError):
        model.hidden(jnp.ones((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32), object(), remat="full")


def test_sharded_layouts_on_8_devices(multi_device_run):
    """Strided micro-batches keep each device's rows; AdamW moments are sharded like their params."""
    r = multi_device_run("scripts/check_step_sharding.py", n_devices=8, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "OK" in r.stdout, r.stdout[-3000:]
