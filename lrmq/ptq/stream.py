"""The one message from the layer-by-layer PTQ driver to whatever keeps its results (the model, or exports)."""

from __future__ import annotations

import dataclasses

import numpy as np

from lrmq.quant.qweight import QuantizedWeight


@dataclasses.dataclass
class LayerOut:
    """One decoder layer after PTQ."""

    index: int  # decoder layer i
    # the layer's new float32 weights, keyed as lrmq.ptq.layer_fn.get_layer_params ('q_proj' .. 'down_proj' kernels
    # [K, N], 'q_proj.bias', norm scales under the norm's name): fake-quant kernels, folded norms
    params: dict[str, np.ndarray]
    packed: dict[str, QuantizedWeight]  # linear name ('q_proj') -> packed weight, the same codes as params[name]
    g_idx: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # GPTQ act-order, dynamic groups
