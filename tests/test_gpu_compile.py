"""GPU readiness on a CPU host: compile-only GPU devices (JAX's CUDA plugin, no GPU, no driver) by name and count.

`make install` puts the plugin in a side directory of the environment (`lrmq.targets.gpu_plugin_dir`), so that a CPU
start never loads it; on x86_64 Linux its absence fails these tests (a broken install), elsewhere they are skipped.
"""

from __future__ import annotations

import platform
import sys

import pytest

from lrmq.configlib import ConfigError
from lrmq import targets


def _require_plugin():
    try:
        targets._find_cuda_plugin()
    except ConfigError:
        if sys.platform == "linux" and platform.machine() == "x86_64":
            raise  # make install puts the plugin here: a missing one is a broken environment
        pytest.skip("JAX's CUDA plugin has no wheel for this platform")


def test_gpu_topology_by_name_and_count():
    _require_plugin()
    devices = targets.gpu_topology_devices("h200:8")
    assert len(devices) == 8 and {d.platform for d in devices} == {"gpu"}
    kind = devices[0].device_kind
    assert kind == "NVIDIA H200 141GB HBM3e"
    assert [len(targets.gpu_topology_devices(n)) for n in ("h100", "a100:2x2")] == [1, 4]
    # JAX takes 0.75 of the GPU's memory by default; the H200's target has 141 GiB
    from lrmq.rl.precompile import hbm_bytes

    assert hbm_bytes(devices[0]) == int(151397597184 * 0.75)
    assert targets.gpu_specs()[kind]["bandwidth"] == 4.8e12


def test_gpu_topology_errors_name_the_problem():
    with pytest.raises(ConfigError, match=r"GPU 'h300': unknown; known: a100, b200, h100, h200"):
        targets.parse_gpu_topology("h300:8")
    with pytest.raises(ConfigError, match="expected NAME, NAME:GPUS or NAME:HOSTSxGPUS"):
        targets.parse_gpu_topology("h200:eight")
    assert targets.parse_gpu_topology("H200:2x8") == ("h200", 2, 8)


def test_native_noise_filter_keeps_real_errors():
    text = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
            "I0000 00:00:1.0 15437 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.\n"
            "Failed to find host bounds for accelerator type: WARNING: could not determine TPU accelerator type\n"
            "WARNING: Logging before InitGoogle() is written to STDERR\n"
            "E0000 00:00:1.0 16606 common_lib.cc:554] INVALID_ARGUMENT: Error: unexpected worker hostname 'WARNING: "
            "could not determine TPU worker hostnames or IP addresses' from env var TPU_WORKER_HOSTNAMES.\n"
            "=== Source Location Trace: === \n"
            "learning/45eac/tfrc/runtime/libtpu_init_utils.cc:327\n"
            "E0000 00:00:1.0 1 foo.cc:1] a real error\n"
            "=== Source Location Trace: ===\n"
            "foo.cc:1\n")
    assert targets.filter_native_noise(text) == ("E0000 00:00:1.0 1 foo.cc:1] a real error\n"
                                                 "=== Source Location Trace: ===\nfoo.cc:1\n")


def test_gpu_memory_line_names_the_fraction_that_fits(monkeypatch):
    kind = "NVIDIA H200 141GB HBM3e"
    assert targets.gpu_memory_line(kind) == (f"{kind}: 141.0 GiB, of which JAX's allocator takes 0.75 "
                                             "(XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75): 105.75 GiB per GPU")
    # 110 GiB needed, 10% headroom: 110 / (141 * 0.9) = 0.867 of the GPU
    assert targets.gpu_memory_line(kind, 110 * 2 ** 30, 0.1).endswith("XLA_PYTHON_CLIENT_MEM_FRACTION=0.87 makes it fit")
    assert "makes it fit" not in targets.gpu_memory_line(kind, 130 * 2 ** 30, 0.1)  # past 0.95: no such setting
    assert targets.gpu_memory_line("TPU v5 lite") is None
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert targets.gpu_usable_bytes(kind) == int(151397597184 * 0.9)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "lots")
    with pytest.raises(ConfigError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='lots': not a number"):
        targets.gpu_usable_bytes(kind)


def test_a_large_sort_compiles_for_a_compile_only_gpu():
    """XLA rewrites a large sort (top-p sampling over the vocabulary) into CUB's radix sort, which asks the CUDA
    runtime for its scratch size while compiling: with no CUDA library here that compile fails, and
    `lower_compile` (every lrmq compile) passes `targets.compile_options`, XLA's own sort kernel."""
    _require_plugin()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lrmq.rl.precompile import lower_compile

    devices = targets.gpu_topology_devices("h100")
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    x = jax.ShapeDtypeStruct((32, 151936), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, jax.P()))
    sort = jax.jit(lambda x: jnp.sort(x, axis=-1))
    with pytest.raises(jax.errors.JaxRuntimeError, match="Error loading CUDA libraries"):
        sort.lower(x).compile()
    compiled, _ = lower_compile(sort, x, mesh=mesh)
    assert compiled.memory_analysis().argument_size_in_bytes == 32 * 151936 * 4
    assert targets.compile_options(jax.devices("cpu")) == {}
