"""Ahead-of-time compiles of the GRPO step and the rollout, for hardware you may not have.

With `libtpu` installed, XLA compiles for any TPU topology from a CPU-only host
(`jax.experimental.topologies`), so a recipe can be checked against its slice's HBM before the slice
is rented: `python -m lrmq.train --config X --compile-only [--topology v5p:2x4x4]`. The state is
abstract throughout (`nnx.eval_shape`): no weight is ever allocated, and no checkpoint needs to be
on this machine (`model.shapes` names the architecture). The update is compiled for every shape it can
take (`lrmq.rl.precompile.update_shapes`), as the trainer does before its first rollout; on real
accelerators the trainer also refuses to start when the update or the rollout does not fit.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lrmq.checkpoint.load import resolve_checkpoint
from lrmq.configlib import ConfigError
from lrmq.generation.engine import Generator, generation_chunk
from lrmq.generation.sampling import SamplingConfig
from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder
from lrmq.model.presets import preset_config
from lrmq.quant.qkernel import QuantizedKernel
from lrmq.quant.training import pack_linears, prepare_for_training, trainable_filter
from lrmq.quant.transforms import qweight_shardings
from lrmq.rl.config import TrainConfig
# the shapes, compiles and memory budget shared with the trainer (re-exported: lrmq.aot.X is their public name)
from lrmq.rl.precompile import (GIB, HBM_BYTES, HEADROOM, PreflightError, UpdateShape, abstract_update,  # noqa: F401
                                check_budget, hbm_bytes, lower_compile, memory_report, update_shapes)
from lrmq.rl.step import make_optimizer, make_train_step, opt_state_shardings, uses_rollout_logprobs
from lrmq.sharding import LOGICAL_AXES_KEY, MeshConfig, batch_divisor, batch_sharding, logical_to_spec, make_mesh


# ----------------------------------------------------------------------------- targets
@functools.lru_cache(maxsize=None)
def topology_devices(name: str) -> tuple:
    """The devices of a TPU topology such as "v5p:2x4x4" or "v5e:2x4" (needs libtpu, not a TPU)."""
    # libtpu takes a machine-wide lock by default, so a second process compiling for TPU (a test and the
    # CLI it launches, two compiles side by side) would fail; compiling only needs no exclusive device.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # libtpu missing, or a malformed name: say which
        raise ConfigError(f"TPU topology {name!r}: {str(e).splitlines()[0]} (needs libtpu: "
                          f"pip install 'jax[tpu]'; names look like v5e:2x4, v5p:2x4x4, v6e:2x2)") from None


# ----------------------------------------------------------------------------- abstract state
def model_config(cfg: TrainConfig) -> ModelConfig:
    """The architecture: the checkpoint's config.json when it is here, else the `model.shapes` preset."""
    m = cfg.model
    path = resolve_checkpoint(m.checkpoint)
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelConfig.from_hf_file(path, dtype=m.dtype, param_dtype=m.param_dtype)
    if m.shapes:
        return preset_config(m.shapes, dtype=m.dtype, param_dtype=m.param_dtype)
    raise ConfigError(f"model.checkpoint={m.checkpoint!r} has no config.json here; set model.shapes to one of "
                      f"the presets in lrmq/model/presets.py to compile without the weights")


def _variable_shardings(state, mesh):
    """NamedShardings for an nnx State whose leaves may be abstract, packed kernels included."""

    def one(var):
        axes = var.get_metadata().get(LOGICAL_AXES_KEY)
        value = var.get_value()
        if isinstance(var, QuantizedKernel):
            return var.replace(value=qweight_shardings(value, axes, mesh))
        ok = axes is not None and len(axes) == len(value.shape)
        return var.replace(value=NamedSharding(mesh, logical_to_spec(axes if ok else None, value.shape, mesh)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _with_shardings(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


@dataclass
class AbstractRun:
    """Everything a step compile needs, as ShapeDtypeStructs carrying their shardings."""

    cfg: TrainConfig
    model_cfg: ModelConfig
    mesh: jax.sharding.Mesh
    graphdef: object
    trainable: object
    rest: object


def abstract_run(cfg: TrainConfig, mesh, mcfg: ModelConfig | None = None) -> AbstractRun:
    """The run's model, parameters and batch as shapes with shardings; `mcfg` overrides the architecture the
    config names (benchmarks compile configs that exist only in code)."""
    mcfg = mcfg or model_config(cfg)

    def build():
        return prepare_for_training(Decoder(mcfg, nnx.Rngs(cfg.run.seed)), cfg.quant, seed=cfg.run.seed)

    model = nnx.eval_shape(build)
    graphdef, trainable, rest = nnx.split(model, trainable_filter(cfg.quant.mode), ...)
    trainable = _with_shardings(trainable, _variable_shardings(trainable, mesh))
    rest = _with_shardings(rest, _variable_shardings(rest, mesh))
    return AbstractRun(cfg, mcfg, mesh, graphdef, trainable, rest)


def abstract_batch(cfg: TrainConfig, mesh, shape: UpdateShape | None = None) -> dict:
    """The train step's batch of `shape` (default the largest of `update_shapes`: S = prompts x group sequences
    of max_prompt_len + max_new_tokens; for rollout.update_padding=pack every sequence at full length, one per
    row, every completion position a slot: the same work as the padded batch)."""
    shape = shape or update_shapes(cfg, batch_divisor(mesh))[0]
    return abstract_update(cfg, shape, mesh)[0]


# ----------------------------------------------------------------------------- compiles
def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def compile_train_step(run: AbstractRun, micro_batch: int | None = None, shape: UpdateShape | None = None):
    """(compiled, seconds) of one optimizer update at `micro_batch` (default: the config's) for the batch
    `shape` (default the largest of `update_shapes`)."""
    cfg = run.cfg
    if micro_batch is not None:
        import dataclasses

        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, micro_batch_size=micro_batch))
    tx, _ = make_optimizer(cfg)
    tr_sh = jax.tree.map(lambda x: x.sharding, run.trainable)
    opt_sh = opt_state_shardings(tx, run.trainable, run.mesh)
    opt = _with_shardings(jax.eval_shape(tx.init, run.trainable), opt_sh)
    step = make_train_step(run.graphdef, cfg, tx, (tr_sh, opt_sh), use_old=uses_rollout_logprobs(cfg))
    batch, ref = abstract_update(cfg, shape or update_shapes(cfg, batch_divisor(run.mesh))[0], run.mesh)
    return lower_compile(step, run.trainable, run.rest, opt, batch, ref, mesh=run.mesh)


def _sds(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _compile(fn, *args, mesh) -> tuple[object, float]:
    return lower_compile(fn, *args, mesh=mesh)


def compile_generate(graphdef, state, mesh, *, batch: int, prompt_len: int, max_new: int,
                     sampling: SamplingConfig):
    """(compiled, seconds) of generation: prefill of `batch` left-padded prompts + decode loop."""
    gen = Generator(None, eos_ids=(0,), pad_id=0, mesh=mesh, graphdef=graphdef)
    fn = gen._fn(max_new, sampling)
    tokens = _sds((batch, prompt_len), jnp.int32, batch_sharding(mesh, 2))
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, P()))
    return _compile(fn, state, tokens, tokens, key, mesh=mesh)


def compile_rollout(run: AbstractRun):
    """(compiled, seconds) of one rollout: prefill + decode of every sequence of a step at once."""
    r = run.cfg.rollout
    rows = generation_chunk(r.generation_batch, r.prompts_per_step * r.group_size, batch_divisor(run.mesh))
    return compile_generate(run.graphdef, (run.trainable, run.rest), run.mesh, batch=rows, prompt_len=r.max_prompt_len,
                            max_new=r.max_new_tokens,
                            sampling=SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k))


def rollout_memory(cfg: TrainConfig, graphdef, state, mesh) -> dict[str, int]:
    """{"rollout": per-device bytes} of the rollout the trainer will run, compiled now: the trainer's preflight
    (`GRPOTrainer(preflight_programs=...)`, wired by lrmq.train) checks it against the budget with the update."""
    r = cfg.rollout
    rows = generation_chunk(r.generation_batch, r.prompts_per_step * r.group_size, batch_divisor(mesh))
    compiled, _ = compile_generate(graphdef, state, mesh, batch=rows, prompt_len=r.max_prompt_len,
                                   max_new=r.max_new_tokens,
                                   sampling=SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k))
    return {"rollout": memory_report(compiled)["total"]}


def abstract_model(mcfg: ModelConfig, mesh, pack: str | None = None):
    """(graphdef, state) of a Decoder as sharded ShapeDtypeStructs (for generation-only compiles);
    `pack` ("int4" | "int8" | "nf4") packs every decoder linear as PTQ would."""

    def build():
        model = Decoder(mcfg, nnx.Rngs(0))
        if pack:
            pack_linears(model, pack)
        return model

    graphdef, state = nnx.split(nnx.eval_shape(build))
    return graphdef, _with_shardings(state, _variable_shardings(state, mesh))


# ----------------------------------------------------------------------------- the check
def _micro_batch_candidates(cfg: TrainConfig, mesh) -> list[int]:
    """Micro-batch sizes below the configured one that divide the batch and the data axes, largest first."""
    s = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    cur = cfg.optim.micro_batch_size or s
    div = mesh.shape["data"] * mesh.shape["fsdp"]
    return [m for m in range(cur - 1, 0, -1) if s % m == 0 and m % div == 0]


@dataclass
class FitReport:
    rows: list[dict]  # one per compiled program: name, memory, flops, seconds
    hbm: int | None
    fits: bool
    largest_fitting_micro_batch: int | None = None

    def table(self) -> str:
        gib = lambda b: f"{b / GIB:.2f}"
        head = "| program | arguments | temporaries | outputs | aliased | total (GiB) | of HBM | XLA TFLOP* | compile s |"
        lines = [head, "|" + "---|" * 9]
        for r in self.rows:
            m = r["memory"]
            share = f"{m['total'] / self.hbm:.0%}" if self.hbm else "?"
            lines.append(f"| {r['name']} | {gib(m['arguments'])} | {gib(m['temporaries'])} | {gib(m['outputs'])} | "
                         f"{gib(m['aliased'])} | {gib(m['total'])} | {share} | {r['flops'] / 1e12:.2f} | "
                         f"{r['seconds']:.1f} |")
        lines.append("* XLA's cost analysis counts each loop body once (one micro-batch, one scanned layer, one "
                     "decode step), so it is a per-iteration figure, not the program's total")
        return "\n".join(lines)


def program_report(name: str, compiled, secs: float, device) -> FitReport:
    """The FitReport of one compiled program against `device`'s HBM minus HEADROOM (fits when HBM is unknown)."""
    hbm = hbm_bytes(device)
    report = FitReport([{"name": name, "memory": memory_report(compiled), "flops": _flops(compiled),
                         "seconds": secs}], hbm, True)
    report.fits = not hbm or report.rows[0]["memory"]["total"] <= hbm * (1 - HEADROOM)
    return report


def fit_line(report: FitReport) -> str:
    """'fits: X GiB per device of Y GiB usable' (or 'does not fit: ...') for a one-program report."""
    total = report.rows[0]["memory"]["total"] / GIB
    return (f"{'fits' if report.fits else 'does not fit'}: {total:.2f} GiB per device"
            + (f" of {report.hbm * (1 - HEADROOM) / GIB:.1f} GiB usable" if report.hbm else ""))


def check_fit(cfg: TrainConfig, devices=None, *, search: bool = True, all_updates: bool = True,
              log=print) -> FitReport:
    """Compile the train step and the rollout for `devices` (default: this process's view of all devices)
    and compare per-device memory with HBM minus HEADROOM; when the step does not fit, find the largest
    micro-batch that does (compiling smaller ones, largest first). The step is compiled for every shape of
    `update_shapes` (`all_updates`, as the trainer does before its first rollout): the first row is the
    largest ("train_step"), then the rollout, then the smaller update shapes ("train_step 2/5")."""
    devices = list(devices) if devices is not None else jax.devices()
    mesh = make_mesh(MeshConfig(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor), devices=devices)
    hbm = hbm_bytes(devices[0])
    budget = hbm * (1 - HEADROOM) if hbm else None
    run = abstract_run(cfg, mesh)
    shapes = update_shapes(cfg, batch_divisor(mesh))
    n = len(shapes)
    programs = [("train_step", lambda: compile_train_step(run, shape=shapes[0])), ("rollout", lambda: compile_rollout(run))]
    if all_updates:
        programs += [(f"train_step {i}/{n}", lambda sh=sh: compile_train_step(run, shape=sh))
                     for i, sh in enumerate(shapes[1:], start=2)]
    rows = []
    for name, fn in programs:
        if name.startswith("train_step"):
            i = int(name.split()[1].split("/")[0]) if " " in name else 1
            log(f"compiling update {i}/{n}: {shapes[i - 1].label()}")
        compiled, secs = fn()
        rows.append({"name": name, "memory": memory_report(compiled), "flops": _flops(compiled), "seconds": secs})
        log(f"compiled {name} in {secs:.1f} s: {rows[-1]['memory']['total'] / GIB:.2f} GiB per device")
    fits = budget is None or all(r["memory"]["total"] <= budget for r in rows)
    report = FitReport(rows, hbm, fits)
    step_fits = budget is None or rows[0]["memory"]["total"] <= budget
    if not step_fits and search:
        for mb in _micro_batch_candidates(cfg, mesh):
            compiled, secs = compile_train_step(run, mb)
            total = memory_report(compiled)["total"]
            log(f"micro-batch {mb}: {total / GIB:.2f} GiB per device ({secs:.1f} s)")
            if total <= budget:
                report.largest_fitting_micro_batch = mb
                break
    return report


def report_dict(report: FitReport, cfg: TrainConfig, target: str) -> dict:
    """A JSON-able record of a check (docs/tpu.md's table is built from these)."""
    return {"target": target, "hbm_bytes": report.hbm, "headroom": HEADROOM, "fits": report.fits,
            "micro_batch": cfg.optim.micro_batch_size, "largest_fitting_micro_batch": report.largest_fitting_micro_batch,
            "mode": cfg.quant.mode, "model": cfg.model.shapes or cfg.model.checkpoint, "programs": report.rows}


def verdict(report: FitReport, cfg: TrainConfig) -> str:
    """One line: fits, or what does not and the micro-batch to use instead."""
    budget = report.hbm * (1 - HEADROOM) if report.hbm else None
    if report.fits:
        worst = max(r["memory"]["total"] for r in report.rows)
        room = f" of {budget / GIB:.1f} GiB usable per device" if budget else " (device memory unknown)"
        return f"fits: at most {worst / GIB:.2f} GiB{room}"
    over = ", ".join(f"{r['name']} needs {r['memory']['total'] / GIB:.2f} GiB" for r in report.rows
                     if r["memory"]["total"] > budget)
    msg = f"does not fit: {over} of {budget / GIB:.1f} GiB usable per device ({HEADROOM:.0%} headroom)"
    step_over = report.rows[0]["memory"]["total"] > budget
    if step_over and report.largest_fitting_micro_batch:
        msg += (f"; the largest micro-batch whose train step fits is {report.largest_fitting_micro_batch} "
                f"(optim.micro_batch_size={report.largest_fitting_micro_batch})")
    elif step_over:
        msg += "; no smaller micro-batch fits either (shard over more chips, or use remat / QLoRA)"
    if not step_over or any(r["name"] == "rollout" and r["memory"]["total"] > budget for r in report.rows):
        msg += "; the rollout's KV cache grows with rollout.generation_batch (sequences per generate call): lower it"
    return msg
