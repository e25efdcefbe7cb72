"""Sharded safetensors written as the tensors come, as transformers names them.

:class:`ShardWriter` appends each tensor's bytes to the current shard's data file as it comes (host memory: the
tensor being written, not the shard) and starts a new shard once the next tensor would pass
``max_shard_bytes``. A shard is finished by :func:`write_shard`: safetensors' header (tensors ordered, and padded,
as safetensors' own ``save_file`` orders them -- the order taken from safetensors itself) followed by the tensors'
bytes copied from the data file in that order, so the file is byte for byte what ``save_file`` writes for the same
tensors. The "-of-N" names are only known at the
end: :meth:`ShardWriter.close` renames the shards to ``model.safetensors`` (one shard) or
``model-00001-of-0000N.safetensors`` ... with ``model.safetensors.index.json`` (``metadata.total_size``,
``weight_map``), the layout `transformers`, compressed-tensors and vLLM load. ``prefix`` replaces "model" in
those names (an lrmq checkpoint's ``params.safetensors`` ..., `lrmq.checkpoint.lrmq_shards`).
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
from safetensors.numpy import save

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default ("5GB")
COPY_CHUNK = 64 * 2**20  # bytes copied at a time from a shard's data file into the shard
INDEX_FILE = "model.safetensors.index.json"


def _header_order(specs: list[tuple[str, np.dtype]], metadata: dict) -> list[tuple[str, str]]:
    """(name, safetensors dtype) in the order safetensors' serializer lays the tensors out (asked of safetensors
    itself on empty arrays of the same dtypes: its order depends on the dtype and the name only)."""
    blob = save({name: np.empty((0,), dtype) for name, dtype in specs}, metadata=metadata)
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    return [(name, entry["dtype"]) for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"])]


def write_shard(part: str, data: str, entries: list[tuple[str, np.dtype, tuple, int, int]], metadata: dict) -> None:
    """The safetensors file ``part`` from the tensors whose bytes are in ``data`` (``entries``: name, dtype, shape,
    offset in ``data``, bytes), laid out as ``save_file`` lays them out."""
    where = {name: (shape, start, nbytes) for name, _, shape, start, nbytes in entries}
    order = _header_order([(name, dtype) for name, dtype, *_ in entries], metadata)
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, st_dtype in order:
        shape, _, nbytes = where[name]
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(data, "rb") as src, open(part, "wb") as dst:
        dst.write(struct.pack("<Q", len(text)))
        dst.write(text)
        for name, _ in order:
            _, start, nbytes = where[name]
            src.seek(start)
            while nbytes:
                chunk = src.read(min(nbytes, COPY_CHUNK))
                if not chunk:
                    raise OSError(f"{data}: ended before tensor {name}")
                dst.write(chunk)
                nbytes -= len(chunk)


class ShardWriter:
    """Tensors into ``directory`` (an existing, empty temporary directory), one shard at a time (module doc)."""

    def __init__(self, directory: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, metadata=None, *,
                 prefix: str = "model"):
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        if not prefix or "/" in prefix or prefix.startswith("."):
            raise ValueError(f"shard file prefix must be a plain file name, got {prefix!r}")
        self.directory, self.max_shard_bytes, self.prefix = directory, int(max_shard_bytes), prefix
        self.metadata = dict(metadata or {"format": "pt"})
        self._written: list[tuple[str, list[str], int]] = []  # (temporary file, tensor names, bytes)
        self._entries: list[tuple[str, np.dtype, tuple, int, int]] = []  # the current shard's tensors
        self._data = None  # the current shard's data file (its tensors' bytes, in arrival order)
        self._size = 0
        self._names: set[str] = set()

    def _data_path(self) -> str:
        return os.path.join(self.directory, f".{self.prefix}-shard-{len(self._written):05d}.data")

    def add(self, name: str, array) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name} written twice")
        # the array's buffer is what is written: a transposed view is made contiguous first (not through
        # np.ascontiguousarray, which turns a 0-d array, an NF4 weight's absmax_offset, into shape [1])
        arr = np.asarray(array)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        if self._size and self._size + arr.nbytes > self.max_shard_bytes:
            self.flush()
        if self._data is None:
            self._data = open(self._data_path(), "wb")
        self._names.add(name)
        self._entries.append((name, arr.dtype, arr.shape, self._size, arr.nbytes))
        self._data.write(memoryview(arr.reshape(-1).view(np.uint8)))
        self._size += arr.nbytes

    def flush(self) -> None:
        """Finish the current shard (if any) on disk now."""
        if not self._entries:
            return
        data = self._data.name
        self._data.close()
        self._data = None
        part = os.path.join(self.directory, f".{self.prefix}-shard-{len(self._written):05d}.part")
        write_shard(part, data, self._entries, self.metadata)
        os.remove(data)
        self._written.append((part, [e[0] for e in self._entries], self._size))
        self._entries, self._size = [], 0

    def close(self) -> list[str]:
        """Write the last shard, give every shard its final name (and the index); returns the file names."""
        self.flush()
        if not self._written:
            raise ValueError(f"{self.directory}: no tensors were written")
        single, index = f"{self.prefix}.safetensors", f"{self.prefix}.safetensors.index.json"
        if len(self._written) == 1:
            os.rename(self._written[0][0], os.path.join(self.directory, single))
            return [single]
        weight_map, total, names = {}, 0, []
        for i, (part, tensors, nbytes) in enumerate(self._written):
            fname = f"{self.prefix}-{i + 1:05d}-of-{len(self._written):05d}.safetensors"
            os.rename(part, os.path.join(self.directory, fname))
            weight_map.update((n, fname) for n in tensors)
            total += nbytes
            names.append(fname)
        with open(os.path.join(self.directory, index), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        return [*names, index]
