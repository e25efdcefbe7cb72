"""Train-mode preparation (QAT / QLoRA), packing Linears, float export and the memory report.

* `prepare_for_training(model, qcfg, *, seed, mesh=None)`:
  - ``qat``: `apply_qat` (float master weights stay `nnx.Param`s; only the dot_generals change, and the
    ragged_dots of targeted mixture-of-experts experts: per-expert fake-quant, STE).
  - ``qlora``: every targeted Linear's kernel becomes a packed `QuantizedKernel` (NF4 + double quant,
    block 64, or int4 asymmetric with `base_group_size`); the float kernel is dropped. Then LoRA
    adapters (`nnx.LoRAParam`) are attached. Targeted mixture-of-experts experts likewise: each stacked [E, K, N]
    kernel packed per expert into a `QuantizedExpertKernel`, stacked per-expert adapters (`lora.ExpertLoRA`) on
    it; the router is never a target (float, frozen).
* `trainable_filter(mode)`: what the optimizer trains (LoRA adapters under QLoRA, else every Param).
* `quantize_linears(model, qweights)` installs given QuantizedWeights (used by the PTQ CLI too).
* `pack_linears(model, packing)`: round-to-nearest pack into a kernel layout (`formats.PACKINGS`).
* `export_float_model(model)`: merge adapters, dequantize packed kernels (packed experts too), reset dot_generals
  (and the experts' QAT ragged_dots): a plain float Decoder (in place; also returned) that `save_hf_model` accepts.
* `param_bytes(model)`: {"base", "adapters", "total", "linears"} bytes of the variables.

Packed weights are placed on the mesh of the float kernel they replace (`transforms.set_packed_kernel`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrmq.model.linear import ExpertLinear, Linear, default_dot_general, default_ragged_dot
from lrmq.quant.formats import PACKINGS, quantize_weight
from lrmq.quant.lora import apply_lora, merge_lora
from lrmq.quant.qat import apply_qat, select_targets, set_dot_general, set_ragged_dot
from lrmq.quant.qweight import QuantizedWeight
from lrmq.quant.transforms import (
    DEFAULT_TARGETS,
    is_packed,
    iter_expert_linears,
    iter_linears,
    mesh_of,
    module_at,
    require_linears,
    restore_float_kernel,
    set_packed_expert_kernel,
    set_packed_kernel,
)
from lrmq.sharding import host_array

BASE_FORMATS = ("nf4", "int4")


def quantize_linears(model, qweights: dict[str, QuantizedWeight], *, mesh=None) -> list[str]:
    """Install {module path: QuantizedWeight} (in place)."""
    for path, qw in qweights.items():
        lin = module_at(model, path)
        if not isinstance(lin, Linear):
            raise ValueError(f"{path} is not a Linear")
        set_packed_kernel(lin, qw, mesh)
    return list(qweights)


def pack_base(model, pattern: str, base_format: str = "nf4", base_group_size: int = 64, *, mesh=None) -> list[str]:
    """Quantize every targeted Linear's float kernel into a packed QuantizedKernel (QLoRA base), and every targeted
    mixture-of-experts ExpertLinear's [E, K, N] kernel into a QuantizedExpertKernel (each expert quantized alone)."""
    if base_format not in BASE_FORMATS:
        raise ValueError(f"unknown base_format {base_format!r}; known: {list(BASE_FORMATS)}")
    done = []
    linears, experts = select_targets(model, pattern, "prepare_for_training(qlora)")
    for path, lin in linears + experts:
        if is_packed(lin):
            continue
        w = lin.kernel.get_value()
        # quantize on one device, placed again below; abstract (traced) weights stay as they are, so the
        # packed layout of a model can be built without its weights (lrmq.aot)
        w_local = w if isinstance(w, jax.core.Tracer) else jnp.asarray(host_array(w))
        options = dict(PACKINGS.get(base_format).options)
        k = lin.in_features
        if base_format == "int4":
            if k % base_group_size:
                raise ValueError(f"quant.base_group_size={base_group_size} does not divide {path}'s K={k}")
            options["group_size"] = base_group_size
        place = set_packed_expert_kernel if isinstance(lin, ExpertLinear) else set_packed_kernel
        place(lin, quantize_weight(w_local, **options), mesh if mesh is not None else mesh_of(w))
        done.append(path)
    return done


def pack_linears(model, packing: str, pattern: str | None = None, *, mesh=None) -> list[str]:
    """Round-to-nearest pack every targeted Linear (default: the seven projections) in a
    `formats.PACKINGS` layout."""
    if packing not in PACKINGS:
        raise ValueError(f"unknown packing {packing!r}; known: {PACKINGS.names()}")
    options = PACKINGS.get(packing).options
    done = []
    for path, lin in require_linears(model, pattern or DEFAULT_TARGETS, "pack_linears"):
        w = lin.kernel.get_value()
        qw = quantize_weight(w if isinstance(w, jax.core.Tracer) else jnp.asarray(host_array(w)),
                             **options)
        set_packed_kernel(lin, qw, mesh if mesh is not None else mesh_of(w))
        done.append(path)
    return done


# ----------------------------------------------------------------------------- public entry points
def prepare_for_training(model, qcfg, *, seed: int = 0, mesh=None):
    """Apply `QuantSection` `qcfg` to `model` in place and return it (see the module docstring)."""
    mode = qcfg.mode
    if mode == "none":
        return model
    if mode == "qat":
        apply_qat(model, qcfg.qat_scheme, pattern=qcfg.targets, group_size=qcfg.qat_group_size,
                  stochastic_rounding=qcfg.qat_stochastic_rounding, seed=seed)
        return model
    if mode == "qlora":
        pack_base(model, qcfg.targets, qcfg.base_format, qcfg.base_group_size, mesh=mesh)
        apply_lora(model, qcfg.targets, rank=qcfg.lora_rank, alpha=qcfg.lora_alpha, dropout=qcfg.lora_dropout,
                   rngs=nnx.Rngs(params=seed), seed=seed, mesh=mesh)
        return model
    raise ValueError(f"unknown quant.mode {mode!r}; known: none, qat, qlora")


def trainable_filter(mode: str):
    """The nnx filter of what the optimizer trains under `quant.mode` `mode`."""
    return nnx.LoRAParam if mode == "qlora" else nnx.Param


def export_float_model(model):
    """Merge adapters, dequantize packed kernels and restore plain dot_generals (in place; returned)."""
    merge_lora(model)
    for _, lin in iter_linears(model, None):
        if is_packed(lin):
            restore_float_kernel(model, lin, lin.float_weight())
        set_dot_general(lin, default_dot_general)
    for _, el in iter_expert_linears(model, None):  # mixture-of-experts experts: QAT's ragged_dot, packed kernels
        if is_packed(el):
            restore_float_kernel(model, el, el.float_weight())
        set_ragged_dot(el, default_ragged_dot)
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
