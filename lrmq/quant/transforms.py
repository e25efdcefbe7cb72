"""Walk a model's `Linear` modules and swap their kernels.

All quantization transforms (`apply_qat`, `apply_lora`, `quantize_linears`, PTQ methods) select their
targets with `iter_linears(model, pattern)`, a regex over dotted module paths
(`layers.3.attn.q_proj`); the model code never changes. A kernel is swapped for a packed
`QuantizedKernel` (`set_packed_kernel`) or back to a float `nnx.Param` (`restore_float_kernel`),
keeping its logical axes and the mesh it lives on. Mixture-of-experts expert projections (`ExpertLinear`, one
stacked [E, in, out] kernel) are selected separately, by `iter_expert_linears`, and packed whole
(`set_packed_expert_kernel`: a `QuantizedExpertKernel`, every array with a leading "expert" axis).

Sharding of packed weights (when a mesh is given or the float kernel was sharded): every array is
placed by `qweight_shardings` from its format's `array_axes` (`lrmq.quant.formats`): int
codes/scales/zeros `[rows, N]` get (in-axis, out-axis) of the kernel; NF4 codes `[N, K/2]` get
(out-axis, in-axis); NF4 per-block absmax / absmax codes (flat, N-major) are split along the
out-axis' mesh axes when the length divides; the tiny double-quant second-level scales and offset
are replicated. Any axis the mesh does not divide stays replicated (`logical_to_spec`).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from lrmq.model.linear import ExpertLinear, Linear
from lrmq.quant.formats import array_axes
from lrmq.quant.qkernel import QuantizedExpertKernel, QuantizedKernel
from lrmq.quant.qweight import QuantizedWeight
from lrmq.sharding import LOGICAL_AXES_KEY, logical_to_spec

# QuantSection.targets' default: the seven projections of every layer; lm_head is never matched.
DEFAULT_TARGETS = r".*\.(q|k|v|o|gate|up|down)_proj$"
# A mixture-of-experts router (`layers.N.mlp.router`) is never a target, whatever the regex (llmcompressor's
# convention: the gate stays in float).
ROUTER_SUFFIX = ".mlp.router"
ATTENTION_TARGETS = r".*\.(q|k|v|o)_proj$"


def path_str(path) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def iter_linears(model: nnx.Module, pattern: str | None = DEFAULT_TARGETS) -> list[tuple[str, Linear]]:
    """[(path, Linear)] in module order whose dotted path fully matches `pattern` (None: all Linears, routers
    included). A regex never selects a router; one that selects a mixture-of-experts expert projection
    (`layers.N.mlp.experts.gate_proj`, an `ExpertLinear`) is refused, so a transform written for Linears never
    skips the experts silently: one that quantizes or adapts experts selects them with `iter_expert_linears`."""
    rx = re.compile(pattern) if pattern is not None else None
    out = []
    for path, mod in nnx.iter_graph(model):
        p = path_str(path)
        if isinstance(mod, ExpertLinear) and rx is not None and rx.fullmatch(p):
            raise ValueError(f"the target regex {pattern!r} selects the mixture-of-experts expert weights {p}, "
                             f"which this step does not handle (it transforms Linear modules only); leave them out "
                             f"(e.g. {ATTENTION_TARGETS!r})")
        if isinstance(mod, Linear) and (rx is None or (rx.fullmatch(p) and not p.endswith(ROUTER_SUFFIX))):
            out.append((p, mod))
    return out


def iter_expert_linears(model: nnx.Module, pattern: str | None = DEFAULT_TARGETS) -> list[tuple[str, ExpertLinear]]:
    """[(path, ExpertLinear)] in module order whose dotted path (`layers.N.mlp.experts.gate_proj`) fully matches
    `pattern` (None: all): a mixture-of-experts layer's stacked expert projections, each one kernel [E, in, out]
    (`DEFAULT_TARGETS` matches all three of every sparse layer). `iter_linears` refuses them; a transform that
    handles experts selects them here."""
    rx = re.compile(pattern) if pattern is not None else None
    return [(p, mod) for p, mod in ((path_str(path), mod) for path, mod in nnx.iter_graph(model))
            if isinstance(mod, ExpertLinear) and (rx is None or rx.fullmatch(p))]


def require_linears(model: nnx.Module, pattern: str | None, what: str) -> list[tuple[str, Linear]]:
    found = iter_linears(model, pattern)
    if not found:
        names = [p for p, _ in iter_linears(model, None)][:8]
        raise ValueError(f"{what}: the target regex {pattern!r} matches no Linear module; module paths look like "
                         f"{names}")
    return found


def kernel_axes(lin: Linear | ExpertLinear) -> tuple:
    """Logical axes of a Linear's kernel, (in, out) (from its Param or QuantizedKernel metadata); an
    ExpertLinear's are ("expert", in, out)."""
    axes = lin.kernel.get_metadata().get(LOGICAL_AXES_KEY)
    return tuple(axes) if axes is not None else (None,) * len(lin.kernel.get_value().shape)  # an array or a packed weight


def module_at(model: nnx.Module, path: str):
    m = model
    for k in path.split("."):
        m = m[int(k)] if k.isdigit() else getattr(m, k)
    return m


# ----------------------------------------------------------------------------- kernel swaps
def is_packed(lin: Linear | ExpertLinear) -> bool:
    return isinstance(lin.kernel, QuantizedKernel)


def mesh_of(arr):
    """The mesh of a NamedSharding-placed array (None otherwise)."""
    sh = getattr(arr, "sharding", None)
    return sh.mesh if isinstance(sh, NamedSharding) else None


def qweight_shardings(qw: QuantizedWeight, axes, mesh) -> QuantizedWeight:
    """A QuantizedWeight-shaped pytree of NamedShardings (see the module docstring)."""
    return jax.tree.map(lambda a, names: NamedSharding(mesh, logical_to_spec(names, a.shape, mesh)),
                        qw, array_axes(qw, axes))


def place_qweight(qw: QuantizedWeight, axes, mesh) -> QuantizedWeight:
    sh = qweight_shardings(qw, axes, mesh)
    return jax.tree.map(lambda a, s: jax.device_put(a, s), qw, sh)


def set_packed_kernel(lin: Linear, qw: QuantizedWeight, mesh=None) -> None:
    """Replace a Linear's kernel by a QuantizedKernel (float kernel dropped), keeping its logical axes."""
    _set_packed(lin, qw, (lin.in_features, lin.out_features), QuantizedKernel, mesh)


def set_packed_expert_kernel(el: ExpertLinear, qw: QuantizedWeight, mesh=None) -> None:
    """Replace an ExpertLinear's stacked float kernel by a `QuantizedExpertKernel` holding the stacked-experts `qw`
    (shape (E, in, out): `formats.quantize_weight` of the [E, in, out] kernel, or `stack_experts` of per-expert
    weights), keeping its logical axes ("expert", in, out) and the mesh it lives on (as `set_packed_kernel`)."""
    _set_packed(el, qw, (el.num_experts, el.in_features, el.out_features), QuantizedExpertKernel, mesh)


def _set_packed(mod, qw: QuantizedWeight, want: tuple, cls, mesh) -> None:
    if tuple(qw.shape) != want:
        expert = isinstance(mod, ExpertLinear)
        raise ValueError(f"packed {'expert ' if expert else ''}weight shape {qw.shape} != {type(mod).__name__} {want}"
                         f"{' (experts, in, out)' if expert else ''}")
    axes = kernel_axes(mod)
    mesh = mesh if mesh is not None else mesh_of(mod.kernel.get_value() if not is_packed(mod) else None)
    if mesh is not None:
        qw = place_qweight(qw, axes, mesh)
    mod.kernel = cls(qw, **{LOGICAL_AXES_KEY: axes})


def restore_float_kernel(model, lin: Linear | ExpertLinear, w, dtype=None) -> None:
    """Set a float [K, N] `nnx.Param` kernel (an ExpertLinear's: [E, K, N]) (param dtype of the model unless
    `dtype`), keeping axes and the mesh of the current kernel (sharded by its logical axes)."""
    axes = kernel_axes(lin)
    cfg = getattr(model, "cfg", None)
    dt = jnp.dtype(dtype or (cfg.param_dtype if cfg is not None else jnp.float32))
    w = jnp.asarray(w).astype(dt)
    leaves = jax.tree.leaves(lin.kernel.get_value())
    mesh = mesh_of(leaves[0]) if leaves else None
    if mesh is not None:
        w = jax.device_put(w, NamedSharding(mesh, logical_to_spec(axes, w.shape, mesh)))
    lin.kernel = nnx.Param(w, **{LOGICAL_AXES_KEY: axes})
