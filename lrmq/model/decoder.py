"""The one decoder shared by Qwen3, Qwen3-MoE, Qwen2/2.5, Llama 3.x and Olmo-3 (differences live in ModelConfig)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from lrmq.model.attention import attention
from lrmq.model.config import ModelConfig
from lrmq.model.linear import Linear
from lrmq.model.moe import MoE
from lrmq.model.params import param
from lrmq.model.rope import apply_rope, inv_frequencies, rope_cos_sin
from lrmq.sharding import constrain_batch

# Rematerialisation policies for training (`Decoder.hidden(..., remat=)`): what each layer keeps for
# the backward pass. "full" keeps only the layer's input; "dots" also keeps matmul outputs.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, scale_in_f32: bool, param_dtype):
        self.scale = param(jnp.ones((dim,), param_dtype), (None,))
        self.eps = eps
        self.scale_in_f32 = scale_in_f32  # Olmo multiplies before casting back; Llama/Qwen after

    def __call__(self, x):
        dtype = x.dtype
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        if self.scale_in_f32:
            return (self.scale[...].astype(jnp.float32) * h).astype(dtype)
        return self.scale[...].astype(dtype) * h.astype(dtype)


def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, scale_in_f32=cfg.family == "olmo3", param_dtype=jnp.dtype(cfg.param_dtype))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, rngs: nnx.Rngs):
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        d = cfg.hidden_size
        lin = lambda i, o, bias, axes: Linear(i, o, use_bias=bias, axes=axes, dtype=dt, param_dtype=pdt, rngs=rngs)
        self.q_proj = lin(d, cfg.q_size, cfg.qkv_bias, ("embed", "heads"))
        self.k_proj = lin(d, cfg.kv_size, cfg.qkv_bias, ("embed", "kv_heads"))
        self.v_proj = lin(d, cfg.kv_size, cfg.qkv_bias, ("embed", "kv_heads"))
        self.o_proj = lin(cfg.q_size, d, cfg.o_bias, ("heads", "embed"))
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = _norm(cfg, cfg.head_dim), _norm(cfg, cfg.head_dim)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = _norm(cfg, cfg.q_size), _norm(cfg, cfg.kv_size)
        else:
            self.q_norm = self.k_norm = None
        self.qk_norm = cfg.qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window if layer_type == "sliding_attention" else None
        inv, scale = inv_frequencies(cfg.rope[layer_type], cfg.head_dim)
        self.inv_freq = tuple(float(v) for v in inv)  # static python data, not a parameter
        self.rope_scale = scale

    def __call__(self, x, positions, cache=None, segments=None):
        """cache: None (training / scoring) or a paged cache (`lrmq.generation.paged.PagedCache`): this
        forward's keys and values are written to it; a decoding cache also answers the attention."""
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(positions, np.asarray(self.inv_freq, np.float32), self.rope_scale, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        if cache is not None:
            cache = cache.write(k, v, positions)
            if cache.decoding:
                return self.o_proj(cache.attend(q, positions, self.window).reshape(b, t, -1)), cache
        # training, scoring and prefill: the keys are this forward's own
        out = attention(q, k, v, positions, positions, self.window, segments=segments)  # blockwise, no [T, S] scores
        return self.o_proj(out.reshape(b, t, -1)), cache


def attend(q, k, v, q_pos, k_pos, window, *, kv_heads_first: bool = False, segments=None):
    """Grouped-query attention with masks from positions (-1 = padding/empty slot).

    q [B, T, H, D], k/v [B, S, KVH, D] ([B, KVH, S, D] with kv_heads_first, the KV-cache layout),
    q_pos [B, T], k_pos [B, S]. Causality and sliding windows are decided by positions, so left-padded
    prompts, caches and training batches share one code path. `segments` [B, T] (self-attention only):
    several sequences packed in one row, each with its own positions; a token sees its own segment only.
    """
    b, t, h, d = q.shape
    kvh = k.shape[1] if kv_heads_first else k.shape[2]
    g = h // kvh
    kv = "bksd" if kv_heads_first else "bskd"
    qg = q.reshape(b, t, kvh, g, d)
    scores = jnp.einsum(f"btkgd,{kv}->bkgts", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    allowed = (kp >= 0) & (kp <= qp)
    if segments is not None:
        allowed &= segments[:, :, None] == segments[:, None, :]
    if window is not None:
        allowed &= (qp - kp) < window
    scores = jnp.where(allowed[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum(f"bkgts,{kv}->btkgd", probs, v)
    return out.reshape(b, t, h, d)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        d, f = cfg.hidden_size, cfg.intermediate_size
        lin = lambda i, o, axes: Linear(i, o, use_bias=cfg.mlp_bias, axes=axes, dtype=dt, param_dtype=pdt, rngs=rngs)
        self.gate_proj = lin(d, f, ("embed", "mlp"))
        self.up_proj = lin(d, f, ("embed", "mlp"))
        self.down_proj = lin(f, d, ("mlp", "embed"))

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """One layer; `moe`: its feed-forward block is the mixture of experts (`lrmq.model.moe.MoE`; the layers
    `ModelConfig.is_moe_layer` names), else the dense MLP."""

    def __init__(self, cfg: ModelConfig, layer_type: str, rngs: nnx.Rngs, *, moe: bool = False):
        self.post_norm = cfg.norm_placement == "post"
        self.attn = Attention(cfg, layer_type, rngs)
        self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, rngs)
        if self.post_norm:  # Olmo: x + norm(f(x))
            self.attn_out_norm = _norm(cfg, cfg.hidden_size)
            self.mlp_out_norm = _norm(cfg, cfg.hidden_size)
        else:  # Llama/Qwen: x + f(norm(x))
            self.attn_norm = _norm(cfg, cfg.hidden_size)
            self.mlp_norm = _norm(cfg, cfg.hidden_size)

    def __call__(self, x, positions, cache=None, segments=None):
        return self.routed(x, positions, cache, segments)[:2]

    def routed(self, x, positions, cache=None, segments=None, experts=None):
        """(output, cache, `Routing` of a sparse layer's router or None for a dense layer). `experts` [B, T, k]:
        a sparse layer runs these experts (routing replay) instead of its router's top-k."""
        ff = self.mlp if isinstance(self.mlp, MLP) else (
            lambda h: self.mlp.routed(h, positions >= 0, experts))
        if self.post_norm:
            a, cache = self.attn(x, positions, cache, segments)
            x = x + self.attn_out_norm(a)
            y, routing = _split_routing(ff(x))
            return x + self.mlp_out_norm(y), cache, routing
        a, cache = self.attn(self.attn_norm(x), positions, cache, segments)
        x = x + a
        y, routing = _split_routing(ff(self.mlp_norm(x)))
        return x + y, cache, routing


def _split_routing(out):
    """A feed-forward block's output as (y, Routing or None): the dense MLP returns y alone."""
    return out if isinstance(out, tuple) else (out, None)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, param_dtype, rngs: nnx.Rngs):
        self.embedding = param(0.02 * jax.random.normal(rngs.params(), (vocab, dim), param_dtype), ("vocab", "embed"))


class Decoder(nnx.Module):
    """Causal LM. `__call__(tokens, positions)` -> logits and `hidden` for training and scoring forwards;
    `hidden_runs` for prefill and decoding with a paged cache (`lrmq.generation.engine`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, pdt, rngs)
        self.layers = nnx.List([DecoderLayer(cfg, cfg.layer_types[i], rngs, moe=cfg.is_moe_layer(i))
                                for i in range(cfg.num_layers)])
        self.final_norm = _norm(cfg, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, axes=("embed", "vocab"),
                                  dtype=dt, param_dtype=pdt, rngs=rngs)

    def hidden(self, tokens, positions, *, remat: str = "none", scan: bool = False, segments=None, experts=None):
        """Final-norm hidden states [B, T, D] of a forward without a cache, and what its routers did: the sparse
        layers' `Routing` stacked on a leading axis (`ModelConfig.moe_layers`' order), None for a dense model.
        Prefill and decoding with a paged cache go through `hidden_runs`, which takes none of these training
        options.

        experts: [B, T, sparse layers, k] (routing replay): each sparse layer runs these experts, not its
        router's top-k (`lrmq.model.moe.replayed_weights`); None = route.

        remat: "none" | "full" | "dots" (REMAT_POLICIES): recompute each layer in the backward pass
        instead of keeping its activations.
        scan: run runs of identical layers as one `lax.scan` over their stacked states: the program holds one
        layer body instead of num_layers copies, so deep models compile in a fraction of the time, for one
        transient copy of the stacked weights.
        segments: [B, T] ids of sequences packed into one row (see `attend`)."""
        x = self.embed_tokens(tokens)
        policy = REMAT_POLICIES[remat] if remat != "none" else None
        replay = _layer_major(experts)
        if scan:
            x, routings = _scan_layers(list(self.layers), x, positions, policy, segments, replay,
                                       self.cfg.moe_layers)
            return self.final_norm(x), _stack_routing(routings)
        run = _remat_layer(policy) if policy is not None else None
        routings, sparse = [], 0
        for layer in self.layers:
            given = None
            if replay is not None and not isinstance(layer.mlp, MLP):
                given, sparse = replay[sparse], sparse + 1
            if run is not None:
                x, routing = run(layer, x, positions, segments, given)
            else:
                x, _, routing = layer.routed(x, positions, None, segments, given)
            x = constrain_batch(x)
            routings.append(routing)
        return self.final_norm(x), _stack_routing(routings)

    def hidden_runs(self, runs, tokens, positions, cache):
        """(final-norm hidden states, the updated cache, the experts each token ran) of a forward with a paged
        cache (`lrmq.generation.paged.PagedCache`: prefill writes it, decoding also attends through it) over layers
        already stacked by `layer_runs` (a decode loop stacks, and lays out, its weights once, outside the loop),
        each run a `lax.scan`. The experts: [sparse layers, B, T, k] int32 (`ModelConfig.moe_layers`' order), None
        for a dense model; a program that does not return them computes nothing for them."""
        x = self.embed_tokens(tokens)
        experts = []
        for run in runs:
            def body(carry, xs, graphdef=run.graphdef):
                x, cache = carry
                state, index = xs
                y, cache, routing = nnx.merge(graphdef, state).routed(x, positions, cache.at_layer(index))
                return (constrain_batch(y), cache), (None if routing is None else routing.experts)

            (x, cache), chosen = jax.lax.scan(body, (x, cache), (run.state, run.start + jnp.arange(run.size)))
            if chosen is not None:
                experts.append(chosen)
        return self.final_norm(x), cache, (jnp.concatenate(experts) if experts else None)

    def embed_tokens(self, tokens):
        return constrain_batch(jnp.take(self.embed.embedding[...], tokens, axis=0).astype(jnp.dtype(self.cfg.dtype)))

    def logits(self, h):
        if self.lm_head is None:
            w = self.embed.embedding[...].astype(h.dtype)
            return jnp.einsum("btd,vd->btv", h, w)
        return self.lm_head(h)

    def __call__(self, tokens, positions=None):
        """Logits [B, T, V] (positions default to 0..T-1)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return self.logits(self.hidden(tokens, positions)[0])


def _layer_major(experts):
    """Replayed experts [B, T, sparse layers, k] -> [sparse layers, B, T, k] (None stays None)."""
    return None if experts is None else jnp.moveaxis(experts, 2, 0)


def _stack_routing(routings):
    """The sparse layers' `Routing`s (None for dense layers; runs of them stacked already) stacked on one leading
    axis, or None for a dense model."""
    parts = [jax.tree.map(lambda a: a[None], r) if r.load.ndim == 1 else r for r in routings if r is not None]
    if not parts:
        return None
    return jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


def _remat_layer(policy):
    """layer.routed(x, positions) under jax.checkpoint -> (output, Routing or None). Split/merge by hand rather
    than nnx.remat: the layer lives in an outer trace (the train step's grad), and the RNG counters its LoRA
    dropout advances must come back out, or every step would reuse one dropout mask."""

    def run(layer, x, positions, segments=None, experts=None):
        graphdef, state = nnx.split(layer)

        @functools.partial(jax.checkpoint, policy=policy)
        def pure(state, x, positions, segments, experts):
            inner = nnx.merge(graphdef, state)
            y, _, routing = inner.routed(x, positions, None, segments, experts)
            return y, routing, nnx.state(inner, nnx.RngState)

        y, routing, rng_state = pure(state, x, positions, segments, experts)
        nnx.update(layer, rng_state)
        return y, routing

    return run


@struct.dataclass
class LayerRun:
    """A maximal run of consecutive layers with equal graphdefs (same structure and static attributes:
    Olmo-3's sliding/full pattern and Qwen3-MoE's dense layers among sparse ones split runs), their states
    stacked on a leading axis."""

    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    state: nnx.State
    start: int = struct.field(pytree_node=False)
    size: int = struct.field(pytree_node=False)


def layer_runs(layers) -> list[LayerRun]:
    splits = [nnx.split(layer) for layer in layers]
    runs, i = [], 0
    while i < len(splits):
        j = i + 1
        while j < len(splits) and splits[j][0] == splits[i][0]:
            j += 1
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(state for _, state in splits[i:j]))
        runs.append(LayerRun(splits[i][0], stacked, i, j - i))
        i = j
    return runs


def _scan_layers(layers, x, positions, policy, segments=None, replay=None, moe_layers=()):
    """Apply `layers` in order, each run of `layer_runs` as one `lax.scan` over the run's stacked
    states; `policy` rematerialises each step like `_remat_layer`. `replay` [sparse layers, B, T, k]: the experts
    of the sparse layers (`moe_layers`: their indices). Returns (x, each run's stacked Routing or None)."""
    routings = []
    for run in layer_runs(layers):
        sparse = run.start in moe_layers  # a run's layers share a graphdef: all sparse or all dense
        given = None
        if replay is not None and sparse:
            first = moe_layers.index(run.start)
            given = replay[first:first + run.size]

        def body(x, xs, graphdef=run.graphdef):
            state, experts = xs
            inner = nnx.merge(graphdef, state)
            y, _, routing = inner.routed(x, positions, None, segments, experts)
            return constrain_batch(y), (nnx.state(inner, nnx.RngState), routing)

        if policy is not None:
            body = jax.checkpoint(body, policy=policy)
        x, (rng_states, routing) = jax.lax.scan(body, x, (run.state, given))
        routings.append(routing)
        for k, layer in enumerate(layers[run.start:run.start + run.size]):  # RNG counters advanced inside
            nnx.update(layer, jax.tree.map(lambda a, k=k: a[k], rng_states))
    return x, routings


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Positions for a (left- or right-) padded batch: cumulative count of real tokens - 1; padding -> -1."""
    mask = mask.astype(jnp.int32)
    return jnp.where(mask > 0, jnp.cumsum(mask, axis=-1) - 1, -1)
