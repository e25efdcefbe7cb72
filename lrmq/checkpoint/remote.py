"""Checkpoints read from a bucket (`gs://...`, any scheme `paths.URL_SCHEMES` handles), without a local copy of
their weights.

`local_view(url)` copies a checkpoint's small files (config.json, tokenizer files, the safetensors index, an
lrmq checkpoint's manifest) into a per-process cache directory with a `remote.json` naming the URL; every
reader that takes a checkpoint directory reads those as local files. The weights stay in the bucket:
`RemoteSafetensors` reads a file's header, then only the byte ranges asked for. `load_hf_model` asks, per
device of this host (`jax.make_array_from_callback`), for the rows of the tensor its shard covers, so a host
of a pod slice fetches its own shards' rows, not every tensor, and nothing is written to its disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading

import numpy as np

from lrmq import paths
from lrmq.checkpoint.safetensors_mmap import SafetensorsError, header_entries

MARKER = "remote.json"
_VIEWS: dict[str, str] = {}
_LOCK = threading.Lock()
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf")


def is_remote_view(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def remote_url(path: str) -> str | None:
    """The URL a local view stands for (None for an ordinary directory)."""
    if not is_remote_view(path):
        return None
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)["url"]


_ROOT: list[str] = []  # this process's cache dir, made on first use


def _cache_root() -> str:
    """$LRMQ_REMOTE_CACHE (kept), else one temporary dir per process, removed when it exits
    (`paths.process_temp_dir`)."""
    if os.environ.get("LRMQ_REMOTE_CACHE"):
        return os.environ["LRMQ_REMOTE_CACHE"]
    if not _ROOT or not os.path.isdir(_ROOT[-1]):
        _ROOT[:] = [paths.process_temp_dir("remote")]
    return _ROOT[-1]


def local_view(url: str) -> str:
    """A local directory standing for the checkpoint at `url`: its small files copied, its weights left in the
    bucket (`remote.json` names the URL). Once per URL and process. A URL that is not a directory there raises
    FileNotFoundError naming it."""
    url = paths.resolve(url)
    with _LOCK:
        if url in _VIEWS and os.path.isdir(_VIEWS[url]):  # (gone once the process's temporary dirs are removed)
            return _VIEWS[url]
        root = paths.epath_of(url)
        try:
            entries = list(root.iterdir()) if root.exists() else []
        except OSError as e:
            raise FileNotFoundError(f"{url}: cannot list the checkpoint directory ({e})") from None
        if not entries:
            raise FileNotFoundError(f"{url}: no such checkpoint directory in the bucket")
        view = os.path.join(_cache_root(), hashlib.sha1(url.encode()).hexdigest()[:16])
        os.makedirs(view, exist_ok=True)
        weights, dirs = [], []
        for e in entries:
            if e.is_dir():
                dirs.append(e.name)
                os.makedirs(os.path.join(view, e.name), exist_ok=True)  # e.g. an lrmq checkpoint's params/
            elif e.name.endswith(_WEIGHT_SUFFIXES):
                weights.append(e.name)
            else:
                with open(os.path.join(view, e.name), "wb") as f:
                    f.write(e.read_bytes())
        with open(os.path.join(view, MARKER), "w") as f:
            json.dump({"url": url, "weights": sorted(weights), "dirs": sorted(dirs)}, f)
        _VIEWS[url] = view
        return view


def weight_files(view: str) -> list[str]:
    with open(os.path.join(view, MARKER)) as f:
        return json.load(f)["weights"]


class RemoteSafetensors:
    """A .safetensors file in a bucket: the header read once; `tensor(name, rows)` reads only the bytes of
    `rows` (a slice of the first axis) of one tensor. `bytes_read` counts what was fetched."""

    def __init__(self, url: str):
        import fsspec

        self.url = url
        self.fs, self._path = fsspec.core.url_to_fs(url)
        self.bytes_read = 0
        try:
            self.size = int(self.fs.size(self._path))
            head = self._read(0, 8)
            if len(head) < 8:
                raise SafetensorsError(f"{url}: too short for a safetensors header ({self.size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > self.size:
                raise SafetensorsError(f"{url}: header length {n} runs past the end of the file ({self.size} bytes)")
            header = json.loads(self._read(8, 8 + n))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{url}: cannot read the safetensors header ({e})") from None
        self.entries = header_entries(header, 8 + n, self.size, url)

    def _read(self, start: int, end: int) -> bytes:
        data = self.fs.cat_file(self._path, start=start, end=end)
        self.bytes_read += len(data)
        return data

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self.entries[name][0]

    def tensor(self, name: str, rows: slice | None = None) -> np.ndarray:
        """The tensor, or only `rows` of its first axis (one contiguous byte range)."""
        dtype, shape, offset, nbytes = self.entries[name]
        if not shape:
            return np.frombuffer(self._read(offset, offset + nbytes), dtype).reshape(shape)
        r0, r1, step = (rows or slice(None)).indices(shape[0])
        if step != 1:
            raise ValueError(f"{self.url}: {name}: rows must be a contiguous slice, got {rows}")
        row = nbytes // shape[0] if shape[0] else 0
        data = self._read(offset + r0 * row, offset + r1 * row) if r1 > r0 else b""
        return np.frombuffer(data, dtype).reshape((max(r1 - r0, 0), *shape[1:]))


def open_safetensors(url: str) -> RemoteSafetensors:
    """One reader per file and process (the header is read once)."""
    with _LOCK:
        r = _READERS.get(url)
    if r is None:
        r = RemoteSafetensors(url)
        with _LOCK:
            _READERS[url] = r
    return r


_READERS: dict[str, RemoteSafetensors] = {}
