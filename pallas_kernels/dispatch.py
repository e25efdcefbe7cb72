"""Public entry points: target/shape dispatch plus an x-only custom_vjp.

`impl`: "auto" (TPU target -> Mosaic TPU kernel, GPU -> Triton kernel, otherwise the XLA
dequantize-then-dot path), or "tpu" / "gpu" / "xla" to force one. Forcing a kernel on a target
it cannot compile for (e.g. "tpu" on CPU) runs it with interpret=True unless told otherwise.
The target is what the traced program is compiled for (`target.current_target`: an explicit
`target(...)`, else the mesh in effect, else `jax.default_backend()`), not the host.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import reference as _ref
from . import tpu as _tpu
from . import tpu_grouped as _tpu_grouped
from .target import current_target


def _gpu():
    """The GPU (Triton) kernels, imported on first use: ~0.3 s of every start on machines without a GPU."""
    from . import gpu

    return gpu


_IMPLS = ("auto", "tpu", "gpu", "xla")


@dataclasses.dataclass(frozen=True)
class _Cfg:
    fmt: str  # "int4" | "int8" | "nf4"
    impl: str  # resolved: "tpu" | "gpu" | "xla"
    interpret: bool
    group_size: Any = None  # int4: group size; nf4: block size; int8: unused
    tiles: tuple = ()  # sorted (name, value) overrides passed to the kernel


def resolve_impl(impl: str = "auto", interpret: bool | None = None) -> tuple[str, bool]:
    """The (impl, interpret) pair a call traced now will use, for the current target."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    platform = current_target().platform
    if impl == "auto":
        impl = platform if platform in ("tpu", "gpu") else "xla"
    if interpret is None:
        interpret = impl != "xla" and impl != platform
    return impl, bool(interpret)


def _xla_compute_dtype(dtype):
    # XLA fallback: 16-bit activations dot against 16-bit dequantized weights (f32 accumulation),
    # the same arithmetic as the kernels; f32 activations get the exact f32 reference.
    return dtype if jnp.dtype(dtype).itemsize == 2 else None


def _flat(x):
    return x.reshape(-1, x.shape[-1])


def _int_zero_cotangent(a):
    return np.zeros(np.shape(a), dtype=jax.dtypes.float0)


def _float_or_int_zero(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros_like(a)
    return _int_zero_cotangent(a)


# ------------------------------------------------------------------------------ one custom_vjp
# Per format: the TPU kernel, the GPU kernel, the XLA reference matmul (each called as
# fn(x2, *q, cfg, **kw)), and the dense float32 [K, N] weight the backward pass multiplies by.
# q is the tuple of quantized arrays: (codes, scales, zeros) for int4 / int8, (codes, absmax) for nf4.
_FORMATS = {
    "int4": (
        lambda x, q, c, **kw: _tpu.int4_matmul_tpu(x, *q, c.group_size, **kw),
        lambda x, q, c, **kw: _gpu().int4_matmul_gpu(x, *q, c.group_size, **kw),
        lambda x, q, c, **kw: _ref.int4_matmul_reference(x, *q, c.group_size, **kw),
        lambda q, c: _ref.dequantize_int4(*q, c.group_size),
    ),
    "int8": (
        lambda x, q, c, **kw: _tpu.int8_matmul_tpu(x, *q, **kw),
        lambda x, q, c, **kw: _gpu().int8_matmul_gpu(x, *q, **kw),
        lambda x, q, c, **kw: _ref.int8_matmul_reference(x, *q, **kw),
        lambda q, c: _ref.dequantize_int8(*q),
    ),
    "nf4": (
        lambda x, q, c, **kw: _tpu.nf4_matmul_tpu(x, *q, c.group_size, **kw),
        lambda x, q, c, **kw: _gpu().nf4_matmul_gpu(x, *q, c.group_size, **kw),
        lambda x, q, c, **kw: _ref.nf4_matmul_reference(x, *q, c.group_size, **kw),
        lambda q, c: _ref.dequantize_nf4(*q, c.group_size).T,  # stored [N, K]
    ),
}


def _forward(x, q, cfg: _Cfg):
    tpu, gpu, ref, _ = _FORMATS[cfg.fmt]
    x2 = _flat(x)
    if cfg.impl == "xla":
        y = ref(x2, q, cfg, compute_dtype=_xla_compute_dtype(x.dtype))
    else:
        y = (tpu if cfg.impl == "tpu" else gpu)(x2, q, cfg, interpret=cfg.interpret, **dict(cfg.tiles))
    return y.reshape(*x.shape[:-1], y.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _qmatmul(x, q, cfg):
    return _forward(x, q, cfg)


def _qmatmul_fwd(x, q, cfg):
    return _forward(x, q, cfg), q


def _qmatmul_bwd(cfg, q, dy):
    w = _FORMATS[cfg.fmt][3](q, cfg)  # [K, N] float32
    cdt = _xla_compute_dtype(dy.dtype)
    if cdt is None:  # f32: the exact product
        dx = jnp.dot(dy.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)
    else:  # 16-bit: the forward's arithmetic (16-bit weight, f32 accumulation), as bitsandbytes' QLoRA
        # backward; an f32 HIGHEST dot would cost ~6 MXU passes on TPU and an f32 copy of the weight
        dx = jnp.dot(dy, w.T.astype(cdt), preferred_element_type=jnp.float32)
    # The quantized base is frozen: no gradient flows to codes / scales / zeros / absmax.
    return dx.astype(dy.dtype), tuple(_float_or_int_zero(a) for a in q)


_qmatmul.defvjp(_qmatmul_fwd, _qmatmul_bwd)


# ------------------------------------------------------------------------------------- public
def _tiles(kw) -> tuple:
    allowed = {"block_m", "block_n", "block_k", "splits", "num_warps", "num_stages"}
    bad = set(kw) - allowed
    if bad:
        raise TypeError(f"unexpected keyword arguments {sorted(bad)}")
    return tuple(sorted((k, v) for k, v in kw.items() if v is not None))


def _gpu_supported(unit: int | None) -> bool:
    return unit is None or (unit & -unit) >= 32


def int4_matmul(x, codes, scales, zeros, group_size=None, *, impl="auto", interpret=None,
                **tiles):
    """y[..., N] = x[..., K] @ dequant_int4(codes[K/2, N], scales[K/g, N], zeros[K/g, N]).

    Codes: element 2i in the low nibble, 2i+1 in the high nibble; w = (q - z) * s.
    `group_size` may be None (implied by scales' rows); tile overrides: block_m/n/k, splits,
    num_warps, num_stages (the last three GPU only). Differentiable w.r.t. x only."""
    k = x.shape[-1]
    g = group_size or k // scales.shape[0]
    impl_r, interp = resolve_impl(impl, interpret)
    if impl == "auto" and impl_r == "gpu" and not (_gpu_supported(g) or scales.shape[0] == 1):
        impl_r, interp = "xla", False
    if impl_r != "gpu":
        tiles = {k_: v for k_, v in tiles.items() if k_ not in ("splits", "num_warps", "num_stages")}
    return _qmatmul(x, (codes, scales, zeros), _Cfg("int4", impl_r, interp, g, _tiles(tiles)))


def int8_matmul(x, codes, scales, zeros, *, impl="auto", interpret=None, **tiles):
    """y[..., N] = x[..., K] @ ((codes[K, N] - zeros) * scales), scales/zeros [1 or K/g, N]."""
    impl_r, interp = resolve_impl(impl, interpret)
    g = x.shape[-1] // scales.shape[0]
    if impl == "auto" and impl_r == "gpu" and scales.shape[0] > 1 and (g & -g) < 16:
        impl_r, interp = "xla", False
    if impl_r != "gpu":
        tiles = {k_: v for k_, v in tiles.items() if k_ not in ("splits", "num_warps", "num_stages")}
    return _qmatmul(x, (codes, scales, zeros), _Cfg("int8", impl_r, interp, None, _tiles(tiles)))


def nf4_matmul(x, codes, absmax, block_size: int = 64, *, impl="auto", interpret=None, **tiles):
    """y[..., N] = x[..., K] @ w_t.T, w_t[n, k] = NF4[code] * absmax[n, k // block_size].

    codes uint8 [N, K/2] in bitsandbytes byte order (even k in the high nibble); absmax
    [N, K/bs] or flat [N*K/bs] (already dequantized from double quant)."""
    impl_r, interp = resolve_impl(impl, interpret)
    if impl == "auto" and impl_r == "gpu" and not _gpu_supported(block_size):
        impl_r, interp = "xla", False
    if impl_r != "gpu":
        tiles = {k_: v for k_, v in tiles.items() if k_ not in ("splits", "num_warps", "num_stages")}
    return _qmatmul(x, (codes, absmax), _Cfg("nf4", impl_r, interp, block_size, _tiles(tiles)))


# ------------------------------------------------------------------------- grouped (mixture of experts)
# x [M, K] rows sorted by expert, `group_sizes` [E], stacked expert weights: the Mosaic TPU kernel
# (`tpu_grouped`) or the XLA reference (dequantize every expert, `jax.lax.ragged_dot`). No GPU kernel: "auto"
# on a GPU target takes the XLA path. Differentiable w.r.t. x only (dx = ragged_dot(dy, W^T)).
_GROUPED = {
    "int4": (lambda x, gs, q, c, **kw: _tpu_grouped.grouped_matmul_tpu("int4", x, gs, *q, c.group_size, **kw),
             lambda x, gs, q, c, **kw: _ref.grouped_int4_matmul_reference(x, gs, *q, c.group_size, **kw),
             lambda q, c: _ref.dequantize_grouped_int4(*q, c.group_size)),
    "int8": (lambda x, gs, q, c, **kw: _tpu_grouped.grouped_matmul_tpu("int8", x, gs, *q, **kw),
             lambda x, gs, q, c, **kw: _ref.grouped_int8_matmul_reference(x, gs, *q, **kw),
             lambda q, c: _ref.dequantize_grouped_int8(*q)),
}


def _grouped_forward(x, group_sizes, q, cfg: _Cfg):
    tpu, ref, _ = _GROUPED[cfg.fmt]
    if cfg.impl == "xla":
        return ref(x, group_sizes, q, cfg, compute_dtype=_xla_compute_dtype(x.dtype))
    return tpu(x, group_sizes, q, cfg, interpret=cfg.interpret, **dict(cfg.tiles))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x, group_sizes, q, cfg):
    return _grouped_forward(x, group_sizes, q, cfg)


def _grouped_fwd(x, group_sizes, q, cfg):
    return _grouped_forward(x, group_sizes, q, cfg), (group_sizes, q)


def _grouped_bwd(cfg, res, dy):
    group_sizes, q = res
    w_t = jnp.swapaxes(_GROUPED[cfg.fmt][2](q, cfg), 1, 2)  # [E, N, K] float32
    cdt = _xla_compute_dtype(dy.dtype)
    if cdt is None:
        dx = jax.lax.ragged_dot(dy.astype(jnp.float32), w_t, group_sizes, precision=jax.lax.Precision.HIGHEST)
    else:
        dx = jax.lax.ragged_dot(dy, w_t.astype(cdt), group_sizes, preferred_element_type=jnp.float32)
    return dx.astype(dy.dtype), _int_zero_cotangent(group_sizes), tuple(_float_or_int_zero(a) for a in q)


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _grouped_tiles(kw) -> tuple:
    bad = set(kw) - {"block_m", "block_n", "block_k"}
    if bad:
        raise TypeError(f"unexpected keyword arguments {sorted(bad)} (the grouped kernels take block_m / block_n / "
                        "block_k)")
    return tuple(sorted((k, v) for k, v in kw.items() if v is not None))


def _grouped_impl(impl, interpret):
    impl_r, interp = resolve_impl(impl, interpret)
    if impl_r == "gpu":
        if impl != "auto":
            raise ValueError("the grouped (mixture-of-experts) kernels have no GPU implementation; use impl='auto', "
                             "'tpu' or 'xla'")
        impl_r, interp = "xla", False
    return impl_r, interp


def grouped_int4_matmul(x, group_sizes, codes, scales, zeros, group_size=None, *, impl="auto", interpret=None,
                        **tiles):
    """y[M, N]: rows of x [M, K] sorted by expert, `group_sizes[e]` rows of expert e (in order), each times its
    expert's int4 weight (codes uint8 [E, K/2, N], K-packed as `int4_matmul`'s; scales / zeros [E, K/g, N]);
    rows past sum(group_sizes) give 0 (`jax.lax.ragged_dot`). Tile overrides: block_m / block_n / block_k (TPU).
    Differentiable w.r.t. x only."""
    impl_r, interp = _grouped_impl(impl, interpret)
    g = group_size or x.shape[-1] // scales.shape[1]
    return _grouped(x, group_sizes.astype(jnp.int32), (codes, scales, zeros),
                    _Cfg("int4", impl_r, interp, g, _grouped_tiles(tiles)))


def grouped_int8_matmul(x, group_sizes, codes, scales, zeros, *, impl="auto", interpret=None, **tiles):
    """`grouped_int4_matmul` for 8-bit experts: codes uint8 [E, K, N], scales / zeros [E, 1 or K/g, N]."""
    impl_r, interp = _grouped_impl(impl, interpret)
    return _grouped(x, group_sizes.astype(jnp.int32), (codes, scales, zeros),
                    _Cfg("int8", impl_r, interp, None, _grouped_tiles(tiles)))
