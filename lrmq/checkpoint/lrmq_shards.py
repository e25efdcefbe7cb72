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

`orbax_io.LrmqWriter` fills a directory one variable at a time (a streamed PTQ writes each decoder layer as it
is finished; host memory holds one tensor, `lrmq.checkpoint.shards.ShardWriter` with ``prefix=PARAMS_PREFIX``).
Reading, here (`ParamFiles`): each
array is placed on its sharding with `jax.make_array_from_callback`, every device's callback reading only
the rows its shard covers, from a memory-mapped view of a local file (`safetensors_mmap.MappedSafetensors`)
or as byte ranges of a file in a bucket (`remote.RemoteSafetensors`).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lrmq.checkpoint import remote
from lrmq.checkpoint.hf import CheckpointError, _weight_map
from lrmq.checkpoint.safetensors_mmap import MappedSafetensors, SafetensorsError

STATE_FILE = "lrmq_state.json"  # the manifest (`orbax_io`)
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
        want = np.dtype(jnp.dtype(dtype))  # (jnp.dtype knows "bfloat16")
        if got_shape != tuple(shape) or got_dtype != want:
            raise CheckpointError(f"{where}: tensor {name} is {got_dtype}{list(got_shape)}, {STATE_FILE} says "
                                  f"{want}{list(shape)}")

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
