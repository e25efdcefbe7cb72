"""One float tensor of a checkpoint at a time, without loading the model: `open_tensors(path)`.

A pass that visits the model's weights in turn (PTQ's layer by layer driver, QuantLRM's importance pass) reads
each tensor when it needs it; nothing else of the checkpoint is read, nothing goes to an accelerator:

* a local Hugging Face directory (``model.safetensors`` or shards with ``model.safetensors.index.json``): every
  tensor is a read-only numpy view of its own memory-mapped pages (`safetensors_mmap.MappedSafetensors`), so
  reading one touches only its bytes;
* a Hugging Face directory in a bucket (``gs://...``, `lrmq.checkpoint.remote`): the headers are read once, then
  each tensor's one byte range (`remote.RemoteSafetensors`); no weight file lands on local disk;
* an lrmq checkpoint (``save_lrmq``: manifest + orbax ``params/``, local or in a bucket): each tensor is an orbax
  partial restore of that one array onto the host (`orbax_io.restore_arrays`), never the whole tree;
  `get_many` restores several (a layer's) in one read; in the safetensors layout (``params.safetensors`` shards,
  `lrmq_shards`) each tensor is a view of its mapped pages, or its byte range in a bucket, as for HF.

Names are lrmq's flat parameter names (``layers.3.attn.q_proj.kernel``), kernels in lrmq orientation ``[K, N]``
(an HF ``[out, in]`` weight comes back transposed, as a view), dtypes as stored. Opening checks every tensor
against the checkpoint's config before any weight is read (the name map and shapes of `hf.match_names`, the
manifest of `orbax_io`), so a missing tensor or a wrong shape is an error naming the checkpoint and the tensor
then, not halfway through a pass. Non-finite values are not looked for (that needs a pass over the data; the
caller that reads every value anyway checks them).

Quantized checkpoints (an lrmq ``packed`` one, compressed-tensors, AutoAWQ) are refused in one line
(`quantized.refuse_quantized`): their Linears are codes, not float tensors.

Readers are safe to use from a second thread (a prefetching reader): each `get` opens what it reads.
"""

from __future__ import annotations

import abc
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrmq import paths
from lrmq.checkpoint import remote
from lrmq.checkpoint.hf import CheckpointError, _remote, flat_params, match_names, tensor_index
from lrmq.checkpoint.load import checkpoint_kind, resolve_checkpoint
from lrmq.checkpoint.orbax_io import (STATE_FILE, _check_manifest, _read_manifest, _savable_vars, read_lrmq_config,
                                      restore_arrays)
from lrmq.checkpoint.quantized import refuse_quantized
from lrmq.checkpoint.safetensors_mmap import MappedSafetensors, SafetensorsError
from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder


class TensorReader(abc.ABC):
    """The float tensors of one checkpoint, read one at a time (see the module docstring); made by
    `open_tensors`. ``cfg``: its ModelConfig; ``path``: the path or URL it was opened with."""

    cfg: ModelConfig
    path: str

    def __init__(self, path: str, cfg: ModelConfig, entries: dict[str, tuple[tuple[int, ...], np.dtype]]):
        self.path, self.cfg, self._entries = path, cfg, entries

    def names(self) -> list[str]:
        """Every float parameter's flat lrmq name, in the model's order."""
        return list(self._entries)

    def _entry(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        if name not in self._entries:
            raise CheckpointError(f"{self.path}: no tensor {name!r} (names are lrmq parameter names, e.g. "
                                  f"{next(iter(self._entries), 'layers.0.attn.q_proj.kernel')!r})")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Its shape in lrmq orientation (kernels [K, N])."""
        return self._entry(name)[0]

    def dtype(self, name: str) -> np.dtype:
        """Its dtype as stored."""
        return self._entry(name)[1]

    def stored(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(its name in the checkpoint, its shape there): an HF tensor name and [out, in] for a Hugging Face
        checkpoint's Linear weight; what messages about the checkpoint's own tensors quote."""
        return name, self.shape(name)

    @abc.abstractmethod
    def get(self, name: str) -> np.ndarray:
        """One tensor: lrmq orientation, stored dtype; only its bytes are read."""

    def get_many(self, names: list[str]) -> dict[str, np.ndarray]:
        """{name: `get(name)`}: the same arrays, in one read where the format has a per-read cost (an lrmq
        checkpoint: one orbax restore, whose metadata parse is per call, for e.g. a whole layer)."""
        return {n: self.get(n) for n in names}


class _HFTensors(TensorReader):
    """A Hugging Face directory, local (memory-mapped) or in a bucket (range reads)."""

    def __init__(self, path: str, view: str):
        where = remote.remote_url(view) or path
        cfg = ModelConfig.from_hf_file(view)
        abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
        index = tensor_index(view)  # {HF name: file path, or URL for a bucket}
        self._files: dict[str, MappedSafetensors | remote.RemoteSafetensors] = {}
        try:
            for f in dict.fromkeys(index.values()):
                self._files[f] = _remote(f) if paths.is_url(f) else MappedSafetensors(f)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None
        absent = sorted(f"{f}: no tensor {h} (the index lists it there)" for h, f in index.items()
                        if h not in self._files[f].keys())
        if absent:
            raise CheckpointError(absent[0] + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""))
        shapes = {h: self._files[f].shape(h) for h, f in index.items()}
        mapping = match_names(abstract, cfg, index, shapes, where)  # every tensor there, with the config's shape
        self._where = {ours: (h, tr, index[h]) for h, (ours, tr) in mapping.items()}
        entries = {}
        for ours in flat_params(abstract):
            h, tr, f = self._where[ours]
            shape = shapes[h][::-1] if tr == "T" else shapes[h]
            entries[ours] = (tuple(shape), self._files[f].dtype(h))
        super().__init__(path, cfg, entries)

    def stored(self, name: str) -> tuple[str, tuple[int, ...]]:
        self._entry(name)
        h, _, f = self._where[name]
        return h, self._files[f].shape(h)

    def get(self, name: str) -> np.ndarray:
        self._entry(name)
        h, tr, f = self._where[name]
        reader = self._files[f]
        arr = reader.tensor(h) if isinstance(reader, remote.RemoteSafetensors) else reader[h]
        return arr.T if tr == "T" else arr


class _LrmqTensors(TensorReader):
    """An lrmq checkpoint (orbax params/ or safetensors shards), local or in a bucket: `restore_arrays`."""

    def __init__(self, path: str, view: str):
        cfg = read_lrmq_config(view)
        manifest = _read_manifest(view)
        abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
        _check_manifest(remote.remote_url(view) or path, manifest, _savable_vars(abstract), [])
        entries = {}
        for name in flat_params(abstract):
            try:
                shape, dt = manifest[name]["array"]
                entries[name] = (tuple(int(d) for d in shape), np.dtype(jnp.dtype(dt)))  # (jnp.dtype knows bfloat16)
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{os.path.join(view, STATE_FILE)}: {name}: bad entry "
                                      f"{manifest.get(name)!r} ({e!r})") from None
        self._view = view
        super().__init__(path, cfg, entries)

    def get(self, name: str) -> np.ndarray:
        return self.get_many([name])[name]

    def get_many(self, names: list[str]) -> dict[str, np.ndarray]:
        return restore_arrays(self._view, {n: self._entry(n) for n in names})


def open_tensors(path: str) -> TensorReader:
    """A `TensorReader` of the float checkpoint at `path`: a Hugging Face directory (local or ``gs://``) or an
    lrmq checkpoint (local or ``gs://``); the alias ``tiny`` too. A quantized checkpoint: CheckpointError naming
    its config.json and format; a tensor the config needs that is missing or has another shape: CheckpointError
    naming the checkpoint and the tensor."""
    view = resolve_checkpoint(path)
    kind = checkpoint_kind(view)
    refuse_quantized(view, "reading it tensor by tensor", "its Linears are packed codes, not float tensors")
    return _LrmqTensors(path, view) if kind == "lrmq" else _HFTensors(path, view)
