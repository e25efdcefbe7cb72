"""The KV cache's storage format, resolved once (`KVFormat`): what its pages hold, how they are laid out and what
scales come with them.

The user names a format (`KV_CACHE_FORMATS`: rollout.kv_cache / generation.kv_cache / EngineConfig.kv_cache):

* "auto": the model's dtype (the pool is a plain array / pair, as it always was); "bf16": bfloat16 pages;
* "fp8_e4m3" / "fp8_e5m2" / "int8": quantized pages in a `kv_pool.QuantPool` with their scales.

Which decode attention reads the pool (`lrmq.generation.attention`) then fixes its layout ("interleaved" for the
XLA and TPU paths, "split" for the GPU kernel) and whether fp8 pages are held as int8 bits (the XLA path's). The
engine resolves all of it once (`attention.kv_format`) into one `KVFormat`; the pool, its sharding and its bytes
per page (`lrmq.generation.kv_pool`) read that object, never the user's string again.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

KV_CACHE_FORMATS = ("auto", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")
QUANT_DTYPES = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2, "int8": jnp.int8}
# The formats whose scales are per layer and KV head (pool-global), so a calibration can be kept across calls.
KEPT_SCALE_FORMATS = ("fp8_e4m3", "fp8_e5m2")
FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
POOL_LAYOUTS = ("interleaved", "split")


def check_kv_cache(kv_cache: str, key: str = "kv_cache") -> str:
    if kv_cache not in KV_CACHE_FORMATS:
        raise ValueError(f"{key} must be one of {', '.join(KV_CACHE_FORMATS)} (got {kv_cache!r})")
    return kv_cache


def no_kept_scales(fmt: str) -> str:
    """Why a format has no scales to keep across calls."""
    if fmt == "int8":
        return "int8 scales each token by its own absmax when it is written: there is no calibration to keep"
    return "an unquantized cache has no scales"


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """A resolved KV cache format (see the module docstring).

    name: one of `KV_CACHE_FORMATS`; layout: the pool's ("interleaved": one [L, P, page_size, 2*KVH, D] array,
    K and V heads interleaved; "split": a (K, V) pair of [KVH, L, P, page_size, D]); int8_bits: fp8 pages held as
    int8 (their bits, the same bytes), as the XLA path reads them (`attention.int8_bits`)."""

    name: str = "auto"
    layout: str = "interleaved"
    int8_bits: bool = False

    def __post_init__(self):
        check_kv_cache(self.name)
        if self.layout not in POOL_LAYOUTS:
            raise ValueError(f"KV pool layout must be one of {', '.join(POOL_LAYOUTS)} (got {self.layout!r})")
        if self.int8_bits and self.name not in KEPT_SCALE_FORMATS:
            raise ValueError(f"int8_bits holds fp8 pages as int8; {self.name!r} pages are not fp8")

    @property
    def quantized(self) -> bool:
        """Pages in a `QuantPool` with their scales (fp8 / int8)."""
        return self.name in QUANT_DTYPES

    @property
    def kept_scales(self) -> bool:
        """Per layer and KV head scales (pool-global) that a caller can keep across calls (fp8)."""
        return self.name in KEPT_SCALE_FORMATS

    @property
    def token_scales(self) -> bool:
        """Whether a quantized pool keeps scale pages (one scale per token and KV head, for K and V): int8 (a
        per-token absmax, nothing saturates) and every "split" pool (JAX's GPU kernel reads its scales from
        pages; fp8 there writes the head's scale for each token)."""
        return self.quantized and (self.name == "int8" or self.layout == "split")

    @property
    def fmax(self) -> float:
        """The largest magnitude a quantized format stores (a scale maps a head's absmax onto it)."""
        return 127.0 if self.name == "int8" else float(jnp.finfo(QUANT_DTYPES[self.name]).max)

    def dtype(self, cfg):
        """dtype of the pages' values: the model's ("auto"), bfloat16 ("bf16") or the quantized format's."""
        if self.name == "auto":
            return jnp.dtype(cfg.dtype)
        return jnp.dtype(jnp.bfloat16 if self.name == "bf16" else QUANT_DTYPES[self.name])

    def pool_dtype(self, cfg):
        """dtype of the pool's arrays: `dtype`, or int8 where fp8 pages are held as their bits."""
        return jnp.dtype(jnp.int8) if self.int8_bits else self.dtype(cfg)
