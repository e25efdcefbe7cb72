"""The jitted GRPO update: micro-batched loss (sum, count) accumulation, clipping, AdamW."""

from __future__ import annotations

from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lrmq.model.decoder import positions_from_mask
from lrmq.model.moe import UNRECORDED, load_balancing_loss
from lrmq.rl.batch import UpdateBatch
from lrmq.rl.config import TrainConfig
from lrmq.rl.losses import (AGGREGATIONS, CORRECTION_METRICS, MISMATCH_METRICS, LossBatch, grpo_loss,
                             rollout_mismatch_metrics, token_entropy, token_logprobs)

# Where an update takes pi_old (the importance ratio's denominator) from: the batch's behaviour_logp (the
# sampler's), its own forward (stop-gradient: on-policy; it returns those log-probs), or the batch's old_logp.
OldLogpSource = Literal["behaviour_logp", "own", "old_logp"]


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    o = cfg.optim
    total = max(cfg.run.steps * cfg.algo.num_iterations, 1)
    warm = o.warmup_updates(total)
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


def opt_state_shardings(tx, params, mesh):
    """Shardings of `tx.init(params)`: every parameter-shaped leaf (Adam's moments) sharded like its
    parameter, the rest (step counts) replicated. `params`: arrays or ShapeDtypeStructs with shardings.

    Without out_shardings, `jax.jit(tx.init)` left the whole AdamW state replicated on every chip
    (30 GiB per chip for an 8B model)."""
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    abstract = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(tx, lambda _, sh: sh, abstract, param_sh,
                                 transform_non_params=lambda _: NamedSharding(mesh, P()))


def init_opt_state(tx, params, mesh):
    """The optimizer state, created directly in its sharded layout."""
    return jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params, mesh))(params)


def completion_logprobs(model, tokens, mask, completion, temperature: float, *, remat: str = "none",
                        chunk: int = 0, scan: bool = False):
    """Log-probs [S, N] of the completion tokens (and their entropies) under the policy at `temperature`.

    Only the N completion positions are projected onto the vocabulary, `chunk` positions at a time
    (0: all at once) with each chunk recomputed in the backward pass, so the f32 logits live at any
    moment are [S, chunk, V], never [S, P+N, V] (1.5k positions x 152k vocab per sequence)."""
    return _completion_forward(model, tokens, mask, completion, temperature, remat=remat, chunk=chunk, scan=scan)[:2]


def _completion_forward(model, tokens, mask, completion, temperature: float, *, remat: str = "none",
                        chunk: int = 0, scan: bool = False, experts=None):
    """`completion_logprobs` and the forward's routing (`Decoder.hidden`; `experts`: replayed)."""
    positions = positions_from_mask(mask)
    # padding keeps position -1: never attended to
    h, routing = model.hidden(tokens, positions, remat=remat, scan=scan, experts=experts)
    n = completion.shape[1]
    return (*_project(model, h[:, -n - 1:-1], completion, temperature, chunk), routing)  # t predicts token t+1


def packed_logprobs(model, mb: UpdateBatch, temperature: float, *, remat: str = "none", chunk: int = 0,
                    scan: bool = False):
    """`completion_logprobs` for a packed batch (`batch.packed_batch`): [K, N] log-probs and entropies,
    zero where no completion token was packed. Only the packed tokens go through the decoder, and only
    the needed completion positions (gathered per device group) are projected onto the vocabulary."""
    return _packed_forward(model, mb, temperature, remat=remat, chunk=chunk, scan=scan)[:2]


def _packed_forward(model, mb: UpdateBatch, temperature: float, *, remat: str = "none", chunk: int = 0,
                    scan: bool = False):
    """`packed_logprobs` and the forward's routing (the batch's `experts` replayed when it has them)."""
    h, routing = model.hidden(mb.tokens, mb.positions, remat=remat, scan=scan, segments=mb.segments,
                              experts=mb.experts)
    groups = mb.src.shape[0]
    k, n = mb.completion_mask.shape
    h = h.reshape(groups, -1, h.shape[-1])  # [groups, rows * W, D]: each group's rows are contiguous
    hg = jax.vmap(lambda hh, ii: jnp.take(hh, ii, axis=0))(h, mb.src)  # [groups, slots, D]
    logp, ent = _project(model, hg, mb.target, temperature, chunk)
    slots = k // groups * n

    def grid(v):  # [groups, slots] -> [K, N]; padding slots land on the dropped last cell
        g = jax.vmap(lambda d, x: jnp.zeros((slots + 1,), v.dtype).at[d].set(x))(mb.dest, v)
        return g[:, :-1].reshape(k, n)

    return grid(logp), grid(ent), routing


def batch_logprobs(model, mb: UpdateBatch, temperature: float, **kw):
    """Log-probs and entropies [K, N] of a micro-batch in its layout (padded or packed), and the forward's
    routing (`Decoder.hidden`: None for a dense model); the batch's `experts` (routing replay) are replayed."""
    if mb.layout == "pack":
        return _packed_forward(model, mb, temperature, **kw)
    return _completion_forward(model, mb.tokens, mb.mask, mb.completion, temperature, experts=mb.experts, **kw)


def routing_metrics(routing, recorded=None) -> dict:
    """The `moe/*` metrics' accumulators of a forward's stacked `Routing`: ``moe/expert_load`` = (token-slots of
    each sparse layer's experts [L, E], the layer's token-slots [L, 1]), summed over micro-batches;
    `finish_routing_metrics` turns it into ``moe/expert_load_max``. With the sampler's `recorded` experts (the
    batch's `experts`), ``moe/route_mismatch`` (`route_mismatch`) too."""
    out = {"moe/expert_load": (routing.load, jnp.sum(routing.load, axis=-1, keepdims=True))}
    if recorded is not None:
        out["moe/route_mismatch"] = route_mismatch(routing.experts, recorded)
    return out


def route_mismatch(ran, recorded) -> tuple[jax.Array, jax.Array]:
    """``moe/route_mismatch`` as (sum, count): of the token-slots the sampler recorded (`recorded` [B, T, sparse
    layers, k], `UNRECORDED` where it ran nothing), those whose expert the update's forward did not run for that
    token in that layer (`ran`: `Routing.experts` [sparse layers, B, T, k]), i.e. k - |learner's k experts &
    sampler's k experts| per token and layer, over k x the recorded tokens and layers. 0 with routing replay (the
    update runs the sampler's experts); without it, the share of routing the learner and the sampler disagree on."""
    ran = jnp.moveaxis(ran, 0, -2).astype(jnp.int32)  # [B, T, L, k]
    rec = recorded.astype(jnp.int32)
    valid = rec[..., :1] != UNRECORDED  # [B, T, L, 1]
    same = jnp.any(ran[..., :, None] == rec[..., None, :], axis=-1)  # [B, T, L, k]: learner's slot j in the record
    differ = jnp.logical_and(valid, jnp.logical_not(same))
    return (jax.lax.stop_gradient(jnp.sum(differ, dtype=jnp.float32)),
            jnp.sum(valid, dtype=jnp.float32) * ran.shape[-1])


def forward_batch(cfg: TrainConfig, mb: UpdateBatch) -> UpdateBatch:
    """The batch the update's forward runs: its recorded `experts` replayed only with rollout.routing_replay (a
    mixture-of-experts rollout records them anyway, for ``moe/route_mismatch``)."""
    return mb if cfg.rollout.routing_replay or mb.experts is None else mb.replace(experts=None)


def finish_routing_metrics(out: dict) -> dict:
    """``moe/expert_load`` (each layer's per-expert share of its token-slots, [L, E]) -> ``moe/expert_load_max``:
    the largest share of any expert in any sparse layer, relative to the uniform share 1 / E (1 = perfectly
    balanced; at most E / k, an expert in every token's top-k)."""
    share = out.pop("moe/expert_load", None)
    if share is not None:
        out["moe/expert_load_max"] = share.shape[-1] * jnp.max(share)
    return out


def _project(model, h, targets, temperature: float, chunk: int):
    """h [B, n, D] -> (log-probs of `targets` [B, n], entropies [B, n]) at `temperature`, `chunk`
    positions at a time, each chunk recomputed in the backward pass."""

    def head(hc, tc):
        logits = model.logits(hc).astype(jnp.float32) / temperature
        return token_logprobs(logits, tc), token_entropy(logits)

    n = targets.shape[1]
    if not chunk or chunk >= n:
        return head(h, targets)
    pad = (-n) % chunk
    hp = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    tp = jnp.pad(targets, ((0, 0), (0, pad)))
    s = h.shape[0]
    hc = hp.reshape(s, -1, chunk, h.shape[-1]).swapaxes(0, 1)  # [chunks, B, chunk, D]
    tc = tp.reshape(s, -1, chunk).swapaxes(0, 1)
    logp, ent = jax.lax.map(lambda a: jax.checkpoint(head)(*a), (hc, tc))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(s, -1)[:, :n]
    return unchunk(logp), unchunk(ent)


def micro_batch_count(cfg: TrainConfig, sequences: int) -> int:
    """How many micro-batches an update of `sequences` sequences accumulates over (optim.micro_batch_size,
    0 = one)."""
    return sequences // (cfg.optim.micro_batch_size or sequences)


def micro_batches(x, n_micro: int):
    """[S, ...] -> [n_micro, S / n_micro, ...] with micro-batch i = rows i, i + n_micro, ... (strided).

    The batch is sharded over the data axes by rows; a strided split keeps each device's rows in
    every micro-batch, so the scan over micro-batches never moves data. A contiguous split
    (`reshape(n_micro, mbs)`) would put the sharding on the scanned axis: every device would gather
    and compute each whole micro-batch."""
    return x.reshape((x.shape[0] // n_micro, n_micro) + x.shape[1:]).swapaxes(0, 1)


def _loss_fn(trainable, rest, graphdef, mb: UpdateBatch, total_count, ref_logp, cfg: TrainConfig,
             old_from: OldLogpSource):
    model = nnx.merge(graphdef, trainable, rest)
    logp, ent, routing = batch_logprobs(model, forward_batch(cfg, mb), cfg.rollout.temperature, remat=cfg.model.remat,
                                        chunk=cfg.model.logits_chunk, scan=cfg.model.scan_layers)
    old = {"behaviour_logp": mb.behaviour_logp, "own": None, "old_logp": mb.old_logp}[old_from]
    aux = load_balancing_loss(routing) if routing is not None and cfg.algo.router_aux_coef else None
    loss_sum, _, metrics = grpo_loss(logp, LossBatch(mb.advantages, mb.completion_mask, old_logp=old,
                                                     behaviour_logp=mb.behaviour_logp, ref_logp=ref_logp),
                                     cfg.loss_config(), router_aux=aux)
    if routing is not None:
        metrics.update(routing_metrics(routing, mb.experts))
    m = mb.completion_mask
    metrics["entropy"] = ((jax.lax.stop_gradient(ent) * m).sum(), m.sum())
    # sampler vs the learner before the update: the old log-probs when handed over, else this forward's (the
    # trainer logs the first update's)
    learner_old = old if old_from == "old_logp" else jax.lax.stop_gradient(logp)
    metrics.update(rollout_mismatch_metrics(learner_old, mb.behaviour_logp, m))
    return loss_sum / total_count, (loss_sum, metrics, jax.lax.stop_gradient(logp))


def train_step(graphdef, cfg: TrainConfig, tx, old_from: OldLogpSource, trainable, rest, opt_state,
               batch: UpdateBatch, ref_logp):
    """One optimizer update over the whole rollout batch, accumulated over micro-batches exactly.

    `old_from` (`old_logprob_sources`) is pi_old. "own" is the on-policy update: the importance ratio's
    denominator is the policy's own (stop-gradient) log-probs of this very forward pass, so no separate
    old-log-prob forward is needed; the step then also returns those log-probs ``[S, N]`` (the pre-update
    policy's), which later inner iterations (mu > 1) take as the batch's old_logp."""
    s = batch.num_sequences  # sequences (a packed batch has fewer token rows)
    n_micro = micro_batch_count(cfg, s)
    # The aggregation's denominator over the whole batch, so sum of micro-batch (sum / total) is exact.
    _, total_count = AGGREGATIONS.get(cfg.algo.loss_aggregation)(
        jnp.zeros_like(batch.completion_mask), batch.completion_mask, max_len=cfg.rollout.max_new_tokens)
    total_count = jnp.maximum(total_count, 1.0)

    split = lambda x: micro_batches(x, n_micro)
    micro = jax.tree.map(split, batch)
    ref_micro = split(ref_logp) if ref_logp is not None else None
    grad_fn = jax.grad(_loss_fn, has_aux=True)
    own = old_from == "own"

    def body(carry, xs):
        g_acc, loss_acc, m_acc = carry
        mb, ref = xs
        g, (loss_sum, metrics, logp) = grad_fn(trainable, rest, graphdef, mb, total_count, ref, cfg, old_from)
        g_acc = jax.tree.map(jnp.add, g_acc, g)
        m_acc = jax.tree.map(jnp.add, m_acc, metrics)
        return (g_acc, loss_acc + loss_sum, m_acc), (logp if own else None)

    zeros_g = jax.tree.map(jnp.zeros_like, trainable)
    zero_metrics = {k: (jnp.zeros(()), jnp.zeros(())) for k in _metric_names(cfg)}
    model_cfg = nnx.merge(graphdef, trainable, rest).cfg
    if model_cfg.num_experts:  # moe/expert_load: [sparse layers, experts] token-slots
        layers = len(model_cfg.moe_layers)
        zero_metrics["moe/expert_load"] = (jnp.zeros((layers, model_cfg.num_experts)), jnp.zeros((layers, 1)))
        if batch.experts is not None:
            zero_metrics["moe/route_mismatch"] = (jnp.zeros(()), jnp.zeros(()))
    (grads, loss_sum, msum), logps = jax.lax.scan(body, (zeros_g, jnp.zeros(()), zero_metrics), (micro, ref_micro))
    grad_norm = optax.global_norm(grads)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    out = finish_routing_metrics({k: v[0] / jnp.maximum(v[1], 1.0) for k, v in msum.items()})
    out["loss"] = loss_sum / total_count
    out["grad_norm"] = grad_norm
    if own:  # undo the strided micro-batch split: [n_micro, S/n_micro, N] -> [S, N]
        out["logp"] = logps.swapaxes(0, 1).reshape(s, -1)
    return trainable, opt_state, out


METRIC_NAMES = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio", "entropy")


def _metric_names(cfg: TrainConfig) -> tuple[str, ...]:
    loss = cfg.loss_config()
    return (METRIC_NAMES + (("kl",) if loss.beta != 0.0 else ()) + MISMATCH_METRICS
            + (CORRECTION_METRICS if loss.rollout_correction != "none" else ())
            + (("moe/aux_loss",) if loss.router_aux_coef != 0.0 else ()))


def old_logprob_sources(cfg: TrainConfig) -> tuple[OldLogpSource, ...]:
    """pi_old, the importance ratio's denominator, of each of a batch's algo.num_iterations updates: the whole
    old-log-prob protocol (the trainer runs, and compiles, exactly these step variants).

    * algo.old_logprobs=rollout with no rollout correction (Tunix's default): every update divides by the
      sampler's log-probs, "behaviour_logp".
    * otherwise (recompute, or a correction on, whatever algo.old_logprobs says): the old policy *is* the current
      one at the first update, so it is on-policy ("own": its own forward, stop-gradient; no extra forward, as TRL
      at mu=1) and returns those log-probs, which the later updates divide by ("old_logp"). A correction weighs
      every update by exp(pi_old - behaviour_logp)."""
    mu = cfg.algo.num_iterations
    if cfg.algo.old_logprobs == "rollout" and cfg.loss_config().rollout_correction == "none":
        return ("behaviour_logp",) * mu
    return ("own",) + ("old_logp",) * (mu - 1)


def rollout_quant_warning(cfg: TrainConfig) -> str | None:
    """A warning for quantized rollouts with no correction whose PPO ratio divides by the sampler's log-probs: the
    clip then acts on the quantization mismatch, unweighted (docs/grpo.md's study: int4 -0.124 held-out accuracy
    against FP rollouts, where ignoring the mismatch cost -0.021 and MIS/TIS nothing measurable)."""
    if cfg.sampler_differs and old_logprob_sources(cfg)[0] == "behaviour_logp":
        r = cfg.rollout
        why = ", ".join(f"{k}={v}" for k, v in (("rollout.quant", r.quant), ("rollout.kv_cache", r.kv_cache),
                                                ("rollout.max_staleness", r.max_staleness))
                        if v not in ("none", "auto", "bf16", 0))
        return (f"{why} with algo.rollout_correction=none and algo.old_logprobs=rollout: the PPO clip compares the "
                "learner with a sampler that differs from it (quantized or stale), uncorrected. Prefer "
                "algo.rollout_correction=auto (sequence_mask: the decoupled objective), or algo.old_logprobs=recompute "
                "to ignore the mismatch (docs/grpo.md, quantized rollouts and the decoupled objective)")
    return None


def make_train_step(graphdef, cfg: TrainConfig, tx, shardings=None, *, old_from: OldLogpSource = "behaviour_logp"):
    """The jitted `train_step` taking pi_old from `old_from`; `shardings`: (trainable's, optimizer state's)."""
    fn = partial(train_step, graphdef, cfg, tx, old_from)
    if shardings is None:
        return jax.jit(fn, donate_argnums=(0, 2))
    tr_sh, opt_sh = shardings
    return jax.jit(fn, donate_argnums=(0, 2), out_shardings=(tr_sh, opt_sh, None))


def make_ref_logprobs(graphdef, cfg: TrainConfig):
    """Reference-policy log-probs [S, N] of an update batch (beta > 0): same graph, frozen reference
    parameters, the whole batch in one forward."""

    def reference_logprobs(ref_trainable, rest, batch: UpdateBatch):
        model = nnx.merge(graphdef, ref_trainable, rest)
        batch = forward_batch(cfg, batch)
        kw = dict(chunk=cfg.model.logits_chunk, scan=cfg.model.scan_layers)
        if batch.layout != "pack":  # the batch's replayed experts too, as the policy's forward
            return _completion_forward(model, batch.tokens, batch.mask, batch.completion, cfg.rollout.temperature,
                                       experts=batch.experts, **kw)[0]
        # a packed batch is laid out per micro-batch: split as the step does, then run all groups at once
        s = batch.num_sequences
        n_micro = micro_batch_count(cfg, s)
        flat = jax.tree.map(lambda x: micro_batches(x, n_micro).reshape((-1,) + x.shape[1:]), batch)
        logp = packed_logprobs(model, flat, cfg.rollout.temperature, **kw)[0]
        return logp.reshape(n_micro, s // n_micro, -1).swapaxes(0, 1).reshape(s, -1)

    return jax.jit(reference_logprobs)
