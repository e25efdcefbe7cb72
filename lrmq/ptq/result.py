"""What a PTQ method returns (every method of :data:`lrmq.ptq.methods.PTQ_METHODS`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from lrmq.quant.formats import WeightFormat, formats_of
from lrmq.quant.qweight import QuantizedWeight


@dataclasses.dataclass
class PTQResult:
    """The model itself holds the fake-quant float weights (and folded norm scales); ``packed`` holds
    the same codes as ``QuantizedWeight``s, so ``dequantize(packed[p])`` is the model's kernel at ``p``."""

    method: str
    packed: dict[str, QuantizedWeight]  # "layers.3.attn.q_proj" -> packed weight (same codes as the model)
    info: dict = dataclasses.field(default_factory=dict)  # per-layer search results, timings
    g_idx: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # GPTQ act-order only
    # AWQ / QuantLRM: the folded scales, {layer index: {scale group: (s_prev, s_fc)}}
    scales: dict[int, dict[str, tuple]] = dataclasses.field(default_factory=dict)
    bits: int = 4
    group_size: int = 128
    symmetric: bool = False
    # the format of `packed` when the quantizer knows more than the arrays show (a QAT scheme, a per-tensor scale);
    # None: `WeightFormat.of_weight` of the packed weights with `method` as the scheme (`weight_format()`)
    weight_format: Optional[WeightFormat] = None

    def formats(self) -> list[WeightFormat]:
        """The result's weight format(s): one for every model lrmq writes."""
        if self.weight_format is not None:
            return [self.weight_format]
        return formats_of(self.packed, self.method, group_size=self.group_size)

    def describe_format(self) -> str:
        return ", ".join(f.describe() for f in self.formats()) or "no quantized weights"
