"""`QuantizedWeight`: the packed weight pytree shared by model, kernels, checkpoints and export.

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
from flax import nnx, struct

from lrmq.quant import packing
from lrmq.quant.quantizers import (
    check_bits,
    compute_qparams,
    dequantize_codes,
    quantize_codes,
    resolve_group_size,
)

ARRAY_FIELDS = ("codes", "scales", "zeros", "absmax_codes", "absmax_scales", "absmax_offset")
STATIC_FIELDS = ("fmt", "bits", "group_size", "shape", "dtype", "symmetric", "block_size", "double_quant")
FORMATS = ("int", "nf4")


@struct.dataclass
class QuantizedWeight:
    """A quantized [K, N] weight.

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
        return self.shape[0]

    @property
    def N(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of all array fields (with NF4 double quant this includes the dequantized absmax)."""
        return int(sum(np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize for a in self.arrays().values()))

    def arrays(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ARRAY_FIELDS if getattr(self, k) is not None}

    def static(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in STATIC_FIELDS}


class QuantizedKernel(nnx.Variable):
    """Non-trainable nnx variable holding one `QuantizedWeight` (read it with `.get_value()`).

    A Variable may hold any pytree in flax 0.12: it survives nnx.split/merge, nnx.jit / jax.jit of the
    split state, and orbax StandardSave/StandardRestore of `nnx.state(model)` (tests/test_qweight.py).
    It is not an `nnx.Param`, so optimizers filtering on Param / LoRAParam never see it.
    """


def quantize_weight(
    w,
    *,
    fmt: str = "int",
    bits: int = 4,
    group_size: int = 128,
    symmetric: bool = False,
    block_size: int = 64,
    double_quant: bool = True,
) -> QuantizedWeight:
    """Quantize a float [K, N] weight. fmt="int": RTN (asym = llm-awq) packed along K; fmt="nf4": bnb."""
    if fmt == "nf4":
        from lrmq.quant.nf4 import nf4_quantize

        if bits != 4:
            raise ValueError(f"fmt='nf4' needs bits=4, got bits={bits}")
        return nf4_quantize(w, block_size=block_size, double_quant=double_quant)
    if fmt != "int":
        raise ValueError(f"unknown fmt {fmt!r}; known: {list(FORMATS)}")
    bits = check_bits(bits)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [K, N] (in, out), got shape {tuple(w.shape)}")
    g = resolve_group_size(w.shape, group_size)
    packing.packed_rows(w.shape[0], bits)  # fail early with a shape message
    scales, zeros = compute_qparams(w, bits, g, symmetric)
    codes = quantize_codes(w, scales, zeros, bits, g)
    return QuantizedWeight(
        codes=packing.pack(codes, bits),
        scales=scales,
        zeros=zeros,
        fmt="int",
        bits=bits,
        group_size=g,
        shape=(int(w.shape[0]), int(w.shape[1])),
        dtype=jnp.dtype(w.dtype).name,
        symmetric=bool(symmetric),
        double_quant=False,
    )


def unpacked_codes(qw: QuantizedWeight):
    """Int codes uint8 [K, N] (fmt="int")."""
    if qw.fmt != "int":
        raise ValueError(f"unpacked_codes needs fmt='int', got fmt={qw.fmt!r}")
    return packing.unpack(qw.codes, qw.bits, qw.K)


def dequantize(qw: QuantizedWeight):
    """QuantizedWeight -> [K, N] array in qw.dtype."""
    if qw.fmt == "nf4":
        from lrmq.quant.nf4 import nf4_dequantize

        return nf4_dequantize(qw)
    if qw.fmt != "int":
        raise ValueError(f"unknown fmt {qw.fmt!r}; known: {list(FORMATS)}")
    return dequantize_codes(unpacked_codes(qw), qw.scales, qw.zeros, qw.group_size, qw.dtype)


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
