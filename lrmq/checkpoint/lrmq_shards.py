"""The safetensors storage layout of an lrmq checkpoint, written layer by layer and read back shard by shard.

The same checkpoint as `lrmq.checkpoint.orbax_io` describes (config.json, the lrmq_state.json manifest,
tokenizer files), with the arrays in safetensors files instead of an orbax ``params/`` tree:

    params.safetensors                      every array, when they fit one shard; else
    params-00001-of-0000N.safetensors ...   shards of at most ``max_shard_bytes`` (default 5 * 10**9)
    params.safetensors.index.json           {"metadata": {"total_size"}, "weight_map": {tensor: file}}

and ``"storage": "safetensors"`` at the top of lrmq_state.json (an orbax checkpoint has no such key). Tensor
names: a float Param by its flat lrmq name (``layers.0.attn.q_proj.kernel``), a packed ``QuantizedKernel``'s
arrays as ``<flat>.<field>`` (``layers.0.attn.q_proj.kernel.codes``, ``.scales``, ``.zeros`` ...:
`QuantizedWeight.arrays`), stored dtypes as they are (bf16 through ml_dtypes). The manifest, not the
safetensors headers, is what the reader trusts: every tensor's header is checked against it before a byte
is read.

`LrmqWriter` fills a directory one variable at a time (a streamed PTQ writes each decoder layer as it is
finished; host memory holds one shard, `lrmq.checkpoint.shards.ShardWriter`). Reading (`ParamFiles`): each
array is placed on its sharding with `jax.make_array_from_callback`, every device's callback reading only
the rows its shard covers, from a memory-mapped view of a local file (`safetensors_mmap.MappedSafetensors`)
or as byte ranges of a file in a bucket (`remote.RemoteSafetensors`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

from lrmq.checkpoint import remote
from lrmq.checkpoint.hf import CheckpointError, _weight_map, copy_tokenizer_files
from lrmq.checkpoint.orbax_io import (CONFIG_FILE, FORMAT_VERSION, STATE_FILE, _array_desc, _hf_config_for,
                                      _json_static, _savable_vars)
from lrmq.checkpoint.safetensors_mmap import MappedSafetensors, SafetensorsError
from lrmq.checkpoint.shards import DEFAULT_MAX_SHARD_BYTES, ShardWriter
from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder
from lrmq.quant.qweight import QuantizedWeight
from lrmq.sharding import LOGICAL_AXES_KEY, host_array

STORAGE = "safetensors"  # lrmq_state.json "storage" of this layout
PARAMS_PREFIX = "params"
PARAMS_FILE = f"{PARAMS_PREFIX}.safetensors"
PARAMS_INDEX = f"{PARAMS_PREFIX}.safetensors.index.json"


def has_params(path: str) -> bool:
    """`path` (a checkpoint directory or a bucket checkpoint's local view) holds this layout's arrays."""
    if os.path.isfile(os.path.join(path, PARAMS_INDEX)) or os.path.isfile(os.path.join(path, PARAMS_FILE)):
        return True
    return remote.is_remote_view(path) and PARAMS_FILE in remote.weight_files(path)


def manifest_tensors(manifest: dict[str, dict[str, Any]]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, dtype name)} of every array a manifest describes, under this layout's names."""
    out = {}
    for p, entry in manifest.items():
        if entry.get("type") == "Param":
            shape, dt = entry["array"]
            out[p] = (tuple(int(d) for d in shape), dt)
        elif entry.get("type") == "QuantizedKernel":
            out.update((f"{p}.{k}", (tuple(int(d) for d in s), d)) for k, (s, d) in entry["arrays"].items())
    return out


# ----------------------------------------------------------------------------- write
class LrmqWriter:
    """An lrmq checkpoint of ``cfg`` written variable by variable into ``directory`` (an existing, empty
    directory: the caller's `lrmq.atomic.atomic_dir`, which makes the whole write atomic).

    ``add_param(flat, array)``: a float parameter (numpy, or a jax array gathered to the host), its dtype stored
    as given (the caller casts to ``cfg.param_dtype``); ``add_quantized(flat, qw)``: a Linear's packed kernel
    (``flat`` = ``'layers.0.attn.q_proj.kernel'``), its ``dtype`` set to ``cfg.param_dtype`` as
    `lrmq.ptq.exports.packed_kernels` does; ``close(weight_formats=..., tokenizer_from=...)``: the last shard,
    the index, lrmq_state.json, config.json and the tokenizer files. Every variable of ``Decoder(cfg)`` must be
    added exactly once, with the config's shape (CheckpointError naming it otherwise); logical axes come from the
    abstract Decoder. Host memory: the shard being filled (at most ``max_shard_bytes``)."""

    def __init__(self, directory: str, cfg: ModelConfig, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.directory, self.cfg = directory, cfg
        self._base = _savable_vars(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
        self._entries: dict[str, dict[str, Any]] = {}
        self._shards = ShardWriter(directory, max_shard_bytes, metadata={"format": "lrmq"}, prefix=PARAMS_PREFIX)
        self._closed = False

    def _start(self, flat: str, what: str) -> dict[str, Any]:
        if self._closed:
            raise CheckpointError(f"{self.directory}: {flat}: the lrmq checkpoint was already closed")
        if flat not in self._base:
            raise CheckpointError(f"{flat}: the decoder of this config has no such variable (cannot store {what})")
        if flat in self._entries:
            raise CheckpointError(f"{flat}: written twice")
        if type(self._base[flat]) is not nnx.Param:
            raise CheckpointError(f"{flat}: a {type(self._base[flat]).__name__}, not a parameter")
        axes = self._base[flat].get_metadata().get(LOGICAL_AXES_KEY)
        return {"logical_axes": list(axes) if axes is not None else None}

    def _want_shape(self, flat: str) -> tuple[int, ...]:
        return tuple(self._base[flat].get_value().shape)

    def add_param(self, flat: str, array) -> None:
        entry = self._start(flat, "a float parameter")
        arr = host_array(array)
        if arr.shape != self._want_shape(flat):
            raise CheckpointError(f"{flat}: shape {list(arr.shape)}, the config needs {list(self._want_shape(flat))}")
        self._shards.add(flat, arr)
        entry.update(type="Param", array=_array_desc(arr))
        self._entries[flat] = entry

    def add_quantized(self, flat: str, qw: QuantizedWeight) -> None:
        self.add_packed(flat, dataclasses.replace(qw, dtype=self.cfg.param_dtype))

    def add_packed(self, flat: str, qw: QuantizedWeight) -> None:
        """`add_quantized` keeping ``qw.dtype`` as it is (`save_lrmq` of a model that holds packed kernels)."""
        entry = self._start(flat, "a packed weight")
        if not flat.endswith(".kernel"):
            raise CheckpointError(f"{flat}: packed weight where the decoder has no Linear kernel")
        if tuple(qw.shape) != self._want_shape(flat):
            raise CheckpointError(f"{flat}: packed weight of shape {list(qw.shape)}, the config needs "
                                  f"{list(self._want_shape(flat))}")
        arrays = {k: host_array(a) for k, a in qw.arrays().items()}
        for k, a in arrays.items():
            self._shards.add(f"{flat}.{k}", a)
        entry.update(type="QuantizedKernel", static=_json_static(qw.static()),
                     arrays={k: _array_desc(a) for k, a in arrays.items()})
        self._entries[flat] = entry

    def close(self, *, weight_formats=None, tokenizer_from: str | None = None) -> None:
        missing = [p for p in self._base if p not in self._entries]
        if missing:
            raise CheckpointError(f"{self.directory}: the lrmq checkpoint is incomplete, missing from the model: "
                                  + ", ".join(missing))
        self._closed = True
        self._shards.close()
        state: dict[str, Any] = {"format_version": FORMAT_VERSION, "storage": STORAGE,
                                 "variables": {p: self._entries[p] for p in self._base}}
        if weight_formats:
            state["weight_formats"] = [wf.to_dict() for wf in weight_formats]
        with open(os.path.join(self.directory, STATE_FILE), "w") as f:
            json.dump(state, f, indent=1)
        with open(os.path.join(self.directory, CONFIG_FILE), "w") as f:
            json.dump(_hf_config_for(self.cfg), f, indent=2)
        if tokenizer_from:
            copy_tokenizer_files(tokenizer_from, self.directory)


# ----------------------------------------------------------------------------- read
class ParamFiles:
    """The arrays of an lrmq checkpoint in this layout (`path`: its directory, or a bucket checkpoint's local
    view): which file holds each tensor (the index, or the one file), each file's header read once when first
    needed. Errors are CheckpointErrors naming the file and the tensor."""

    def __init__(self, path: str):
        self.path = path
        self._url = remote.remote_url(path)
        self._base = self._url or path
        self._files: dict[str, MappedSafetensors | remote.RemoteSafetensors] = {}
        index = os.path.join(path, PARAMS_INDEX)
        if os.path.isfile(index):
            wm = _weight_map(index, self._where(PARAMS_INDEX))
            bad = sorted({f for f in wm.values() if not f or "/" in f or "\\" in f or f.startswith(".")})
            if bad:
                raise CheckpointError(f"{self._where(PARAMS_INDEX)}: names files outside the checkpoint "
                                      f"directory: {bad}")
            self._file_of: dict[str, str] | None = wm
        elif has_params(path):
            self._file_of = None  # every tensor in params.safetensors
        else:
            raise CheckpointError(f"{self._base}: no {PARAMS_FILE} or {PARAMS_INDEX} ({STATE_FILE} says its arrays "
                                  "are stored as safetensors)")

    def _where(self, fname: str) -> str:
        return f"{self._url}/{fname}" if self._url else os.path.join(self.path, fname)

    def _open(self, name: str):
        """(reader, file path or URL) of the file holding tensor `name`."""
        if self._file_of is None:
            fname = PARAMS_FILE
        elif name in self._file_of:
            fname = self._file_of[name]
        else:
            raise CheckpointError(f"{self._where(PARAMS_INDEX)}: no tensor {name} ({STATE_FILE} lists it)")
        where = self._where(fname)
        if fname not in self._files:
            present = (fname in remote.weight_files(self.path)) if self._url else os.path.isfile(where)
            if not present:
                listed = f"{PARAMS_INDEX} lists it for tensor {name}" if self._file_of is not None else \
                    f"{STATE_FILE} says the arrays are there"
                raise CheckpointError(f"{where}: missing ({listed}); the checkpoint's arrays are incomplete")
            try:
                self._files[fname] = remote.open_safetensors(where) if self._url else MappedSafetensors(where)
            except SafetensorsError as e:
                raise CheckpointError(str(e)) from None
        return self._files[fname], where

    def check(self, name: str, shape, dtype) -> None:
        """Tensor `name` is in its file with `shape` and `dtype` (the manifest's); headers only."""
        reader, where = self._open(name)
        if name not in reader.keys():
            raise CheckpointError(f"{where}: no tensor {name} ({STATE_FILE} lists it)")
        got_shape, got_dtype = tuple(reader.shape(name)), np.dtype(reader.dtype(name))
        if got_shape != tuple(shape) or got_dtype != np.dtype(dtype):
            raise CheckpointError(f"{where}: tensor {name} is {got_dtype}{list(got_shape)}, {STATE_FILE} says "
                                  f"{np.dtype(dtype)}{list(shape)}")

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Tensor `name` (or only `rows` of its first axis): a read-only view of the mapped file, or the bytes
        fetched from the bucket; nothing else of the file is read."""
        reader, _ = self._open(name)
        if isinstance(reader, remote.RemoteSafetensors):
            return reader.tensor(name, rows)
        arr = reader[name]
        return arr if rows is None else arr[rows]

    def place(self, name: str, target: jax.ShapeDtypeStruct) -> jax.Array:
        """Tensor `name` as a jax.Array on ``target.sharding``: each of this host's devices reads only the rows of
        its shard (devices holding the same rows share one read)."""
        shape, cache = tuple(target.shape), {}

        def shard(idx):
            if not shape:
                return np.array(self.read(name))
            idx = tuple(idx)
            key = idx[0].indices(shape[0])
            if key not in cache:
                cache[key] = self.read(name, slice(*key))
            return np.array(cache[key][(slice(None), *idx[1:])])  # a copy: the device never aliases the mapping

        return jax.make_array_from_callback(shape, target.sharding, shard)


def restore_arrays(path: str, arrays: dict[str, tuple[tuple[int, ...], Any]]) -> dict[str, np.ndarray]:
    """`orbax_io.restore_arrays` for this layout: {name: (shape, dtype)} -> numpy arrays (read-only views of the
    mapped files, or bytes fetched from a bucket), each checked against its header first."""
    files = ParamFiles(path)
    for n, (shape, dtype) in arrays.items():
        files.check(n, shape, dtype)
    return {n: files.read(n) for n in arrays}


def restore_model(path: str, manifest: dict[str, dict[str, Any]], targets: dict[str, Any]) -> dict[str, Any]:
    """{flat: restored value} for `load_lrmq`: `targets` maps each variable to a ShapeDtypeStruct (a Param) or an
    abstract QuantizedWeight of them, each carrying its sharding. Every header is checked before any array is
    read."""
    files = ParamFiles(path)
    for n, (shape, dt) in manifest_tensors(manifest).items():
        files.check(n, shape, dt)
    out = {}
    for p, target in targets.items():
        if manifest[p]["type"] == "Param":
            out[p] = files.place(p, target)
        else:
            out[p] = target.replace(**{k: files.place(f"{p}.{k}", t) for k, t in target.arrays().items()})
    return out
