"""Round-to-nearest quantization of a model's Linears, without calibration: the one RTN of lrmq.

:func:`quantize_linear` is the int quantizer every PTQ method ends with (AWQ / QuantLRM quantize
their scaled and clipped weights with it; ``rtn`` and ``int8`` are it alone): llm-awq's
``pseudo_quantize_tensor`` (asymmetric) or lrmq's symmetric quantizer, groups along K. It returns
the fake-quant float32 weight and the packed ``QuantizedWeight`` from one set of codes, so
``dequantize(packed) == fake`` bit for bit. :func:`nf4_quantize_model` is the same for bitsandbytes
NF4 (double quantization).

The model-level functions write the fake-quant weights into the model in place (cast to each
kernel's dtype) and return a :class:`PTQResult` with the packed weights.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from lrmq.ptq.result import PTQResult
from lrmq.quant import packing
from lrmq.quant.quantizers import compute_qparams, dequantize_codes, quantize_codes, resolve_group_size
from lrmq.quant.formats import PER_TENSOR, WeightFormat, dequantize, quantize_weight
from lrmq.quant.qweight import QuantizedWeight, stack_experts
from lrmq.quant.transforms import DEFAULT_TARGETS, iter_expert_linears, iter_linears


def targeted(model, targets: str):
    """[(path, module)] of every Linear and every mixture-of-experts ExpertLinear (its stacked [E, K, N] experts,
    quantized per expert) whose path matches ``targets``, in module order; a router is never among them."""
    found = iter_expert_linears(model, targets)
    dense = iter_linears(model, f"(?!.*\\.mlp\\.experts\\.)(?:{targets})") if found else iter_linears(model, targets)
    return dense + found


def quantize_experts(w, bits: int, group_size: int, symmetric: bool):
    """:func:`quantize_linear` of each expert's [K, N] slice of a stacked [E, K, N] weight: (fake-quant float32
    [E, K, N], stacked-experts QuantizedWeight)."""
    outs = [quantize_linear(w[e], bits, group_size, symmetric) for e in range(w.shape[0])]
    return jnp.stack([fq for fq, _ in outs]), stack_experts([qw for _, qw in outs])


@partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "per_tensor"))
def _quantize_jit(w, bits, group_size, symmetric, per_tensor=False):
    scales, zeros = compute_qparams(w, bits, 0 if per_tensor else group_size, symmetric)
    codes = quantize_codes(w, scales, zeros, bits, group_size)
    return dequantize_codes(codes, scales, zeros, group_size, jnp.float32), codes, scales, zeros


def quantize_linear(w, bits: int, group_size: int, symmetric: bool):
    """(fake-quant float32 weight, packed QuantizedWeight) of a [K, N] weight, from one set of codes
    (the functions of ``quantize_weight``); ``group_size`` -1 = per output channel, 0 = per tensor (one scale and
    zero, stored per channel: the same value in every column)."""
    w = jnp.asarray(w, jnp.float32)
    per_tensor = group_size == 0
    g = resolve_group_size(w.shape, -1 if per_tensor else group_size)
    packing.packed_rows(w.shape[0], bits)  # fail early with a shape message
    fq, codes, scales, zeros = _quantize_jit(w, bits, g, symmetric, per_tensor)
    qw = QuantizedWeight(codes=jnp.asarray(packing.pack(np.asarray(codes), bits)), scales=scales, zeros=zeros,
                         fmt="int", bits=bits, group_size=g, shape=tuple(int(d) for d in w.shape), dtype="float32",
                         symmetric=bool(symmetric), double_quant=False)
    return fq, qw


def _set_kernel(lin, w) -> None:
    lin.kernel.set_value(jnp.asarray(w).astype(lin.kernel.get_value().dtype))


def rtn_quantize_model(model, *, bits: int = 4, group_size: int = 128, symmetric: bool = False,
                       targets: str = DEFAULT_TARGETS, method: str = "rtn") -> PTQResult:
    """Round-to-nearest int of every Linear whose path matches ``targets`` (default: the seven
    projections of every layer; AWQ's alpha=0 without clipping); a mixture-of-experts layer's experts per expert
    (``targeted``), its router never."""
    result = PTQResult(method=method, packed={}, bits=bits, group_size=group_size, symmetric=symmetric)
    for path, lin in targeted(model, targets):
        w = lin.float_weight()
        quantize = quantize_experts if w.ndim == 3 else quantize_linear
        fq, result.packed[path] = quantize(w, bits, group_size, symmetric)
        _set_kernel(lin, fq)
    if group_size == PER_TENSOR:  # the arrays say per channel; the format is one scale per tensor
        result.weight_format = WeightFormat(bits=bits, group_size=PER_TENSOR, symmetric=bool(symmetric), scheme=method)
    return result


def nf4_quantize_model(model, *, block_size: int = 64, targets: str = DEFAULT_TARGETS) -> PTQResult:
    """bitsandbytes NF4 with double quantization (``block_size`` values per absmax) of every targeted Linear."""
    result = PTQResult(method="nf4", packed={}, bits=4, group_size=block_size, symmetric=True)
    for path, lin in targeted(model, targets):
        qw = quantize_weight(lin.float_weight(), fmt="nf4", bits=4, block_size=block_size, double_quant=True)
        result.packed[path] = qw
        _set_kernel(lin, dequantize(qw))
    return result
