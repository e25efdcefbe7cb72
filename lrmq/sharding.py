"""Meshes and logical-axis sharding rules.

Parameters are annotated with logical axes ("embed", "heads", "mlp", "vocab", ...) under the metadata key
`LOGICAL_AXES_KEY` (`lrmq.model.params.param` sets it); `RULES` maps each to mesh axes of a
(data, fsdp, tensor) mesh, with a fourth axis, `expert`, where MeshConfig.expert > 1 (expert parallelism: the
stacked expert kernels split over it by their leading "expert" dimension, the batch and every other weight's model
dimension split over it as over fsdp; `lrmq.model.moe.Experts` dispatches the tokens to their experts' chips with
an all-to-all). A mesh without it (expert = 1) is the (data, fsdp, tensor) mesh it always was. All mesh axes are
Auto, so XLA propagates activation shardings and AQT's dot_general (which cannot take `out_sharding`) works.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
# The expert-parallel mesh axis, after MESH_AXES (innermost: the all-to-all dispatch between nearest chips); only
# in a mesh whose MeshConfig.expert > 1, so code reading it asks `mesh.shape.get(EXPERT_AXIS, 1)`.
EXPERT_AXIS = "expert"
# The axes a batch's rows are split over (those the mesh has with > 1 device): data parallel, FSDP and expert
# parallel alike (an expert-parallel chip holds its own tokens and sends each to its expert's chip).
BATCH_AXES = ("data", "fsdp", EXPERT_AXIS)
# The nnx.Variable metadata key holding a parameter's logical axes. lrmq keeps its own key rather than flax's
# eager `sharding`, so models build outside a mesh and the annotation survives flax's renames across versions.
LOGICAL_AXES_KEY = "logical_axes"

# logical axis -> mesh axis (or None = replicated). One table, as the HF name map.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "embed": ("fsdp", EXPERT_AXIS),  # the expert axis shards the other weights as fsdp does (the experts: over E)
    "expert": EXPERT_AXIS,
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "lora_rank": None,
}


@dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = -1  # -1: all remaining devices
    tensor: int = 1
    expert: int = 1  # > 1: an EXPERT_AXIS of this size after the others (expert parallelism)


def mesh_axes(cfg: MeshConfig) -> tuple[str, ...]:
    """The axis names of `cfg`'s mesh: MESH_AXES, and EXPERT_AXIS when cfg.expert > 1."""
    return MESH_AXES + ((EXPERT_AXIS,) if cfg.expert > 1 else ())


def make_mesh(cfg: MeshConfig | tuple[int, ...] | None = None, devices=None) -> Mesh:
    """The mesh of `cfg` (a MeshConfig, or its fields as a tuple (data, fsdp, tensor[, expert])) over `devices`
    (default all): at most one axis -1 (the devices left), the product equal to the device count."""
    devices = devices if devices is not None else jax.devices()
    if cfg is None:
        cfg = MeshConfig()
    if isinstance(cfg, tuple):
        cfg = MeshConfig(*cfg)
    if cfg.expert < 1:
        raise ValueError(f"mesh expert={cfg.expert}: expected >= 1")
    names = mesh_axes(cfg)
    shape = [cfg.data, cfg.fsdp, cfg.tensor, cfg.expert][:len(names)]
    n = len(devices)
    if shape.count(-1) > 1:
        raise ValueError(f"mesh {shape}: at most one axis may be -1")
    if -1 in shape:
        rest = math.prod(s for s in shape if s != -1)
        if n % rest:
            raise ValueError(f"mesh {dict(zip(names, shape))} does not divide {n} devices")
        shape[shape.index(-1)] = n // rest
    if math.prod(shape) != n:
        raise ValueError(f"mesh {dict(zip(names, shape))} needs {math.prod(shape)} devices, have {n}")
    dev = np.asarray(devices).reshape(shape)
    return Mesh(dev, names, axis_types=(AxisType.Auto,) * len(names))


# The decode layout (the generation engine relays the weights into it once per device call, never per token):
# tensor parallel over "tensor" and "fsdp": attention heads, MLP columns and the vocabulary split, the model
# dimension whole; replicated over "data". Each chip reads 1/(tensor x fsdp) of the weights per decode step
# (FSDP shards gathered whole would have it read all of them), and its KV heads are the ones of its share of
# the paged KV pool (`lrmq.generation.kv_pool.kv_head_axes`). An axis that does not divide a dimension leaves
# that weight whole (`logical_to_spec`).
DECODE_TP = ("tensor", "fsdp")
DECODE_RULES = {**RULES, "batch": ("data",), "embed": None, "heads": DECODE_TP, "kv_heads": DECODE_TP,
                "mlp": DECODE_TP, "vocab": DECODE_TP}

# The rules a program is being traced under, for code that partitions by hand (`lrmq.quant.qmatmul` wraps the
# Pallas kernels, which XLA cannot partition, in a shard_map): the generation engine traces its programs under
# DECODE_RULES, everything else under RULES.
_RULES_IN_EFFECT: contextvars.ContextVar = contextvars.ContextVar("lrmq_rules", default=None)


@contextlib.contextmanager
def use_rules(rules):
    token = _RULES_IN_EFFECT.set(rules)
    try:
        yield
    finally:
        _RULES_IN_EFFECT.reset(token)


def rules_in_effect() -> dict:
    return _RULES_IN_EFFECT.get() or RULES


# ----------------------------------------------------------------------------- mesh axes of a PartitionSpec
# One helper per concept for code that partitions by hand (the paged cache, splash attention, the packed-weight
# kernels): a spec entry from its axes and back, the size of some axes, the axes that divide a dimension, and
# whether a program is already inside a shard_map.


def spec_entry(axes) -> str | tuple[str, ...] | None:
    """The PartitionSpec entry of a dimension split over `axes`: None (whole), one name, or the tuple of them."""
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of a PartitionSpec entry or a rule's target (None, a name, or names): `spec_entry` undone."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def axes_size(mesh, axes) -> int:
    """Devices along `axes` of `mesh` (1 for none; an axis the mesh does not have counts 1)."""
    return math.prod(mesh.shape.get(a, 1) for a in axes)


def dividing_axes(mesh, names, size: int, exclude=()) -> tuple[str, ...]:
    """The axes of `names` that `mesh` has with more than one device (those in `exclude` aside), trailing ones
    dropped until their product divides `size` (a decode batch smaller than the mesh: () = replicated)."""
    axes = tuple(a for a in names if a not in exclude and a in mesh.shape and mesh.shape[a] > 1)
    while axes and size % axes_size(mesh, axes):
        axes = axes[:-1]
    return axes


def is_manual(mesh) -> bool:
    """Whether some axis of `mesh` is Manual: the program is inside a shard_map already, the caller partitions."""
    manual = getattr(AxisType, "Manual", None)
    return any(t == manual for t in (getattr(mesh, "axis_types", ()) or ()))


def logical_to_spec(axes: tuple[str | None, ...] | None, shape: tuple[int, ...], mesh: Mesh, rules=None) -> P:
    """PartitionSpec for logical axes; an axis whose size the mesh axis does not divide stays replicated."""
    if not axes:
        return P()
    out, used = [], set()
    for name, dim in zip(axes, shape):
        target = (rules or RULES).get(name) if name else None
        if target is None:
            out.append(None)
            continue
        names = tuple(a for a in entry_axes(target) if a not in used and mesh.shape.get(a, 1) > 1)
        if not names or dim % axes_size(mesh, names):
            out.append(None)
            continue
        used.update(names)
        out.append(spec_entry(names))
    return P(*out)


def state_shardings(state, mesh: Mesh, rules=None, *, stacked: bool = False):
    """NamedShardings for every leaf of an nnx State (from each Variable's logical axes; `rules` default RULES).
    stacked: the leaves carry a leading layer axis (`lrmq.model.decoder.layer_runs`), kept whole."""
    return _map_variables(state, lambda axes, v: _leaf_sharding(axes, v, mesh, rules, stacked), stacked)


def abstract_state(state, mesh: Mesh, rules=None, *, stacked: bool = False):
    """`state` (abstract or concrete arrays, Variables kept) as ShapeDtypeStructs carrying its `state_shardings`."""
    shardings = jax.tree.leaves(state_shardings(state, mesh, rules, stacked=stacked))
    leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
              for a, s in zip(jax.tree.leaves(state), shardings, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(state), leaves)


def constrain_state(state, mesh: Mesh, rules=None, *, stacked: bool = False):
    """`state` (inside jit) with every array constrained to its `state_shardings` sharding, Variables kept."""
    def one(axes, v):
        return jax.lax.with_sharding_constraint(v, _leaf_sharding(axes, v, mesh, rules, stacked))

    return jax.tree.map(lambda var: var.replace(_map_variables(var, one, stacked)) if isinstance(var, nnx.Variable)
                        else var, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _map_variables(tree, fn, stacked: bool = False):
    """fn(logical axes or None, array) over every array of `tree`, a Variable's arrays getting its axes; the
    arrays of a packed weight (a Variable with `array_axes`, `QuantizedKernel`) each get their own."""
    def one(var):
        axes = var.get_metadata().get(LOGICAL_AXES_KEY) if isinstance(var, nnx.Variable) else None
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if hasattr(var, "array_axes"):
            return jax.tree.map(lambda v, a: fn(a, v), value, var.array_axes(lead=int(stacked)))
        return jax.tree.map(lambda v: fn(axes, v), value)

    if isinstance(tree, nnx.Variable):
        return one(tree)
    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _leaf_sharding(axes, v, mesh: Mesh, rules, stacked: bool) -> NamedSharding:
    shape = getattr(v, "shape", ())[int(stacked):]
    inner = logical_to_spec(axes if _matches(axes, shape) else None, shape, mesh, rules)
    return NamedSharding(mesh, P(None, *inner) if stacked else inner)


def _matches(axes, shape) -> bool:
    return axes is not None and len(axes) == len(shape)


def batch_axes(mesh) -> tuple[str, ...]:
    """The BATCH_AXES `mesh` has with more than one device: those a batch's rows are split over."""
    return tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Shard the leading (batch) dimension over data x fsdp (x expert)."""
    axes = batch_axes(mesh)
    return NamedSharding(mesh, P(spec_entry(axes), *([None] * (ndim - 1))))


def constrain_batch(x: jax.Array) -> jax.Array:
    """Pin an activation's leading (batch) dim to the data axes of the mesh in effect (`jax.set_mesh`).

    Without it XLA may keep activations replicated and gather them rather than the FSDP weights (the
    8B step needed 680 GiB of temporaries per chip). A no-op outside a mesh, or when the batch does not
    divide (e.g. a decode batch smaller than the mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    axes = batch_axes(mesh)
    if not axes or x.ndim == 0 or x.shape[0] % axes_size(mesh, axes):
        return x
    return jax.lax.with_sharding_constraint(x, P(spec_entry(axes), *([None] * (x.ndim - 1))))


def bytes_per_device(tree) -> int:
    """Bytes the largest share of `tree`'s arrays (concrete, or ShapeDtypeStructs with shardings) takes on one
    device: each leaf's shard shape (its whole shape when unsharded) times its item size."""
    total = 0
    for a in jax.tree.leaves(tree):
        sh = getattr(a, "sharding", None)
        shape = sh.shard_shape(a.shape) if sh is not None else a.shape
        total += math.prod(shape) * np.dtype(a.dtype).itemsize
    return total


def batch_divisor(mesh: Mesh) -> int:
    """Devices a batch's rows are split over (`batch_axes`): a batch size must be a multiple of it."""
    return axes_size(mesh, batch_axes(mesh))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Place an existing model's parameters onto the mesh according to their logical axes."""
    gdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh)
    pure = nnx.to_pure_dict(state)
    pure_sh = nnx.to_pure_dict(shardings) if not isinstance(shardings, dict) else shardings
    placed = jax.tree.map(lambda a, s: jax.device_put(a, s), pure, pure_sh)
    nnx.replace_by_pure_dict(state, placed)
    return nnx.merge(gdef, state)


def host_array(x) -> np.ndarray:
    """A global jax.Array as numpy on this process, gathering shards other hosts hold.

    Non-fully-addressable arrays need a collective: every process must call this for the same
    array in the same order."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
