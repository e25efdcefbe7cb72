"""Zero-copy reads of .safetensors files: tensors are read-only numpy views of memory-mapped file pages.

``safetensors.safe_open(..., framework="numpy").get_tensor`` copies every tensor into fresh memory;
passes that read each weight once and reduce it (QuantLRM importance) need no copy: the page-cache
pages are read in place.  Each tensor gets its own mapping of just its pages, released when the last
view of it is dropped, so resident memory stays at the tensors in use.

Format: an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": ...}``, then the data; every entry is checked against
the file size before any view is made.
"""

from __future__ import annotations

import json
import mmap
import os
import struct

import numpy as np

_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
           "U8": "uint8", "BOOL": "bool"}


class SafetensorsError(ValueError):
    """A .safetensors file is malformed; the message names the file (and the tensor)."""


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def header_entries(header: dict, base: int, size: int, where: str) -> dict[str, tuple[np.dtype, tuple[int, ...], int, int]]:
    """{name: (dtype, shape, absolute offset, bytes)} of a parsed safetensors header whose data starts at `base`
    in a file of `size` bytes; every entry checked against the file (SafetensorsError naming `where`)."""
    entries = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _np_dtype(_DTYPES[e["dtype"]])
            shape = tuple(int(d) for d in e["shape"])
            begin, end = (int(o) for o in e["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise SafetensorsError(f"{where}: tensor {name}: bad header entry {e!r} ({err!r})") from None
        want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != want or begin < 0 or base + end > size:
            raise SafetensorsError(
                f"{where}: tensor {name}: data_offsets {[begin, end]} do not hold {e['dtype']}{list(shape)} "
                f"({want} bytes) inside the file ({size - base} data bytes)")
        entries[name] = (dtype, shape, base + begin, want)
    return entries


class MappedSafetensors:
    """``f = MappedSafetensors(path)``; ``f.keys()``, ``f.shape(name)``, ``f.dtype(name)``, ``f[name]`` (read-only
    view)."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise SafetensorsError(f"{path}: too short for a safetensors header ({size} bytes)")
                (n,) = struct.unpack("<Q", head)
                if 8 + n > size:
                    raise SafetensorsError(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
                raw = fh.read(n)
        except OSError as e:
            raise SafetensorsError(f"{path}: cannot read: {e}") from None
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: header is not valid JSON: {e}") from None
        self._base = 8 + n
        self._entries = header_entries(header, self._base, size, path)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str):
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def dtype(self, name: str) -> np.dtype:
        return self._entry(name)[0]

    def __getitem__(self, name: str) -> np.ndarray:
        dtype, shape, start, nbytes = self._entry(name)
        if nbytes == 0:
            return np.zeros(shape, dtype)
        page = start - start % mmap.ALLOCATIONGRANULARITY
        with open(self.path, "rb") as fh:  # the mapping keeps its own reference to the file
            mm = mmap.mmap(fh.fileno(), start + nbytes - page, offset=page, access=mmap.ACCESS_READ)
        count = nbytes // dtype.itemsize
        return np.frombuffer(mm, dtype=dtype, count=count, offset=start - page).reshape(shape)
