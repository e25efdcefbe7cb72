"""Weight-only dequant-matmul kernels (Pallas TPU / Pallas Triton GPU / XLA fallback).

Standalone: raw arrays in, raw arrays out; `lrmq.quant.qmatmul` bridges `QuantizedWeight`.
Layouts and dispatch rules: docs/kernels.md.
"""
from .dispatch import grouped_int4_matmul, grouped_int8_matmul, int4_matmul, int8_matmul, nf4_matmul, resolve_impl
from .target import Target, current_target, mesh_in_effect, target
from .reference import (
    NF4_TABLE,
    dequantize_grouped_int4,
    dequantize_grouped_int8,
    dequantize_int4,
    dequantize_int8,
    dequantize_nf4,
    grouped_int4_matmul_reference,
    grouped_int8_matmul_reference,
    int4_matmul_reference,
    int8_matmul_reference,
    nf4_matmul_reference,
    pack_int4,
    pack_nf4,
    unpack_int4,
    unpack_nf4,
)

__all__ = [
    "NF4_TABLE", "Target", "current_target", "dequantize_int4", "dequantize_int8",
    "dequantize_grouped_int4", "dequantize_grouped_int8", "dequantize_nf4", "grouped_int4_matmul",
    "grouped_int4_matmul_reference", "grouped_int8_matmul", "grouped_int8_matmul_reference", "int4_matmul",
    "int4_matmul_reference", "int8_matmul", "int8_matmul_reference", "mesh_in_effect",
    "nf4_matmul", "nf4_matmul_reference", "pack_int4", "pack_nf4", "resolve_impl", "target",
    "unpack_int4", "unpack_nf4",
]
