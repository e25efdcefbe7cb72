"""`qmatmul(x, qw)`: activations times a packed `QuantizedWeight`, differentiable w.r.t. `x` only.

Dispatch (docs/DESIGN.md "Kernels"):

* int4 (`fmt="int"`, bits 4)          -> `pallas_kernels.int4_matmul(x, codes, scales, zeros, group_size)`
* 8-bit (`fmt="int"`, bits 8)         -> `pallas_kernels.int8_matmul(x, codes, scales, zeros)`
* NF4 (`fmt="nf4"`, K % block == 0)   -> `pallas_kernels.nf4_matmul(x, codes, absmax, block_size)`; the
  absmax is `qw.scales`, already dequantized from the double-quant state at quantization time
* anything else (int 2/3/5/6/7 bits, NF4 whose blocks straddle rows) -> dequantize in XLA, then dot,
  with the weight behind `stop_gradient` (the packed base is frozen).

Each kernel picks TPU / GPU / XLA by the compile *target* (`pallas_kernels.current_target`: the mesh
in effect, else the default backend); on CPU they run the XLA reference path.

Sharded programs: XLA cannot partition a Mosaic / Triton custom call ("Mosaic kernels cannot be
automatically partitioned"). When a kernel (not the XLA path) is chosen and a mesh with more than one
device is in effect, the call is wrapped in `jax.shard_map` (`kernel_specs`): the activation's leading
(batch) dim stays sharded over the mesh's batch axes (replicated when it does not divide), the weight
is gathered over its FSDP storage axes (XLA inserts the all-gather), stays split over the tensor axis
on N (column-parallel) or on K (row-parallel, partial outputs `psum`-ed). The custom_vjp backward runs
inside the same shard_map, so it is partitioned the same way. Which axes are "batch" and how the weight
is laid out come from the logical rules in effect (`sharding.use_rules`): training's `RULES`, or the
generation engine's `DECODE_RULES`, under which a weight split over (tensor, fsdp) stays split and no
weight crosses the interconnect per decoded token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from lrmq.quant.formats import PACKINGS, Packing, array_axes, dequantize, packing_of
from lrmq.quant.qweight import QuantizedWeight
from lrmq.sharding import (axes_size, dividing_axes, entry_axes, is_manual, logical_to_spec, rules_in_effect,
                           spec_entry)


def _dequant_dot(x, qw: QuantizedWeight):
    w = jax.lax.stop_gradient(dequantize(qw)).astype(x.dtype)
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def qmatmul_path(qw: QuantizedWeight) -> str:
    """Which path `qmatmul` takes for this weight: a `PACKINGS` name ('int4' | 'int8' | 'nf4') or
    'dequant'."""
    p = packing_of(qw)
    return p.name if p is not None else "dequant"


# ------------------------------------------------------------------------------------ partitioning
@dataclasses.dataclass(frozen=True)
class KernelSpecs:
    """shard_map specs of one kernel call: x, the kernel arrays, the output, and the axes the
    partial outputs are summed over (row-parallel)."""

    x: P
    arrays: tuple
    out: P
    psum: tuple


def _batch_axes(mesh, lead: int | None, rules: dict) -> tuple:
    """Mesh axes the activation's leading dim is split over: the `batch` rule's axes, dropping
    trailing ones until the size divides (decode batches smaller than the mesh: replicated)."""
    return () if lead is None else dividing_axes(mesh, entry_axes(rules.get("batch")), lead)


def _weight_axes(qw: QuantizedWeight, packing: Packing, axes, mesh, rules: dict) -> tuple[tuple, tuple]:
    """(K mesh axes, N mesh axes) the kernel keeps the weight split over: the weight's logical
    sharding under `rules` minus the batch axes (training's FSDP storage axes, gathered per call;
    the decode rules split the batch over `data` only, so a tensor-parallel weight stays split);
    K only when every K-shaped array (codes, group scales) splits evenly, so each shard holds
    whole groups."""
    if axes is None or len(axes) != 2:
        return (), ()
    batch = set(entry_axes(rules.get("batch")))
    spec = tuple(logical_to_spec(tuple(axes), (qw.K, qw.N), mesh, rules)) + (None, None)
    k_ax, n_ax = (tuple(a for a in entry_axes(s) if a not in batch) for s in spec[:2])
    if n_ax and qw.N % axes_size(mesh, n_ax):
        n_ax = ()
    if k_ax:
        t = axes_size(mesh, k_ax)
        unit, groups = packing.k_split(qw)
        if qw.K % (t * unit) or (groups > 1 and groups % t):
            k_ax = ()
    return k_ax, n_ax


def kernel_specs(x_shape: tuple, qw: QuantizedWeight, packing: Packing | str, axes,
                 mesh, rules: dict | None = None) -> KernelSpecs:
    """Partition specs for running the kernel on `mesh` (see the module docstring). `rules`: the
    logical-axis rules the weights are laid out by (default: those in effect, `sharding.use_rules`)."""
    packing = PACKINGS.get(packing) if isinstance(packing, str) else packing
    rules = rules if rules is not None else rules_in_effect()
    k_ax, n_ax = _weight_axes(qw, packing, axes, mesh, rules)
    batch = _batch_axes(mesh, x_shape[0] if len(x_shape) > 1 else None, rules)
    mid = [None] * max(len(x_shape) - 2, 0)
    lead = [spec_entry(batch)] if len(x_shape) > 1 else []
    k, n = spec_entry(k_ax), spec_entry(n_ax)
    return KernelSpecs(P(*lead, *mid, k), packing.specs(k, n, qw), P(*lead, *mid, n), k_ax)


def _sharded_call(packing: Packing, qw, impl, x, operands, axes, mesh, target):
    specs = kernel_specs(x.shape, qw, packing, axes, mesh)

    def body(x_local, *local):
        with pk.target(target.platform, target.device_kind):  # the manual sub-mesh says less
            y = packing.call(x_local, *local, qw=qw, impl=impl)
        return jax.lax.psum(y, specs.psum) if specs.psum else y

    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs.x, *specs.arrays), out_specs=specs.out,
                       check_vma=False)
    return fn(x, *operands)


def qmatmul(x: jax.Array, qw: QuantizedWeight, *, impl: str = "auto", axes=None) -> jax.Array:
    """y[..., N] = x[..., K] @ dequantize(qw)[K, N]; gradient w.r.t. x only.

    `axes`: the weight's logical (in, out) axes (the Linear's kernel metadata); with a kernel
    target and a multi-device mesh in effect they decide how the kernel call is partitioned."""
    if qw.num_experts is not None:
        raise ValueError(f"qmatmul takes a [K, N] weight, got stacked experts of shape {qw.shape} (qragged_dot)")
    if x.shape[-1] != qw.K:
        raise ValueError(f"qmatmul: x has {x.shape[-1]} features, the weight expects K={qw.K} (shape {qw.shape})")
    packing = packing_of(qw)
    if packing is None:
        return _dequant_dot(x, qw).astype(x.dtype)
    operands = packing.operands(qw)
    impl_r, _ = pk.resolve_impl(impl)
    mesh = pk.mesh_in_effect()
    if impl_r == "xla" or mesh is None or mesh.size == 1 or is_manual(mesh):
        y = packing.call(x, *operands, qw=qw, impl=impl)
    else:
        y = _sharded_call(packing, qw, impl, x, operands, axes, mesh, pk.current_target())
    return y.astype(x.dtype)


# ------------------------------------------------------------------------------ stacked experts
def _dequant_ragged_dot(x, qw: QuantizedWeight, group_sizes):
    w = jax.lax.stop_gradient(dequantize(qw)).astype(x.dtype)
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def qragged_dot(x: jax.Array, qw: QuantizedWeight, group_sizes: jax.Array, *, impl: str = "auto",
                axes=None) -> jax.Array:
    """The grouped matmul of a mixture-of-experts layer with packed experts: x [M, K], rows sorted by expert
    (`group_sizes` [E]: rows of expert 0 first, then 1, ...; rows past their sum give 0) times a stacked-experts
    `qw` (shape (E, K, N)) -> [M, N], `jax.lax.ragged_dot(x, dequantize(qw), group_sizes)`; gradient w.r.t. x only.

    On a TPU target (`pallas_kernels.current_target`, as `qmatmul`) int4 and int8 experts run the grouped Pallas
    kernel (`pallas_kernels.grouped_int4_matmul` / `grouped_int8_matmul`: each expert's tile dequantized in VMEM);
    everywhere else, for other formats, and under a multi-device mesh outside a shard_map (the kernel cannot be
    partitioned automatically; the expert-parallel `shard_map` of `lrmq.model.moe` calls it per chip), the XLA path:
    every expert dequantized, then `jax.lax.ragged_dot`. `impl` forces one as `qmatmul`'s ("tpu" off a TPU:
    interpret mode)."""
    if qw.num_experts is None:
        raise ValueError(f"qragged_dot takes a stacked-experts weight of shape (E, K, N), got shape {qw.shape}")
    if x.ndim != 2 or x.shape[-1] != qw.K:
        raise ValueError(f"qragged_dot: x must be [M, K={qw.K}] (weight shape {qw.shape}), got {tuple(x.shape)}")
    if tuple(group_sizes.shape) != (qw.num_experts,):
        raise ValueError(f"qragged_dot: group_sizes must be [{qw.num_experts}] (one per expert), got "
                         f"{tuple(group_sizes.shape)}")
    packing = packing_of(qw)
    if packing is None or packing.grouped_call is None:
        return _dequant_ragged_dot(x, qw, group_sizes)
    impl_r, _ = pk.resolve_impl(impl)
    mesh = pk.mesh_in_effect()
    if impl_r != "tpu" or (mesh is not None and mesh.size > 1 and not is_manual(mesh)):
        return _dequant_ragged_dot(x, qw, group_sizes)
    return packing.grouped_call(x, group_sizes, *packing.operands(qw), qw=qw, impl=impl).astype(x.dtype)


def qragged_dot_path(qw: QuantizedWeight, impl: str = "auto") -> str:
    """Which path `qragged_dot` takes for a stacked-experts weight traced now (outside a multi-device mesh): the
    grouped kernel's packing name ('int4' | 'int8') on a TPU target, else 'dequant'."""
    packing = packing_of(qw)
    if packing is None or packing.grouped_call is None or pk.resolve_impl(impl)[0] != "tpu":
        return "dequant"
    return packing.name


def expert_shard(qw: QuantizedWeight, axes, mesh, expert: str, mlp: tuple):
    """How an expert-parallel `shard_map` (`lrmq.model.moe`) takes a stacked-experts `qw`: (in_specs, a pytree of
    `PartitionSpec`s shaped like `qw`; the local weight's shape) with every array's leading expert dim over the mesh
    axis `expert` (E / S experts a chip) and the dims of logical axis "mlp" (`axes`: the kernel's logical
    (expert, in, out) axes) over the `mlp` mesh axes, or None where that `mlp` split would not leave each chip whole
    quantization groups: only int4 / int8 codes split there (N: any split dividing it; K: whole groups a chip, as
    `kernel_specs`); other formats (NF4's flat blocks, 2/3/5-7-bit codes) split on the expert axis only, so the
    caller gathers their hidden dim (`mlp=()`)."""
    if qw.num_experts is None:
        raise ValueError(f"expert_shard takes a stacked-experts weight of shape (E, K, N), got shape {qw.shape}")
    axes = tuple(axes) if axes is not None else ("expert", None, None)
    t = axes_size(mesh, mlp) if mlp else 1
    shape = [qw.num_experts // mesh.shape[expert], qw.K, qw.N]
    for i, name in ((1, axes[1]), (2, axes[2])):
        if name != "mlp" or t == 1:
            continue
        packing = packing_of(qw)
        if qw.fmt != "int" or packing is None or shape[i] % t:
            return None
        if i == 1:
            unit, groups = packing.k_split(qw)
            if qw.K % (t * unit) or groups % t:
                return None
        shape[i] //= t
    entry = {"expert": expert, "mlp": spec_entry(mlp) if t > 1 else None}
    logical = array_axes(qw, axes)
    for name, a in qw.arrays().items():  # every split dim divides (a per-channel [1, N] scale row does not)
        if any(n == "mlp" and t > 1 and d % t for n, d in zip(getattr(logical, name), a.shape)):
            return None
    specs = jax.tree.map(lambda a: P(*(entry.get(n) for n in a)), logical,
                         is_leaf=lambda a: isinstance(a, tuple))
    return specs, tuple(shape)


def local_expert_weight(qw: QuantizedWeight, shape: tuple) -> QuantizedWeight:
    """The per-chip view, inside an expert-parallel `shard_map`, of a stacked-experts weight split by `expert_shard`
    (its arrays already the local shards): the same weight with the local `shape`."""
    return qw.replace(shape=tuple(shape))
