"""The linear seam: every projection in the model goes through `Linear`.

The weight representation (float `nnx.Param`, or a packed `QuantizedWeight`), the `dot_general`
(plain, or an AQT quantized one for QAT) and an optional LoRA adapter are attributes that
transforms in `lrmq.quant` set by module path. The model code never changes.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from lrmq.model.params import LOGICAL_AXES_KEY, param


def default_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, axes: tuple[str | None, str | None],
                 dtype, param_dtype, rngs: nnx.Rngs, init_std: float = 0.02):
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        key = rngs.params()
        self.kernel = param(init_std * jax.random.normal(key, (in_features, out_features), param_dtype), axes)
        self.bias = param(jnp.zeros((out_features,), param_dtype), (axes[1],)) if use_bias else None
        self.dot_general: Callable = default_dot_general
        self.lora = None  # lrmq.quant.lora.LoRA when adapters are attached

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        w = self.kernel.get_value()  # QuantizedKernel holds a pytree: not subscriptable
        if _is_quantized(w):
            from lrmq.quant.qmatmul import qmatmul  # packed weights: Pallas kernels / XLA fallback
            # logical axes: how the kernel call is partitioned on a multi-device mesh
            y = qmatmul(x, w, axes=self.kernel.get_metadata().get(LOGICAL_AXES_KEY))
        else:
            y = self.dot_general(x, w.astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ())))
        y = y.astype(self.dtype)
        if self.lora is not None:
            y = y + self.lora(x).astype(self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y

    def float_weight(self) -> jax.Array:
        """The [in, out] weight as float (dequantized if packed), without adapters."""
        w = self.kernel.get_value()  # QuantizedKernel holds a pytree: not subscriptable
        if _is_quantized(w):
            from lrmq.quant.qweight import dequantize
            return dequantize(w)
        return w


def _is_quantized(w) -> bool:
    return not isinstance(w, (jax.Array, jnp.ndarray)) and hasattr(w, "codes")
