"""Sharded safetensors written as the tensors come, as transformers names them.

:class:`ShardWriter` appends tensors to the current shard and writes it to disk once the next tensor would
pass ``max_shard_bytes`` (host memory: one shard, not the model). The "-of-N" names are only known at the
end: :meth:`ShardWriter.close` renames the shards to ``model.safetensors`` (one shard) or
``model-00001-of-0000N.safetensors`` ... with ``model.safetensors.index.json`` (``metadata.total_size``,
``weight_map``), the layout `transformers`, compressed-tensors and vLLM load. ``prefix`` replaces "model" in
those names (an lrmq checkpoint's ``params.safetensors`` ..., `lrmq.checkpoint.lrmq_shards`).
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default ("5GB")
INDEX_FILE = "model.safetensors.index.json"


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
        self._shard: dict[str, np.ndarray] = {}
        self._size = 0
        self._names: set[str] = set()

    def add(self, name: str, array) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name} written twice")
        # safetensors writes the array's buffer: a transposed view must be made contiguous first (not through
        # np.ascontiguousarray, which turns a 0-d array, an NF4 weight's absmax_offset, into shape [1])
        arr = np.asarray(array)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        if self._size and self._size + arr.nbytes > self.max_shard_bytes:
            self.flush()
        self._names.add(name)
        self._shard[name] = arr
        self._size += arr.nbytes

    def flush(self) -> None:
        """Write the current shard (if any) to disk now."""
        if not self._shard:
            return
        part = os.path.join(self.directory, f".{self.prefix}-shard-{len(self._written):05d}.part")
        save_file(self._shard, part, metadata=self.metadata)
        self._written.append((part, list(self._shard), self._size))
        self._shard, self._size = {}, 0

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
