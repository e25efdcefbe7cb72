"""Train-mode preparation (QAT / QLoRA), packing Linears, float export and the memory report.

* `prepare_for_training(model, qcfg, *, seed, mesh=None)`:
  - ``qat``: `apply_qat` (float master weights stay `nnx.Param`s; only the dot_generals change).
  - ``qlora``: every targeted Linear's kernel becomes a packed `QuantizedKernel` (NF4 + double quant,
    block 64, or int4 asymmetric with `base_group_size`); the float kernel is dropped. Then LoRA
    adapters (`nnx.LoRAParam`) are attached.
* `quantize_linears(model, qweights)` installs given QuantizedWeights (used by the PTQ CLI too).
* `export_float_model(model)`: merge adapters, dequantize packed kernels, reset dot_generals: a plain
  float Decoder (in place; also returned) that `save_hf_model` accepts.
* `param_bytes(model)`: {"base", "adapters", "total", "linears"} bytes of the variables.

Sharding of packed weights (when `mesh` is given or the float kernel was sharded): every array is
placed by `qweight_shardings`: int codes/scales/zeros `[rows, N]` get (in-axis, out-axis) of the kernel;
NF4 codes `[N, K/2]` get (out-axis, in-axis); NF4 per-block absmax / absmax codes (flat, N-major) are
split along the out-axis' mesh axes when the length divides; the tiny double-quant second-level scales
and offset are replicated. Any axis the mesh does not divide stays replicated (`logical_to_spec`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lrmq.checkpoint.hf import host_array
from lrmq.model.linear import Linear, default_dot_general
from lrmq.model.params import LOGICAL_AXES_KEY
from lrmq.quant.qweight import QuantizedKernel, QuantizedWeight, quantize_weight
from lrmq.quant.transforms import iter_linears, kernel_axes, require_linears

BASE_FORMATS = ("nf4", "int4")


# ----------------------------------------------------------------------------- sharding of packed weights
def _mesh_of(arr):
    sh = getattr(arr, "sharding", None)
    return sh.mesh if isinstance(sh, NamedSharding) else None


def qweight_shardings(qw: QuantizedWeight, axes, mesh) -> QuantizedWeight:
    """A QuantizedWeight-shaped pytree of NamedShardings (see the module docstring)."""
    from lrmq.sharding import logical_to_spec

    ax_in, ax_out = (tuple(axes) if axes is not None else (None, None))

    def spec_for(name, a):
        if a is None:
            return None
        if qw.fmt == "int" and a.ndim == 2:
            return logical_to_spec((ax_in, ax_out), a.shape, mesh)
        if qw.fmt == "nf4" and name == "codes":
            return logical_to_spec((ax_out, ax_in), a.shape, mesh)
        if qw.fmt == "nf4" and name in ("scales", "absmax_codes") and a.ndim == 1:
            return logical_to_spec((ax_out,), a.shape, mesh)
        return P()

    fields = {k: (NamedSharding(mesh, spec_for(k, getattr(qw, k))) if getattr(qw, k) is not None else None)
              for k in ("codes", "scales", "zeros", "absmax_codes", "absmax_scales", "absmax_offset")}
    return qw.replace(**fields)


def place_qweight(qw: QuantizedWeight, axes, mesh) -> QuantizedWeight:
    sh = qweight_shardings(qw, axes, mesh)
    return jax.tree.map(lambda a, s: jax.device_put(a, s), qw, sh)


# ----------------------------------------------------------------------------- kernels in / out
def set_packed_kernel(lin: Linear, qw: QuantizedWeight, mesh=None) -> None:
    """Replace a Linear's kernel by a QuantizedKernel (float kernel dropped), keeping its logical axes."""
    if tuple(qw.shape) != (lin.in_features, lin.out_features):
        raise ValueError(f"packed weight shape {qw.shape} != Linear ({lin.in_features}, {lin.out_features})")
    axes = kernel_axes(lin)
    mesh = mesh if mesh is not None else _mesh_of(lin.kernel.get_value() if not _packed(lin) else None)
    if mesh is not None:
        qw = place_qweight(qw, axes, mesh)
    lin.kernel = QuantizedKernel(qw, **{LOGICAL_AXES_KEY: axes})


def restore_float_kernel(model, lin: Linear, w, dtype=None) -> None:
    """Set a float [K, N] `nnx.Param` kernel (param dtype of the model unless `dtype`), keeping axes and
    the mesh of the current kernel (sharded by its logical axes)."""
    from lrmq.sharding import logical_to_spec

    axes = kernel_axes(lin)
    cfg = getattr(model, "cfg", None)
    dt = jnp.dtype(dtype or (cfg.param_dtype if cfg is not None else jnp.float32))
    w = jnp.asarray(w).astype(dt)
    cur = lin.kernel.get_value()
    leaves = jax.tree.leaves(cur)
    mesh = _mesh_of(leaves[0]) if leaves else None
    if mesh is not None:
        w = jax.device_put(w, NamedSharding(mesh, logical_to_spec(axes, w.shape, mesh)))
    lin.kernel = nnx.Param(w, **{LOGICAL_AXES_KEY: axes})


def _packed(lin: Linear) -> bool:
    return isinstance(lin.kernel, QuantizedKernel)


def quantize_linears(model, qweights: dict[str, QuantizedWeight], *, mesh=None) -> list[str]:
    """Install {module path: QuantizedWeight} (in place)."""
    from lrmq.quant.transforms import module_at

    for path, qw in qweights.items():
        lin = module_at(model, path)
        if not isinstance(lin, Linear):
            raise ValueError(f"{path} is not a Linear")
        set_packed_kernel(lin, qw, mesh)
    return list(qweights)


def pack_base(model, pattern: str, base_format: str = "nf4", base_group_size: int = 64, *, mesh=None) -> list[str]:
    """Quantize every targeted Linear's float kernel into a packed QuantizedKernel (QLoRA base)."""
    if base_format not in BASE_FORMATS:
        raise ValueError(f"unknown base_format {base_format!r}; known: {list(BASE_FORMATS)}")
    done = []
    for path, lin in require_linears(model, pattern, "prepare_for_training(qlora)"):
        if _packed(lin):
            continue
        w = lin.kernel.get_value()
        # quantize on one device, placed again below; abstract (traced) weights stay as they are, so the
        # packed layout of a model can be built without its weights (lrmq.aot)
        w_local = w if isinstance(w, jax.core.Tracer) else jnp.asarray(host_array(w))
        if base_format == "nf4":
            qw = quantize_weight(w_local, fmt="nf4", bits=4, block_size=64, double_quant=True)
        else:
            if w_local.shape[0] % base_group_size:
                raise ValueError(f"base_group_size={base_group_size} does not divide {path}'s K={w_local.shape[0]}")
            qw = quantize_weight(w_local, fmt="int", bits=4, group_size=base_group_size, symmetric=False)
        set_packed_kernel(lin, qw, mesh if mesh is not None else _mesh_of(w))
        done.append(path)
    return done


# The packed layouts served by the Pallas kernels, by name (`pack_linears`, `lrmq.generate --pack`).
PACKINGS = {
    "int4": dict(fmt="int", bits=4, group_size=128, symmetric=False),
    "int8": dict(fmt="int", bits=8, group_size=-1, symmetric=False),
    "nf4": dict(fmt="nf4", bits=4, block_size=64, double_quant=True),
}


def pack_linears(model, packing: str, pattern: str | None = None, *, mesh=None) -> list[str]:
    """Round-to-nearest pack every targeted Linear (default: the seven projections) in a PACKINGS layout."""
    from lrmq.quant.transforms import DEFAULT_TARGETS

    if packing not in PACKINGS:
        raise ValueError(f"unknown packing {packing!r}; known: {sorted(PACKINGS)}")
    done = []
    for path, lin in require_linears(model, pattern or DEFAULT_TARGETS, "pack_linears"):
        w = lin.kernel.get_value()
        qw = quantize_weight(w if isinstance(w, jax.core.Tracer) else jnp.asarray(host_array(w)),
                             **PACKINGS[packing])
        set_packed_kernel(lin, qw, mesh if mesh is not None else _mesh_of(w))
        done.append(path)
    return done


# ----------------------------------------------------------------------------- public entry points
def prepare_for_training(model, qcfg, *, seed: int = 0, mesh=None):
    """Apply `QuantSection` `qcfg` to `model` in place and return it (see the module docstring)."""
    mode = qcfg.mode
    if mode == "none":
        return model
    if mode == "qat":
        from lrmq.quant.qat import apply_qat

        apply_qat(model, qcfg.qat_scheme, pattern=qcfg.targets, group_size=qcfg.qat_group_size,
                  stochastic_rounding=qcfg.qat_stochastic_rounding, seed=seed)
        return model
    if mode == "qlora":
        from lrmq.quant.lora import apply_lora

        pack_base(model, qcfg.targets, qcfg.base_format, qcfg.base_group_size, mesh=mesh)
        apply_lora(model, qcfg.targets, rank=qcfg.lora_rank, alpha=qcfg.lora_alpha, dropout=qcfg.lora_dropout,
                   rngs=nnx.Rngs(params=seed), seed=seed, mesh=mesh)
        return model
    raise ValueError(f"unknown quant.mode {mode!r}; known: none, qat, qlora")


def export_float_model(model):
    """Merge adapters, dequantize packed kernels and restore plain dot_generals (in place; returned)."""
    from lrmq.quant.lora import merge_lora

    merge_lora(model)
    for _, lin in iter_linears(model, None):
        if _packed(lin):
            restore_float_kernel(model, lin, lin.float_weight())
        lin.dot_general = default_dot_general
    return model


def _nbytes(a) -> int:
    return int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize


def param_bytes(model) -> dict[str, int]:
    """Bytes held by the model's variables: base (float Params + packed kernels), adapters (LoRAParam),
    total, and linears (the Linear kernels alone, packed or float)."""
    base = adapters = 0
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.RngState))):
        n = sum(_nbytes(a) for a in jax.tree.leaves(v.get_value()))
        if isinstance(v, nnx.LoRAParam):
            adapters += n
        else:
            base += n
    linears = sum(sum(_nbytes(a) for a in jax.tree.leaves(lin.kernel.get_value())) for _, lin in iter_linears(model, None))
    return {"base": base, "adapters": adapters, "total": base + adapters, "linears": linears}


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of a pytree (e.g. an optax state)."""
    return sum(_nbytes(a) for a in jax.tree.leaves(tree) if hasattr(a, "dtype") and hasattr(a, "shape"))
