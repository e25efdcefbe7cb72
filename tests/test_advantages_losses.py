import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrmq.rl.advantages import ADVANTAGES, compute_advantages
from lrmq.rl.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LossBatch,
    LossConfig,
    grpo_loss,
    policy_loss_terms,
    token_entropy,
    token_logprobs,
)

# ----------------------------------------------------------------------------- advantages


def test_registered_names():
    assert ADVANTAGES.names() == ["drgrpo", "grpo", "rloo"]
    assert set(AGGREGATIONS.names()) == {
        "sequence-mean-token-mean",
        "token-mean",
        "drgrpo-constant",
        "sequence-sum-constant",
    }
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    with pytest.raises(KeyError, match="known"):
        ADVANTAGES.get("ppo")


def test_grpo_advantages_ddof():
    r = [2.0, 0.0, 1.0, 1.0]  # two groups of 2
    a0 = compute_advantages("grpo", r, 2, eps=0.0, std_ddof=0)  # std = 1
    np.testing.assert_allclose(a0, [1.0, -1.0, 0.0, 0.0], atol=1e-6)
    a1 = compute_advantages("grpo", r, 2, eps=0.0, std_ddof=1)  # std = sqrt(2)
    np.testing.assert_allclose(a1, [1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0], atol=1e-6)
    # Default: TRL's eps 1e-4 and unbiased std.
    ad = compute_advantages("grpo", r, 2)
    np.testing.assert_allclose(ad[:2], [1 / (math.sqrt(2) + 1e-4), -1 / (math.sqrt(2) + 1e-4)], rtol=1e-6)
    # Paper-1 reward values, G = 4: mean 0.35, unbiased std over 3 degrees of freedom.
    r4 = np.array([1.1, 0.1, 0.1, 0.1])
    dev = r4 - 0.35
    std1 = math.sqrt((dev**2).sum() / 3)
    np.testing.assert_allclose(compute_advantages("grpo", r4, 4), dev / (std1 + 1e-4), rtol=1e-5)


def test_grpo_single_sample_group_is_finite():
    a = compute_advantages("grpo", [1.0, 0.0], 1)
    np.testing.assert_array_equal(a, [0.0, 0.0])


def test_drgrpo_and_rloo():
    np.testing.assert_allclose(compute_advantages("drgrpo", [1.0, 0.0, 0.0, 1.0], 4), [0.5, -0.5, -0.5, 0.5])
    # RLOO: r_i - mean of the other three.
    np.testing.assert_allclose(compute_advantages("rloo", [1.0, 0.0, 0.0, 0.0], 4), [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)


def test_advantages_reject_ragged_groups():
    with pytest.raises(ValueError):
        compute_advantages("grpo", [1.0, 0.0, 1.0], 2)


# ----------------------------------------------------------------------------- aggregation

VALS = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # third row: batch padding


@pytest.mark.parametrize(
    "name, max_len, want_sum, want_count",
    [
        ("sequence-mean-token-mean", None, 1.5 + 4.0, 2.0),
        ("token-mean", None, 7.0, 3.0),
        ("drgrpo-constant", None, 7.0, 2 * 3.0),
        ("sequence-sum-constant", 4, 7.0, 2 * 4.0),
    ],
)
def test_aggregation_hand_values(name, max_len, want_sum, want_count):
    s, c = AGGREGATIONS.get(name)(VALS, MASK, max_len=max_len)
    assert float(s) == pytest.approx(want_sum)
    assert float(c) == pytest.approx(want_count)


def test_aggregation_ignores_nan_on_padding():
    vals = VALS.at[0, 2].set(jnp.nan)
    for name in AGGREGATIONS.names():
        s, c = AGGREGATIONS.get(name)(vals, MASK)
        assert np.isfinite(float(s)), name


@pytest.mark.parametrize("name", ["sequence-mean-token-mean", "token-mean", "drgrpo-constant"])
def test_microbatch_accumulation_is_exact(name):
    rng = np.random.default_rng(0)
    vals = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)
    lengths = np.array([5, 1, 3, 2, 4, 1])
    mask = jnp.asarray(np.arange(5)[None, :] < lengths[:, None], jnp.float32)
    agg = jax.jit(AGGREGATIONS.get(name), static_argnames="max_len")
    fs, fc = agg(vals, mask, max_len=5)
    full = float(fs / fc)
    for splits in ([2], [1, 3], [1, 2, 3]):
        parts = np.split(np.arange(6), splits)
        sums = [agg(vals[p], mask[p], max_len=5) for p in parts]
        total = sum(float(s) for s, _ in sums) / sum(float(c) for _, c in sums)
        assert total == pytest.approx(full, rel=1e-6)
    # The naive mean of per-micro-batch means is *not* the same objective (uneven token counts).
    parts = np.split(np.arange(6), [1])
    naive = np.mean([float(s / c) for s, c in (agg(vals[p], mask[p], max_len=5) for p in parts)])
    assert naive != pytest.approx(full, rel=1e-3)


# ----------------------------------------------------------------------------- policy loss and clipping

RATIOS = jnp.array([1.5, 0.5, 1.1])


def _clip_case():
    logp = jnp.log(jnp.stack([RATIOS, RATIOS]))
    old = jnp.zeros_like(logp)
    adv = jnp.array([1.0, -1.0])
    mask = jnp.ones_like(logp)
    return logp, old, adv, mask


def test_clipping_values_and_indicator():
    logp, old, adv, mask = _clip_case()
    loss, low, high = policy_loss_terms(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    # A>0: ratio 1.5 -> clipped to 1.2; 0.5 -> unclipped (min); 1.1 inside.
    # A<0: ratio 1.5 -> unclipped -1.5 (min); 0.5 -> clipped -0.8; 1.1 inside.
    np.testing.assert_allclose(loss, [[-1.2, -0.5, -1.1], [1.5, 0.8, 1.1]], rtol=1e-6)
    np.testing.assert_array_equal(high, [[1, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(low, [[0, 0, 0], [0, 1, 0]])


def test_clipping_gradient():
    logp, old, adv, mask = _clip_case()
    g = jax.grad(lambda lp: policy_loss_terms(lp, old, adv, mask, eps_low=0.2, eps_high=0.2)[0].sum())(logp)
    # d(-ratio*A)/dlogp = -ratio*A where unclipped, 0 where the clipped branch is active.
    np.testing.assert_allclose(g, [[0.0, -0.5, -1.1], [1.5, 0.0, 1.1]], rtol=1e-6)


def test_asymmetric_clip_high():
    logp = jnp.log(jnp.array([[1.25]]))
    loss, _, high = policy_loss_terms(logp, jnp.zeros((1, 1)), jnp.array([1.0]), jnp.ones((1, 1)), eps_low=0.2, eps_high=0.28)
    assert float(loss[0, 0]) == pytest.approx(-1.25)
    assert float(high[0, 0]) == 0.0
    loss, _, high = policy_loss_terms(logp, jnp.zeros((1, 1)), jnp.array([1.0]), jnp.ones((1, 1)), eps_low=0.2, eps_high=0.2)
    assert float(loss[0, 0]) == pytest.approx(-1.2)
    assert float(high[0, 0]) == 1.0


def test_extreme_log_ratio_on_padding_stays_finite():
    logp = jnp.array([[0.0, 500.0]])
    old = jnp.array([[0.0, -500.0]])
    mask = jnp.array([[1.0, 0.0]])
    f = lambda lp: grpo_loss(lp, LossBatch(jnp.array([-1.0]), mask, old_logp=old), LossConfig(aggregation="token-mean"))[0]
    val, g = jax.value_and_grad(f)(logp)
    assert float(val) == pytest.approx(1.0)
    assert np.all(np.isfinite(g))


# ----------------------------------------------------------------------------- KL


def test_kl_estimators_hand_values():
    logp, ref = jnp.log(0.5), jnp.log(0.25)
    l2 = math.log(2.0)
    assert float(KL_ESTIMATORS.get("k1")(logp, ref)) == pytest.approx(l2, rel=1e-6)
    assert float(KL_ESTIMATORS.get("k2")(logp, ref)) == pytest.approx(0.5 * l2 * l2, rel=1e-6)
    assert float(KL_ESTIMATORS.get("k3")(logp, ref)) == pytest.approx(0.5 + l2 - 1.0, rel=1e-5)
    for name in ("k1", "k2", "k3"):
        assert float(KL_ESTIMATORS.get(name)(logp, logp)) == 0.0


# ----------------------------------------------------------------------------- grpo_loss


def test_grpo_loss_with_kl_and_metrics():
    logp, old, adv, mask = _clip_case()
    ref = logp - jnp.log(2.0)  # logp - ref = log 2 everywhere
    s, c, m = grpo_loss(logp, LossBatch(adv, mask, old_logp=old, ref_logp=ref),
                        LossConfig(eps_low=0.2, eps_high=0.2, aggregation="token-mean", beta=0.1, kl_estimator="k1"))
    policy = np.array([[-1.2, -0.5, -1.1], [1.5, 0.8, 1.1]])
    assert float(s / c) == pytest.approx((policy + 0.1 * math.log(2)).mean(), rel=1e-5)
    mean = lambda k: float(m[k][0] / m[k][1])
    assert mean("clip_ratio/region_mean") == pytest.approx(2 / 6)
    assert mean("clip_ratio/low_mean") == pytest.approx(1 / 6)
    assert mean("clip_ratio/high_mean") == pytest.approx(1 / 6)
    assert float(m["kl"][0] / m["kl"][1]) == pytest.approx(math.log(2), rel=1e-5)
    assert float(m["ratio"][0] / m["ratio"][1]) == pytest.approx((1.5 + 0.5 + 1.1) / 3, rel=1e-5)


def test_grpo_loss_beta_zero_needs_no_reference():
    logp, old, adv, mask = _clip_case()
    _, _, m = grpo_loss(logp, LossBatch(adv, mask, old_logp=old))
    assert "kl" not in m
    with pytest.raises(ValueError):
        grpo_loss(logp, LossBatch(adv, mask, old_logp=old), LossConfig(beta=0.1))


def test_grpo_loss_on_policy_gradient():
    # old_logp=None: ratio == 1, loss = -A, gradient per token = -A / (|o_i| * num_seq).
    logp = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = jnp.array([2.0, -1.0])
    f = lambda lp: (lambda s, c, _: s / c)(*grpo_loss(lp, LossBatch(adv, mask)))
    val, g = jax.value_and_grad(f)(logp)
    assert float(val) == pytest.approx((-2.0 + 1.0) / 2)
    np.testing.assert_allclose(g, [[-0.5, -0.5, 0.0], [1 / 6, 1 / 6, 1 / 6]], rtol=1e-6)
    # Dr.GRPO constant normaliser: every valid token gets -A / (num_seq * max_len).
    f = lambda lp: (lambda s, c, _: s / c)(*grpo_loss(lp, LossBatch(adv, mask),
                                                      LossConfig(aggregation="drgrpo-constant", max_len=4)))
    np.testing.assert_allclose(jax.grad(f)(logp), [[-0.25, -0.25, 0.0], [0.125, 0.125, 0.125]], rtol=1e-6)


# ----------------------------------------------------------------------------- logits helpers


def test_token_logprobs_and_entropy():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.bfloat16)
    tokens = jnp.asarray(rng.integers(0, 7, size=(2, 3)))
    lp = token_logprobs(logits, tokens)
    assert lp.dtype == jnp.float32
    ref = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(lp, ref, atol=1e-6)

    assert float(token_entropy(jnp.zeros((4,)))) == pytest.approx(math.log(4), rel=1e-6)
    masked = jnp.array([0.0, 0.0, 0.0, -jnp.inf])
    assert float(token_entropy(masked)) == pytest.approx(math.log(3), rel=1e-6)
    assert float(token_entropy(jnp.array([1e4, 0.0, 0.0]))) == pytest.approx(0.0, abs=1e-6)


# ----------------------------------------------------------------------------- TRL-facing behaviours

PAPER_REWARDS = (0.0, 0.1, 1.1)  # paper 1's reward set: {0, format bonus, correct + bonus}


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("eps", [1e-4, 0.0])
def test_equal_rewards_give_exactly_zero_advantage(name, eps):
    # float32: the mean of eight 0.1 is one ulp off 0.1, its std ~1e-8; without the guard A was -7.45e-5
    # (eps 1e-4) or ~-0.9 (eps 0).
    values = PAPER_REWARDS + (1.0, 0.3, 0.7, -0.1)
    for g in range(2, 65):
        # one constant group per value beside a varied one (so the batch std is not 0)
        r = np.concatenate([np.full(g, v, np.float32) for v in values] + [np.linspace(0, 1, g, dtype=np.float32)])
        for scale in ("group", "batch", "none"):
            a = np.asarray(compute_advantages(name, r, g, eps=eps, scale=scale))
            assert np.all(a[:-g] == 0.0), (name, g, scale, a[:-g])
            assert np.all(np.isfinite(a)) and np.any(a[-g:] != 0.0)


def test_equal_rewards_are_not_counted_as_clipped():
    a = compute_advantages("grpo", np.full(8, 0.1, np.float32), 8)
    logp = jnp.full((8, 4), -1.0)
    old = logp - 1.0  # ratio e: far outside the clip range
    _, _, m = grpo_loss(logp, LossBatch(a, jnp.ones((8, 4)), old_logp=old))
    assert float(m["clip_ratio/region_mean"][0]) == 0.0


def test_batch_scaled_advantages():
    r = np.array([1.0, 0.0, 0.0, 0.0, 1.1, 1.1, 0.1, 0.0], np.float32)
    a = np.asarray(compute_advantages("grpo", r, 4, scale="batch"))
    g = r.reshape(2, 4)
    want = (g - g.mean(1, keepdims=True)).reshape(-1) / (np.std(r, ddof=1) + 1e-4)
    np.testing.assert_allclose(a, want, rtol=1e-6)
    np.testing.assert_allclose(compute_advantages("grpo", r, 4, scale="none"), compute_advantages("drgrpo", r, 4))


def test_kl_bias_correction_matches_formula():
    # TRL: per_token_kl = k3(logp, ref) * exp(logp - old_logp), the ratio differentiable.
    rng = np.random.default_rng(3)
    logp = jnp.asarray(rng.normal(-1, 0.3, (2, 5)), jnp.float32)
    old = logp + jnp.asarray(rng.normal(0, 0.05, (2, 5)), jnp.float32)
    ref = logp + jnp.asarray(rng.normal(0, 0.2, (2, 5)), jnp.float32)
    mask = jnp.ones((2, 5))
    adv = jnp.zeros(2)  # policy term 0: the loss is the KL term alone
    beta = 0.5

    def ours(lp, corr):
        s, c, _ = grpo_loss(lp, LossBatch(adv, mask, old_logp=old, ref_logp=ref),
                            LossConfig(beta=beta, kl_bias_correction=corr, aggregation="token-mean"))
        return s / c

    def formula(lp, corr):
        k3 = jnp.exp(ref - lp) - (ref - lp) - 1
        return beta * (k3 * (jnp.exp(lp - old) if corr else 1.0)).mean()

    for corr in (False, True):
        np.testing.assert_allclose(ours(logp, corr), formula(logp, corr), rtol=1e-6)
        np.testing.assert_allclose(jax.grad(ours)(logp, corr), jax.grad(formula)(logp, corr), rtol=1e-5, atol=1e-8)
    assert not np.allclose(jax.grad(ours)(logp, True), jax.grad(ours)(logp, False))


def test_sequence_level_importance_is_gspo():
    # GSPO: w_i = exp(mean_t(logp - old)), one clip decision per sequence, the same loss on each of its tokens.
    logp = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    old = jnp.array([[-1.5, -2.0, -3.5], [-0.1, -0.2, -9.0]])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = jnp.array([1.0, -1.0])
    w = np.exp([(0.5 + 0.0 + 0.5) / 3, (-0.4 - 0.3) / 2])  # 1.396 (clipped at 1.2, A>0), 0.705 (A<0: clipped)
    loss, low, high = policy_loss_terms(logp, old, adv, mask, level="sequence")
    np.testing.assert_allclose(loss, [[-1.2] * 3, [0.8, 0.8, 0.0]], rtol=1e-6)
    assert low.shape == (2, 1) and high.tolist() == [[1.0], [0.0]] and low.tolist() == [[0.0], [1.0]]
    s, c, m = grpo_loss(logp, LossBatch(adv, mask, old_logp=old), LossConfig(importance_level="sequence"))
    assert float(m["clip_ratio/region_mean"][1]) == 2.0  # counted per sequence, as TRL
    np.testing.assert_allclose(float(m["ratio"][0] / m["ratio"][1]), w.mean(), rtol=1e-6)
    # inside the clip range the gradient of a token is -A * w / |o_i| (per sequence-mean aggregation)
    old2 = logp - 0.05
    f = lambda lp: (lambda s, c, _: s / c)(*grpo_loss(lp, LossBatch(adv, mask, old_logp=old2),
                                                      LossConfig(importance_level="sequence")))
    g = np.asarray(jax.grad(f)(logp))
    wi = np.exp(0.05)
    np.testing.assert_allclose(g, [[-wi / 3 / 3 / 2 * 3] * 3, [wi / 2 / 2 / 2 * 2] * 2 + [0.0]], rtol=1e-5)
