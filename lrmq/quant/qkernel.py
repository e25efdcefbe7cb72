"""`QuantizedKernel`: the nnx variable holding a Linear's packed weight; it brings its own matmul.

`lrmq.model.linear.Linear` calls `kernel.packed_matmul(x)` when its kernel variable has one (the
weight representation chooses the matmul, as `dot_general` does for float kernels), so the model
imports nothing from `lrmq.quant`. `QuantizedExpertKernel` is its stacked-experts form: a mixture-of-experts
`ExpertLinear` calls `kernel.packed_ragged_dot(x, group_sizes)` the same way.
"""

from __future__ import annotations

import jax
from flax import nnx

from lrmq.quant.formats import array_axes, dequantize
from lrmq.quant.qmatmul import expert_shard, local_expert_weight, qmatmul, qragged_dot
from lrmq.sharding import LOGICAL_AXES_KEY


class QuantizedKernel(nnx.Variable):
    """Non-trainable nnx variable holding one `QuantizedWeight` (read it with `.get_value()`).

    A Variable may hold any pytree in flax 0.12: it survives nnx.split/merge, nnx.jit / jax.jit of the
    split state, and orbax StandardSave/StandardRestore of `nnx.state(model)` (tests/test_qweight.py).
    It is not an `nnx.Param`, so optimizers filtering on Param / LoRAParam never see it.
    """

    def packed_matmul(self, x: jax.Array) -> jax.Array:
        """x @ W through the Pallas kernels (or XLA dequant); the logical axes decide how the kernel
        call is partitioned on a multi-device mesh."""
        return qmatmul(x, self.get_value(), axes=self.get_metadata().get(LOGICAL_AXES_KEY))

    def dequantized(self) -> jax.Array:
        """The [K, N] float weight."""
        return dequantize(self.get_value())

    def array_axes(self, lead: int = 0):
        """The logical axes of each packed array (`formats.array_axes`), for `lrmq.sharding`'s layouts;
        `lead`: a stacked layer axis in front."""
        return array_axes(self.get_value(), self.get_metadata().get(LOGICAL_AXES_KEY), lead)


class QuantizedExpertKernel(QuantizedKernel):
    """The packed kernel of an `ExpertLinear`: one stacked-experts `QuantizedWeight` (shape (E, K, N), every array
    with a leading expert axis; logical axes ("expert", in, out)). A `QuantizedKernel` for everything that stores,
    shards or copies packed weights (checkpoints, `lrmq.sharding`, rollout copies); its matmul is the grouped one."""

    def packed_ragged_dot(self, x: jax.Array, group_sizes: jax.Array, local=None) -> jax.Array:
        """Rows of x [M, K] sorted by expert (`group_sizes[e]` rows of expert e, in order) times their expert's
        weight: `qmatmul.qragged_dot` (a grouped Pallas kernel on TPU, else dequantize + `jax.lax.ragged_dot`).
        `local`: inside an expert-parallel shard_map, (this chip's shards of the arrays, the local shape) as
        `shard_specs` split them; the local experts' grouped matmul."""
        qw = self.get_value() if local is None else local_expert_weight(*local)
        return qragged_dot(x, qw, group_sizes, axes=self.get_metadata().get(LOGICAL_AXES_KEY))

    def shard_specs(self, mesh, expert: str, mlp: tuple):
        """(shard_map in_specs of the packed arrays, the local shape) for an expert-parallel layer, or None where
        the hidden (`mlp`) split would not keep whole groups a chip (`qmatmul.expert_shard`)."""
        return expert_shard(self.get_value(), self.get_metadata().get(LOGICAL_AXES_KEY), mesh, expert, mlp)

    def packed_matmul(self, x: jax.Array) -> jax.Array:
        raise TypeError("a QuantizedExpertKernel (stacked experts) has no plain matmul; ExpertLinear calls "
                        "packed_ragged_dot(x, group_sizes)")

    def dequantized(self) -> jax.Array:
        """The [E, K, N] float weight."""
        return dequantize(self.get_value())
