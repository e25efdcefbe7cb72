"""GRPO-family policy losses, loss aggregation and KL estimators, registered by name.

Shapes: ``logp`` / ``old_logp`` / ``ref_logp`` / ``mask`` are ``[B, T]`` over completion tokens
(``mask`` is 1 on real tokens, 0 on padding); ``advantages`` is ``[B]``, one per sequence.

Aggregations return ``(loss_sum, count)`` rather than a mean: the optimiser-step loss is
``sum(loss_sum) / sum(count)`` over micro-batches, which equals the full-batch aggregation exactly,
so gradient accumulation does not change the objective. See docs/grpo.md ("Algorithm").
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from lrmq.registry import Registry

POLICY_LOSSES = Registry("policy loss")
AGGREGATIONS = Registry("loss aggregation")
KL_ESTIMATORS = Registry("KL estimator")
ROLLOUT_CORRECTIONS = Registry("rollout correction")

# exp(20) ~ 4.9e8 is finite in float32; an unclipped log-ratio from a stale or padded token can
# overflow to inf, and inf * 0 (mask) = NaN would poison the whole batch's gradient.
LOG_RATIO_CLIP = 20.0


def _f32(x):
    return jnp.asarray(x, jnp.float32)


# ----------------------------------------------------------------------------- per-token policy loss

IMPORTANCE_LEVELS = ("token", "sequence")


def importance_log_weights(logp, old_logp, mask, level: str = "token"):
    """log of the importance ratio pi/pi_old: per token ``[B, T]`` (GRPO, PPO) or, for ``level="sequence"``
    (GSPO), the length-normalised sequence log-ratio ``mean_t(logp - old_logp)`` as ``[B, 1]``."""
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance level {level!r}: expected one of {IMPORTANCE_LEVELS}")
    log_ratio = _f32(logp) - _f32(old_logp)
    if level == "sequence":
        m = _f32(mask)
        log_ratio = (jnp.where(m > 0, log_ratio, 0.0).sum(-1) / jnp.maximum(m.sum(-1), 1.0))[:, None]
    return jnp.clip(log_ratio, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)


@POLICY_LOSSES.register("grpo")
@POLICY_LOSSES.register("ppo-clip")
def policy_loss_terms(logp, old_logp, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.2,
                      level: str = "token"):
    """PPO-clip surrogate per token.

    Returns ``(loss [B,T], low [B,T'], high [B,T'])``: ``loss = -min(w*A, clip(w, 1-eps_low, 1+eps_high)*A)``
    with ``w`` the importance ratio of ``importance_log_weights`` (``T' = T`` per token, ``1`` per
    sequence), zero on padding. ``low`` / ``high`` are 1.0 where the clipped branch is the one taken
    (``w < 1-eps_low`` with ``A < 0``, ``w > 1+eps_high`` with ``A > 0``), i.e. where the token gets no
    policy gradient: TRL's ``clip_ratio/low`` and ``/high`` indicators.
    """
    mask = _f32(mask)
    adv = _f32(advantages)[:, None]
    ratio = jnp.exp(importance_log_weights(logp, old_logp, mask, level))
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -jnp.minimum(unclipped, clipped)
    low = ((ratio < 1.0 - eps_low) & (adv < 0)).astype(jnp.float32)
    high = ((ratio > 1.0 + eps_high) & (adv > 0)).astype(jnp.float32)
    valid = mask > 0
    # where, not multiply: a NaN on a padded position must not leak into the sums.
    return jnp.where(valid, jnp.broadcast_to(loss, mask.shape), 0.0), low, high


# ----------------------------------------------------------------------------- aggregation


def _masked(values, mask):
    mask = _f32(mask)
    return jnp.where(mask > 0, _f32(values), 0.0), mask


@AGGREGATIONS.register("sequence-mean-token-mean")
def sequence_mean_token_mean(values, mask, *, max_len: int | None = None):
    """Mean over each sequence's tokens, then mean over sequences (paper 1 / TRL ``loss_type="grpo"``).

    sum = sum over sequences of that sequence's token mean; count = sequences with >= 1 token.
    """
    del max_len
    v, m = _masked(values, mask)
    tokens = m.sum(axis=-1)
    per_seq = v.sum(axis=-1) / jnp.maximum(tokens, 1.0)
    return per_seq.sum(), (tokens > 0).sum().astype(jnp.float32)


@AGGREGATIONS.register("token-mean")
def token_mean(values, mask, *, max_len: int | None = None):
    """Sum over all tokens / number of tokens (DAPO): long sequences weigh more."""
    del max_len
    v, m = _masked(values, mask)
    return v.sum(), m.sum()


@AGGREGATIONS.register("drgrpo-constant")
@AGGREGATIONS.register("sequence-sum-constant")
def drgrpo_constant(values, mask, *, max_len: int | None = None):
    """Sum of token losses / (num_sequences * max_len) (Dr.GRPO: no per-sequence 1/|o_i|).

    ``max_len`` should be the configured max completion length; it defaults to the padded width T,
    which is only the same constant if every micro-batch is padded to it. Sequences with no valid
    token (batch padding rows) are not counted.
    """
    v, m = _masked(values, mask)
    length = v.shape[-1] if max_len is None else max_len
    n_seq = (m.sum(axis=-1) > 0).sum().astype(jnp.float32)
    return v.sum(), n_seq * jnp.float32(length)


# ----------------------------------------------------------------------------- KL estimators
# Estimators of KL(pi || pi_ref) from samples of pi, per token (Schulman, "Approximating KL").


@KL_ESTIMATORS.register("k1")
def kl_k1(logp, ref_logp):
    """logp - ref_logp: unbiased, high variance, can be negative."""
    return _f32(logp) - _f32(ref_logp)


@KL_ESTIMATORS.register("k2")
def kl_k2(logp, ref_logp):
    """0.5 * (logp - ref_logp)^2: biased, low variance, >= 0."""
    d = _f32(logp) - _f32(ref_logp)
    return 0.5 * d * d


@KL_ESTIMATORS.register("k3")
def kl_k3(logp, ref_logp):
    """exp(ref - logp) - (ref - logp) - 1: unbiased, low variance, >= 0 (GRPO paper, TRL)."""
    # Same overflow guard as the policy ratio.
    d = jnp.clip(_f32(ref_logp) - _f32(logp), -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    return jnp.exp(d) - d - 1.0


# ----------------------------------------------------------------------------- rollout/learner mismatch
# The sampler (rollout engine, possibly a quantized copy) and the learner give a sampled token different
# probabilities. A correction weighs each token's policy loss by w ~ pi_learner_old / pi_sampler, truncated or
# masked (TIS / MIS). Each takes ``log_ratio`` = learner_old - sampler log-probs ``[B, T]`` and the mask and
# returns ``(weight, corrected)``: ``weight`` ``[B, T]`` per token or ``[B, 1]`` per sequence, ``corrected``
# 1.0 where the ratio was truncated or masked (same shape). ``cap`` is C_max, ``cap_min`` C_min (0 = none).
# token_* / sequence_* are TRL 1.16's modes exactly (its sequence ratio is the *product* of the token ratios);
# geometric_* take the geometric mean instead (verl's "geometric" level, ms-swift's sequence_* modes).


def _seq_log_ratio(log_ratio, mask, mean: bool):
    m = _f32(mask)
    s = jnp.nan_to_num(jnp.where(m > 0, _f32(log_ratio), 0.0), nan=0.0).sum(-1, keepdims=True)
    return s / jnp.maximum(m.sum(-1, keepdims=True), 1.0) if mean else s


def _ratio(log_ratio, mask):
    # nan -> 0 (ratio 1), as TRL does for tokens the sampler could not score; the +-20 clip only guards exp
    lr = jnp.nan_to_num(jnp.where(_f32(mask) > 0, _f32(log_ratio), 0.0), nan=0.0)
    return jnp.exp(jnp.clip(lr, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))


def _outside(ratio, cap, cap_min):
    return ((ratio > cap) | (ratio < cap_min)).astype(jnp.float32)


def _truncate(ratio, cap, cap_min):
    return jnp.clip(ratio, cap_min, cap), _outside(ratio, cap, cap_min)


def _mask_out(ratio, cap, cap_min):
    out = _outside(ratio, cap, cap_min)
    return jnp.where(out > 0, 0.0, ratio), out


@ROLLOUT_CORRECTIONS.register("token_truncate")
def token_truncate(log_ratio, mask, *, cap: float, cap_min: float = 0.0):
    """TIS: w_t = clip(rho_t, C_min, C_max) per token (TRL token_truncate)."""
    return _truncate(_ratio(log_ratio, mask), cap, cap_min)


@ROLLOUT_CORRECTIONS.register("token_mask")
def token_mask(log_ratio, mask, *, cap: float, cap_min: float = 0.0):
    """w_t = rho_t, or 0 where rho_t is outside [C_min, C_max] (TRL token_mask)."""
    return _mask_out(_ratio(log_ratio, mask), cap, cap_min)


@ROLLOUT_CORRECTIONS.register("sequence_truncate")
def sequence_truncate(log_ratio, mask, *, cap: float, cap_min: float = 0.0):
    """w_i = clip(prod_t rho_t, C_min, C_max) on every token of sequence i (TRL sequence_truncate)."""
    return _truncate(_ratio(_seq_log_ratio(log_ratio, mask, False), jnp.ones((mask.shape[0], 1))), cap, cap_min)


@ROLLOUT_CORRECTIONS.register("sequence_mask")
def sequence_mask(log_ratio, mask, *, cap: float, cap_min: float = 0.0):
    """MIS: w_i = prod_t rho_t, or 0 for the whole sequence outside [C_min, C_max] (TRL sequence_mask, its default)."""
    return _mask_out(_ratio(_seq_log_ratio(log_ratio, mask, False), jnp.ones((mask.shape[0], 1))), cap, cap_min)


@ROLLOUT_CORRECTIONS.register("geometric_truncate")
def geometric_truncate(log_ratio, mask, *, cap: float, cap_min: float = 0.0):
    """w_i = clip(exp(mean_t log rho_t), C_min, C_max): the length-normalised sequence ratio, truncated."""
    return _truncate(_ratio(_seq_log_ratio(log_ratio, mask, True), jnp.ones((mask.shape[0], 1))), cap, cap_min)


@ROLLOUT_CORRECTIONS.register("geometric_mask")
def geometric_mask(log_ratio, mask, *, cap: float, cap_min: float = 0.0):
    """w_i = exp(mean_t log rho_t), or 0 for the whole sequence outside [C_min, C_max]."""
    return _mask_out(_ratio(_seq_log_ratio(log_ratio, mask, True), jnp.ones((mask.shape[0], 1))), cap, cap_min)


def _seq_mean(x, mask):
    """(sum, count) of a per-sequence value [B] over sequences with >= 1 token."""
    has = _f32(mask).sum(-1) > 0
    return jnp.where(has, x, 0.0).sum(), has.sum().astype(jnp.float32)


def rollout_mismatch_metrics(learner_logp, sampler_logp, mask):
    """Sampler/learner mismatch on the sampled tokens, each a ``(sum, count)`` mean (no gradient).

    With ``d = log pi_learner - log pi_sampler`` per token (samples from the sampler):
    ``kl_k1`` = mean(-d) and ``kl_k3`` = mean(e^d - 1 - d), estimators of KL(sampler || learner);
    ``chi2_token`` = mean(e^{2d}) - 1 and ``chi2_seq`` = mean_i(prod_t e^{2d}) - 1 (chi-square of the
    learner from the sampler per token and per sequence); ``ppl_ratio`` = mean_i of the learner's
    perplexity / the sampler's, exp(-mean_t d) per sequence; ``logp_diff`` = mean |d| (TRL's
    ``sampling/sampling_logp_difference/mean``). Ratios are exp of a log clipped to +-20, as the loss's."""
    m = _f32(mask)
    valid = m > 0
    d = jax.lax.stop_gradient(jnp.where(valid, _f32(learner_logp) - _f32(sampler_logp), 0.0))
    dc = jnp.clip(d, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    n_tok = m.sum()
    tok = lambda x: (jnp.where(valid, x, 0.0).sum(), n_tok)
    seq_sum = d.sum(-1)
    seq_mean = seq_sum / jnp.maximum(m.sum(-1), 1.0)
    return {
        "mismatch/kl_k1": tok(-d),
        "mismatch/kl_k3": tok(jnp.exp(dc) - 1.0 - dc),
        "mismatch/chi2_token": tok(jnp.exp(2.0 * dc) - 1.0),
        "mismatch/chi2_seq": _seq_mean(jnp.exp(2.0 * jnp.clip(seq_sum, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)) - 1.0, m),
        "mismatch/ppl_ratio": _seq_mean(jnp.exp(jnp.clip(-seq_mean, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)), m),
        "mismatch/logp_diff": tok(jnp.abs(d)),
    }


MISMATCH_METRICS = ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/chi2_token", "mismatch/chi2_seq",
                    "mismatch/ppl_ratio", "mismatch/logp_diff")
CORRECTION_METRICS = ("mismatch/weight_mean", "mismatch/corrected_frac")


# ----------------------------------------------------------------------------- full loss


def _indicator_mean(x, mask):
    """(sum, count) of a clip indicator: over valid tokens for ``[B, T]``, over non-empty sequences for
    ``[B, 1]`` (sequence-level importance), as TRL's ``global_masked_mean``."""
    m = _f32(mask)
    if x.shape[-1] == 1 and m.shape[-1] != 1:
        has = m.sum(-1) > 0
        return jnp.where(has, x[:, 0], 0.0).sum(), has.sum().astype(jnp.float32)
    return jnp.where(m > 0, x, 0.0).sum(), m.sum()


@dataclass(frozen=True)
class LossConfig:
    """The loss part of the algorithm config, as `grpo_loss` takes it (a run's: `TrainConfig.loss_config()`, from
    algo.* and rollout.max_new_tokens). Hashable: static under jit. The defaults are the GRPO paper's loss."""

    policy_loss: str = "grpo"  # a POLICY_LOSSES name
    eps_low: float = 0.2
    eps_high: float = 0.2
    importance_level: str = "token"  # "sequence": GSPO
    aggregation: str = "sequence-mean-token-mean"  # an AGGREGATIONS name
    max_len: int | None = None  # the Dr.GRPO constant (the configured max completion length)
    beta: float = 0.0  # KL coefficient; 0: no KL computed, no reference needed
    kl_estimator: str = "k3"  # a KL_ESTIMATORS name
    kl_bias_correction: bool = False  # KL term times the (differentiable) importance ratio (TRL)
    rollout_correction: str = "none"  # a ROLLOUT_CORRECTIONS name, or "none": nothing computed
    rollout_correction_cap: float = 3.0
    rollout_correction_min: float = 0.0
    router_aux_coef: float = 0.0  # the load-balancing loss's weight (mixture of experts); 0: not added


@dataclass(frozen=True)
class LossBatch:
    """What the loss reads of one micro-batch, ``[B, T]`` over completion tokens (``advantages`` ``[B]``).

    ``old_logp``: pi_old, the importance ratio's denominator; None means on-policy: ``stop_gradient(logp)`` of this
    very forward (ratio 1, the gradient is the policy gradient). ``behaviour_logp``: the sampler's log-probs, read
    by a rollout correction only. ``ref_logp``: the KL reference's, read when ``beta != 0`` only."""

    advantages: jax.Array
    completion_mask: jax.Array
    old_logp: jax.Array | None = None
    behaviour_logp: jax.Array | None = None
    ref_logp: jax.Array | None = None


def _correction_weights(old_logp, behaviour_logp, mask, cfg: LossConfig):
    """(stop-gradient weight [B, T], its metrics) of the rollout correction on ``old_logp - behaviour_logp``."""
    if behaviour_logp is None:
        raise ValueError(f"rollout_correction={cfg.rollout_correction!r} needs behaviour_logp")
    w, corrected = ROLLOUT_CORRECTIONS.get(cfg.rollout_correction)(
        jax.lax.stop_gradient(old_logp) - _f32(behaviour_logp), mask, cap=cfg.rollout_correction_cap,
        cap_min=cfg.rollout_correction_min)
    w = jax.lax.stop_gradient(jnp.broadcast_to(w, mask.shape))
    valid = mask > 0
    n_tokens = mask.sum()
    return w, {"mismatch/weight_mean": (jnp.where(valid, w, 0.0).sum(), n_tokens),
               "mismatch/corrected_frac": (jnp.where(valid, jnp.broadcast_to(corrected, mask.shape), 0.0).sum(),
                                           n_tokens)}


def _kl_term(logp, ref_logp, ratio, mask, cfg: LossConfig):
    """The per-token KL estimate against the reference (times the ratio with kl_bias_correction), 0 on padding."""
    if ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp")
    kl = KL_ESTIMATORS.get(cfg.kl_estimator)(logp, ref_logp)
    if cfg.kl_bias_correction:
        kl = kl * ratio
    return jnp.where(mask > 0, kl, 0.0)


def grpo_loss(logp, batch: LossBatch, cfg: LossConfig = LossConfig(), router_aux=None):
    """GRPO / Dr.GRPO / DAPO / GSPO-style loss for one micro-batch (``batch``: see `LossBatch`).

    Per token: ``l = w * policy_loss + beta * KL_est(logp, ref_logp)`` (KL added before aggregation, as in
    TRL and Tunix), then aggregated with ``cfg.aggregation``. ``kl_bias_correction`` multiplies the KL term
    by the (differentiable) importance ratio, as TRL's ``use_bias_correction_kl`` (its default since
    1.x): the KL is estimated from samples of pi_old, not pi. ``importance_level="sequence"`` is GSPO.

    ``w`` is 1 unless ``cfg.rollout_correction`` (a ``ROLLOUT_CORRECTIONS`` name) is set: then the stop-gradient
    weight of ``log_ratio = pi_old - behaviour_logp`` (the learner's pre-update log-probs against the sampler's), as
    TRL does; it adds the metrics ``mismatch/weight_mean`` (per token) and ``mismatch/corrected_frac`` (tokens whose
    ratio, or whose sequence's, was truncated or masked).

    Returns ``(loss_sum, count, metrics)``: the loss as (sum, count), so micro-batches accumulate exactly, and
    ``metrics`` mapping name -> ``(sum, count)``: ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
    ``clip_ratio/region_mean`` (TRL's names and meaning), ``ratio`` and (when beta != 0) ``kl``.

    ``router_aux`` (a mixture-of-experts forward's `lrmq.model.moe.load_balancing_loss`, a scalar for this
    micro-batch) with ``cfg.router_aux_coef != 0``: ``router_aux_coef * router_aux`` is added per aggregation unit,
    i.e. ``coef * aux * count`` to the sum, so the step's loss is the policy loss plus coef times the count-weighted
    mean of the micro-batches' aux losses (exactly coef * aux with one micro-batch, as transformers adds it per
    forward); metric ``moe/aux_loss``.
    """
    logp = _f32(logp)
    mask = _f32(batch.completion_mask)
    old_logp = jax.lax.stop_gradient(logp) if batch.old_logp is None else batch.old_logp
    per_token, low, high = POLICY_LOSSES.get(cfg.policy_loss)(
        logp, old_logp, batch.advantages, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
        level=cfg.importance_level)
    ratio = jnp.exp(importance_log_weights(logp, old_logp, mask, cfg.importance_level))
    metrics = {
        "clip_ratio/low_mean": _indicator_mean(low, mask),
        "clip_ratio/high_mean": _indicator_mean(high, mask),
        "clip_ratio/region_mean": _indicator_mean(jnp.maximum(low, high), mask),
        "ratio": _indicator_mean(jax.lax.stop_gradient(ratio), mask),
    }
    if cfg.rollout_correction != "none":
        w, weight_metrics = _correction_weights(old_logp, batch.behaviour_logp, mask, cfg)
        per_token = per_token * w
        metrics.update(weight_metrics)
    if cfg.beta != 0.0:
        kl = _kl_term(logp, batch.ref_logp, ratio, mask, cfg)
        per_token = per_token + cfg.beta * kl
        metrics["kl"] = (jax.lax.stop_gradient(kl).sum(), mask.sum())
    loss_sum, count = AGGREGATIONS.get(cfg.aggregation)(per_token, mask, max_len=cfg.max_len)
    if cfg.router_aux_coef != 0.0:
        if router_aux is None:
            raise ValueError("router_aux_coef != 0 needs router_aux (a mixture-of-experts forward)")
        aux = _f32(router_aux)
        loss_sum = loss_sum + cfg.router_aux_coef * aux * count
        metrics["moe/aux_loss"] = (jax.lax.stop_gradient(aux) * count, count)
    return loss_sum, count, metrics


# ----------------------------------------------------------------------------- logits helpers


def token_logprobs(logits, tokens):
    """log softmax(logits)[tokens] in float32: ``[..., V], [...] -> [...]``.

    Computed as ``logit[token] - logsumexp(logits)`` so the full ``[..., V]`` log-softmax is never
    materialised (a bf16 log-softmax loses ~3 digits, enough to bias the ratio).
    """
    x = _f32(logits)
    picked = jnp.take_along_axis(x, jnp.asarray(tokens)[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(x, axis=-1)


def token_entropy(logits):
    """Entropy of softmax(logits) per position in float32: ``[..., V] -> [...]``."""
    x = _f32(logits)
    lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
    logp = x - lse
    p = jnp.exp(logp)
    # p == 0 where a logit is -inf (masked vocab); 0 * -inf would be NaN.
    return -jnp.where(p > 0, p * logp, 0.0).sum(axis=-1)
