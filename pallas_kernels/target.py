"""Which hardware the program being traced is compiled for (not which backend this host runs).

Kernel choice and TPU tiles must follow the *target*: a train step compiled ahead of time for a
TPU topology on a CPU host (or traced under a TPU mesh) must get the Mosaic kernel even though
`jax.default_backend()` is "cpu". Resolution order, read at trace time:

1. an explicit `with pallas_kernels.target("tpu", device_kind="TPU v6 lite"):`;
2. the mesh in effect: `jax.set_mesh(mesh)` (public `jax.sharding.get_abstract_mesh()`, which
   works inside `jit` and carries the device kind), else the legacy `with mesh:` context;
3. `jax.default_backend()` and its first device.

The setting is read when a function is traced; `jax.jit` caches traces by the mesh in context but
not by this contextvar, so re-wrap (or clear caches) when switching `target(...)` for one function.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
_PLATFORMS = ("tpu", "gpu", "cpu")


@dataclasses.dataclass(frozen=True)
class Target:
    platform: str  # "tpu" | "gpu" | "cpu"
    device_kind: str | None = None  # e.g. "TPU v5 lite"; None when unknown


_EXPLICIT: contextvars.ContextVar[Target | None] = contextvars.ContextVar(
    "pallas_kernels_target", default=None)


def _normalize(platform: str) -> str:
    p = platform.lower()
    return "gpu" if p in _GPU_PLATFORMS else p


@contextlib.contextmanager
def target(platform: str, device_kind: str | None = None):
    """Compile kernels for `platform` ("tpu" | "gpu" | "cpu") inside this block, whatever the host.

    `device_kind` (a jax `Device.device_kind`, e.g. "TPU v5 lite", "TPU v6 lite") selects the
    TPU generation's tiles; None keeps the mesh's / backend's kind if it is the same platform,
    else a profile valid on every TPU generation."""
    p = _normalize(platform)
    if p not in _PLATFORMS:
        raise ValueError(f"target platform must be one of {_PLATFORMS}, got {platform!r}")
    if device_kind is None:
        implicit = _implicit_target()
        device_kind = implicit.device_kind if implicit.platform == p else None
    token = _EXPLICIT.set(Target(p, device_kind))
    try:
        yield
    finally:
        _EXPLICIT.reset(token)


def _abstract_mesh():
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    return None if mesh is None or getattr(mesh, "empty", True) else mesh


def _concrete_mesh():
    """The concrete mesh of `jax.set_mesh` or of the legacy `with mesh:` (None if neither)."""
    try:  # no public accessor that also works under jit; guarded for future moves
        from jax._src import mesh as mesh_lib
    except ImportError:  # pragma: no cover
        return None
    get = getattr(mesh_lib, "get_concrete_mesh", None)
    mesh = get() if get is not None else None
    if mesh is not None and not mesh.empty:
        return mesh
    resources = getattr(mesh_lib, "thread_resources", None)
    mesh = getattr(getattr(resources, "env", None), "physical_mesh", None)
    return mesh if mesh is not None and not mesh.empty else None


def mesh_in_effect():
    """The mesh a traced program is partitioned over (abstract mesh of `jax.set_mesh` first, then
    the concrete one / legacy `with mesh:`), or None outside any mesh context."""
    return _abstract_mesh() or _concrete_mesh()


def _mesh_device(mesh):
    """(platform, device_kind) of a mesh's devices, or None if the mesh does not say."""
    dev = getattr(mesh, "abstract_device", None)
    if dev is not None:
        return _normalize(dev.platform), dev.device_kind
    devices = getattr(mesh, "devices", None)
    if devices is not None and getattr(devices, "size", 0):
        d = devices.flat[0]
        return _normalize(d.platform), d.device_kind
    return None


def _implicit_target() -> Target:
    for mesh in (_abstract_mesh(), _concrete_mesh()):
        found = _mesh_device(mesh) if mesh is not None else None
        if found is not None:
            return Target(*found)
    backend = _normalize(jax.default_backend())
    return Target(backend, jax.devices()[0].device_kind)


def current_target() -> Target:
    """The target kernels are compiled for right now (see the module docstring)."""
    return _EXPLICIT.get() or _implicit_target()


# ------------------------------------------------------------------------------------ GPUs
@dataclasses.dataclass(frozen=True)
class Gpu:
    """What a tile plan needs to know of a GPU: compute capability and the shared memory one block may take."""
    name: str
    capability: tuple[int, int]
    smem_per_block: int  # bytes: cudaDevAttrMaxSharedMemoryPerBlockOptin (XLA's shared_memory_per_block_optin)


# By a substring of jax's device_kind, first match wins. The figures are XLA's target specs
# (lrmq/assets/gpu_targets: a100, h100, h200, b200) and NVIDIA's tuning guides for the rest.
GPUS = (
    (("B200", "B100"), Gpu("B200", (10, 0), 232448)),
    (("H100", "H200", "H800", "H20"), Gpu("H100/H200", (9, 0), 232448)),
    (("A100", "A800"), Gpu("A100", (8, 0), 166912)),
    (("L4", "RTX 40", "Ada"), Gpu("Ada (sm_89)", (8, 9), 101376)),
)
# a GPU kind not above: the smallest shared memory of sm_86 / sm_89 parts (99 KiB), no sm_90 instructions
UNKNOWN_GPU = Gpu("unknown GPU", (8, 6), 101376)
REFERENCE_GPU = GPUS[1][1]  # the tile plan of a trace not compiled for a GPU (interpret mode): an H100/H200's


def gpu_of(device_kind: str | None) -> Gpu:
    """The `Gpu` of a jax device kind ("NVIDIA H200 141GB HBM3e"); REFERENCE_GPU for None (`target("gpu")` with no
    kind: the GPU the kernels are planned for), UNKNOWN_GPU for a kind not in GPUS."""
    if device_kind is None:
        return REFERENCE_GPU
    for keys, gpu in GPUS:
        if any(k in device_kind for k in keys):
            return gpu
    return UNKNOWN_GPU


def target_gpu() -> Gpu:
    """The GPU a kernel traced now is compiled for (REFERENCE_GPU when the target is not a GPU)."""
    t = current_target()
    return gpu_of(t.device_kind) if t.platform == "gpu" else REFERENCE_GPU
