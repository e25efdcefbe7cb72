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

import dataclasses
import functools
import os
from dataclasses import dataclass

import jax
from flax import nnx

from lrmq.checkpoint.load import resolve_checkpoint
from lrmq.configlib import ConfigError
from lrmq.generation.engine import Engine, EngineConfig
from lrmq.generation.sampling import SamplingConfig
from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder
from lrmq.model.presets import preset_config
from lrmq.quant.training import pack_linears, prepare_for_training, trainable_filter
from lrmq.rl.config import TrainConfig
# the shapes, compiles and memory budget shared with the trainer (re-exported: lrmq.aot.X is their public name)
from lrmq.rl.precompile import (GIB, HBM_BYTES, HEADROOM, PreflightError, UpdateShape, abstract_update,  # noqa: F401
                                check_budget, hbm_bytes, lower_compile, memory_report, update_shapes)
from lrmq.rl.rollout_copy import RolloutCopy, RolloutQuant
from lrmq.rl.step import make_optimizer, make_train_step, opt_state_shardings, uses_rollout_logprobs
from lrmq.sharding import MeshConfig, abstract_state, batch_divisor, make_mesh


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
    return AbstractRun(cfg, mcfg, mesh, graphdef, abstract_state(trainable, mesh), abstract_state(rest, mesh))


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


def compile_generate(graphdef, state, mesh, *, model_cfg: ModelConfig, engine: EngineConfig, requests: int,
                     prompt_len: int, max_new: int, sampling: SamplingConfig,
                     programs: tuple[str, ...] = ("prefill", "decode")) -> dict[str, tuple[object, float]]:
    """{"prefill" | "decode": (compiled, seconds)} of the generation engine's programs for `requests` sequences
    of `prompt_len` + `max_new` tokens (`Engine.abstract_calls`: the largest prefill, one decode call)."""
    eng = Engine(None, eos_ids=(0,), pad_id=0, graphdef=graphdef, model_cfg=model_cfg, config=engine, mesh=mesh)
    calls = eng.abstract_calls(state, n_requests=requests, prompt_len=prompt_len, max_new=max_new,
                               sampling=sampling, mesh=mesh)
    out = {}
    for name in programs:
        fn, args = calls[name]
        out[name] = _compile(fn, *args, mesh=mesh)
    return out


def _rollout_programs(cfg: TrainConfig, graphdef, state, mesh, model_cfg: ModelConfig, programs=("prefill", "decode")):
    r = cfg.rollout
    return compile_generate(graphdef, state, mesh, model_cfg=model_cfg, engine=r.engine_config(),
                            requests=r.prompts_per_step * r.group_size, prompt_len=r.max_prompt_len,
                            max_new=r.max_new_tokens, programs=programs,
                            sampling=SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k))


def rollout_model(run: AbstractRun) -> tuple[object, tuple]:
    """(graphdef, abstract states) the run's rollouts sample from: the policy, or its packed copy (rollout.quant)."""
    if not run.cfg.quantized_rollout:
        return run.graphdef, (run.trainable, run.rest)
    r = run.cfg.rollout
    copy = RolloutCopy(run.graphdef, run.trainable, run.rest,
                       RolloutQuant(r.quant, group_size=r.quant_group_size, targets=run.cfg.quant.targets,
                                    merge_lora=r.lora == "merged"),
                       awq_scales=r.quant_scales == "awq", mesh=run.mesh)
    return copy.graphdef, copy.abstract_states(run.trainable, run.rest)


def compile_rollout(run: AbstractRun, program: str = "decode") -> tuple[object, float]:
    """(compiled, seconds) of one of the rollout engine's programs ("prefill" | "decode") for the run's config
    (on the packed copy with rollout.quant)."""
    graphdef, states = rollout_model(run)
    return _rollout_programs(run.cfg, graphdef, states, run.mesh, run.model_cfg, (program,))[program]


def rollout_memory(cfg: TrainConfig, graphdef, state, mesh) -> dict[str, int]:
    """{"rollout prefill" | "rollout decode": per-device bytes} of the rollout engine's programs, compiled now:
    the trainer's preflight (`GRPOTrainer(preflight_programs=...)`, wired by lrmq.train) checks them against
    the budget with the update."""
    programs = _rollout_programs(cfg, graphdef, state, mesh, model_config(cfg))
    return {f"rollout {name}": memory_report(compiled)["total"] for name, (compiled, _) in programs.items()}


def abstract_model(mcfg: ModelConfig, mesh, pack: str | None = None):
    """(graphdef, state) of a Decoder as sharded ShapeDtypeStructs (for generation-only compiles);
    `pack` ("int4" | "int8" | "nf4") packs every decoder linear as PTQ would."""

    def build():
        model = Decoder(mcfg, nnx.Rngs(0))
        if pack:
            pack_linears(model, pack)
        return model

    graphdef, state = nnx.split(nnx.eval_shape(build))
    return graphdef, abstract_state(state, mesh)


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


def program_report(programs: dict[str, tuple[object, float]], device) -> FitReport:
    """The FitReport of compiled programs {name: (compiled, seconds)} against `device`'s HBM minus HEADROOM
    (fits when HBM is unknown)."""
    hbm = hbm_bytes(device)
    rows = [{"name": name, "memory": memory_report(c), "flops": _flops(c), "seconds": secs}
            for name, (c, secs) in programs.items()]
    return FitReport(rows, hbm, not hbm or all(r["memory"]["total"] <= hbm * (1 - HEADROOM) for r in rows))


def fit_line(report: FitReport) -> str:
    """'fits: X GiB per device of Y GiB usable' (or 'does not fit: ...') for the report's largest program."""
    total = max(r["memory"]["total"] for r in report.rows) / GIB
    return (f"{'fits' if report.fits else 'does not fit'}: {total:.2f} GiB per device"
            + (f" of {report.hbm * (1 - HEADROOM) / GIB:.1f} GiB usable" if report.hbm else ""))


def check_generate(graphdef, state, mesh, *, engine: EngineConfig, requests: int, slots_option: str, log=print,
                   **kw) -> tuple[FitReport | None, str]:
    """Compile the engine's programs (`compile_generate`) and check them against HBM: (report, verdict line).
    A program the compiler refuses (RESOURCE_EXHAUSTED) or one past the budget does not fit; then fewer
    decode slots are tried (bisecting over powers of two), and the verdict names the largest count that fits
    (as `slots_option`, the command's name for it). Never raises for memory: the line says what to change."""
    def attempt(cfg):
        try:
            return program_report(compile_generate(graphdef, state, mesh, engine=cfg, requests=requests, **kw),
                                  mesh.devices.flat[0]), None
        except jax.errors.JaxRuntimeError as e:  # the TPU compiler itself refuses a program past HBM
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            return None, str(e).splitlines()[0][:200]

    report, err = attempt(engine)
    if report is not None and report.fits:
        return report, fit_line(report)
    slots = engine.slots or min(requests, 256)
    why = fit_line(report) if report is not None else f"does not fit: the compiler ran out of device memory ({err})"
    # bisect over power-of-two multiples of the data-parallel divisor below `slots`: the largest that fits
    counts = [batch_divisor(mesh) << k for k in range(64) if batch_divisor(mesh) << k < slots]
    lo, hi, best = 0, len(counts), None  # counts[hi:] do not fit
    while lo < hi:
        mid = (lo + hi) // 2
        log(f"trying {counts[mid]} decode slots")
        smaller, _ = attempt(dataclasses.replace(engine, slots=counts[mid], pages=0))
        if smaller is not None and smaller.fits:
            lo, best = mid + 1, (counts[mid], smaller)
        else:
            hi = mid
    if best is not None:
        return report, f"{why}; {slots_option}={best[0]} fits ({fit_line(best[1])})"
    return report, f"{why}; no slot count fits: use more devices, pack the weights, or fewer new tokens"


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
    programs = [("train_step", lambda: compile_train_step(run, shape=shapes[0])),
                ("rollout prefill", lambda: compile_rollout(run, "prefill")),
                ("rollout decode", lambda: compile_rollout(run, "decode"))]
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
