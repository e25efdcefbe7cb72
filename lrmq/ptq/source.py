"""Where the PTQ driver's weights come from: an in-memory model, or a checkpoint read layer by layer.

A source gives the model config, the token embedding (read once), the other non-layer tensors, and an
iterator over the decoder layers' float32 weights (keyed as :func:`lrmq.ptq.layer_fn.get_layer_params`),
each layer read when its turn comes:

* :class:`ModelSource` -- a ``Decoder`` in memory (today's small-model path); ``write_back`` puts a
  processed layer's weights into it, cast to each variable's dtype.
* :class:`CheckpointSource` -- a float HF (local or ``gs://``) or lrmq checkpoint through
  :func:`lrmq.checkpoint.tensors.open_tensors`: one tensor at a time, memory-mapped or range-read; the
  ``Decoder`` is never built. Layer i+1 is read on a background thread while layer i is processed, so the
  host holds at most two layers' float32 weights. Each tensor is cast to the model's ``param_dtype`` and
  then to float32 -- the values ``load_model`` + ``get_layer_params`` give, bit for bit.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Iterator

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from lrmq.checkpoint.tensors import open_tensors
from lrmq.model.config import ModelConfig
from lrmq.ptq import layer_fn as lf
from lrmq.ptq.stream import LayerOut


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


class ModelSource:
    """An in-memory model as a PTQ source (module doc)."""

    def __init__(self, model):
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.path = None

    def embedding(self) -> np.ndarray:
        return np.asarray(self.model.embed.embedding[...])

    def layer(self, i: int) -> dict[str, np.ndarray]:
        return {k: np.asarray(v, np.float32) for k, v in lf.get_layer_params(self.model.layers[i]).items()}

    def layers(self) -> Iterator[dict[str, np.ndarray]]:
        return (self.layer(i) for i in range(self.cfg.num_layers))

    def write_back(self, out: LayerOut) -> None:
        lf.set_layer_params(self.model.layers[out.index], {k: jnp.asarray(v) for k, v in out.params.items()})


class CheckpointSource:
    """A float checkpoint read layer by layer (module doc)."""

    def __init__(self, path: str):
        self.path = path
        self.reader = open_tensors(path)
        self.cfg: ModelConfig = self.reader.cfg
        self.param_dtype = _np_dtype(self.cfg.param_dtype)  # the dtype load_model gives each weight

    def _get(self, name: str) -> np.ndarray:
        return np.asarray(self.reader.get(name)).astype(self.param_dtype, copy=False)

    def embedding(self) -> np.ndarray:
        return self._get("embed.embedding")

    def others(self) -> dict[str, np.ndarray]:
        """Every non-layer tensor (embedding, final norm, untied head), in the model's param dtype."""
        return {n: self._get(n) for n in self.reader.names() if not n.startswith("layers.")}

    @functools.lru_cache(maxsize=None)
    def _paths(self, kind: tuple) -> tuple:
        """Weight paths of a layer of ``kind`` (layer type, sparse): the first layer of that kind's."""
        first = next(j for j in range(self.cfg.num_layers) if self._kind(j) == kind)
        return lf.layer_spec(self.cfg, first).param_paths

    def _kind(self, i: int) -> tuple:
        return self.cfg.layer_types[i], self.cfg.is_moe_layer(i)

    def layer(self, i: int) -> dict[str, np.ndarray]:
        names = {key: f"layers.{i}." + ".".join(map(str, path)) for key, path in self._paths(self._kind(i))}
        arrays = self.reader.get_many(list(names.values()))  # one read of the layer where reads have a cost (orbax)
        return {key: np.asarray(arrays[n]).astype(self.param_dtype, copy=False).astype(np.float32) for key, n in names.items()}

    def layers(self) -> Iterator[dict[str, np.ndarray]]:
        """Layer weights in order, the next one read on a background thread meanwhile."""
        n = self.cfg.num_layers
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ptq-prefetch") as pool:
            nxt = pool.submit(self.layer, 0)
            for i in range(n):
                cur = nxt.result()
                if i + 1 < n:
                    nxt = pool.submit(self.layer, i + 1)
                yield cur
                del cur

    def write_back(self, out: LayerOut) -> None:
        raise TypeError(f"{self.path}: a checkpoint source is read only; stream the quantized layers into an export")


def as_source(obj):
    """A source for ``obj``: a model (``ModelSource``), a checkpoint path (``CheckpointSource``) or a source."""
    if isinstance(obj, (ModelSource, CheckpointSource)):
        return obj
    if isinstance(obj, str):
        return CheckpointSource(obj)
    if isinstance(obj, nnx.Module):
        return ModelSource(obj)
    raise TypeError(f"not a PTQ source: {type(obj).__name__}")
