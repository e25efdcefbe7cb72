"""The jitted GRPO update: micro-batched loss (sum, count) accumulation, clipping, AdamW."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lrmq.model.decoder import positions_from_mask
from lrmq.rl.config import TrainConfig
from lrmq.rl.losses import AGGREGATIONS, grpo_loss, token_entropy, token_logprobs


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    o = cfg.optim
    total = max(cfg.run.steps * cfg.algo.num_iterations, 1)
    warm = min(o.warmup_steps, total)
    if o.schedule == "constant":
        decay = optax.constant_schedule(o.lr)
    elif o.schedule == "cosine":
        decay = optax.cosine_decay_schedule(o.lr, max(total - warm, 1))
    else:  # linear to zero, as TRL/HF's default "linear" scheduler
        decay = optax.linear_schedule(o.lr, 0.0, max(total - warm, 1))
    sched = optax.join_schedules([optax.linear_schedule(0.0, o.lr, warm), decay], [warm]) if warm else decay
    tx = optax.chain(
        optax.clip_by_global_norm(o.max_grad_norm) if o.max_grad_norm > 0 else optax.identity(),
        optax.adamw(sched, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay),
    )
    return tx, sched


def completion_logprobs(model, tokens, mask, completion, temperature: float):
    """Log-probs [S, N] of the completion tokens (and their entropies) under the policy at `temperature`."""
    positions = positions_from_mask(mask)
    logits = model(tokens, positions)  # padding keeps position -1: never attended to
    n = completion.shape[1]
    logits = logits[:, -n - 1:-1].astype(jnp.float32) / temperature  # position t predicts token t+1
    return token_logprobs(logits, completion), token_entropy(logits)


def _loss_fn(trainable, rest, graphdef, mb, total_count, ref_logp, cfg: TrainConfig):
    model = nnx.merge(graphdef, trainable, rest)
    a = cfg.algo
    logp, ent = completion_logprobs(model, mb["tokens"], mb["mask"], mb["completion"], cfg.rollout.temperature)
    loss_sum, _, metrics = grpo_loss(logp, mb["old_logp"], mb["advantages"], mb["completion_mask"], eps_low=a.eps_low,
                                     eps_high=a.eps_high, aggregation=a.loss_aggregation, beta=a.beta,
                                     ref_logp=ref_logp, kl_estimator=a.kl_estimator,
                                     max_len=cfg.rollout.max_new_tokens, policy_loss=a.policy_loss)
    m = mb["completion_mask"]
    metrics["entropy"] = ((jax.lax.stop_gradient(ent) * m).sum(), m.sum())
    return loss_sum / total_count, (loss_sum, metrics)


def train_step(graphdef, cfg: TrainConfig, tx, trainable, rest, opt_state, batch, ref_logp):
    """One optimizer update over the whole rollout batch, accumulated over micro-batches exactly."""
    s = batch["tokens"].shape[0]
    mbs = cfg.optim.micro_batch_size or s
    n_micro = s // mbs
    # The aggregation's denominator over the whole batch, so sum of micro-batch (sum / total) is exact.
    _, total_count = AGGREGATIONS.get(cfg.algo.loss_aggregation)(
        jnp.zeros_like(batch["completion_mask"]), batch["completion_mask"], max_len=cfg.rollout.max_new_tokens)
    total_count = jnp.maximum(total_count, 1.0)

    split = lambda x: x.reshape((n_micro, mbs) + x.shape[1:])
    micro = jax.tree.map(split, batch)
    ref_micro = split(ref_logp) if ref_logp is not None else None
    grad_fn = jax.grad(_loss_fn, has_aux=True)

    def body(carry, xs):
        g_acc, loss_acc, m_acc = carry
        mb, ref = xs
        g, (loss_sum, metrics) = grad_fn(trainable, rest, graphdef, mb, total_count, ref, cfg)
        g_acc = jax.tree.map(jnp.add, g_acc, g)
        m_acc = jax.tree.map(jnp.add, m_acc, metrics)
        return (g_acc, loss_acc + loss_sum, m_acc), None

    zeros_g = jax.tree.map(jnp.zeros_like, trainable)
    zero_metrics = {k: (jnp.zeros(()), jnp.zeros(())) for k in _metric_names(cfg)}
    (grads, loss_sum, msum), _ = jax.lax.scan(body, (zeros_g, jnp.zeros(()), zero_metrics), (micro, ref_micro))
    grad_norm = optax.global_norm(grads)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    out = {k: v[0] / jnp.maximum(v[1], 1.0) for k, v in msum.items()}
    out["loss"] = loss_sum / total_count
    out["grad_norm"] = grad_norm
    return trainable, opt_state, out


def _metric_names(cfg: TrainConfig) -> tuple[str, ...]:
    names = ("clip_fraction", "ratio", "entropy")
    return names + (("kl",) if cfg.algo.beta != 0.0 else ())


def make_train_step(graphdef, cfg: TrainConfig, tx, shardings=None):
    fn = partial(train_step, graphdef, cfg, tx)
    if shardings is None:
        return jax.jit(fn, donate_argnums=(0, 2))
    tr_sh, opt_sh = shardings
    return jax.jit(fn, donate_argnums=(0, 2), out_shardings=(tr_sh, opt_sh, None))


def make_ref_logprobs(graphdef, cfg: TrainConfig):
    """Reference-policy log-probs (beta > 0): same graph, frozen reference parameters."""

    def fn(ref_trainable, rest, tokens, mask, completion):
        model = nnx.merge(graphdef, ref_trainable, rest)
        return completion_logprobs(model, tokens, mask, completion, cfg.rollout.temperature)[0]

    return jax.jit(fn)
