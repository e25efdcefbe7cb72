"""Where the Sampler and the Learner run (rollout.placement), and how weights move between their meshes.

colocated: one mesh (mesh.data x fsdp x tensor over every device) serves both, one after the other.
split: each process's local devices are divided, its first `mesh.rollout_fraction` to the sampler and the rest to
the learner; the sampler's mesh is mesh.rollout_data x rollout_fsdp x rollout_tensor over the sampler devices of
every process, the learner's mesh.data x fsdp x tensor over the others. Every process drives both meshes, so a
multi-host run needs no Pathways.

A sync moves the learner's weights into the sampler's decode layout (`transfer`): `jax.device_put` to the sampler's
shardings. Where one process cannot address every device of both meshes, the runtime may refuse that transfer (a
multi-controller device_put between two device sets); `transfer` then says so, once, with the runtime's message,
and takes the route that works everywhere: each array gathered to every process
(`multihost_utils.process_allgather`, a program over the source's mesh) and each process placing its own shards of
the destination (`jax.make_array_from_callback`). That route costs a host copy of the weights per process (the
packed copy's bytes with rollout.quant); docs/grpo.md "Sampler and Learner".
"""

from __future__ import annotations

import logging
from collections import defaultdict

import jax
import numpy as np

from lrmq.configlib import ConfigError
from lrmq.generation.kv_pool import decode_fsdp
from lrmq.rl.setup import model_config
from lrmq.sharding import MeshConfig, make_mesh

log = logging.getLogger("lrmq.train")


def split_devices(devices, fraction: float) -> tuple[list, list]:
    """(sampler devices, learner devices): the first round(fraction x n) of each process's n local devices go to
    the sampler, in device-id order; a ConfigError naming mesh.rollout_fraction when a side would be empty. A
    process with one CPU device (a laptop's `python -m lrmq.train ... rollout.placement=split`) gives it to both:
    two meshes over the same device, each role with its own weights, the rollout overlapping the update as far as
    the host's cores allow (a CPU has no memory budget for the KV pool to share); an accelerator is never shared."""
    local = defaultdict(list)
    for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
        local[d.process_index].append(d)
    sampler, learner = [], []
    for proc, devs in sorted(local.items()):
        if len(devs) == 1 and devs[0].platform == "cpu":
            log.info("rollout.placement=split on process %d's one CPU device: the sampler and the learner share it "
                     "(for more, XLA_FLAGS=--xla_force_host_platform_device_count=8)", proc)
            sampler += devs
            learner += devs
            continue
        n = int(round(fraction * len(devs)))
        if not 0 < n < len(devs):
            raise ConfigError(f"rollout.placement=split: mesh.rollout_fraction={fraction} of process {proc}'s "
                              f"{len(devs)} local device(s) leaves {'the sampler' if n <= 0 else 'the learner'} "
                              "none; a split needs >= 2 devices per process or rollout.placement=colocated")
        sampler += devs[:n]
        learner += devs[n:]
    return sampler, learner


def placement_meshes(cfg, devices=None):
    """(learner mesh, sampler mesh) of a TrainConfig: the same mesh twice when colocated."""
    m = cfg.mesh
    devices = list(devices if devices is not None else jax.devices())
    if cfg.rollout.placement == "colocated":
        mesh = _mesh(MeshConfig(m.data, m.fsdp, m.tensor, m.expert), devices,
                     "mesh.data / mesh.fsdp / mesh.tensor / mesh.expert")
        return mesh, mesh
    sampler_devs, learner_devs = split_devices(devices, m.rollout_fraction)
    learner = _mesh(MeshConfig(m.data, m.fsdp, m.tensor, m.expert), learner_devs,
                    f"mesh.data / mesh.fsdp / mesh.tensor / mesh.expert (the learner's {len(learner_devs)} devices)")
    fsdp = m.rollout_fsdp or sampler_fsdp(cfg, len(sampler_devs) // m.rollout_tensor, sampler_devs[0].platform,
                                          model_config(cfg).num_kv_heads)
    sampler = _mesh(MeshConfig(m.rollout_data, fsdp, m.rollout_tensor), sampler_devs,
                    f"mesh.rollout_data / rollout_fsdp / rollout_tensor (the sampler's {len(sampler_devs)} devices)")
    return learner, sampler


def sampler_fsdp(cfg, chips: int, platform: str, kv_heads: int) -> int:
    """mesh.rollout_fsdp=0: the largest fsdp axis over `chips` sampler chips (the rest is data) that splits the
    model's `kv_heads` KV heads into whole shares its KV format runs at (`kv_pool.decode_fsdp`). Logged."""
    fsdp = decode_fsdp(chips, kv_heads, cfg.rollout.kv_cache, platform)
    log.info("mesh.rollout_fsdp=0: the sampler's %d chips as data=%d x fsdp=%d (%d of the %d KV heads per chip, "
             "rollout.kv_cache=%s)", chips, chips // fsdp, fsdp, kv_heads // fsdp, kv_heads, cfg.rollout.kv_cache)
    return fsdp


def _mesh(mc: MeshConfig, devices, keys: str):
    try:
        return make_mesh(mc, devices=devices)
    except ValueError as e:
        raise ConfigError(f"{keys}: {e}") from None


def is_split(learner_mesh, sampler_mesh) -> bool:
    return learner_mesh is not sampler_mesh


_REFUSED: list[str] = []  # the runtime's message, once per process


def transfer(tree, shardings, *, copy: bool = True):
    """`tree` placed on `shardings` (another mesh's, or the same mesh's decode layout): `jax.device_put`, fresh
    buffers unless copy=False; where the runtime refuses a transfer between the two device sets (multi-process),
    the allgather route of the module docstring."""
    if _REFUSED:
        return _gathered(tree, shardings)
    try:
        return jax.device_put(tree, shardings, may_alias=not copy)
    except (ValueError, RuntimeError, NotImplementedError) as e:
        if jax.process_count() == 1:
            raise
        _REFUSED.append(str(e).splitlines()[0][:300])
        log.warning("rollout.placement=split: the runtime refused a device_put between the learner's and the "
                    "sampler's meshes (%s); syncing through each process's host instead (an allgather of each array, "
                    "then every process places its own shards)", _REFUSED[0])
        return _gathered(tree, shardings)


def _gathered(tree, shardings):
    from jax.experimental import multihost_utils

    def one(x, sharding):
        full = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])

    return jax.tree.map(one, tree, shardings)


def describe(learner_mesh, sampler_mesh) -> str:
    if not is_split(learner_mesh, sampler_mesh):
        return f"colocated on {dict(learner_mesh.shape)} ({learner_mesh.devices.size} devices)"
    return (f"split: learner {dict(learner_mesh.shape)} ({learner_mesh.devices.size} devices), sampler "
            f"{dict(sampler_mesh.shape)} ({sampler_mesh.devices.size} devices)")
