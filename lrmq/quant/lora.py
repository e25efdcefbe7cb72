"""LoRA adapters on the linear seam (QLoRA: frozen packed base + trainable `nnx.LoRAParam`s).

`LoRA(in, out, rank, alpha, dropout)`: `a` [in, r] (peft init: kaiming-uniform with a=sqrt(5), i.e.
U(-1/sqrt(in), 1/sqrt(in))), `b` [r, out] zeros; `lora(x) = dropout(x) @ a @ b * alpha / r`.
Logical axes: `a` (kernel in-axis, "lora_rank"), `b` ("lora_rank", kernel out-axis); "lora_rank" is
replicated (lrmq.sharding.RULES).

**Dropout** (`mode`):
* ``"train"`` (default): dropout is applied only in *differentiated* forwards. `x @ a` is a
  `custom_vjp` (`lora_down`) whose primal (what plain evaluation runs) has no dropout and whose forward
  rule (what `jax.grad` runs whenever the adapter `a` is differentiated) drops `x`. So rollouts, evaluation, log-prob recomputation and the KL reference are deterministic
  with no dropout, while the jitted GRPO update trains with dropout, from one graphdef and with no
  flag to flip (the trainer merges the same graph for both).
* ``"off"``: never; ``"always"``: in every forward (tests).
The mask is a counter-based hash (`dropout_keep`): element i is kept when
`mix(mix(i ^ k1) ^ k2) >= rate * 2^32`, `mix` being murmur3's 32-bit finalizer and k1, k2 derived from the
seed, crc32(path without its layer index) and `hash(x)` (`lrmq.quant.qat.data_hash`). No RNG state needs
threading through the jitted step; the mask changes with every batch and micro-batch, is reproducible
on resume, and is the same bits on CPU, GPU and TPU. Not `jax.random.bernoulli`: its threefry over a
[tokens, hidden] activation made libtpu's backend crawl on v6e (the Qwen3-4B QLoRA step: 1741 s to
compile with threefry masks, 309 s with this hash; docs/tpu.md). `model.set_attributes`-style toggling
works too: `set_lora_dropout(model, m)`.
`ExpertLoRA(experts, in, out, ...)`: the same adapter stacked over a mixture-of-experts layer's experts, `a`
[E, in, r], `b` [E, r, out] (zeros), each expert's `a` drawn as `LoRA`'s; logical axes ("expert", in, "lora_rank")
and ("expert", "lora_rank", out). `ExpertLinear` calls it on its rows sorted by expert:
`lora(x, group_sizes) = ragged_dot(ragged_dot(dropout(x), a), b) * alpha / r`, the dropout rules as above
(`expert_lora_down`). `apply_lora` attaches one to every `ExpertLinear` the target regex selects (the router is
never selected).
Adapter files (peft names): `lrmq.checkpoint.peft`.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from lrmq.model.linear import ExpertLinear
from lrmq.quant.qat import data_hash, path_salt, select_targets
from lrmq.quant.transforms import (
    DEFAULT_TARGETS,
    iter_expert_linears,
    iter_linears,
    kernel_axes,
    restore_float_kernel,
)
from lrmq.sharding import LOGICAL_AXES_KEY, logical_to_spec

DROPOUT_MODES = ("train", "off", "always")


_M32 = 0xFFFFFFFF


def _mix32(v):
    """murmur3's fmix32: a bijection on uint32 whose every output bit depends on every input bit."""
    v = v ^ (v >> 16)
    v = v * jnp.uint32(0x85EBCA6B)
    v = v ^ (v >> 13)
    v = v * jnp.uint32(0xC2B2AE35)
    return v ^ (v >> 16)


def _flat_index(shape) -> jax.Array:
    """Row-major element index as uint32 (wraps past 2^32 elements: the stream then repeats)."""
    idx, stride = jnp.zeros(shape, jnp.uint32), 1
    for d in reversed(range(len(shape))):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride & _M32)
        stride *= shape[d]
    return idx


def dropout_keep(x, rate: float, seed: int, salt: int) -> jax.Array:
    """Boolean keep-mask of x's shape, each element kept with probability 1 - rate, from a counter-based
    hash of (seed, salt, the bits of x, element index): a few integer ops per element that XLA fuses
    into the consumer (see the module docstring for why not threefry)."""
    k = jnp.uint32(((seed * 0x9E3779B1) ^ (salt * 0x85EBCA77)) & _M32)
    k1 = _mix32(data_hash(x) ^ k)
    k2 = _mix32(k1 ^ jnp.uint32(0x27D4EB2F))
    bits = _mix32(_mix32(_flat_index(x.shape) ^ k1) ^ k2)
    return bits >= jnp.uint32(min(round(rate * 2.0 ** 32), _M32))


def _drop(x, rate: float, seed: int, salt: int):
    keep = dropout_keep(x, rate, seed, salt)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x)).astype(x.dtype), keep


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def lora_down(x, a, rate: float, seed: int, salt: int):
    """x @ a, with dropout on x only in differentiated forwards (a is the trainable adapter, so every
    GRPO update differentiates it, whether or not x itself depends on trainable parameters)."""
    return x @ a  # plain evaluation (rollouts, eval, reference): no dropout


def _down_fwd(x, a, rate, seed, salt):
    xd, keep = _drop(x, rate, seed, salt)
    return xd @ a, (xd, a, keep)


def _down_bwd(rate, seed, salt, res, g):
    xd, a, keep = res
    da = jnp.einsum("...k,...r->kr", xd, g, preferred_element_type=jnp.float32).astype(a.dtype)
    dxd = g @ a.T
    dx = jnp.where(keep, dxd / (1.0 - rate), jnp.zeros_like(dxd)).astype(xd.dtype)
    return dx, da


lora_down.defvjp(_down_fwd, _down_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def expert_lora_down(x, a, group_sizes, rate: float, seed: int, salt: int):
    """ragged_dot(x, a) over rows sorted by expert (`a` [E, in, r]), with dropout on x only in differentiated
    forwards, as `lora_down`."""
    return jax.lax.ragged_dot(x, a, group_sizes)


def _edown_fwd(x, a, group_sizes, rate, seed, salt):
    xd, keep = _drop(x, rate, seed, salt)
    return jax.lax.ragged_dot(xd, a, group_sizes), (xd, a, group_sizes, keep)


def _edown_bwd(rate, seed, salt, res, g):
    xd, a, group_sizes, keep = res
    _, vjp = jax.vjp(lambda xd, a: jax.lax.ragged_dot(xd, a, group_sizes), xd, a)
    dxd, da = vjp(g)
    dx = jnp.where(keep, dxd / (1.0 - rate), jnp.zeros_like(dxd)).astype(xd.dtype)
    return dx, da, None


expert_lora_down.defvjp(_edown_fwd, _edown_bwd)


def _check_lora(rank: int, dropout: float, mode: str) -> None:
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
    if mode not in DROPOUT_MODES:
        raise ValueError(f"LoRA dropout mode {mode!r}; known: {list(DROPOUT_MODES)}")


class LoRA(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, rank: int = 8, alpha: float = 16.0,
                 dropout: float = 0.0, rngs: nnx.Rngs, axes=(None, None), param_dtype=jnp.float32,
                 mode: str = "train", seed: int = 0, salt: int = 0):
        _check_lora(rank, dropout, mode)
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on torch's [r, in] lora_A
        a = jax.random.uniform(rngs.params(), (in_features, rank), jnp.float32, -bound, bound).astype(param_dtype)
        self.a = nnx.LoRAParam(a, **{LOGICAL_AXES_KEY: (axes[0], "lora_rank")})
        self.b = nnx.LoRAParam(jnp.zeros((rank, out_features), param_dtype), **{LOGICAL_AXES_KEY: ("lora_rank", axes[1])})
        self.rank, self.alpha, self.rate = int(rank), float(alpha), float(dropout)
        self.mode, self.seed, self.salt = mode, int(seed), int(salt)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def __call__(self, x):
        a, b = self.a[...].astype(x.dtype), self.b[...].astype(x.dtype)
        if self.rate > 0.0 and self.mode == "train":
            h = lora_down(x, a, self.rate, self.seed, self.salt)
        elif self.rate > 0.0 and self.mode == "always":
            h = _drop(x, self.rate, self.seed, self.salt)[0] @ a
        else:
            h = x @ a
        return (h @ b) * jnp.asarray(self.scale, x.dtype)

    def delta(self) -> jax.Array:
        """scale * a @ b, the [in, out] weight update (float32)."""
        return self.scale * (self.a[...].astype(jnp.float32) @ self.b[...].astype(jnp.float32))


class ExpertLoRA(nnx.Module):
    """`LoRA` stacked over `num_experts` experts (module docstring): `__call__(x, group_sizes)` on rows sorted by
    expert, `delta()` the [E, in, out] update."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, rank: int = 8, alpha: float = 16.0,
                 dropout: float = 0.0, rngs: nnx.Rngs, axes=("expert", None, None), param_dtype=jnp.float32,
                 mode: str = "train", seed: int = 0, salt: int = 0):
        _check_lora(rank, dropout, mode)
        bound = 1.0 / math.sqrt(in_features)  # LoRA's init, per expert
        a = jax.random.uniform(rngs.params(), (num_experts, in_features, rank), jnp.float32, -bound, bound)
        self.a = nnx.LoRAParam(a.astype(param_dtype), **{LOGICAL_AXES_KEY: (axes[0], axes[1], "lora_rank")})
        self.b = nnx.LoRAParam(jnp.zeros((num_experts, rank, out_features), param_dtype),
                               **{LOGICAL_AXES_KEY: (axes[0], "lora_rank", axes[2])})
        self.rank, self.alpha, self.rate = int(rank), float(alpha), float(dropout)
        self.mode, self.seed, self.salt = mode, int(seed), int(salt)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def __call__(self, x, group_sizes, factors=None):
        """`factors`: (a, b) to use instead of the parameters' values (an expert-parallel shard_map's local experts'
        shares, `lrmq.model.moe`)."""
        a, b = (self.a[...], self.b[...]) if factors is None else factors
        a, b = a.astype(x.dtype), b.astype(x.dtype)
        if self.rate > 0.0 and self.mode == "train":
            h = expert_lora_down(x, a, group_sizes, self.rate, self.seed, self.salt)
        elif self.rate > 0.0 and self.mode == "always":
            h = jax.lax.ragged_dot(_drop(x, self.rate, self.seed, self.salt)[0], a, group_sizes)
        else:
            h = jax.lax.ragged_dot(x, a, group_sizes)
        return jax.lax.ragged_dot(h, b, group_sizes) * jnp.asarray(self.scale, x.dtype)

    def delta(self) -> jax.Array:
        """scale * a[e] @ b[e] for every expert e: the [E, in, out] weight update (float32)."""
        return self.scale * jnp.einsum("eir,ero->eio", self.a[...].astype(jnp.float32),
                                       self.b[...].astype(jnp.float32))


def apply_lora(model, pattern: str = DEFAULT_TARGETS, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               rngs: nnx.Rngs | None = None, *, seed: int = 0, mesh=None, mode: str = "train") -> list[str]:
    """Attach a LoRA adapter to every targeted Linear, and an `ExpertLoRA` to every targeted mixture-of-experts
    `ExpertLinear` (in place); returns the paths. With `mesh`, the adapters are placed by their logical axes."""
    rngs = rngs if rngs is not None else nnx.Rngs(seed)
    touched = []
    linears, experts = select_targets(model, pattern, "apply_lora")
    for path, lin in linears + experts:
        if lin.lora is not None:
            raise ValueError(f"apply_lora: {path} already has an adapter")
        pdt = _param_dtype(model)
        kw = dict(rank=rank, alpha=alpha, dropout=dropout, rngs=rngs, axes=kernel_axes(lin), param_dtype=pdt,
                  mode=mode, seed=seed, salt=path_salt(path))
        lora = (ExpertLoRA(lin.num_experts, lin.in_features, lin.out_features, **kw) if isinstance(lin, ExpertLinear)
                else LoRA(lin.in_features, lin.out_features, **kw))
        if mesh is not None:
            _place(lora, mesh)
        lin.lora = nnx.data(lora)
        touched.append(path)
    return touched


def _param_dtype(model):
    cfg = getattr(model, "cfg", None)
    return jnp.dtype(cfg.param_dtype) if cfg is not None else jnp.float32


def _place(module, mesh):
    for var in (module.a, module.b):
        spec = logical_to_spec(var.get_metadata()[LOGICAL_AXES_KEY], var.get_value().shape, mesh)
        var.set_value(jax.device_put(var.get_value(), jax.sharding.NamedSharding(mesh, spec)))


def set_lora_dropout(model, mode: str) -> None:
    if mode not in DROPOUT_MODES:
        raise ValueError(f"LoRA dropout mode {mode!r}; known: {list(DROPOUT_MODES)}")
    for _, lin in lora_linears(model):
        lin.lora.mode = mode


def lora_linears(model) -> list[tuple[str, object]]:
    """[(path, module)] of every adapted Linear, then every adapted mixture-of-experts ExpertLinear."""
    return [(p, lin) for p, lin in iter_linears(model, None) + iter_expert_linears(model, None) if lin.lora is not None]


def merge_lora(model) -> list[str]:
    """W <- W + scale * a @ b for every adapted Linear (per expert for an ExpertLinear), then drop the adapter (in
    place).

    A packed base is dequantized first: the merged kernel is always a float `nnx.Param` (param dtype),
    keeping the kernel's logical axes and (when sharded) its sharding."""
    merged = []
    for path, lin in lora_linears(model):
        w = lin.float_weight().astype(jnp.float32) + lin.lora.delta()
        restore_float_kernel(model, lin, w)
        lin.lora = None
        merged.append(path)
    return merged
