"""What a PTQ method returns (every method of :data:`lrmq.ptq.methods.PTQ_METHODS`)."""

from __future__ import annotations

import dataclasses

import numpy as np

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
