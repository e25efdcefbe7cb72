import os
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from lrmq.checkpoint.safetensors_mmap import MappedSafetensors, SafetensorsError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_views_equal_safetensors_values(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "w.bf16": rng.standard_normal((37, 5000)).astype(ml_dtypes.bfloat16),  # spans several pages
        "w.f32": rng.standard_normal((3, 7)).astype(np.float32),
        "w.f16": rng.standard_normal(11).astype(np.float16),
        "i8": np.arange(-5, 5, dtype=np.int8),
        "empty": np.zeros((0, 4), np.float32),
    }
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    f = MappedSafetensors(path)
    assert sorted(f.keys()) == sorted(tensors)
    for k, v in tensors.items():
        got = f[k]
        assert got.dtype == v.dtype and got.shape == v.shape == f.shape(k), k
        assert np.array_equal(got.view(np.uint8), v.view(np.uint8)), k
        assert not got.flags.writeable or got.size == 0
    with pytest.raises(KeyError, match="no tensor 'missing'"):
        f["missing"]


def _write_raw(path, header: bytes, data: bytes = b""):
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header + data)


def test_malformed_files_name_file_and_tensor(tmp_path):
    p = str(tmp_path / "bad.safetensors")
    open(p, "wb").write(b"\x01\x02")
    with pytest.raises(SafetensorsError, match=r"bad\.safetensors: too short"):
        MappedSafetensors(p)
    _write_raw(p, b"{not json")
    with pytest.raises(SafetensorsError, match="not valid JSON"):
        MappedSafetensors(p)
    with open(p, "wb") as fh:
        fh.write(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(SafetensorsError, match="runs past the end"):
        MappedSafetensors(p)
    # a truncated file: the entry claims more bytes than exist
    _write_raw(p, b'{"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}', b"\0" * 20)
    with pytest.raises(SafetensorsError, match=r"tensor w: data_offsets \[0, 64\]"):
        MappedSafetensors(p)
    _write_raw(p, b'{"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}', b"\0" * 64)
    with pytest.raises(SafetensorsError, match="tensor w"):
        MappedSafetensors(p)
    _write_raw(p, b'{"w": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4)
    with pytest.raises(SafetensorsError, match="tensor w: bad header entry"):
        MappedSafetensors(p)


def test_importance_benchmark_smoke(tmp_path):
    # benchmarks/quantize.py importance section end to end on one layer of Qwen3-0.6B shapes
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "quantize.py"), "--quick", "--layers", "1",
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if "importance:" in x][0]
    fields = dict(kv.split("=") for kv in line.split("importance: ")[1].split(", "))
    assert fields["warm_stats_reads"] == "1" and int(fields["warm_n_matrices"]) == 4
    assert float(fields["warm_ratio"]) > 0 and float(fields["cold_ratio"]) > 0


def test_remote_safetensors_reads_only_the_rows_asked_for(tmp_path):
    """A bucket checkpoint's tensors are streamed: the header once, then one byte range per request (fsspec's
    in-memory filesystem stands in for the bucket); a row slice fetches exactly its rows' bytes."""
    import fsspec
    from safetensors.numpy import save_file

    from lrmq.checkpoint.remote import RemoteSafetensors

    a = np.arange(64 * 24, dtype=np.float32).reshape(64, 24)
    b = np.arange(10, dtype=np.int32)
    local = str(tmp_path / "m.safetensors")
    save_file({"a": a, "b": b}, local)
    with open(local, "rb") as f:
        fsspec.filesystem("memory").pipe("/lrmq-test/m.safetensors", f.read())
    r = RemoteSafetensors("memory://lrmq-test/m.safetensors")
    header = r.bytes_read
    assert set(r.keys()) == {"a", "b"} and r.shape("a") == (64, 24) and header < 200
    np.testing.assert_array_equal(r.tensor("a", slice(16, 32)), a[16:32])
    assert r.bytes_read - header == 16 * 24 * 4  # those rows only
    np.testing.assert_array_equal(r.tensor("b"), b)
    np.testing.assert_array_equal(r.tensor("a"), a)
    assert r.bytes_read - header == 16 * 24 * 4 + b.nbytes + a.nbytes
    with pytest.raises(ValueError, match="contiguous"):
        r.tensor("a", slice(0, 8, 2))
    fsspec.filesystem("memory").pipe("/lrmq-test/cut.safetensors", open(local, "rb").read()[:-40])
    with pytest.raises(ValueError, match="cut.safetensors: tensor .*inside the file"):
        RemoteSafetensors("memory://lrmq-test/cut.safetensors")
