"""The mixture-of-experts block of the one decoder (Qwen3-MoE), in place of a layer's dense MLP.

Each token's router logits (a `Linear` to num_experts, kept in float: quantization transforms never select it)
go through a float32 softmax; the top-k experts are kept (`route`), their probabilities renormalised to sum to 1
with `norm_topk_prob`, and cast to the compute dtype, as transformers' Qwen3MoeTopKRouter does. `Experts` runs
the chosen SwiGLU experts as grouped matmuls: the token-expert pairs sorted by expert (a stable argsort of the
flattened top-k ids; group sizes by bincount), each projection one `jax.lax.ragged_dot` over the stacked
[experts, in, out] kernels (`ExpertLinear`), then unsorted and summed with the routing weights. No token is
dropped (no capacity factor): every group is as large as its expert's load.

Choice and computation are separate (`MoE.routed` = `route`, then `Experts(x, experts, weights)`), so a
forward can be given the experts another one chose (routing replay: `replayed_weights`) without a second expert
path. `MoE.routed` also returns what its router did (`Routing`): the experts, for a sampler to record, and the
per-expert load and probability mass the load-balancing loss (`load_balancing_loss`) and the `moe/*` metrics
(`expert_load`) read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from lrmq.model.config import ModelConfig
from lrmq.model.linear import ExpertLinear, Linear


# A replayed expert id meaning "not recorded" (a token the sampler never ran: the last completion token, padding):
# that token is routed by the router's own top-k. Ids are uint8, so at most 254 experts are replayable.
UNRECORDED = 255


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] float32, expert ids [N, k] int32) of router `logits` [N, E]: the float32 softmax's k largest
    probabilities, in descending order; equal probabilities are taken lower expert index first (`jax.lax.top_k`),
    so a choice among tied experts is deterministic and the same in every program. `normalize`: the k weights
    divided by their sum (Qwen3-MoE's norm_topk_prob)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def replayed_weights(logits: jax.Array, experts: jax.Array, normalize: bool) -> jax.Array:
    """Routing weights [N, k] float32 of given `experts` [N, k] (routing replay: the experts a sampler chose): the
    float32 softmax of the router `logits` [N, E] gathered at those ids, divided by their sum with `normalize`. The
    router's gradient flows through the chosen experts' probabilities (the softmax couples every gate row), as in
    rollout routing replay; where `experts` are `route`'s own choice the weights are bit-identical to its."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights = jnp.take_along_axis(probs, experts.astype(jnp.int32), axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights


@struct.dataclass
class Routing:
    """What a sparse layer's router did in one forward (a pytree; `Decoder.hidden` stacks it over the sparse layers
    on a leading axis, `ModelConfig.moe_layers`' order). `experts` [B, T, k] int32: the experts each token ran
    (chosen, or replayed); over the tokens that count (position >= 0: padding excluded, as transformers' attention
    mask does): `load` [E] float32, the token-slots each expert got (k per token, no gradient), and `prob` [E]
    float32, the sum of the router's softmax probabilities (differentiable)."""

    experts: jax.Array
    load: jax.Array
    prob: jax.Array


def load_balancing_loss(routing: Routing) -> jax.Array:
    """The Switch / Qwen3-MoE load-balancing loss of a forward's stacked `routing`, transformers'
    `load_balancing_loss_func` with an attention mask: E * sum_e f_e * P_e, where f_e is expert e's token-slots and
    P_e its probability mass, each summed over every sparse layer and divided by (sparse layers x counted tokens).
    Its minimum, with perfectly balanced routing, is top-k (f sums to k, P to 1)."""
    e = routing.load.shape[-1]
    k = routing.experts.shape[-1]
    rows = jnp.maximum(jnp.sum(routing.load) / k, 1.0)  # sparse layers x counted tokens
    f = jnp.sum(routing.load.reshape(-1, e), axis=0) / rows
    p = jnp.sum(routing.prob.reshape(-1, e), axis=0) / rows
    return e * jnp.sum(f * p)


class Experts(nnx.Module):
    """num_experts SwiGLU MLPs of width moe_intermediate_size, their kernels stacked (`ExpertLinear`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        lin = lambda i, o, axes: ExpertLinear(e, i, o, axes=axes, dtype=dt, param_dtype=pdt, rngs=rngs)
        self.gate_proj = lin(d, f, ("embed", "mlp"))
        self.up_proj = lin(d, f, ("embed", "mlp"))
        self.down_proj = lin(f, d, ("mlp", "embed"))
        self.num_experts = e

    def __call__(self, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
        """x [N, D], experts / weights [N, k] -> [N, D]: sum over j of weights[n, j] * expert experts[n, j] (x[n])."""
        n, k = experts.shape
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # token-slot pairs grouped by expert, tokens in order within a group
        sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        xs = jnp.take(x, order // k, axis=0)
        h = jax.nn.silu(self.gate_proj(xs, sizes)) * self.up_proj(xs, sizes)
        ys = self.down_proj(h, sizes)
        ys = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True).reshape(n, k, -1)  # back to token order
        return jnp.sum(ys * weights.astype(ys.dtype)[..., None], axis=1)


class MoE(nnx.Module):
    """A sparse layer's feed-forward block: router + experts (`__call__(x)` [B, T, D] -> [B, T, D])."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.router = Linear(cfg.hidden_size, cfg.num_experts, use_bias=False, axes=("embed", None), dtype=dt,
                             param_dtype=pdt, rngs=rngs)
        self.experts = Experts(cfg, rngs)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.routed(x)[0]

    def routed(self, x: jax.Array, valid: jax.Array | None = None,
               experts: jax.Array | None = None) -> tuple[jax.Array, Routing]:
        """(output [B, T, D], its `Routing`) of x [B, T, D]. `valid` [B, T] bool: the tokens the routing statistics
        count (None: all). `experts` [B, T, k] (any integer dtype): replay these experts instead of the top-k
        (`replayed_weights`); a token whose first id is `UNRECORDED` is routed as usual."""
        b, t, d = x.shape
        h = x.reshape(b * t, d)
        logits = self.router(h)
        weights, chosen = route(logits, self.top_k, self.norm_topk_prob)
        if experts is not None:  # the given experts where recorded, the softmax gathered at them (where they are
            given = experts.reshape(b * t, self.top_k).astype(jnp.int32)  # route's own, its weights bit for bit)
            chosen = jnp.where(given[:, :1] == UNRECORDED, chosen, given)
            weights = replayed_weights(logits, chosen, self.norm_topk_prob)
        y = self.experts(h, chosen, weights.astype(logits.dtype)).reshape(b, t, d)
        count = (jnp.ones((b * t,), jnp.float32) if valid is None else valid.reshape(b * t).astype(jnp.float32))
        e = self.experts.num_experts
        load = jnp.zeros((e,), jnp.float32).at[chosen].add(jnp.broadcast_to(count[:, None], chosen.shape))
        prob = jnp.sum(jax.nn.softmax(logits.astype(jnp.float32), axis=-1) * count[:, None], axis=0)
        return y, Routing(chosen.reshape(b, t, self.top_k), jax.lax.stop_gradient(load), prob)
