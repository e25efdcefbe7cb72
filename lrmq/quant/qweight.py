"""`QuantizedWeight`: the packed weight pytree shared by model, kernels, checkpoints and export.

How each format is made, read back and served: `lrmq.quant.formats`; the nnx variable that holds one
in a model: `lrmq.quant.qkernel.QuantizedKernel`.

Field layouts are fixed by docs/DESIGN.md ("Packed formats"). Arrays are pytree leaves (None when a
format does not use them); format metadata is static (hashable, part of the treedef), so jit retraces
per format and `jax.tree` maps over the arrays only.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


ARRAY_FIELDS = ("codes", "scales", "zeros", "absmax_codes", "absmax_scales", "absmax_offset")
STATIC_FIELDS = ("fmt", "bits", "group_size", "shape", "dtype", "symmetric", "block_size", "double_quant")


@struct.dataclass
class QuantizedWeight:
    """A quantized [K, N] weight, or a stack of E experts' [K, N] weights: `shape == (E, K, N)` (a 3-D shape means
    stacked experts, `ExpertLinear`'s kernel), where every array field below carries a leading E axis (expert e's
    arrays are `a[e]`: `expert_slice`; `stack_experts` is the inverse).

    int (fmt="int"): codes uint8 packed along K [K*bits/8, N] (bits 5..8: [K, N]); scales f32 [K/g, N];
      zeros uint8 [K/g, N]; w = (q - z) * s.
    nf4 (fmt="nf4"): codes uint8 [N, K/2] (bnb bytes); scales f32 [ceil(N*K/block_size)] absmax
      (already dequantized when double_quant); absmax_codes uint8, absmax_scales f32
      [ceil(nblocks/256)], absmax_offset f32 [] when double_quant. group_size is 0 (unused).
    """

    codes: jax.Array
    scales: jax.Array
    zeros: Optional[jax.Array] = None
    absmax_codes: Optional[jax.Array] = None
    absmax_scales: Optional[jax.Array] = None
    absmax_offset: Optional[jax.Array] = None
    fmt: str = struct.field(pytree_node=False, default="int")
    bits: int = struct.field(pytree_node=False, default=4)
    group_size: int = struct.field(pytree_node=False, default=128)
    shape: tuple = struct.field(pytree_node=False, default=())
    dtype: str = struct.field(pytree_node=False, default="float32")
    symmetric: bool = struct.field(pytree_node=False, default=False)
    block_size: int = struct.field(pytree_node=False, default=64)
    double_quant: bool = struct.field(pytree_node=False, default=False)

    @property
    def K(self) -> int:
        return self.shape[-2]

    @property
    def N(self) -> int:
        return self.shape[-1]

    @property
    def num_experts(self) -> int | None:
        """E of a stacked-experts weight (3-D `shape`), None for a plain [K, N] one."""
        return self.shape[0] if len(self.shape) == 3 else None

    @property
    def nbytes(self) -> int:
        """Bytes of all array fields (with NF4 double quant this includes the dequantized absmax)."""
        return int(sum(np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize for a in self.arrays().values()))

    def arrays(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ARRAY_FIELDS if getattr(self, k) is not None}

    def static(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in STATIC_FIELDS}


def expert_slice(qw: QuantizedWeight, e: int) -> QuantizedWeight:
    """Expert `e` of a stacked-experts weight (`shape` (E, K, N)) as a plain [K, N] QuantizedWeight."""
    if qw.num_experts is None:
        raise ValueError(f"expert_slice needs a stacked-experts weight of shape (E, K, N), got shape {qw.shape}")
    if not 0 <= int(e) < qw.num_experts:
        raise IndexError(f"expert {e} out of range for a weight of {qw.num_experts} experts")
    return jax.tree.map(lambda a: a[int(e)], qw.replace(shape=tuple(qw.shape[1:])))


def stack_experts(qws) -> QuantizedWeight:
    """E plain [K, N] QuantizedWeights of one format (same static fields: fmt, bits, group size, shape, ...) stacked
    into one stacked-experts weight of shape (E, K, N) (expert e = `qws[e]`)."""
    qws = list(qws)
    if not qws:
        raise ValueError("stack_experts needs at least one expert weight")
    first = qws[0].static()
    if len(first["shape"]) != 2:
        raise ValueError(f"stack_experts stacks plain [K, N] weights, got shape {first['shape']}")
    for e, q in enumerate(qws[1:], 1):
        if q.static() != first:
            diff = sorted(k for k in first if q.static()[k] != first[k])
            raise ValueError(f"stack_experts: expert {e} differs from expert 0 in {diff} "
                             f"({[q.static()[k] for k in diff]} vs {[first[k] for k in diff]})")
        if set(q.arrays()) != set(qws[0].arrays()):
            raise ValueError(f"stack_experts: expert {e} has arrays {sorted(q.arrays())}, expert 0 "
                             f"{sorted(qws[0].arrays())}")
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *qws)
    return stacked.replace(shape=(len(qws), *first["shape"]))


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def to_flat_dict(qw: QuantizedWeight, prefix: str = "") -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) for safetensors: `<prefix>.codes` etc. as numpy arrays, and the static fields
    as `<prefix>.<field>` -> JSON string (safetensors metadata must be str -> str)."""
    tensors = {_key(prefix, k): np.asarray(v) for k, v in qw.arrays().items()}
    meta = {_key(prefix, k): json.dumps(list(v) if k == "shape" else v) for k, v in qw.static().items()}
    return tensors, meta


def from_flat_dict(tensors: dict[str, Any], metadata: dict[str, str], prefix: str = "") -> QuantizedWeight:
    """Inverse of `to_flat_dict`; extra keys with other prefixes are ignored."""
    static = {}
    for k in STATIC_FIELDS:
        key = _key(prefix, k)
        if key not in metadata:
            raise KeyError(f"metadata is missing {key!r} for quantized weight {prefix!r}")
        static[k] = json.loads(metadata[key])
    static["shape"] = tuple(static["shape"])
    arrays = {}
    for k in ARRAY_FIELDS:
        key = _key(prefix, k)
        if key in tensors:
            arrays[k] = jnp.asarray(tensors[key])
    for req in ("codes", "scales"):
        if req not in arrays:
            raise KeyError(f"tensors are missing {_key(prefix, req)!r}")
    return QuantizedWeight(**arrays, **static)
