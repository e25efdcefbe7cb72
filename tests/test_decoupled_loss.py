"""The decoupled objective of asynchronous RL (AReaL, arXiv 2505.24298): samples drawn from a stale and/or quantized
sampler pi_behaviour, the PPO clip on pi_theta / pi_prox (pi_prox: the learner at the update's start), and the
behaviour weight pi_prox / pi_behaviour through algo.rollout_correction. lrmq's `grpo_loss` against a NumPy
reference written from AReaL's `ppo_actor_loss_fn` (inclusionAI/AReaL, areal/utils/functional.py, read, not
copied): ratio r = exp(logp - prox); pg = max(-A r, -A clip(r, 1 - eps, 1 + eps_high)); behaviour weight
w = exp(prox - behaviour), 0 where w > cap (behav_imp_weight_cap; tokens kept at w <= cap); loss = sum over valid
tokens of pg * w / the number of valid tokens. In lrmq: old_logp = pi_prox, behaviour_logp = pi_behaviour,
algo.rollout_correction=token_mask with rollout_correction_cap = cap (min 0), algo.loss_aggregation=token-mean."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrmq.rl.losses import LossBatch, LossConfig, grpo_loss


def areal_loss(logp, prox, behav, adv, mask, *, eps=0.2, eps_high=None, cap=None):
    """(loss, d loss / d logp) of AReaL's decoupled PPO actor loss, in NumPy (float64)."""
    logp, prox, behav, adv = (np.asarray(x, np.float64) for x in (logp, prox, behav, adv))
    m = np.asarray(mask) > 0
    a = adv[:, None]
    ratio = np.where(m, np.exp(logp - prox), 0.0)
    clipped = np.clip(ratio, 1 - eps, 1 + (eps if eps_high is None else eps_high))
    pg1, pg2 = -a * ratio, -a * clipped
    pg = np.maximum(pg1, pg2)
    w = np.exp(prox - behav)
    keep = m & (w <= cap) if cap is not None else m
    w = np.where(keep, w, 0.0)
    n = max(int(m.sum()), 1)
    loss = np.where(m, pg * w, 0.0).sum() / n
    # gradient: only the unclipped branch depends on logp (d(-A r)/dlogp = -A r), where it is the max
    grad = np.where(m & (pg1 >= pg2), -a * ratio * w, 0.0) / n
    return loss, grad


def _batch(seed, b=6, t=9, spread=0.6):
    rng = np.random.default_rng(seed)
    prox = -rng.uniform(0.1, 3.0, (b, t))
    behav = prox + rng.normal(0, spread, (b, t))  # a stale / quantized sampler
    logp = prox + rng.normal(0, 0.3, (b, t))  # the policy after some updates
    adv = rng.normal(0, 1, b)
    mask = (np.arange(t)[None] < rng.integers(2, t + 1, b)[:, None]).astype(np.float32)
    return [np.asarray(x, np.float32) for x in (logp, prox, behav, adv, mask)]


def _lrmq(logp, prox, behav, adv, mask, cfg):
    def f(lp):
        s, c, _ = grpo_loss(lp, LossBatch(advantages=jnp.asarray(adv), completion_mask=jnp.asarray(mask),
                                          old_logp=jnp.asarray(prox), behaviour_logp=jnp.asarray(behav)), cfg)
        return s / c

    return jax.value_and_grad(f)(jnp.asarray(logp))


@pytest.mark.parametrize("seed,cap,eps_high", [(0, 2.0, None), (1, 2.5, 0.28), (2, 1.2, None)])
def test_lrmq_matches_the_areal_decoupled_loss(seed, cap, eps_high):
    logp, prox, behav, adv, mask = _batch(seed)
    want, want_grad = areal_loss(logp, prox, behav, adv, mask, eps=0.2, eps_high=eps_high, cap=cap)
    cfg = LossConfig(eps_low=0.2, eps_high=0.2 if eps_high is None else eps_high, aggregation="token-mean",
                     rollout_correction="token_mask", rollout_correction_cap=cap, rollout_correction_min=0.0)
    got, grad = _lrmq(logp, prox, behav, adv, mask, cfg)
    w = np.exp(prox.astype(np.float64) - behav)
    assert 0 < ((w > cap) & (mask > 0)).sum() < (mask > 0).sum()  # the cap masks some tokens, not all
    np.testing.assert_allclose(float(got), want, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=2e-5, atol=1e-7)


def test_on_policy_and_unquantized_it_is_todays_loss_bit_for_bit():
    """k = 0 and no quantization: the sampler is the learner at the update's start (behaviour == prox), so the
    behaviour weight is exp(0) = 1 exactly, and the decoupled loss is today's loss (correction none, the ratio
    against the same old log-probs), value and gradient, bit for bit."""
    logp, prox, _, adv, mask = _batch(3)
    for agg in ("sequence-mean-token-mean", "token-mean", "drgrpo-constant"):
        decoupled = LossConfig(aggregation=agg, max_len=9, rollout_correction="token_mask", rollout_correction_cap=3.0)
        today = LossConfig(aggregation=agg, max_len=9, rollout_correction="none")
        got, g_got = _lrmq(logp, prox, prox, adv, mask, decoupled)
        want, g_want = _lrmq(logp, prox, prox, adv, mask, today)
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), agg
        assert np.asarray(g_got).tobytes() == np.asarray(g_want).tobytes(), agg


def test_a_stale_sampler_turns_the_correction_on():
    """rollout.max_staleness > 0 makes the sampler differ from the learner at the update's start, so
    algo.rollout_correction=auto resolves to a correction (the decoupled objective) and pi_old is the learner's own
    (recomputed) log-probs; k = 0 keeps today's (no correction, the sampler's log-probs)."""
    from conftest import tiny_train_config
    from lrmq.rl.step import old_logprob_sources

    sync = tiny_train_config("unused")
    stale = tiny_train_config("unused", rollout={"max_staleness": 2})
    assert sync.loss_config().rollout_correction == "none" and old_logprob_sources(sync) == ("behaviour_logp",)
    assert stale.loss_config().rollout_correction != "none" and old_logprob_sources(stale) == ("own",)
