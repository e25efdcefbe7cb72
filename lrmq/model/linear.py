"""The linear seam: every projection in the model goes through `Linear` (the experts of a mixture-of-experts
block through `ExpertLinear`, its stacked-kernel form).

The weight representation (float `nnx.Param`, or a packed `lrmq.quant.qkernel.QuantizedKernel`),
the `dot_general` (plain, or an AQT quantized one for QAT) and an optional LoRA adapter are
attributes that transforms in `lrmq.quant` set by module path. The model code never changes, and
imports nothing from `lrmq.quant`: a packed kernel variable brings its own `packed_matmul` and
`dequantized`, as a float kernel arrives with `dot_general`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from lrmq.model.params import param


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
        if _is_packed(self.kernel):
            y = self.kernel.packed_matmul(x)
        else:
            w = self.kernel.get_value()
            y = self.dot_general(x, w.astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ())))
        y = y.astype(self.dtype)
        if self.lora is not None:
            y = y + self.lora(x).astype(self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y

    def float_weight(self) -> jax.Array:
        """The [in, out] weight as float (dequantized if packed), without adapters."""
        return self.kernel.dequantized() if _is_packed(self.kernel) else self.kernel.get_value()


def _is_packed(kernel) -> bool:
    # Looked up on the class: nnx.Variable forwards unknown attributes to its value.
    return callable(getattr(type(kernel), "packed_matmul", None))


def default_ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                              preferred_element_type=preferred_element_type)


class ExpertLinear(nnx.Module):
    """`num_experts` bias-free [in, out] projections, one per expert, stacked into one [experts, in, out] kernel,
    applied as a grouped matmul: `__call__(x, group_sizes)` takes rows sorted by expert (`group_sizes[e]` rows of
    expert e, in expert order) and multiplies each group by its expert's kernel (`ragged_dot`, the seam a
    quantized form replaces as `Linear.dot_general`; a packed kernel brings its own `packed_ragged_dot`, as a packed
    `Linear` kernel its `packed_matmul`; an optional adapter, `lora(x, group_sizes)`, adds its grouped low-rank
    term on the same rows, as `Linear.lora`). The expert axis leads, with logical axis "expert", so an
    expert mesh axis and per-expert quantization address it as one dimension."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, axes: tuple[str | None, str | None],
                 dtype, param_dtype, rngs: nnx.Rngs, init_std: float = 0.02):
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.dtype = dtype
        shape = (num_experts, in_features, out_features)
        self.kernel = param(init_std * jax.random.normal(rngs.params(), shape, param_dtype), ("expert", *axes))
        self.ragged_dot: Callable = default_ragged_dot
        self.lora = None  # lrmq.quant.lora.ExpertLoRA (stacked per-expert adapters) when attached

    def __call__(self, x: jax.Array, group_sizes: jax.Array, kernel=None, lora=None) -> jax.Array:
        """`kernel` / `lora`: inside an expert-parallel shard_map (`lrmq.model.moe`), this chip's share of the kernel
        (the float [E / S, in, out] array, or a packed kernel's (arrays, local shape)) and of the adapter's factors
        (a, b); None: the variables' own values."""
        x = x.astype(self.dtype)
        if is_packed_experts(self.kernel):
            y = self.kernel.packed_ragged_dot(x, group_sizes, local=kernel).astype(self.dtype)
        else:
            w = self.kernel.get_value() if kernel is None else kernel
            y = self.ragged_dot(x, w.astype(self.dtype), group_sizes).astype(self.dtype)
        if self.lora is not None:  # the adapter brings its own grouped call over the same sorted rows
            y = y + self.lora(x, group_sizes, factors=lora).astype(self.dtype)
        return y

    def float_weight(self) -> jax.Array:
        """The [experts, in, out] weight as float (dequantized if packed)."""
        return self.kernel.dequantized() if is_packed_experts(self.kernel) else self.kernel.get_value()


def is_packed_experts(kernel) -> bool:
    # As `_is_packed`: a packed stacked-experts kernel variable (lrmq.quant.qkernel.QuantizedExpertKernel) brings
    # its own grouped matmul.
    return callable(getattr(type(kernel), "packed_ragged_dot", None))
