"""The mixture-of-experts block of the one decoder (Qwen3-MoE), in place of a layer's dense MLP.

Each token's router logits (a `Linear` to num_experts, kept in float: quantization transforms never select it)
go through a float32 softmax; the top-k experts are kept (`route`), their probabilities renormalised to sum to 1
with `norm_topk_prob`, and cast to the compute dtype, as transformers' Qwen3MoeTopKRouter does. `Experts` runs
the chosen SwiGLU experts as grouped matmuls: the token-expert pairs sorted by expert (a stable argsort of the
flattened top-k ids; group sizes by bincount), each projection one `jax.lax.ragged_dot` over the stacked
[experts, in, out] kernels (`ExpertLinear`), then unsorted and summed with the routing weights. No token is
dropped (no capacity factor): every group is as large as its expert's load.

Expert parallelism: under a mesh with an `expert` axis (`lrmq.sharding.EXPERT_AXIS`, MeshConfig.expert > 1) that
divides num_experts, `Experts` runs in a `jax.shard_map` (`_expert_parallel`): each chip holds E / S experts (S the
axis size) and its own tokens. Where the tokens are split over the expert axis (training: the batch rows are), each
chip sorts its token-slots by expert, exchanges the per-expert counts (an all-gather of E integers), sends each
slot to its expert's chip with one `ragged_all_to_all`, sorts what it received by local expert, runs the grouped
matmuls, and sends the results back with a second one (MaxText's layers/moe.py scheme). The receive buffer holds
the worst case (S x its own slots: every slot sent to one chip), so no token is dropped, as without the axis. Where
the tokens are not split over it (the decode layout splits the batch over `data` only), every chip computes its
experts' share of its tokens and the shares are summed (a psum over the expert axis). The expert kernels' model
dimension is gathered at the shard_map's edge (FSDP); an `mlp` dimension split over tensor axes stays split, each
chip computing its columns and the down projections' partial sums added (the decode layout's tensor parallelism:
no weight is gathered per token). Packed expert kernels enter as their arrays' local shards (the kernel variable
brings its specs and its local grouped call: `shard_specs`, `packed_ragged_dot(..., local=)`), their hidden split
kept only where every chip holds whole quantization groups (else gathered); expert adapters' factors split over
the expert axis like the kernels and run on the same local rows. XLA:CPU has no ragged-all-to-all: on the CPU the same exchange runs as a
padded `all_to_all` (`_ragged_exchange`), so the multi-device CPU test checks the same offsets.

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
from jax.sharding import PartitionSpec as P

from lrmq.model.config import ModelConfig
from lrmq.model.linear import ExpertLinear, Linear, is_packed_experts
from lrmq.sharding import (EXPERT_AXIS, LOGICAL_AXES_KEY, axes_size, dividing_axes, entry_axes, is_manual,
                           logical_to_spec, rules_in_effect, spec_entry)


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
        plan = _expert_plan(self, x.shape[0])
        if plan is not None:
            return _expert_parallel(self, plan, x, experts, weights)
        n, k = experts.shape
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # token-slot pairs grouped by expert, tokens in order within a group
        sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        xs = jnp.take(x, order // k, axis=0)
        h = jax.nn.silu(self.gate_proj(xs, sizes)) * self.up_proj(xs, sizes)
        ys = self.down_proj(h, sizes)
        ys = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True).reshape(n, k, -1)  # back to token order
        return jnp.sum(ys * weights.astype(ys.dtype)[..., None], axis=1)


# ----------------------------------------------------------------------------- expert parallelism
@struct.dataclass
class _Plan:
    """How `_expert_parallel` splits one call: the mesh in effect, the token axes (the batch axes of the rules in
    effect that divide the token count, the `mlp` axes excluded), the `mlp` axes the kernels' hidden dimension stays
    split over, and whether the tokens are split over the expert axis (all-to-all dispatch) or not (psum)."""

    mesh: object = struct.field(pytree_node=False)
    tokens: tuple = struct.field(pytree_node=False)
    mlp: tuple = struct.field(pytree_node=False)
    dispatch: bool = struct.field(pytree_node=False)


def _expert_plan(module: "Experts", n_tokens: int) -> _Plan | None:
    """The expert-parallel plan of a call on `n_tokens` tokens, or None for the single-program path: no mesh in
    effect, no expert axis (> 1 device) dividing num_experts, or already inside a shard_map."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get(EXPERT_AXIS, 1) <= 1 or is_manual(mesh):
        return None
    if module.num_experts % mesh.shape[EXPERT_AXIS]:
        return None
    rules = rules_in_effect()
    k = module.gate_proj.kernel
    spec = tuple(logical_to_spec(("expert", "embed", "mlp"), tuple(k.shape), mesh, rules)) + (None,) * 3
    mlp = tuple(a for a in entry_axes(spec[2]) if a != EXPERT_AXIS)
    if mlp and module.down_proj.kernel.shape[1] % axes_size(mesh, mlp):
        mlp = ()
    if mlp and any(is_packed_experts(lin.kernel) and lin.kernel.shard_specs(mesh, EXPERT_AXIS, mlp) is None
                   for lin in _projections(module)):
        mlp = ()  # a packed kernel whose groups the hidden split would cut: its hidden dimension gathered
    tokens = dividing_axes(mesh, entry_axes(rules.get("batch")), n_tokens, exclude=mlp)
    return _Plan(mesh, tokens, mlp, EXPERT_AXIS in tokens)


def _exclusive_cumsum(v: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(v, axis=axis) - v


def _ragged_exchange(x, out, input_offsets, send_sizes, output_offsets, recv_sizes):
    """`jax.lax.ragged_all_to_all` over the expert axis (its semantics: rows [input_offsets[j], + send_sizes[j])
    of x go to chip j, written there from ITS output row output_offsets[j]; recv_sizes[i] rows come from chip i),
    lowered as such where the backend has it, and on the CPU (XLA:CPU has no ragged-all-to-all) as an
    `all_to_all` of each destination's rows padded to x's length, placed by a scatter at the senders' offsets."""

    def padded(x, out, input_offsets, send_sizes, output_offsets, recv_sizes):
        m = x.shape[0]
        r = jnp.arange(m)
        rows = input_offsets[:, None] + r[None, :]  # [S, m]: the rows sent to each chip, padded to m
        keep = r[None, :] < send_sizes[:, None]
        send = jnp.where(keep[..., None], jnp.take(x, jnp.clip(rows, 0, m - 1), axis=0), 0)
        got = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0, tiled=False)  # [S, m, D]: got[i] = chip i's rows for me
        at = jax.lax.all_to_all(output_offsets, EXPERT_AXIS, 0, 0, tiled=True)  # at[i]: where chip i writes here
        dest = jnp.where(r[None, :] < recv_sizes[:, None], at[:, None] + r[None, :], out.shape[0])
        return out.at[dest.reshape(-1)].set(got.reshape(-1, x.shape[-1]), mode="drop", unique_indices=True)

    def ragged(*args):
        return jax.lax.ragged_all_to_all(*args, axis_name=EXPERT_AXIS)

    return jax.lax.platform_dependent(x, out, input_offsets, send_sizes, output_offsets, recv_sizes,
                                      cpu=padded, default=ragged)


def _projections(module: "Experts") -> tuple:
    return module.gate_proj, module.up_proj, module.down_proj


def _local_specs(lin, mesh, mlp: tuple):
    """(the shard_map in_specs of `lin`'s kernel value, of its adapter's (a, b) or None, the local shape of a packed
    kernel or None): experts over the expert axis, the logical `mlp` dimension over `mlp` (the rest gathered)."""
    axes = tuple(lin.kernel.get_metadata().get(LOGICAL_AXES_KEY) or ("expert", None, None))
    over = lambda name: spec_entry(mlp) if name == "mlp" else None
    lora = None if lin.lora is None else (P(EXPERT_AXIS, over(axes[1]), None), P(EXPERT_AXIS, None, over(axes[2])))
    if is_packed_experts(lin.kernel):
        kspec, shape = lin.kernel.shard_specs(mesh, EXPERT_AXIS, mlp)
        return kspec, lora, shape
    return P(EXPERT_AXIS, over(axes[1]), over(axes[2])), lora, None


def _ffn(module: "Experts", xs, sizes, local, mlp: tuple):
    """The SwiGLU experts on rows `xs` sorted by local expert (`sizes` [E / S] rows each; rows past their sum are
    padding, returned as 0), through each `ExpertLinear` with this chip's share of its kernel and adapter (`local`:
    a (kernel, adapter factors) pair a projection); the down projection's partial sums over the `mlp` axes added
    (an adapter's too: its down factor a is split on the hidden dimension as the kernel is)."""

    def proj(lin, h, own):
        return lin(h, sizes, kernel=own[0], lora=own[1]).astype(lin.dtype)

    h = jax.nn.silu(proj(module.gate_proj, xs, local[0])) * proj(module.up_proj, xs, local[1])
    y = proj(module.down_proj, h, local[2])
    if mlp:
        y = jax.lax.psum(y, mlp)
    valid = jnp.arange(xs.shape[0]) < jnp.sum(sizes)
    return jnp.where(valid[:, None], y, 0)


def _expert_parallel(module: "Experts", plan: _Plan, x, experts, weights):
    """`Experts.__call__` in a shard_map over `plan.mesh` (the module docstring: dispatch by ragged all-to-all,
    or a psum when the tokens are not split over the expert axis)."""
    mesh, e = plan.mesh, module.num_experts
    s = mesh.shape[EXPERT_AXIS]
    el = e // s
    tok = spec_entry(plan.tokens)
    lins = _projections(module)
    plans = [_local_specs(lin, mesh, plan.mlp) for lin in lins]
    specs = tuple((kspec, lspec) for kspec, lspec, _ in plans)
    values = tuple((lin.kernel.get_value(), None if lin.lora is None else (lin.lora.a[...], lin.lora.b[...]))
                   for lin in lins)
    out_dtype = module.down_proj.dtype

    def body(x, experts, weights, values):
        # a packed kernel's local arrays go back with their local shape (`QuantizedExpertKernel.packed_ragged_dot`)
        kernels = tuple((v if shape is None else (v, shape), ab) for (v, ab), (_, _, shape) in zip(values, plans))
        n, k = experts.shape
        me = jax.lax.axis_index(EXPERT_AXIS)
        flat = experts.reshape(-1)
        if not plan.dispatch:  # every chip has all its group's tokens: its own experts' share, summed over chips
            local = flat - me * el
            key = jnp.where((local >= 0) & (local < el), local, el)
            order = jnp.argsort(key, stable=True)
            sizes = jnp.bincount(key, length=el + 1)[:el].astype(jnp.int32)
            ys = _ffn(module, jnp.take(x, order // k, axis=0), sizes, kernels, mlp=())
            ys = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True).reshape(n, k, -1)
            y = jnp.sum(ys * weights.astype(ys.dtype)[..., None], axis=1)
            return jax.lax.psum(y, (EXPERT_AXIS, *plan.mlp))
        order = jnp.argsort(flat, stable=True)  # this chip's slots by expert, so by destination chip
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)  # [E]
        xs = jnp.take(x, order // k, axis=0)
        counts = jax.lax.all_gather(sizes, EXPERT_AXIS).reshape(s, s, el)  # [sender, destination, local expert]
        per_pair = jnp.sum(counts, axis=-1)  # [sender, destination] slots
        send = per_pair[me]
        recv = per_pair[:, me]
        rows = s * n * k  # the worst case: every chip's slots to this one
        out_at = _exclusive_cumsum(per_pair, axis=0)[me]  # where each destination writes my rows: after lower senders'
        got = _ragged_exchange(xs, jnp.zeros((rows, x.shape[-1]), xs.dtype), _exclusive_cumsum(send), send,
                               out_at, recv)
        # what came is by sender, then local expert: each row's local expert, padding (past the total) last
        mine = counts[:, me].reshape(-1)  # [sender x local expert] rows, in arrival order
        ends = jnp.cumsum(mine)
        seg = jnp.searchsorted(ends, jnp.arange(rows), side="right")
        key = jnp.where(seg < s * el, seg % el, el)
        lorder = jnp.argsort(key, stable=True)
        ys = _ffn(module, jnp.take(got, lorder, axis=0), jnp.sum(counts[:, me], axis=0), kernels, plan.mlp)
        ys = jnp.zeros_like(ys).at[lorder].set(ys, unique_indices=True)  # back in arrival order
        back = _ragged_exchange(ys, jnp.zeros((n * k, ys.shape[-1]), ys.dtype), _exclusive_cumsum(recv), recv,
                                _exclusive_cumsum(per_pair, axis=1)[:, me], send)
        ys = jnp.zeros_like(back).at[order].set(back, unique_indices=True).reshape(n, k, -1)
        return jnp.sum(ys * weights.astype(ys.dtype)[..., None], axis=1)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(tok, None), P(tok, None), P(tok, None), specs),
                       out_specs=P(tok, None), check_vma=False)
    return fn(x, experts, weights, values).astype(out_dtype)


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
