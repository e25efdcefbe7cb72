"""Quantization-aware training in RL: swap each targeted `Linear`'s `dot_general`.

Schemes (`QuantSection.qat_scheme`):

* ``paper_int8`` - paper 1's QAFT/STE (rlquant `QuantizedLinear`): per-tensor symmetric absmax int8,
  `S = max(max|W0| / 127, 1e-6)` computed **once from the base weights at load** and frozen,
  `W_q = clip(round(W / S), -128, 127) * S`, identity backward (`W + stop_gradient(W_q - W)`).
  Own code, not AQT: AQT recalibrates its scale from the current weight on every call.
* ``int8`` / ``int4`` - AQT weight-only, symmetric, scale `absmax / (2^(b-1) - 1)` per output channel
  (`qat_group_size=0`) or per group of `qat_group_size` input rows (AQT `tiled_dot_general`).
* ``int4_asym`` / ``int8_asym`` - min-max asymmetric, a zero point per group of `qat_group_size` input rows (0 = per
  output channel), STE (`W + stop_gradient(W_q - W)`): `W_q` is exactly `lrmq.quantize --method rtn`'s
  round-to-nearest of the current weight (`lrmq.quant.quantizers.fake_quant`, llm-awq's `pseudo_quantize_tensor`),
  recomputed on every call, so ``int4_asym`` with `qat_group_size=128` is `lrmq.quantize`'s default format (int4 asym
  g128 f32-scale) code for code.
* ``w8a8`` - AQT int8 weights (per output channel / group) and int8 activations (per token, i.e. per
  row over the contraction axis).

Gradients go straight through to the float master weights (AQT's STE; our stop_gradient STE).

**Mixture-of-experts expert weights** (`ExpertLinear`, stacked [E, K, N] kernels through `jax.lax.ragged_dot`;
selected by the same `quant.targets` regex, `transforms.iter_expert_linears`): AQT has no ragged_dot, so their
`ragged_dot` seam is set to `ExpertSTERaggedDot` (`PerExpertTensorSTERaggedDot` for paper_int8), a weight
fake-quant with a straight-through gradient, per expert: each expert's [K, N] weight goes through the very
function the scheme's dense reference uses (`fake_quant_weight`: AQT's symmetric absmax per output channel / per
group of `qat_group_size` input rows, scale absmax / qmax, rounded as AQT rounds; lrmq's RTN for the asym
schemes; paper_int8's per-tensor scale frozen at load, one per expert), then `ragged_dot` with the sorted rows.
w8a8 fake-quantizes the expert inputs per token (row) too, STE. What is identical to the dense Linears: the
integer codes and scales of every weight (an expert is quantized as a Linear of its shape would be). What is not:
AQT multiplies the integer operands and rescales the product, the expert path multiplies the dequantized weight
(equal up to float rounding of the products); `qat_stochastic_rounding` (AQT's gradient quantization) has no
expert form and is refused when the targets select experts.

**Rollouts use the same quantized forward.** The dot_general is a static attribute of the module, so it
lives in the graphdef that both the jitted train step and the generation `Engine` merge: sampling, log-probs
and the update all see exactly the quantized policy (as paper 1, whose vLLM-free HF generate ran the
fake-quantized `QuantizedLinear`s). No separate serving graph exists to drift from it.

**Stochastic rounding** (`qat_stochastic_rounding=True`, AQT schemes only): as AQT's fully-quantized
training, the incoming *gradient* of each backward dot_general is quantized to int8 with stochastic
rounding (`set_stochastic_rounding(vjp_lhs=True)`); the forward (and therefore rollouts) is unchanged
and deterministic. The PRNG key is `fold_in(fold_in(key(seed), crc32(module path)), hash(x))` where
`hash(x)` is a position-weighted wrapping uint32 sum of the bits of the layer input. It needs no
RNG state threaded through the (trainer-owned) jitted step, changes every step (the rollout batch and
the weights change), differs per layer and per micro-batch, and is reproducible on resume.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from lrmq.model.linear import ExpertLinear, Linear, default_dot_general, default_ragged_dot
from lrmq.quant.formats import PER_CHANNEL, PER_TENSOR, WeightFormat
from lrmq.quant.quantizers import fake_quant, fake_quant_per_tensor, per_tensor_scale
from lrmq.sharding import EXPERT_AXIS
from lrmq.quant.transforms import (DEFAULT_TARGETS, ROUTER_SUFFIX, iter_expert_linears, iter_linears,
                                   require_linears)

SCHEMES = ("paper_int8", "int8", "int4", "int4_asym", "int8_asym", "w8a8")
ASYM_SCHEMES = {"int4_asym": 4, "int8_asym": 8}  # min-max with a zero point (own STE, lrmq's RTN quantizer)


def scheme_bits(scheme: str) -> int:
    """Weight bits of a QAT scheme."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown qat_scheme {scheme!r}; known: {list(SCHEMES)}")
    return 4 if scheme in ("int4", "int4_asym") else 8


def qat_weight_format(scheme: str, group_size: int = 0) -> WeightFormat:
    """The weight format a QAT scheme trains in (and its quantized export stores): `scheme` and `group_size` are a
    run's `quant.qat_scheme` / `quant.qat_group_size` (0 = per output channel). `.quantize_args()` of the result
    are the `lrmq.quantize` flags that write the same format from a float policy."""
    bits = scheme_bits(scheme)
    if scheme == "paper_int8":
        return WeightFormat(bits=8, group_size=PER_TENSOR, symmetric=True, scheme=f"qat:{scheme}")
    return WeightFormat(bits=bits, group_size=int(group_size) if group_size else PER_CHANNEL,
                        symmetric=scheme not in ASYM_SCHEMES, scheme=f"qat:{scheme}")


def data_hash(x) -> jax.Array:
    """A uint32 that changes with the values of x (position-weighted wrapping sum of its bits)."""
    x = jax.lax.stop_gradient(x)
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    w = jax.lax.broadcasted_iota(jnp.uint32, x.shape, x.ndim - 1) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * w, dtype=jnp.uint32)


def data_key(seed: int, salt: int, x) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), salt), data_hash(x))


def path_salt(path: str) -> int:
    """A per-projection salt for data-derived keys, from the path without its layer index.

    Projections that see the same input (q/k/v, gate/up) need different keys; one projection in two
    layers sees different inputs already. Leaving the index out keeps every layer's graphdef equal, so
    `Decoder.hidden(scan=True)` can scan over the layers of a model with adapters or stochastic QAT."""
    return zlib.crc32(re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.", path).encode()) & 0x7FFFFFFF


# ----------------------------------------------------------------------------- paper_int8 (own STE)
class FrozenScale(nnx.Variable):
    """A quantization scale fixed once (paper_int8's per-tensor weight scale): model state that no
    optimizer filter (Param / LoRAParam) selects, saved and restored with the run like the rest."""


class PerTensorSTEDotGeneral(nnx.Module):
    """dot_general with a frozen per-tensor int8 scale and an identity backward for the weight.

    The scale is state (a `FrozenScale` variable), not a constant in the graphdef, so every layer's
    graphdef stays equal and the update can scan over the layers (`model.scan_layers`)."""

    def __init__(self, scale, bits: int = 8):
        self.scale = FrozenScale(jnp.asarray(scale, jnp.float32))
        self.bits = bits

    def quantize(self, w):
        wq = fake_quant_per_tensor(w, self.bits, scale=self.scale[...])
        return w + jax.lax.stop_gradient(wq - w)  # forward W_q, backward identity (STE)

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
        return jax.lax.dot_general(lhs, self.quantize(rhs), dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)


# ----------------------------------------------------------------------------- asymmetric (own STE)
@dataclasses.dataclass(frozen=True)
class AsymSTEDotGeneral:
    """dot_general whose weight is lrmq's asymmetric round-to-nearest of the current weight (min-max, a zero point
    per group of `group_size` input rows; 0 = per output channel), identity backward (STE). Frozen and hashable:
    static in the graphdef, like `AqtDotGeneral`."""

    bits: int
    group_size: int = 0

    def quantize(self, w):
        wq = fake_quant(w, self.bits, self.group_size or -1, symmetric=False)
        return w + jax.lax.stop_gradient(wq - w)

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
        return jax.lax.dot_general(lhs, self.quantize(rhs), dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)


# ----------------------------------------------------------------------------- AQT schemes
@functools.lru_cache(maxsize=None)
def aqt_config(lhs_bits, rhs_bits: int, stochastic_rounding: bool):
    """AQT DotGeneral config: symmetric int, scale absmax / (2^(b-1) - 1) (preserve_max_val)."""
    from aqt.jax.v2 import config as aqt_cfg
    from aqt.jax.v2.numerics import utils as numerics_utils

    c = aqt_cfg.dot_general_make(lhs_bits=lhs_bits, rhs_bits=rhs_bits, bwd_bits=8 if stochastic_rounding else None)
    c.fwd.dg_quantizer.rhs.numerics = numerics_utils.get_numerics(rhs_bits, preserve_max_val=True)
    if lhs_bits:
        c.fwd.dg_quantizer.lhs.numerics = numerics_utils.get_numerics(lhs_bits, preserve_max_val=True)
    if stochastic_rounding:
        aqt_cfg.set_stochastic_rounding(c, vjp_lhs_stochastic_rounding=True, vjp_rhs_stochastic_rounding=False,
                                        implementation="jax.uniform")
    return c


@dataclasses.dataclass(frozen=True)
class AqtDotGeneral:
    """Function-style AQT dot_general for a `Linear` (x [..., K] . w [K, N]); frozen and hashable."""

    weight_bits: int
    act_bits: int | None = None
    group_size: int = 0  # 0: per output channel
    stochastic_rounding: bool = False
    seed: int = 0
    salt: int = 0

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
        (lc, rc), (lb, rb) = dimension_numbers
        if tuple(lc) != (lhs.ndim - 1,) or tuple(rc) != (0,) or lb or rb:
            raise ValueError(f"AqtDotGeneral supports x[..., K] . w[K, N] only, got {dimension_numbers}")
        lead = lhs.shape[:-1]
        x2 = lhs.reshape(-1, lhs.shape[-1])
        cfg = aqt_config(self.act_bits, self.weight_bits, self.stochastic_rounding)
        if self.stochastic_rounding:
            from aqt.jax.v2 import config as aqt_cfg

            cfg = aqt_cfg.set_context(cfg, data_key(self.seed, self.salt, x2), train_step=None)
        dims = (((1,), (0,)), ((), ()))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)  # aqt: implicit dtype conversion
            if self.group_size and self.group_size < rhs.shape[0]:
                from aqt.jax.v2 import tiled_dot_general as tdg

                tcfg = tdg.Cfg.from_einsum("mk,kn->mn", {"k": self.group_size})
                y = tdg.tiled_dot_general(tcfg, x2, rhs, dims, dot_general=cfg)
            else:
                y = cfg(x2, rhs, dims)
        y = y.reshape(*lead, rhs.shape[1])
        return y.astype(preferred_element_type) if preferred_element_type is not None else y


# ----------------------------------------------------------------------------- fake-quant references
def fake_quant_weight(w, scheme: str, group_size: int = 0, scale=None):
    """The weight the QAT forward multiplies by (for tests / exports of the fake-quantized model)."""
    if scheme == "paper_int8":
        return fake_quant_per_tensor(w, 8, scale=scale)
    if scheme in ASYM_SCHEMES:
        return fake_quant(w, ASYM_SCHEMES[scheme], group_size or -1, symmetric=False)
    bits = {"int8": 8, "w8a8": 8, "int4": 4}[scheme]
    return _sym_fake_quant(w, bits, group_size, axis=0)


def sym_weight_codes(w, bits: int, group_size: int):
    """The AQT weight schemes' integers and scales of a [K, N] weight: q int32 [K, N] in [-qmax, qmax] and
    scale f32 [K/g, N] (g = group_size, or K when 0 / not smaller), with q * scale (per group) exactly the weight
    the QAT forward multiplies by (`fake_quant_weight`). What a QAT policy's packed export stores."""
    k, n = w.shape
    g = group_size if group_size and group_size < k else k
    q, s = _sym_q(w.astype(jnp.float32).reshape(k // g, g, n), bits, axis=1)
    return q.reshape(k, n).astype(jnp.int32), s.reshape(k // g, n)


def _sym_q(a32, bits: int, axis: int):
    """(q, scale) of symmetric absmax quantization over `axis` of a float32 array (scale keeps the axis)."""
    qmax = 2 ** (bits - 1) - 1
    s = jnp.max(jnp.abs(a32), axis=axis, keepdims=True) / qmax
    # AQT (aqt_tensor.QTensor.quant) multiplies by reciprocal(scale), inf -> 1; it does not divide, so
    # neither does this reference (a true division would differ from AQT by an ulp at ties).
    s_inv = jax.lax.reciprocal(s)
    s_inv = jnp.where(jnp.isinf(s_inv), jnp.ones_like(s_inv), s_inv)
    return jnp.clip(jnp.round(a32 * s_inv), -qmax, qmax), s


def _sym_fake_quant(a, bits: int, group_size: int, axis: int):
    """Symmetric absmax fake-quant over `axis` (groups of `group_size` along it; 0 = whole axis)."""
    if axis == 0 and group_size and group_size < a.shape[0]:
        q, s = sym_weight_codes(a, bits, group_size)
        k, n = a.shape
        return (q.reshape(k // group_size, group_size, n) * s[:, None, :]).reshape(k, n).astype(a.dtype)
    q, s = _sym_q(a.astype(jnp.float32), bits, axis)
    return (q * s).astype(a.dtype)


def fake_quant_activations(x, bits: int = 8):
    """w8a8's activation fake-quant: per token (row over the last axis)."""
    return _sym_fake_quant(x, bits, 0, axis=x.ndim - 1)


# ----------------------------------------------------------------------------- expert weights (ragged_dot)
def _ste(w, wq):
    return w + jax.lax.stop_gradient(wq - w)  # forward wq, backward identity


@dataclasses.dataclass(frozen=True)
class ExpertSTERaggedDot:
    """ragged_dot of an `ExpertLinear` (rows sorted by expert . stacked weight [E, K, N]) through the weight a scheme's
    dense QAT forward multiplies by, per expert (`fake_quant_weight` of each expert's [K, N], every group of
    `group_size` input rows its own scale; 0 = per output channel), identity backward (STE). `act_bits`: the rows
    fake-quantized per token too (w8a8), STE. Frozen and hashable: static in the graphdef, as `AqtDotGeneral`.

    `in_features`: the projection's K. Under expert parallelism (`lrmq.model.moe`'s shard_map) each chip's call holds
    its own experts, and a K split over `tensor` (down_proj's hidden dimension) arrives split: exact when every
    scale group lies within one chip's rows (`group_size` dividing the local K), refused in one line otherwise
    (per-channel scales and w8a8's per-token activation scales need the whole K)."""

    scheme: str
    group_size: int = 0
    act_bits: int | None = None
    in_features: int = 0

    def _check_local(self, k_local: int) -> None:
        if not self.in_features or k_local == self.in_features:
            return
        if self.act_bits or not self.group_size or k_local % self.group_size:
            what, fix = (("w8a8's per-token activation scales", "a weight-only scheme") if self.act_bits else
                         ("per-output-channel scales" if not self.group_size else
                          f"qat_group_size={self.group_size}'s scale groups", f"a qat_group_size dividing {k_local}"))
            raise ValueError(f"QAT {self.scheme} on expert weights: {what} need the expert projection's whole "
                             f"{self.in_features} input rows, but this chip holds {k_local} of them (expert "
                             f"parallelism with the expert hidden dimension split over tensor); use {fix} or "
                             "mesh.tensor=1")

    def quantize(self, w):
        self._check_local(w.shape[-2])
        wq = jax.vmap(lambda we: fake_quant_weight(we, self.scheme, self.group_size))(jax.lax.stop_gradient(w))
        return _ste(w, wq)

    def __call__(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None):
        if self.act_bits:
            lhs = _ste(lhs, fake_quant_activations(jax.lax.stop_gradient(lhs), self.act_bits))
        return jax.lax.ragged_dot(lhs, self.quantize(rhs), group_sizes, precision=precision,
                                  preferred_element_type=preferred_element_type)


class PerExpertTensorSTERaggedDot(nnx.Module):
    """paper_int8 on an `ExpertLinear`: each expert's weight fake-quantized per tensor with its own int8 scale, frozen
    from the base weights at load (`FrozenScale` [E], state as `PerTensorSTEDotGeneral`'s), identity backward. Under
    expert parallelism a chip's call holds its E / S experts (the expert axis' contiguous block): it takes their
    scales (elementwise with a fixed scale, so a K split over tensor changes nothing)."""

    def __init__(self, scales, bits: int = 8):
        self.scale = FrozenScale(jnp.asarray(scales, jnp.float32))
        self.bits = bits

    def quantize(self, w):
        scales = self.scale[...]
        if scales.shape[0] != w.shape[0]:  # in an expert-parallel shard_map: this chip's experts, a contiguous block
            n = w.shape[0]
            scales = jax.lax.dynamic_slice_in_dim(scales, jax.lax.axis_index(EXPERT_AXIS) * n, n)
        wq = jax.vmap(lambda we, s: fake_quant_per_tensor(we, self.bits, scale=s))(jax.lax.stop_gradient(w), scales)
        return _ste(w, wq)

    def __call__(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None):
        return jax.lax.ragged_dot(lhs, self.quantize(rhs), group_sizes, precision=precision,
                                  preferred_element_type=preferred_element_type)


def make_ragged_dot(scheme: str, w=None, *, group_size: int = 0):
    """The QAT ragged_dot of scheme `scheme` for a stacked expert weight `w` [E, K, N] (paper_int8 reads it for its
    per-expert scales; every scheme its K)."""
    if scheme == "paper_int8":
        if group_size:
            raise ValueError("qat_scheme='paper_int8' is per-tensor; qat_group_size must be 0")
        return PerExpertTensorSTERaggedDot(jax.lax.stop_gradient(jax.vmap(lambda we: per_tensor_scale(we, 8))(w)))
    if scheme not in SCHEMES:
        raise ValueError(f"unknown qat_scheme {scheme!r}; known: {list(SCHEMES)}")
    return ExpertSTERaggedDot(scheme=scheme, group_size=int(group_size), act_bits=8 if scheme == "w8a8" else None,
                              in_features=int(w.shape[-2]) if w is not None else 0)


def set_ragged_dot(el: ExpertLinear, rd) -> None:
    """Set an ExpertLinear's ragged_dot (a module as data, anything else as static: `set_dot_general`'s rule)."""
    el.ragged_dot = nnx.data(rd) if isinstance(rd, nnx.Module) else nnx.static(rd)


# ----------------------------------------------------------------------------- the transform
def make_dot_general(scheme: str, w=None, *, group_size: int = 0, stochastic_rounding: bool = False, seed: int = 0,
                     salt: int = 0):
    if scheme == "paper_int8":
        if stochastic_rounding:
            raise ValueError("qat_stochastic_rounding is not defined for qat_scheme='paper_int8' (frozen-scale "
                             "RTN, as the paper); use int8/int4/w8a8")
        if group_size:
            raise ValueError("qat_scheme='paper_int8' is per-tensor; qat_group_size must be 0")
        return PerTensorSTEDotGeneral(jax.lax.stop_gradient(per_tensor_scale(w, 8)))
    if scheme not in SCHEMES:
        raise ValueError(f"unknown qat_scheme {scheme!r}; known: {list(SCHEMES)}")
    if scheme in ASYM_SCHEMES:
        if stochastic_rounding:
            raise ValueError(f"qat_stochastic_rounding is for the AQT schemes (int8/int4/w8a8), not "
                             f"qat_scheme={scheme!r}")
        return AsymSTEDotGeneral(bits=ASYM_SCHEMES[scheme], group_size=int(group_size))
    bits = 4 if scheme == "int4" else 8
    return AqtDotGeneral(weight_bits=bits, act_bits=8 if scheme == "w8a8" else None, group_size=int(group_size),
                         stochastic_rounding=bool(stochastic_rounding), seed=int(seed), salt=salt)


def apply_qat(model, scheme: str = "paper_int8", *, pattern: str = DEFAULT_TARGETS, group_size: int = 0,
              stochastic_rounding: bool = False, seed: int = 0) -> list[str]:
    """Set the QAT dot_general on every targeted Linear and the QAT ragged_dot on every targeted mixture-of-experts
    expert projection (in place). Returns the paths touched.

    paper_int8 reads each base weight once here to fix its scale (one per expert of an expert projection).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown qat_scheme {scheme!r}; known: {list(SCHEMES)}")
    linears, experts = select_targets(model, pattern, "apply_qat")
    if experts and stochastic_rounding:
        raise ValueError(f"apply_qat: qat_stochastic_rounding quantizes AQT's backward, which has no ragged_dot: the "
                         f"targets select the expert weights {experts[0][0]}; turn it off or leave the experts out "
                         f"of quant.targets")
    touched = []
    for path, lin in linears + experts:
        w = lin.kernel[...]
        if not hasattr(w, "shape") or hasattr(w, "codes"):
            raise ValueError(f"apply_qat: {path} holds a packed weight; QAT needs float master weights")
        if group_size and w.shape[-2] % group_size:
            raise ValueError(f"apply_qat: qat_group_size={group_size} does not divide {path}'s K={w.shape[-2]}")
        if isinstance(lin, ExpertLinear):
            set_ragged_dot(lin, make_ragged_dot(scheme, w, group_size=group_size))
        else:
            dg = make_dot_general(scheme, w, group_size=group_size, stochastic_rounding=stochastic_rounding,
                                  seed=seed, salt=path_salt(path))
            set_dot_general(lin, dg)
        touched.append(path)
    return touched


def select_targets(model, pattern: str | None, what: str) -> tuple[list[tuple[str, Linear]],
                                                                 list[tuple[str, ExpertLinear]]]:
    """(Linears, mixture-of-experts ExpertLinears) whose paths `pattern` selects, for a transform that handles both
    (a router is never selected: `iter_linears`'s rule); refused in one line, as `require_linears`, when it selects
    nothing."""
    experts = iter_expert_linears(model, pattern)
    if not experts:
        return require_linears(model, pattern, what), []
    rx = re.compile(pattern) if pattern is not None else None
    linears = [(p, lin) for p, lin in iter_linears(model, None)
               if (rx is None or rx.fullmatch(p)) and not p.endswith(ROUTER_SUFFIX)]
    return linears, experts


def set_dot_general(lin: Linear, dg) -> None:
    """Set a Linear's dot_general: a module (paper_int8's, which holds its frozen scale) as data, anything
    else (functions, frozen dataclasses) as static, so a module's state leaves the model with it."""
    lin.dot_general = nnx.data(dg) if isinstance(dg, nnx.Module) else nnx.static(dg)


def remove_qat(model) -> None:
    """Restore the plain dot_general on every Linear and the plain ragged_dot on every expert projection."""
    for _, lin in iter_linears(model, None):
        set_dot_general(lin, default_dot_general)
    for _, el in iter_expert_linears(model, None):
        set_ragged_dot(el, default_ragged_dot)


def is_qat(lin: Linear | ExpertLinear) -> bool:
    if isinstance(lin, ExpertLinear):
        return isinstance(lin.ragged_dot, (ExpertSTERaggedDot, PerExpertTensorSTERaggedDot))
    return isinstance(lin.dot_general, (PerTensorSTEDotGeneral, AqtDotGeneral, AsymSTEDotGeneral))
