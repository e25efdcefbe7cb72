"""PTQ's work spread over the host's chips, with results that do not depend on how many there are.

The calibration blocks ``[n, T]`` are cut into **units** of ``size`` blocks (the largest divisor of ``n``
that is <= ``calibration.batch_size``: the same cut for any number of devices). A per-unit function
(a layer forward with its captures, AWQ's grid losses, GPTQ's ``X^T X``) runs on every chip of the PTQ
mesh (one axis, ``data``, over the local devices) at once, one unit per chip per step, under
``shard_map``: each chip runs the very same program on the same ``[size, T, ..]`` shapes, so a unit's
result is bit for bit the same whichever chip, and however many chips, computed it (XLA:CPU vectorizes a
reduction differently for another batch shape: that is why the cut is fixed, not ``n / devices``).

Per-unit results come back to the host, where they are concatenated (activations) or summed in unit
order 0, 1, 2, ... (:func:`ordered_sum`: statistics, losses, Hessians): one fixed order, so 1, 4 or 8
devices give identical bytes. The layer's weights are replicated on every chip; the activations stay
on the host and a chip holds one unit's (:class:`UnitRunner` feeds them a step at a time, the next step's
transfer queued while the current one runs).

A step with fewer units left than chips is padded with copies of the last unit, whose results are
dropped.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXIS = "data"


def ptq_mesh(devices: int | Sequence | None = None) -> Mesh:
    """The PTQ mesh: one ``data`` axis over ``devices`` (a count of local devices, a list, or None: all local
    devices). ValueError naming the count when there are not that many."""
    local = jax.local_devices()
    if devices is None:
        devs = local
    elif isinstance(devices, int):
        if devices < 1 or devices > len(local):
            raise ValueError(f"mesh.devices={devices}: this host has {len(local)} local "
                             f"{local[0].platform} device(s)")
        devs = local[:devices]
    else:
        devs = list(devices)
    return Mesh(np.asarray(devs), (AXIS,), axis_types=(AxisType.Auto,))


def unit_size(n: int, batch_size: int) -> int:
    """Largest divisor of ``n`` that is <= ``batch_size``: every unit has the same shape."""
    return max(d for d in range(1, max(1, min(batch_size, n)) + 1) if n % d == 0)


def ordered_sum(parts: Iterator[np.ndarray] | Sequence[np.ndarray]) -> np.ndarray:
    """``((p0 + p1) + p2) + ...`` in float32 on the host, in the order given (unit order)."""
    acc = None
    for p in parts:
        p = np.asarray(p)
        if acc is None:
            acc = np.array(p, copy=True)
        else:
            np.add(acc, p, out=acc)
    if acc is None:
        raise ValueError("ordered_sum of nothing")
    return acc


@functools.lru_cache(maxsize=None)
def _program(fn: Callable, mesh: Mesh, n_rep: int, n_units: int, statics: tuple):
    kw = dict(statics)

    def body(*args):
        rep, units = args[:n_rep], args[n_rep:]
        out = fn(*rep, *(u[0] for u in units), **kw)
        return jax.tree.map(lambda v: v[None], out)

    specs = (P(),) * n_rep + (P(AXIS),) * n_units
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(AXIS), check_vma=False))


def unit_program(fn: Callable, mesh: Mesh, n_rep: int, n_units: int, **statics):
    """``fn(*replicated, *unit_arrays, **statics)`` as one jitted program over the mesh: the replicated
    arguments (weights) on every chip, each unit argument ``[devices, ...]`` one slice per chip, the outputs
    ``[devices, ...]``. Cached per (fn, mesh, statics); ``lower(...)`` compiles it ahead of time."""
    return _program(fn, mesh, n_rep, n_units, tuple(sorted(statics.items())))


@dataclasses.dataclass
class UnitRunner:
    """Maps per-unit functions over the calibration blocks on ``mesh`` (module doc)."""

    mesh: Mesh
    n: int  # calibration blocks
    size: int  # blocks per unit

    @classmethod
    def for_blocks(cls, mesh: Mesh, n: int, batch_size: int) -> "UnitRunner":
        return cls(mesh, n, unit_size(n, batch_size))

    @property
    def devices(self) -> int:
        return self.mesh.devices.size

    @property
    def units(self) -> int:
        return self.n // self.size

    def replicate(self, tree):
        """Put ``tree`` (a layer's weights) on every chip once, for several programs to read."""
        return jax.device_put(tree, NamedSharding(self.mesh, P()))

    def _steps(self, arrays: Sequence[np.ndarray], count: int, size: int | None):
        """Steps of one unit (``size`` blocks, or one item of a stacked array when ``size`` is None) per chip."""
        d = self.devices

        def take(a, i):
            return a[i * size:(i + 1) * size] if size else a[i]

        for first in range(0, count, d):
            idx = [min(first + k, count - 1) for k in range(d)]  # pad with the last unit
            yield min(d, count - first), [np.stack([take(a, i) for i in idx]) for a in arrays]

    def _map(self, fn, replicated, arrays, count, size, statics) -> Iterator:
        prog = unit_program(fn, self.mesh, len(replicated), len(arrays), **statics)
        sharding = NamedSharding(self.mesh, P(AXIS))
        pending = None
        for valid, batch in self._steps([np.asarray(a) for a in arrays], count, size):
            out = prog(*replicated, *(jax.device_put(b, sharding) for b in batch))
            if pending is not None:
                yield from _split(*pending)
            pending = (valid, out)
        if pending is not None:
            yield from _split(*pending)

    def map(self, fn: Callable, replicated: tuple, arrays: Sequence[np.ndarray], **statics) -> Iterator:
        """Yield ``fn(*replicated, *unit slices, **statics)`` of every unit, in unit order, as host numpy
        pytrees. ``arrays``: host arrays with the blocks on axis 0. The next step is dispatched before
        the current one is read back."""
        return self._map(fn, replicated, arrays, self.units, self.size, statics)

    def map_items(self, fn: Callable, replicated: tuple, items: Sequence[np.ndarray], **statics) -> Iterator:
        """As :meth:`map` over the leading axis of ``items`` (e.g. equal column chunks of a weight), one item
        per chip per step."""
        return self._map(fn, replicated, items, int(np.shape(items[0])[0]), None, statics)

    def concat(self, fn: Callable, replicated: tuple, arrays: Sequence[np.ndarray], **statics):
        """Per-unit outputs concatenated along the blocks (activations: [n, ...] host arrays)."""
        outs = list(self.map(fn, replicated, arrays, **statics))
        return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *outs)

    def sum(self, fn: Callable, replicated: tuple, arrays: Sequence[np.ndarray], **statics):
        """Per-unit outputs summed in unit order (:func:`ordered_sum`), leaf by leaf."""
        acc = None
        for out in self.map(fn, replicated, arrays, **statics):
            acc = jax.tree.map(lambda o: np.array(o, copy=True), out) if acc is None else \
                jax.tree.map(lambda a, o: np.add(a, o, out=a), acc, out)
        return acc


def _split(valid: int, out) -> Iterator:
    host = jax.tree.map(np.asarray, out)
    for k in range(valid):
        yield jax.tree.map(lambda v: v[k], host)
