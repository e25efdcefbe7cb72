"""Walk a model's `Linear` modules by a regex over dotted module paths (`layers.3.attn.q_proj`).

All quantization transforms (`apply_qat`, `apply_lora`, `quantize_linears`, PTQ methods) select their
targets with `iter_linears(model, pattern)`; the model code never changes.
"""

from __future__ import annotations

import re

from flax import nnx

from lrmq.model.linear import Linear
from lrmq.model.params import LOGICAL_AXES_KEY

# QuantSection.targets' default: the seven projections of every layer; lm_head is never matched.
DEFAULT_TARGETS = r".*\.(q|k|v|o|gate|up|down)_proj$"


def path_str(path) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def iter_linears(model: nnx.Module, pattern: str | None = DEFAULT_TARGETS) -> list[tuple[str, Linear]]:
    """[(path, Linear)] in module order whose dotted path fully matches `pattern` (None: all Linears)."""
    rx = re.compile(pattern) if pattern is not None else None
    out = []
    for path, mod in nnx.iter_graph(model):
        if isinstance(mod, Linear):
            p = path_str(path)
            if rx is None or rx.fullmatch(p):
                out.append((p, mod))
    return out


def require_linears(model: nnx.Module, pattern: str | None, what: str) -> list[tuple[str, Linear]]:
    found = iter_linears(model, pattern)
    if not found:
        names = [p for p, _ in iter_linears(model, None)][:8]
        raise ValueError(f"{what}: the target regex {pattern!r} matches no Linear module; module paths look like "
                         f"{names}")
    return found


def kernel_axes(lin: Linear) -> tuple[str | None, str | None]:
    """Logical (in, out) axes of a Linear's kernel (from its Param or QuantizedKernel metadata)."""
    axes = lin.kernel.get_metadata().get(LOGICAL_AXES_KEY)
    return tuple(axes) if axes is not None else (None, None)


def module_at(model: nnx.Module, path: str):
    m = model
    for k in path.split("."):
        m = m[int(k)] if k.isdigit() else getattr(m, k)
    return m
