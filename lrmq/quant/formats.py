"""Weight formats as one table: how each packed layout is made, read back, served and sharded.

* `STORAGE`: the storage formats of `QuantizedWeight.fmt`, "int" (2..8 bits, groups and packing
  along K) and "nf4" (bitsandbytes bytes): quantize, dequantize, and the logical axes of every
  array (how it is sharded).
* `PACKINGS`: the layouts a Pallas kernel serves, by name ("int4", "int8", "nf4"): the quantize
  options that make one, which weights the kernel accepts, its operands, its call, and how the
  operands split on a mesh. `qmatmul`, `pack_linears`, `lrmq.generate --pack` and the QLoRA bases
  read this table. A new kernel format is one `Packing` here plus its kernel in `pallas_kernels`.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from lrmq.quant import packing
from lrmq.quant.nf4 import nf4_dequantize, nf4_quantize
from lrmq.quant.quantizers import (
    check_bits,
    compute_qparams,
    dequantize_codes,
    quantize_codes,
    resolve_group_size,
)
from lrmq.quant.qweight import ARRAY_FIELDS, QuantizedWeight, expert_slice, stack_experts  # noqa: F401 (expert_slice re-exported)
from lrmq.registry import Registry


# ------------------------------------------------------------------------------ storage formats
@dataclasses.dataclass(frozen=True)
class StorageFormat:
    """One `QuantizedWeight.fmt`. `array_axes(name, ndim)`: for each dim of that array, "in" or
    "out" (the weight axis it follows, so it is sharded like the kernel's logical axis), or None
    for a replicated array."""

    name: str
    quantize: Callable[..., QuantizedWeight]
    dequantize: Callable[[QuantizedWeight], jax.Array]
    array_axes: Callable[[str, int], tuple | None]


STORAGE: Registry = Registry("weight format")


def _int_quantize(w, *, bits: int = 4, group_size: int = 128, symmetric: bool = False,
                  **_ignored) -> QuantizedWeight:
    """RTN (asymmetric = llm-awq) codes packed along K."""
    bits = check_bits(bits)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [K, N] (in, out), got shape {tuple(w.shape)}")
    g = resolve_group_size(w.shape, group_size)
    packing.packed_rows(w.shape[0], bits)  # fail early with a shape message
    scales, zeros = compute_qparams(w, bits, g, symmetric)
    codes = quantize_codes(w, scales, zeros, bits, g)
    return QuantizedWeight(codes=packing.pack(codes, bits), scales=scales, zeros=zeros, fmt="int",
                           bits=bits, group_size=g, shape=(int(w.shape[0]), int(w.shape[1])),
                           dtype=jnp.dtype(w.dtype).name, symmetric=bool(symmetric),
                           double_quant=False)


def unpacked_codes(qw: QuantizedWeight):
    """Int codes uint8 [K, N] (fmt="int"); [E, K, N] of a stacked-experts weight."""
    if qw.fmt != "int":
        raise ValueError(f"unpacked_codes needs fmt='int', got fmt={qw.fmt!r}")
    if qw.num_experts is not None:
        return jax.vmap(lambda c: packing.unpack(c, qw.bits, qw.K))(jnp.asarray(qw.codes))
    return packing.unpack(qw.codes, qw.bits, qw.K)


def _int_dequantize(qw: QuantizedWeight):
    return dequantize_codes(unpacked_codes(qw), qw.scales, qw.zeros, qw.group_size, qw.dtype)


def _nf4_quantize(w, *, bits: int = 4, block_size: int = 64, double_quant: bool = True,
                  **_ignored) -> QuantizedWeight:
    if bits != 4:
        raise ValueError(f"fmt='nf4' needs bits=4, got bits={bits}")
    return nf4_quantize(w, block_size=block_size, double_quant=double_quant)


STORAGE.register("int")(StorageFormat(
    "int", _int_quantize, _int_dequantize,
    # codes [K*bits/8, N], scales / zeros [K/g, N]: rows follow K, columns follow N
    lambda name, ndim: ("in", "out") if ndim == 2 else None))
STORAGE.register("nf4")(StorageFormat(
    "nf4", _nf4_quantize, nf4_dequantize,
    # codes [N, K/2] (torch orientation); per-block absmax and its codes flat, N-major; the
    # double-quant second level is tiny and replicated
    lambda name, ndim: (("out", "in") if name == "codes" else
                        ("out",) if name in ("scales", "absmax_codes") and ndim == 1 else None)))


def storage_format(fmt: str) -> StorageFormat:
    if fmt not in STORAGE:
        raise ValueError(f"unknown fmt {fmt!r}; known: {STORAGE.names()}")
    return STORAGE.get(fmt)


def array_axes(qw: QuantizedWeight, axes, lead: int = 0) -> QuantizedWeight:
    """Each array's logical axes (a tuple per array field; () = replicated) from the kernel's (in, out)
    logical `axes`, as the storage format lays the arrays out (NF4 codes are [N, K/2], int codes [K', N]).
    A stacked-experts weight (shape (E, K, N)) takes the kernel's (expert, in, out) axes: every array's leading
    E dim gets the expert axis, the rest as for one expert.
    `lead`: leading dims the arrays carry before their own (a stacked layer axis), not in the result."""
    which = storage_format(qw.fmt).array_axes
    stacked = qw.num_experts is not None
    axes = tuple(axes) if axes is not None else (None,) * len(qw.shape)
    if len(axes) != len(qw.shape):
        raise ValueError(f"logical axes {axes} do not match the packed weight's shape {qw.shape}")
    expert = axes[:1] if stacked else ()
    named = dict(zip(("in", "out"), axes[-2:]))

    def one(name):
        a = getattr(qw, name)
        if a is None:
            return None
        own = a.ndim - lead - len(expert)
        dims = which(name, own)
        if dims is None:
            return expert + (None,) * own if expert else ()
        return expert + tuple(named[d] for d in dims)

    return qw.replace(**{k: one(k) for k in ARRAY_FIELDS})


def quantize_weight(w, *, fmt: str = "int", bits: int = 4, group_size: int = 128,
                    symmetric: bool = False, block_size: int = 64,
                    double_quant: bool = True) -> QuantizedWeight:
    """Quantize a float [K, N] weight. fmt="int": RTN (asym = llm-awq) packed along K;
    fmt="nf4": bitsandbytes NF4 (`block_size`, `double_quant`).
    A [E, K, N] weight (stacked experts) gives a stacked-experts QuantizedWeight of shape (E, K, N): the per-expert
    quantizer mapped over E and the results stacked (`stack_experts`), so expert e's arrays are bit for bit those of
    quantizing w[e] alone. (Not `jax.vmap`: batched, XLA turns the quantizers' `exact_div` divisions by an
    unbatched operand back into reciprocal multiplies, an ulp off in ~half the scales.)"""
    quantize = partial(storage_format(fmt).quantize, bits=bits, group_size=group_size, symmetric=symmetric,
                       block_size=block_size, double_quant=double_quant)
    if getattr(w, "ndim", 2) == 3:
        return stack_experts([quantize(w[e]) for e in range(w.shape[0])])
    return quantize(w)


def dequantize(qw: QuantizedWeight):
    """QuantizedWeight -> [K, N] array in qw.dtype ([E, K, N] for stacked experts: each expert's dequantized)."""
    deq = storage_format(qw.fmt).dequantize
    if qw.num_experts is not None:
        return jax.vmap(deq)(qw.replace(shape=tuple(qw.shape[1:])))
    return deq(qw)


# ------------------------------------------------------------------------------ kernel layouts
@dataclasses.dataclass(frozen=True)
class Packing:
    """A layout served by a Pallas kernel.

    options: `quantize_weight` keyword arguments that produce it.
    serves(qw): whether the kernel takes this weight (else `qmatmul` dequantizes in XLA).
    operands(qw): the arrays the kernel takes after x; call(x, *operands, qw=, impl=) runs it.
    specs(k, n, qw): PartitionSpecs of the operands, given the mesh axes K and N are split over.
    k_split(qw): (K unit, groups): K may be split t ways only if K % (t * unit) == 0 and the
      groups (if more than one) divide by t, so every shard holds whole groups.
    grouped_call(x, group_sizes, *operands, qw=, impl=): the grouped (mixture-of-experts) kernel for a
      stacked-experts weight of this layout (operands with a leading expert axis), or None (dequantize in XLA,
      then `ragged_dot`)."""

    name: str
    options: dict
    serves: Callable[[QuantizedWeight], bool]
    operands: Callable[[QuantizedWeight], tuple]
    call: Callable[..., jax.Array]
    specs: Callable[[Any, Any, QuantizedWeight], tuple]
    k_split: Callable[[QuantizedWeight], tuple[int, int]]
    grouped_call: Callable[..., jax.Array] | None = None


PACKINGS: Registry = Registry("packing")


def _affine_specs(k, n, qw):  # codes [K/2 or K, N]; scales / zeros [K/g, N] ([1, N]: never on K)
    side = P(None if qw.scales.shape[0] == 1 else k, n)
    return P(k, n), side, side


PACKINGS.register("int4")(Packing(
    "int4", dict(fmt="int", bits=4, group_size=128, symmetric=False),
    serves=lambda qw: qw.fmt == "int" and qw.bits == 4,
    operands=lambda qw: (qw.codes, qw.scales, qw.zeros),
    call=lambda x, *ops, qw, impl: pk.int4_matmul(x, *ops, impl=impl),  # g from the local scales
    specs=_affine_specs,
    k_split=lambda qw: (2, qw.K // qw.group_size),
    grouped_call=lambda x, gs, *ops, qw, impl: pk.grouped_int4_matmul(x, gs, *ops, impl=impl)))
PACKINGS.register("int8")(Packing(
    "int8", dict(fmt="int", bits=8, group_size=-1, symmetric=False),
    serves=lambda qw: qw.fmt == "int" and qw.bits == 8,
    operands=lambda qw: (qw.codes, qw.scales, qw.zeros),
    call=lambda x, *ops, qw, impl: pk.int8_matmul(x, *ops, impl=impl),
    specs=_affine_specs,
    k_split=lambda qw: (1, qw.K // qw.group_size),
    grouped_call=lambda x, gs, *ops, qw, impl: pk.grouped_int8_matmul(x, gs, *ops, impl=impl)))
PACKINGS.register("nf4")(Packing(
    "nf4", dict(fmt="nf4", bits=4, block_size=64, double_quant=True),
    # blocks are flat in torch order: the kernel needs every row to hold whole blocks
    serves=lambda qw: qw.fmt == "nf4" and qw.K % qw.block_size == 0,
    # absmax (already dequantized from double quant) as [N, K/bs], so it splits on N and K
    operands=lambda qw: (qw.codes, qw.scales.reshape(qw.N, qw.K // qw.block_size)),
    call=lambda x, *ops, qw, impl: pk.nf4_matmul(x, *ops, qw.block_size, impl=impl),
    specs=lambda k, n, qw: (P(n, k), P(n, k)),  # codes [N, K/2], absmax [N, K/bs]
    k_split=lambda qw: (qw.block_size, qw.K // qw.block_size)))


def packing_of(qw: QuantizedWeight) -> Packing | None:
    """The kernel layout serving `qw`, or None (dequantize in XLA, then dot)."""
    return next((p for p in map(PACKINGS.get, PACKINGS.names()) if p.serves(qw)), None)


# ------------------------------------------------------------------------------ the format's name
PER_CHANNEL = -1  # WeightFormat.group_size: one scale per output channel
PER_TENSOR = 0  # one scale for the whole tensor (paper 1's int8 STE)
_SCALE_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """The weight format of a quantized artifact: what its codes and scales mean, and which quantizer chose them.

    `bits`; `group_size` (input rows per scale: > 0 a group, `PER_CHANNEL` (-1) one scale per output channel,
    `PER_TENSOR` (0) one for the tensor; nf4: the block size); `symmetric` (no zero point) or asymmetric (a zero
    point per group); `scale_dtype`; `scheme`, the quantizer that chose the codes (a PTQ method, "rtn", "awq", ...,
    or "qat:<quant.qat_scheme>"); `kind` "int" or "nf4" (`double_quant`: nf4's absmax quantized again).
    `describe()` is its short name (``int4 asym g128 f32-scale (rtn)``), written by every command that writes
    or scores a quantized model; `quantize_args()` the `python -m lrmq.quantize` flags that write a float
    checkpoint in the same format (RTN: the same codes for the same weights); `to_dict` / `from_dict` its JSON.

    A QAT run's format: `lrmq.quant.qat.qat_weight_format(quant.qat_scheme, quant.qat_group_size)` of the run's
    RUN/config.yaml `quant` section (`lrmq.ptq.qat_export.run_weight_format(RUN)` reads it), or
    ``WeightFormat.from_dict(json.load(open("RUN/final_policy_quantized/qat_policy.json"))["weight_format"])``;
    a packed checkpoint's: the ``weight_formats`` entry of its ``lrmq_state.json``
    (`lrmq.checkpoint.orbax_io.read_weight_formats`).
    """

    bits: int
    group_size: int
    symmetric: bool
    scheme: str
    scale_dtype: str = "float32"
    kind: str = "int"
    double_quant: bool = False

    def __post_init__(self):
        if self.kind not in ("int", "nf4"):
            raise ValueError(f"WeightFormat.kind must be 'int' or 'nf4', got {self.kind!r}")
        check_bits(self.bits)
        if self.group_size < -1:
            raise ValueError(f"WeightFormat.group_size must be > 0, -1 (per channel) or 0 (per tensor), "
                             f"got {self.group_size}")
        if self.scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"WeightFormat.scale_dtype must be one of {list(_SCALE_DTYPES)}, got {self.scale_dtype!r}")

    @property
    def grouping(self) -> str:
        if self.kind == "nf4":
            return f"block{self.group_size}"
        return {PER_CHANNEL: "per-channel", PER_TENSOR: "per-tensor"}.get(self.group_size, f"g{self.group_size}")

    def describe(self) -> str:
        """E.g. ``int4 asym g128 f32-scale (rtn)``, ``int8 sym per-tensor f32-scale (qat:paper_int8)``,
        ``nf4 block64 double-quant (nf4)``."""
        if self.kind == "nf4":
            return f"nf4 {self.grouping}{' double-quant' if self.double_quant else ''} ({self.scheme})"
        return (f"int{self.bits} {'sym' if self.symmetric else 'asym'} {self.grouping} "
                f"{_SCALE_DTYPES[self.scale_dtype]}-scale ({self.scheme})")

    def quantize_args(self) -> list[str]:
        """The `python -m lrmq.quantize` flags (besides --checkpoint / --out) that write this format with
        round-to-nearest: ``--method rtn --bits B --group-size G [--symmetric]`` (nf4: ``--method nf4``)."""
        if self.kind == "nf4":
            return ["--method", "nf4", "--group-size", str(self.group_size)]
        return ["--method", "rtn", "--bits", str(self.bits), "--group-size", str(self.group_size),
                *(["--symmetric"] if self.symmetric else [])]

    def quantize_command(self, checkpoint: str = "RUN/final_policy", out: str = "OUT") -> str:
        return " ".join(["python -m lrmq.quantize --checkpoint", checkpoint, *self.quantize_args(), "--out", out])

    def same_format(self, other: "WeightFormat") -> bool:
        """Equal in everything but the scheme (the quantizer that chose the codes)."""
        return dataclasses.replace(self, scheme="") == dataclasses.replace(other, scheme="")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "name": self.describe()}

    @classmethod
    def from_dict(cls, d: dict, where: str = "weight_format") -> "WeightFormat":
        """Inverse of `to_dict` (its `name` is ignored); a missing or unknown key is a one-line ValueError."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a mapping, got {type(d).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields - {"name"})
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(fields)}")
        missing = [k for k in ("bits", "group_size", "symmetric", "scheme") if k not in d]
        if missing:
            raise ValueError(f"{where}: missing keys {missing}")
        return cls(**{k: v for k, v in d.items() if k in fields})

    @classmethod
    def of_weight(cls, qw: QuantizedWeight, scheme: str, *, per_tensor: bool = False,
                  group_size: int | None = None) -> "WeightFormat":
        """The format of one packed weight (`per_tensor`: its per-channel scales are one scale repeated;
        `group_size`: the group size asked for, which names a group that spans the whole K, e.g. g64 of K=64)."""
        if qw.fmt == "nf4":
            return cls(bits=4, group_size=qw.block_size, symmetric=True, scheme=scheme, kind="nf4",
                       double_quant=bool(qw.double_quant))
        g = PER_TENSOR if per_tensor else group_size if group_size == qw.group_size else \
            PER_CHANNEL if qw.group_size == qw.K else qw.group_size
        return cls(bits=qw.bits, group_size=g, symmetric=bool(qw.symmetric), scheme=scheme,
                   scale_dtype=jnp.dtype(qw.scales.dtype).name)


def formats_of(packed: dict, scheme: str, *, per_tensor: bool = False,
               group_size: int | None = None) -> list[WeightFormat]:
    """The distinct formats of a {path: QuantizedWeight} (one for every model lrmq writes), in first-seen order."""
    out: list[WeightFormat] = []
    for qw in packed.values():
        f = WeightFormat.of_weight(qw, scheme, per_tensor=per_tensor, group_size=group_size)
        if f not in out:
            out.append(f)
    return out
