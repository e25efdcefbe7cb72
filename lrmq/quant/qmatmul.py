"""`qmatmul(x, qw)`: activations times a packed `QuantizedWeight`, differentiable w.r.t. `x` only.

Dispatch (docs/DESIGN.md "Kernels"):

* int4 (`fmt="int"`, bits 4)          -> `pallas_kernels.int4_matmul(x, codes, scales, zeros, group_size)`
* 8-bit (`fmt="int"`, bits 8)         -> `pallas_kernels.int8_matmul(x, codes, scales, zeros)`
* NF4 (`fmt="nf4"`, K % block == 0)   -> `pallas_kernels.nf4_matmul(x, codes, absmax, block_size)`; the
  absmax is `qw.scales`, already dequantized from the double-quant state at quantization time
* anything else (int 2/3/5/6/7 bits, NF4 whose blocks straddle rows) -> dequantize in XLA, then dot,
  with the weight behind `stop_gradient` (the packed base is frozen).

Each kernel picks TPU / GPU / XLA by backend; on CPU they run the XLA reference path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lrmq.quant.qweight import QuantizedWeight, dequantize


def _dequant_dot(x, qw: QuantizedWeight):
    w = jax.lax.stop_gradient(dequantize(qw)).astype(x.dtype)
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def qmatmul_path(qw: QuantizedWeight) -> str:
    """Which path `qmatmul` takes for this weight: 'int4' | 'int8' | 'nf4' | 'dequant'."""
    if qw.fmt == "nf4":
        return "nf4" if qw.K % qw.block_size == 0 else "dequant"
    if qw.fmt == "int" and qw.bits == 4:
        return "int4"
    if qw.fmt == "int" and qw.bits == 8:
        return "int8"
    return "dequant"


def qmatmul(x: jax.Array, qw: QuantizedWeight, *, impl: str = "auto") -> jax.Array:
    """y[..., N] = x[..., K] @ dequantize(qw)[K, N]; gradient w.r.t. x only."""
    if x.shape[-1] != qw.K:
        raise ValueError(f"qmatmul: x has {x.shape[-1]} features, the weight expects K={qw.K} (shape {qw.shape})")
    import pallas_kernels as pk

    path = qmatmul_path(qw)
    if path == "int4":
        y = pk.int4_matmul(x, qw.codes, qw.scales, qw.zeros, qw.group_size, impl=impl)
    elif path == "int8":
        y = pk.int8_matmul(x, qw.codes, qw.scales, qw.zeros, impl=impl)
    elif path == "nf4":
        y = pk.nf4_matmul(x, qw.codes, qw.scales, qw.block_size, impl=impl)
    else:
        y = _dequant_dot(x, qw)
    return y.astype(x.dtype)
