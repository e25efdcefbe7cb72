"""What a PTQ method returns (every method of :data:`lrmq.ptq.methods.PTQ_METHODS`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from lrmq.ptq.layerwise import linear_path
from lrmq.ptq.source import as_source
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

    # GPTQ with act_order and static groups: "static" (compressed-tensors' / llmcompressor's actorder name: the rows
    # were quantized in activation order, the groups are consecutive, nothing changes in the format)
    actorder: Optional[str] = None
    # a streamed run (the layers went to an export, not into `packed`): the formats and act-order Linears seen
    streamed_formats: list = dataclasses.field(default_factory=list)

    def formats(self) -> list[WeightFormat]:
        """The result's weight format(s): one for every model lrmq writes."""
        if self.weight_format is not None:
            return [self.weight_format]
        if not self.packed and self.streamed_formats:
            return list(self.streamed_formats)
        return formats_of(self.packed, self.method, group_size=self.group_size)

    def collector(self, source, emit: Optional[Callable] = None) -> Callable:
        """What the layerwise driver calls with each finished layer (:class:`lrmq.ptq.stream.LayerOut`). Without
        ``emit`` (an in-memory model): the layer's weights are written back into the model and its packed
        weights kept in ``packed`` / ``g_idx``. With ``emit`` (a streamed run): the layer goes to ``emit`` and
        only its formats are kept."""
        def collect(out):
            moe = "router" in out.params
            paths = {name: linear_path(out.index, name, moe) for name in (*out.packed, *out.g_idx)}
            if emit is None:
                as_source(source).write_back(out)
                self.packed.update((paths[n], qw) for n, qw in out.packed.items())
                self.g_idx.update((paths[n], g) for n, g in out.g_idx.items())
                return
            emit(out)
            for f in formats_of({paths[n]: qw for n, qw in out.packed.items()}, self.method,
                                group_size=self.group_size):
                if f not in self.streamed_formats:
                    self.streamed_formats.append(f)
            self.g_idx.update((paths[n], np.asarray(g)) for n, g in out.g_idx.items())

        return collect

    def describe_format(self) -> str:
        return ", ".join(f.describe() for f in self.formats()) or "no quantized weights"
