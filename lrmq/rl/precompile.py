"""The update's shapes, known before step 1, and what compiling them ahead of time needs.

A GRPO batch's real size varies from step to step (prompt and completion lengths), so the update's layout
(`rollout.update_padding`) rounds it to one of a fixed set of shapes that the config alone decides:

* pack: `rollout.update_shapes` packed shapes of rows x (max_prompt_len + max_new_tokens) columns and
  completion slots per device group (`batch.packed_ladder`), from the worst case down in steps of sqrt(2);
* bucket: every (prompt bucket, completion bucket) pair of powers of two from 16 (`batch.pow2_buckets`);
* max: the one shape max_prompt_len + max_new_tokens.

`update_shapes` lists them and `abstract_update` gives each as ShapeDtypeStructs with the batch sharding, so
the trainer compiles every one (`jax.jit(...).lower(...).compile()`) before its first rollout and the
`--compile-only` preflight (`lrmq.aot`) compiles the same set for hardware it does not have. The memory
budget helpers (`memory_report`, `check_budget`, `PreflightError`) live here too: the trainer's preflight
and `lrmq.aot` share them without the trainer importing `lrmq.aot` (a layer above it; `lrmq.train` hands the
trainer aot's rollout compile as a callable).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import get_args

import jax
import jax.numpy as jnp

from lrmq.configlib import ConfigError
from lrmq.rl.batch import UpdateBatch, ladder_choice, packed_ladder, pow2_buckets
from lrmq.rl.config import TrainConfig
from lrmq.rl.run_state import progress_bar
from lrmq.rl.step import (OldLogpSource, make_ref_logprobs, make_train_step, micro_batch_count,
                          old_logprob_sources)
from lrmq.sharding import batch_divisor, batch_sharding
from lrmq.targets import compile_options, gpu_usable_bytes

log = logging.getLogger("lrmq.train")

GIB = 1024 ** 3
# HBM per chip by device kind (public Cloud TPU specs), for topologies compiled without the hardware.
HBM_BYTES = {"TPU v4": 32 * GIB, "TPU v5 lite": 16 * GIB, "TPU v5": 95 * GIB, "TPU v6 lite": 32 * GIB}
# Leave this share of HBM free: runtime buffers, fragmentation, and host transfers are not in the report.
HEADROOM = 0.10


# ----------------------------------------------------------------------------- the update's shapes
@dataclass(frozen=True)
class UpdateShape:
    """One shape of the update batch. pack: `rows` and `slots` per device group (micro-batch x data shard),
    `width` columns; bucket / max: `prompt` + `completion` columns for every sequence."""

    layout: str  # "pack" | "bucket" | "max"
    width: int
    rows: int = 0
    slots: int = 0
    prompt: int = 0
    completion: int = 0

    def label(self) -> str:
        if self.layout == "pack":
            return f"{self.rows} rows x {self.width}, {self.slots} slots per group"
        return f"{self.prompt} + {self.completion} columns"


def _geometry(cfg: TrainConfig, groups: int) -> tuple[int, int, int]:
    """(sequences S, micro-batches, sequences per micro-batch and device group)."""
    s = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    n_micro = micro_batch_count(cfg, s)
    return s, n_micro, s // n_micro // groups


def update_shapes(cfg: TrainConfig, groups: int) -> list[UpdateShape]:
    """Every shape an update of this config can have on `groups` (data x fsdp) device groups, largest first
    (the first is the worst case: the memory the preflight checks)."""
    r = cfg.rollout
    n = r.max_new_tokens
    if r.update_padding == "pack":
        _, _, k_loc = _geometry(cfg, groups)
        width = r.max_prompt_len + n
        return [UpdateShape("pack", width, rows=rows, slots=slots)
                for rows, slots in packed_ladder(k_loc, k_loc * n, r.update_shapes)]
    if r.update_padding == "bucket":
        pairs = [(p, c) for p in pow2_buckets(r.max_prompt_len) for c in pow2_buckets(n)]
        return [UpdateShape("bucket", p + c, prompt=p, completion=c) for p, c in sorted(pairs, reverse=True)]
    return [UpdateShape("max", r.max_prompt_len + n, prompt=r.max_prompt_len, completion=n)]


def packed_chooser(shapes: list[UpdateShape]):
    """`packed_batch`'s choose_shape over the config's packed shapes."""
    return ladder_choice([(s.rows, s.slots) for s in shapes if s.layout == "pack"])


def replay_shape(cfg: TrainConfig, model_cfg) -> tuple[int, int] | None:
    """(sparse layers, k) of the experts an update batch carries (the sampler's record: every mixture-of-experts run,
    replayed with rollout.routing_replay, else read by ``moe/route_mismatch`` only), None for a dense model."""
    return (len(model_cfg.moe_layers), model_cfg.num_experts_per_tok) if model_cfg.num_experts else None


def abstract_update(cfg: TrainConfig, shape: UpdateShape, mesh, *, old_logp: bool = False,
                    experts: tuple[int, int] | None = None) -> tuple[UpdateBatch, jax.ShapeDtypeStruct | None]:
    """(the update batch, the reference log-probs or None when algo.beta = 0) of `shape` as ShapeDtypeStructs
    with the batch sharding (`UpdateBatch.abstract`): what `jax.jit(step).lower` takes for the batch the trainer
    will pass; `old_logp`: the batch of the updates that divide by the first one's log-probs; `experts`: (sparse
    layers, k) of the replayed experts (rollout.routing_replay)."""
    groups = batch_divisor(mesh)
    s, n_micro, _ = _geometry(cfg, groups)
    n = shape.completion if shape.layout != "pack" else cfg.rollout.max_new_tokens
    sharding = lambda ndim: batch_sharding(mesh, ndim)
    batch = UpdateBatch.abstract(shape.layout, sharding, sequences=s, completion=n, width=shape.width,
                                 rows=n_micro * groups * shape.rows, groups=groups * n_micro, slots=shape.slots,
                                 old_logp=old_logp, experts=experts)
    ref = jax.ShapeDtypeStruct((s, n), jnp.float32, sharding=sharding(2)) if cfg.algo.beta != 0.0 else None
    return batch, ref


def batch_key(batch: UpdateBatch, ref=None) -> tuple:
    """What a compiled update is looked up by: the batch's layout and array shapes and the reference's (or None)."""
    return batch.layout, batch.shapes(), None if ref is None else tuple(ref.shape)


# ----------------------------------------------------------------------------- the update's programs
class UpdatePrograms:
    """The update's programs of one run: a jitted step per source of pi_old and, with algo.beta != 0, the
    reference log-probs. `compile` compiles, for every shape of `update_shapes`, the step variants the updates run
    (`step.old_logprob_sources`) and the reference before the first rollout; `step` and `reference` hand back the
    compiled program of a batch's shape (the jitted one, which compiles then, with a warning, only for a shape
    outside `update_shapes`, which the layouts never produce)."""

    def __init__(self, graphdef, cfg: TrainConfig, tx, shardings, mesh, *, replay: tuple[int, int] | None = None):
        self.cfg, self.mesh, self.replay = cfg, mesh, replay  # replay: (sparse layers, k) of routing replay
        self.sources = old_logprob_sources(cfg)  # pi_old of each update of a batch
        self.steps = {src: make_train_step(graphdef, cfg, tx, shardings, old_from=src)
                      for src in get_args(OldLogpSource)}
        self.reference_fn = make_ref_logprobs(graphdef, cfg) if cfg.algo.beta != 0.0 else None
        self.shapes = update_shapes(cfg, batch_divisor(mesh))
        self._compiled: dict = {}  # (old_from, or "reference", batch_key) -> compiled program
        self.missed: set = set()  # keys that had to be compiled during training (none expected)

    def compile(self, trainable, rest, opt_state, ref_trainable, *, progress: bool = False) -> dict[str, int]:
        """Compile every program the updates run, for every shape (JAX's persistent cache turns a rerun's compiles
        into loads); returns {program name: per-device bytes} of the largest shape."""
        jobs = [(shape, src) for shape in self.shapes for src in dict.fromkeys(self.sources)]
        if self.reference_fn is not None:
            jobs += [(shape, "reference") for shape in self.shapes]
        bar = progress_bar(len(jobs), 0, enabled=progress, desc="compiling update", unit="program")
        mem: dict[str, int] = {}
        t_all = time.perf_counter()
        try:
            for i, (shape, src) in enumerate(jobs, start=1):
                what = "reference" if src == "reference" else f"update ({src})"
                log.info("compiling %s %d/%d: %s", what, i, len(jobs), shape.label())
                bar.set_postfix_str(shape.label())
                batch, ref = abstract_update(self.cfg, shape, self.mesh, old_logp=src == "old_logp",
                                             experts=self.replay)
                if src == "reference":
                    name, key, args = "reference_logprobs", (src, batch_key(batch)), (ref_trainable, rest, batch)
                else:
                    name, key, args = "train_step", (src, batch_key(batch, ref)), (trainable, rest, opt_state, batch, ref)
                self._compiled[key], secs = lower_compile(self.reference_fn if src == "reference" else self.steps[src],
                                                          *args, mesh=self.mesh)
                if name not in mem:  # the first of each is the largest shape
                    mem[name] = memory_report(self._compiled[key])["total"]
                log.debug("compiled %s %d/%d in %.1f s", what, i, len(jobs), secs)
                bar.update(1)
        finally:
            bar.close()
        log.info("compiled %d update programs in %.1f s (%d shapes)", len(jobs), time.perf_counter() - t_all,
                 len(self.shapes))
        return mem

    def step(self, old_from: OldLogpSource, batch: UpdateBatch, ref_logp):
        """The update taking pi_old from `old_from` for this batch's shape."""
        return self._lookup((old_from, batch_key(batch, ref_logp)), self.steps[old_from])

    def reference(self, batch: UpdateBatch):
        """The reference log-probs program for this batch's shape."""
        return self._lookup(("reference", batch_key(batch)), self.reference_fn)

    def _lookup(self, key, jitted):
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        if key not in self.missed and self._compiled:  # (an update before any compile: quiet)
            self.missed.add(key)
            log.warning("%s shape %s was not compiled ahead of time: compiling it now",
                        "reference log-probs" if key[0] == "reference" else "update", key[1])
        return jitted


# ----------------------------------------------------------------------------- compiles and memory
def lower_compile(fn, *args, mesh) -> tuple[object, float]:
    """(compiled, seconds) of `fn.lower(*args).compile()` under `mesh` (JAX's persistent cache applies; the XLA
    options a compile-only GPU target needs: `lrmq.targets.compile_options`)."""

    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = fn.lower(*args).compile(compile_options(mesh.devices.flat) or None)
    return compiled, time.perf_counter() - t0


def hbm_bytes(device) -> int | None:
    """Usable memory of one device: the runtime's own limit on real hardware, else the spec table (TPUs) or, for a
    GPU, its target description's memory times JAX's allocator fraction (`lrmq.targets.gpu_usable_bytes`)."""
    try:
        stats = device.memory_stats()
        if stats and stats.get("bytes_limit"):
            return int(stats["bytes_limit"])
    except Exception:  # topology devices and CPUs have no runtime stats
        pass
    kind = getattr(device, "device_kind", "")
    if kind in HBM_BYTES:
        return HBM_BYTES[kind]
    return gpu_usable_bytes(kind)  # a GPU lrmq has a target description of: JAX's share of its memory


def memory_report(compiled) -> dict:
    """Per-device bytes of a compiled program (what XLA allocates for one chip's share)."""
    ma = compiled.memory_analysis()
    arg, out = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    alias, tmp = int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes)
    code = int(getattr(ma, "generated_code_size_in_bytes", 0))
    return {"arguments": arg, "outputs": out, "aliased": alias, "temporaries": tmp, "code": code,
            "total": arg + out - alias + tmp + code}


class PreflightError(ConfigError):
    """The update or the rollout needs more memory per device than the device has (lrmq.train exits 3)."""


def check_budget(mem: dict[str, int], device, hbm_limit_gib: float = 0.0, log=print) -> None:
    """Raise PreflightError naming every program of `mem` (name -> bytes per device) over the allowed memory:
    `hbm_limit_gib`, or the device's HBM minus HEADROOM (no limit when it is unknown)."""
    limit = hbm_limit_gib * GIB if hbm_limit_gib else (hbm_bytes(device) or 0) * (1 - HEADROOM)
    gib = lambda b: f"{b / GIB:.2f} GiB"
    log("preflight: " + ", ".join(f"{k} {gib(v)}" for k, v in mem.items()) + f" per device (limit {gib(limit)})")
    over = {k: v for k, v in mem.items() if limit and v > limit}
    if over:
        raise PreflightError(
            "preflight: " + ", ".join(f"{k} needs {gib(v)}" for k, v in over.items()) +
            f" per device, more than the {gib(limit)} allowed; nothing was run. Find a micro-batch that fits "
            f"with `python -m lrmq.train --config CONFIG --compile-only` (or lower rollout.prompts_per_step)")
