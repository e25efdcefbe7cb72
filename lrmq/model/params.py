"""Parameters carry logical axis names; `lrmq.sharding` maps them onto the mesh."""

from __future__ import annotations

from flax import nnx

LOGICAL_AXES_KEY = "logical_axes"


def param(value, axes: tuple[str | None, ...]) -> nnx.Param:
    """An nnx.Param annotated with logical axes (e.g. ("embed", "mlp")).

    We keep our own metadata key rather than flax's eager `sharding` so models build outside a mesh
    and the annotation survives flax's renames across versions.
    """
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {axes} do not match parameter shape {value.shape}")
    return nnx.Param(value, **{LOGICAL_AXES_KEY: tuple(axes)})
