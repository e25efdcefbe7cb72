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
from lrmq.checkpoint.hf import CheckpointError, _remote, flat_params, match_names, tensor_index, with_fused_views
from lrmq.checkpoint.hf_names import Slot
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
        index, shapes, self._views = with_fused_views(cfg, index, shapes, where)  # transformers 5's fused experts
        mapping = match_names(abstract, cfg, index, shapes, where)  # every tensor there, with the config's shape
        # lrmq name -> its stored pieces (one, or one per expert in expert order): (HF name, slot, file)
        self._where: dict[str, list[tuple[str, Slot, str]]] = {}
        for h, slot in mapping.items():
            self._where.setdefault(slot.path, []).append((h, slot, index[h]))
        entries = {}
        for ours, var in flat_params(abstract).items():
            h, _, f = self._where[ours][0]
            entries[ours] = (tuple(var.get_value().shape), self._files[f].dtype(self._views.get(h, (h,))[0]))
        super().__init__(path, cfg, entries)

    def stored(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(its HF name, its shape there); a stacked expert parameter: expert 0's tensor."""
        self._entry(name)
        h, _, f = self._where[name][0]
        return h, shapes_of(self._files[f], h, self._views)

    def get(self, name: str) -> np.ndarray:
        self._entry(name)
        pieces = [self._read(h, f) for h, _, f in self._where[name]]
        pieces = [arr.T if slot.transform == "T" else arr for arr, (_, slot, _) in zip(pieces, self._where[name])]
        return pieces[0] if self._where[name][0][1].expert is None else np.stack(pieces)

    def _read(self, h: str, f: str) -> np.ndarray:
        reader = self._files[f]
        src, idx = self._views.get(h, (h, None))
        if isinstance(reader, remote.RemoteSafetensors):
            return reader.tensor(src) if idx is None else reader.tensor(src, slice(idx[0], idx[0] + 1))[0][idx[1:]]
        return reader[src] if idx is None else reader[src][idx]


def shapes_of(reader, h: str, views: dict[str, tuple[str, tuple]]) -> tuple[int, ...]:
    """The stored shape of HF tensor `h`, a block of a fused expert tensor when `views` names it."""
    if h not in views:
        return tuple(reader.shape(h))
    src, (_, rows) = views[h]
    shape = reader.shape(src)
    return (len(range(*rows.indices(shape[1]))), shape[2])


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
