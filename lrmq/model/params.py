"""Parameters carry logical axis names; `lrmq.sharding` (which owns the metadata key) maps them onto the mesh."""

from __future__ import annotations

from flax import nnx

from lrmq.sharding import LOGICAL_AXES_KEY


def param(value, axes: tuple[str | None, ...]) -> nnx.Param:
    """An nnx.Param annotated with logical axes (e.g. ("embed", "mlp")) under `lrmq.sharding.LOGICAL_AXES_KEY`."""
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {axes} do not match parameter shape {value.shape}")
    return nnx.Param(value, **{LOGICAL_AXES_KEY: tuple(axes)})
