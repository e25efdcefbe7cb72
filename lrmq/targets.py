"""Compile-only devices of hardware this machine does not have: TPU topologies (libtpu) and NVIDIA GPUs (JAX's CUDA
PJRT plugin), for ahead-of-time compiles from a CPU-only host (`lrmq.aot`, `--compile-only --topology`).

GPUs: `gpu_topology_devices("h200:8")` is one host of 8 H200s, `"h100:2x8"` two hosts of 8. XLA compiles for the GPU
a target description names (a `stream_executor.GpuTargetConfigProto` in text format); lrmq keeps XLA's own
descriptions in `lrmq/assets/gpu_targets/*.txtpb`, each with its source and what was changed. The plugin is
`jax-cuda12-pjrt` + `jax-cuda12-plugin` of jax's version. Installed into the environment's site-packages, JAX would
load it at every start and it prints "Could not find cuda drivers" lines on a machine without a GPU, even with
JAX_PLATFORMS=cpu; so `make install` puts it in a side directory (`gpu_plugin_dir()`) that only a GPU compile
loads. A plugin installed the usual way (`pip install 'jax[cuda12]'`) is used as it is.

The native runtimes' start-up lines (libtpu's "Failed to find host bounds", "could not determine TPU accelerator
type" and TPU_WORKER_HOSTNAMES error, the CUDA plugin's "Could not find cuda drivers") are kept off the screen
(`native_noise_filtered`): they say that this machine has no TPU or GPU, which an ahead-of-time compile knows.
Every other line the runtimes print while loading is passed on.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path

from lrmq.configlib import ConfigError

# ----------------------------------------------------------------------------- native start-up noise
NATIVE_NOISE = tuple(re.compile(p) for p in (
    r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine",
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR\s*$",
    r"^WARNING: Logging before InitGoogle\(\) is written to STDERR\s*$",
    r"^Failed to find host bounds for accelerator type",
    r"could not determine TPU worker hostnames or IP addresses",
))
# what follows a dropped error line: its source trace
_TRACE = re.compile(r"^(=== Source Location Trace: ===|\S+\.(cc|h):\d+)\s*$")


def filter_native_noise(text: str) -> str:
    """`text` less the lines of NATIVE_NOISE and the source trace that follows a dropped line."""
    out, dropping = [], False
    for line in text.splitlines(keepends=True):
        if any(p.search(line) for p in NATIVE_NOISE):
            dropping = True
            continue
        if dropping and _TRACE.match(line):
            continue
        dropping = False
        out.append(line)
    return "".join(out)


@contextlib.contextmanager
def native_noise_filtered():
    """Run the block with file descriptor 2 (where C++ runtimes log) going to a temporary file, then write what it
    got to stderr less `filter_native_noise`'s lines (also when the block raises)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = filter_native_noise(tmp.read().decode("utf-8", errors="replace"))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


# ----------------------------------------------------------------------------- TPU
@functools.lru_cache(maxsize=None)
def tpu_topology_devices(name: str) -> tuple:
    """The devices of a TPU topology such as "v5p:2x4x4" or "v5e:2x4" (needs libtpu, not a TPU)."""
    # libtpu takes a machine-wide lock by default, so a second process compiling for TPU (a test and the
    # CLI it launches, two compiles side by side) would fail; compiling only needs no exclusive device.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        with native_noise_filtered():
            return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # libtpu missing, or a malformed name: say which
        raise ConfigError(f"TPU topology {name!r}: {str(e).splitlines()[0]} (needs libtpu: "
                          f"pip install 'jax[tpu]'; names look like v5e:2x4, v5p:2x4x4, v6e:2x2)") from None


# ----------------------------------------------------------------------------- GPU
GPU_TARGET_DIR = Path(__file__).parent / "assets" / "gpu_targets"
# JAX on a GPU takes this fraction of the device's memory for its allocator (XLA_PYTHON_CLIENT_MEM_FRACTION, JAX's
# default 0.75): what a program can use on the real device, so what a compile-only check compares with
GPU_MEM_FRACTION_DEFAULT = 0.75
GPU_PLUGIN_DIR_ENV = "LRMQ_GPU_PLUGIN_DIR"
_CUDA_PLUGIN = "jax_plugins.xla_cuda12"


def gpu_names() -> list[str]:
    """The GPU names `gpu_topology_devices` takes (one per target description in GPU_TARGET_DIR)."""
    return sorted(p.stem for p in GPU_TARGET_DIR.glob("*.txtpb"))


def gpu_target_config(kind: str) -> str:
    """The GpuTargetConfigProto text of GPU `kind` ("h200"), comments dropped."""
    path = GPU_TARGET_DIR / f"{kind}.txtpb"
    if not path.is_file():
        raise ConfigError(f"GPU {kind!r}: unknown; known: {', '.join(gpu_names())}")
    return "".join(line for line in path.read_text().splitlines(keepends=True) if not line.lstrip().startswith("#"))


def _field(text: str, name: str) -> str:
    m = re.search(rf"^\s*{name}:\s*(.+?)\s*$", text, re.M)
    if m is None:
        raise ConfigError(f"{GPU_TARGET_DIR}: a target has no {name}")
    return m.group(1).strip('"')


@functools.lru_cache(maxsize=None)
def gpu_specs() -> dict[str, dict]:
    """{device_kind: {"name", "memory_bytes", "bandwidth", "compute_capability"}} of the kept targets."""
    out = {}
    for kind in gpu_names():
        text = gpu_target_config(kind)
        cc = re.search(r"cuda_compute_capability\s*{\s*major:\s*(\d+)(?:\s*minor:\s*(\d+))?", text)
        out[_field(text, "device_description_str")] = {
            "name": kind, "memory_bytes": int(_field(text, "device_memory_size")),
            "bandwidth": float(_field(text, "memory_bandwidth")),
            "compute_capability": f"{cc.group(1)}.{cc.group(2) or 0}"}
    return out


# XLA's PrimitiveType numbers of the dtypes whose matrix-unit rates a target description lists (its
# matrix_unit_description.rate_infos keys): BF16 = 16, F32 = 11 (the TF32 rate: what an f32 dot at JAX's default
# precision runs at on Hopper)
PRIMITIVE_TYPES = {"bf16": 16, "f32": 11}


def gpu_peak_flops(kind: str, dtype: str = "bf16") -> float:
    """Dense FLOP/s of GPU `kind` ("h200") for `dtype` (bf16, or f32 at TF32) from its kept target description:
    2 (an FMA) x the matrix units' rate x cores. H100 / H200: 989 TFLOP/s bf16, 495 f32 (NVIDIA's dense figures)."""
    text = gpu_target_config(kind)
    matrix = text[text.index("matrix_unit_description"):]
    key = PRIMITIVE_TYPES[dtype]
    m = re.search(rf"key: {key}\s*value {{\s*clock_rate_ghz: ([\d.]+)\s*units_per_core: (\d+)\s*ops_per_clock: (\d+)",
                  matrix)
    if m is None:
        raise ConfigError(f"{GPU_TARGET_DIR / (kind + '.txtpb')}: no matrix-unit rate for {dtype}")
    cores = int(re.search(r"core_count: (\d+)", text).group(1))
    return 2 * float(m.group(1)) * 1e9 * int(m.group(2)) * int(m.group(3)) * cores


# One TPU chip's dense bf16 FLOP/s and HBM bandwidth (bytes/s), Google Cloud's published figures
# (cloud.google.com/tpu/docs/v5e, /v5p, /v6e): an f32 dot at JAX's default precision is one bf16 pass on a TPU
TPU_PEAKS = {"TPU v5 lite": (197e12, 819e9), "TPU v5": (459e12, 2765e9), "TPU v6 lite": (918e12, 1640e9)}


def chip_peaks(device_kind: str, dtype: str = "bf16") -> tuple[float, float] | None:
    """(FLOP/s, HBM bytes/s) of one chip of `device_kind` (a TPU of TPU_PEAKS; a GPU with a kept target
    description: `gpu_peak_flops` at `dtype` and its memory bandwidth); None for other devices. A TPU's f32 dot runs
    at the bf16 rate (JAX's default precision: one bf16 pass)."""
    if device_kind in TPU_PEAKS:
        return TPU_PEAKS[device_kind]
    spec = gpu_specs().get(device_kind)
    if spec is None:
        return None
    return gpu_peak_flops(spec["name"], dtype), spec["bandwidth"]


def gpu_mem_fraction() -> float:
    """The share of a GPU's memory JAX's allocator takes: XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75."""
    raw = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if not raw:
        return GPU_MEM_FRACTION_DEFAULT
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r}: not a number") from None
    if not 0 < value <= 1:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r}: must be in (0, 1]")
    return value


def gpu_usable_bytes(device_kind: str) -> int | None:
    """What a JAX program can allocate on one GPU of `device_kind` (a kept target's device_description_str):
    its memory times `gpu_mem_fraction()`; None for a kind lrmq has no description of."""
    spec = gpu_specs().get(device_kind)
    return int(spec["memory_bytes"] * gpu_mem_fraction()) if spec else None


def gpu_plugin_dir() -> str:
    """Where `make install` puts JAX's CUDA plugin beside the environment (LRMQ_GPU_PLUGIN_DIR overrides)."""
    return os.environ.get(GPU_PLUGIN_DIR_ENV) or os.path.join(sys.prefix, "lrmq-gpu-aot")


def gpu_install_hint() -> str:
    import jax

    return (f"pip install --target {gpu_plugin_dir()} jax-cuda12-pjrt=={jax.__version__} "
            f"jax-cuda12-plugin=={jax.__version__} (what make install does), or pip install 'jax[cuda12]'")


def _plugin_importable() -> bool:
    try:  # find_spec of a dotted name raises when the parent package (`jax_plugins`) is not there at all
        return importlib.util.find_spec(_CUDA_PLUGIN) is not None
    except ModuleNotFoundError:
        return False


def _find_cuda_plugin() -> None:
    """Make JAX's CUDA plugin importable: installed, or in `gpu_plugin_dir()`; else a ConfigError with the hint."""
    if _plugin_importable():
        return
    side = gpu_plugin_dir()
    if os.path.isdir(os.path.join(side, *_CUDA_PLUGIN.split("."))) and side not in sys.path:
        sys.path.append(side)  # `jax_plugins` is a namespace package: its path follows sys.path
        importlib.invalidate_caches()
    if not _plugin_importable():
        raise ConfigError(f"GPU compiles need JAX's CUDA plugin, not found here: {gpu_install_hint()}")


def parse_gpu_topology(name: str) -> tuple[str, int, int]:
    """("h200", hosts, gpus per host) of "h200" (one GPU), "h200:8" (one host of 8) or "h200:2x8" (two hosts of 8)."""
    m = re.fullmatch(r"([a-z0-9]+)(?::(?:(\d+)x)?(\d+))?", name.strip().lower())
    if m is None:
        raise ConfigError(f"GPU topology {name!r}: expected NAME, NAME:GPUS or NAME:HOSTSxGPUS "
                          f"(e.g. h200:8; names: {', '.join(gpu_names())})")
    kind, hosts, per_host = m.group(1), int(m.group(2) or 1), int(m.group(3) or 1)
    gpu_target_config(kind)  # an unknown name's error
    if hosts < 1 or per_host < 1:
        raise ConfigError(f"GPU topology {name!r}: counts must be >= 1")
    return kind, hosts, per_host


# XLA options a compile for a compile-only GPU needs: XLA rewrites a large sort (top-p sampling over the vocabulary)
# into CUB's radix sort and asks the CUDA runtime for its scratch size while compiling ("INTERNAL: CUDA Runtime
# error: Error loading CUDA libraries"); without it XLA's own sort kernel is compiled
COMPILE_ONLY_GPU_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}


def compile_options(devices) -> dict:
    """XLA compiler options for a program compiled for `devices`: COMPILE_ONLY_GPU_OPTIONS for compile-only GPU
    devices (`gpu_topology_devices`' StreamExecutorGpuDevice, which cannot run), else none."""
    first = next(iter(devices), None)
    if first is not None and first.platform == "gpu" and first in _COMPILE_ONLY:
        return dict(COMPILE_ONLY_GPU_OPTIONS)
    return {}


_COMPILE_ONLY: set = set()


@functools.lru_cache(maxsize=None)
def gpu_topology_devices(name: str) -> tuple:
    """Compile-only devices of a GPU topology such as "h200:8" (one host of 8 H200s; `parse_gpu_topology`), for
    `jax.jit(...).lower(...).compile()` on a machine without a GPU (needs JAX's CUDA plugin, not a GPU)."""
    kind, hosts, per_host = parse_gpu_topology(name)
    config = gpu_target_config(kind)
    # the plugin checks the CUDA libraries' versions at start unless JAX_PLATFORMS leaves CUDA out; compiling
    # needs no CUDA library
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    import jax

    # everything that may load the plugin's libraries runs inside the filter (importing JAX modules after the
    # side directory is on the path loads its CUDA extensions, which print the driver lines)
    with native_noise_filtered():
        # JAX's backends start first, without the plugin of the side directory: it is only ever used to compile,
        # and a process without JAX_PLATFORMS never tries to start a CUDA backend (and print its driver lines)
        jax.devices()
        _find_cuda_plugin()
        from jax.experimental import topologies

        def make():
            return topologies.get_topology_desc("gpu", platform="cuda", topology=f"1x{hosts}x{per_host}",
                                                target_config=config).devices

        try:
            try:
                devices = make()
            except NotImplementedError:  # JAX looked for plugins before the side directory was on the path
                importlib.import_module(_CUDA_PLUGIN).initialize()
                devices = make()
        except Exception as e:
            raise ConfigError(f"GPU topology {name!r}: {str(e).strip().splitlines()[0]}") from None
    _COMPILE_ONLY.update(devices)
    return tuple(devices)


def gpu_memory_line(device_kind: str, needed: float | None = None, headroom: float = 0.0) -> str | None:
    """One line for a compile-only GPU report: the GPU's memory and the share JAX's allocator takes of it; with
    `needed` (the largest program's bytes) past that share less `headroom`, the XLA_PYTHON_CLIENT_MEM_FRACTION that
    would hold it (when one up to 0.95 does). None for a device lrmq has no GPU description of."""
    spec = gpu_specs().get(device_kind)
    if spec is None:
        return None
    mem, frac = spec["memory_bytes"], gpu_mem_fraction()
    line = (f"{device_kind}: {mem / 2 ** 30:.1f} GiB, of which JAX's allocator takes {frac:.2f} "
            f"(XLA_PYTHON_CLIENT_MEM_FRACTION, default {GPU_MEM_FRACTION_DEFAULT}): {mem * frac / 2 ** 30:.2f} GiB "
            f"per GPU")
    if needed is not None and needed > mem * frac * (1 - headroom):
        want = needed / (mem * (1 - headroom))
        if want <= 0.95:
            line += f"; XLA_PYTHON_CLIENT_MEM_FRACTION={max(want + 0.005, frac + 0.01):.2f} makes it fit"
    return line
