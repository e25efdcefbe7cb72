"""Quantizers, weight formats, the `QuantizedWeight` pytree and the train-mode transforms."""

from lrmq.quant.formats import PACKINGS, STORAGE, dequantize, quantize_weight
from lrmq.quant.nf4 import nf4_dequantize, nf4_fake_quant, nf4_quantize
from lrmq.quant.packing import pack, pack_nibbles_high_first, unpack, unpack_nibbles_high_first
from lrmq.quant.qkernel import QuantizedKernel
from lrmq.quant.quantizers import (
    QUANTIZERS,
    compute_qparams,
    dequantize_codes,
    fake_quant,
    fake_quant_per_tensor,
    per_tensor_scale,
    pseudo_quantize_awq,
    quantize_codes,
)
from lrmq.quant.qweight import QuantizedWeight, from_flat_dict, to_flat_dict

__all__ = [
    "PACKINGS", "QUANTIZERS", "STORAGE", "QuantizedKernel", "QuantizedWeight", "compute_qparams",
    "dequantize", "dequantize_codes", "fake_quant", "fake_quant_per_tensor", "from_flat_dict",
    "nf4_dequantize", "nf4_fake_quant", "nf4_quantize", "pack", "pack_nibbles_high_first",
    "per_tensor_scale", "pseudo_quantize_awq", "quantize_codes", "quantize_weight", "to_flat_dict",
    "unpack", "unpack_nibbles_high_first",
]
