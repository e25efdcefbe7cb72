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
import math
import re
import time
from dataclasses import dataclass, field

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from lrmq import compile_cache
from lrmq.configlib import ConfigError
from lrmq.generation.engine import Engine, EngineConfig, pool_info
from lrmq.generation.kv_pool import pool_budget
from lrmq.generation.sampling import SamplingConfig
from lrmq.hlo import collective_totals
from lrmq.model.config import ModelConfig
from lrmq.model.decoder import Decoder
from lrmq.quant.training import pack_linears, prepare_for_training, trainable_filter
from lrmq.rl.batch import UpdateBatch
from lrmq.rl.config import TrainConfig
# the shapes, compiles and memory budget shared with the trainer (re-exported: lrmq.aot.X is their public name)
from lrmq.rl.precompile import (GIB, HBM_BYTES, HEADROOM, PreflightError, UpdateShape, abstract_update,  # noqa: F401
                                check_budget, hbm_bytes, lower_compile, memory_report, replay_shape, update_shapes)
from lrmq.rl.rollout_copy import RolloutCopy, RolloutQuant
from lrmq.rl.step import make_optimizer, make_train_step, old_logprob_sources, opt_state_shardings
from lrmq.sharding import MeshConfig, abstract_state, batch_divisor, bytes_per_device, make_mesh
from lrmq.rl.placement import is_split, placement_meshes
from lrmq.rl.setup import model_config
from lrmq.targets import chip_peaks, gpu_memory_line, gpu_topology_devices, tpu_topology_devices  # noqa: F401


# ----------------------------------------------------------------------------- targets
def topology_devices(name: str, platform: str = "tpu") -> tuple:
    """Compile-only devices of a TPU topology ("v5p:2x4x4", needs libtpu) or, with platform "gpu", of GPUs
    ("h200:8": one host of 8 H200s, needs JAX's CUDA plugin); `lrmq.targets`."""
    if platform == "gpu":
        return gpu_topology_devices(name)
    if platform != "tpu":
        raise ConfigError(f"--platform {platform!r}: expected tpu or gpu")
    return tpu_topology_devices(name)


TOPOLOGY_HELP = ("with --compile-only: the hardware to compile for, TPU (--platform tpu, needs libtpu) e.g. v5p:2x4x4, "
                 "or GPU (--platform gpu, needs JAX's CUDA plugin) NAME:GPUS e.g. h200:8 (one host of 8; "
                 "names: h100, h200, a100, b200)")
PLATFORM_HELP = "the --topology's kind: tpu (libtpu) or gpu (JAX's CUDA plugin, no GPU needed)"


def target_devices(topology: str | None, platform: str = "tpu") -> list | None:
    """The --compile-only target's devices: `topology_devices(topology, platform)`, or None for this machine's
    devices (a --platform gpu without a --topology is an error: this machine has no GPU to compile for)."""
    if not topology:
        if platform == "gpu":
            raise ConfigError("--platform gpu needs --topology NAME:GPUS, e.g. h200:8")
        return None
    if platform == "gpu":

        compile_cache.disable_for_compile_only_gpu()
    return list(topology_devices(topology, platform))


def memory_note(report: "FitReport", devices) -> str | None:
    """A GPU target's memory line (`lrmq.targets.gpu_memory_line`): its memory, JAX's share, and the
    XLA_PYTHON_CLIENT_MEM_FRACTION that makes a program past that share fit; None for other devices."""
    if not devices:
        return None
    totals = [row_total(r) for r in report.rows]
    needed = max(totals) if totals and not math.isinf(max(totals)) else None
    return gpu_memory_line(devices[0].device_kind, needed, HEADROOM)


# ----------------------------------------------------------------------------- abstract state
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


def abstract_batch(cfg: TrainConfig, mesh, shape: UpdateShape | None = None, model_cfg=None) -> UpdateBatch:
    """The train step's batch of `shape` (default the largest of `update_shapes`: S = prompts x group sequences
    of max_prompt_len + max_new_tokens; for rollout.update_padding=pack every sequence at full length, one per
    row, every completion position a slot: the same work as the padded batch), with the replayed experts of
    rollout.routing_replay (`replay_shape` of `model_cfg`, the run's model config by default)."""
    shape = shape or update_shapes(cfg, batch_divisor(mesh))[0]
    model_cfg = model_cfg if model_cfg is not None else model_config(cfg)
    return abstract_update(cfg, shape, mesh, experts=replay_shape(cfg, model_cfg))[0]


# ----------------------------------------------------------------------------- compiles
def compiled_cost(compiled) -> dict:
    """XLA's cost analysis of a compiled program ({"flops": ..., "bytes accessed": ...}, per loop iteration). A
    compile-only GPU executable has none (its `cost_analysis()` is None): then XLA's HloCostAnalysis of its
    optimized HLO, run through the CPU client (the same analysis; {} where this jaxlib does not offer it)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    if cost:
        return dict(cost)
    try:
        from jax._src import xla_bridge
        from jax._src.lib import xla_client

        module = compiled.runtime_executable().hlo_modules()[0]
        return dict(xla_client._xla.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module))
    except Exception:  # a private helper of jaxlib: absent, or moved in a later version
        return {}


def _flops(compiled) -> float:
    return float(compiled_cost(compiled).get("flops", 0.0))


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
    # a batch's first update (the later ones of mu > 1 are the same program or one reading the batch's old_logp)
    step = make_train_step(run.graphdef, cfg, tx, (tr_sh, opt_sh), old_from=old_logprob_sources(cfg)[0])
    batch, ref = abstract_update(cfg, shape or update_shapes(cfg, batch_divisor(run.mesh))[0], run.mesh,
                                 experts=replay_shape(cfg, run.model_cfg))
    return lower_compile(step, run.trainable, run.rest, opt, batch, ref, mesh=run.mesh)


def _sds(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _compile(fn, *args, mesh) -> tuple[object, float]:
    return lower_compile(fn, *args, mesh=mesh)


def compile_generate(graphdef, state, mesh, *, model_cfg: ModelConfig, engine: EngineConfig, requests: int,
                     prompt_len: int, max_new: int, sampling: SamplingConfig,
                     programs: tuple[str, ...] = ("prefill", "decode")) -> dict[str, tuple[object, float]]:
    """{"prefill" | "decode": (compiled, seconds)} of the generation engine's programs for `requests` sequences
    of `prompt_len` + `max_new` tokens (`Engine.abstract_calls`: the largest prefill, one decode call); the decode attention is
    `engine.attention` (rollout.decode_attention / generation.decode_attention / --decode-attention)."""
    eng = Engine(None, eos_ids=(0,), pad_id=0, graphdef=graphdef, model_cfg=model_cfg, config=engine, mesh=mesh)
    calls = eng.abstract_calls(state, n_requests=requests, prompt_len=prompt_len, max_new=max_new,
                               sampling=sampling, mesh=mesh)
    out = {}
    for name in programs:
        fn, args = calls[name]
        out[name] = _compile(fn, *args, mesh=mesh)
    return out


def _rollout_programs(cfg: TrainConfig, graphdef, state, mesh, model_cfg: ModelConfig, programs=("prefill", "decode"),
                      engine: EngineConfig | None = None):
    r = cfg.rollout
    return compile_generate(graphdef, state, mesh, model_cfg=model_cfg, engine=engine or r.engine_config(moe=bool(model_cfg.num_experts)),
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


def compile_rollout(run: AbstractRun, program: str = "decode", engine: EngineConfig | None = None
                    ) -> tuple[object, float]:
    """(compiled, seconds) of one of the rollout engine's programs ("prefill" | "decode") for the run's config
    (on the packed copy with rollout.quant); `engine` overrides `rollout.engine_config()` (a sized pool)."""
    graphdef, states = rollout_model(run)
    return _rollout_programs(run.cfg, graphdef, states, run.mesh, run.model_cfg, (program,), engine)[program]


def rollout_memory(cfg: TrainConfig, graphdef, state, mesh, engine: EngineConfig | None = None) -> dict[str, int]:
    """{"rollout prefill" | "rollout decode": per-device bytes} of the rollout engine's programs (its
    configuration `engine`, default `rollout.engine_config()`), compiled now: the trainer's preflight
    (`GRPOTrainer(preflight_programs=...)`, wired by lrmq.train) checks them against the budget with the update."""
    programs = _rollout_programs(cfg, graphdef, state, mesh, model_config(cfg), engine=engine)
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
def refusal(e: BaseException) -> str | None:
    """The compiler's first line when it refused a program for device memory (libtpu raises RESOURCE_EXHAUSTED
    for a program past HBM instead of compiling it), else None."""
    if isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e):
        return str(e).strip().splitlines()[0][:300]
    return None


def program_row(name: str, compile_fn) -> dict:
    """A report row {name, memory, flops, bytes, seconds} of `compile_fn() -> (compiled, seconds)` (flops and bytes
    accessed: `compiled_cost`). A program the compiler refuses for memory is a row too (memory None, "refused": the
    compiler's line), never a traceback."""
    t0 = time.perf_counter()
    try:
        compiled, secs = compile_fn()
    except jax.errors.JaxRuntimeError as e:
        why = refusal(e)
        if why is None:
            raise
        return {"name": name, "memory": None, "refused": why, "flops": 0.0, "bytes": 0.0,
                "seconds": time.perf_counter() - t0}
    cost = compiled_cost(compiled)
    return {"name": name, "memory": memory_report(compiled), "flops": float(cost.get("flops", 0.0)),
            "bytes": float(cost.get("bytes accessed", 0.0)), "seconds": secs, "collectives": program_collectives(compiled)}


def program_collectives(compiled) -> dict | None:
    """`hlo.collective_totals` of a compiled program (one run: its loops' trip counts included), None where its
    text is not what lrmq.hlo reads."""
    try:
        return collective_totals(compiled.as_text())
    except ValueError:
        return None


ALL_TO_ALL = ("all-to-all", "ragged-all-to-all")


def all_to_all_line(report: "FitReport") -> str | None:
    """One line: the all-to-all bytes each program moves per device in one run (expert-parallel dispatch; a
    ragged one counted at the mean over the devices, `hlo.collective_totals`, a device's own experts' slots
    included), None when none has any."""
    parts = []
    for r in report.rows:
        coll = r.get("collectives") or {}
        moved = [coll[op] for op in ALL_TO_ALL if op in coll]
        if moved:
            unknown = " (a loop's trip count unknown: counted once)" if any(m["unknown_trips"] for m in moved) else ""
            parts.append(f"{r['name']} {sum(m['operand_bytes'] for m in moved) / GIB:.3f} GiB in "
                         f"{sum(m['count'] for m in moved)} exchanges{unknown}")
    return "all-to-all per device per program run: " + "; ".join(parts) if parts else None


_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def refused_bytes(line: str) -> float | None:
    """The memory a refused program asked for, from the compiler's line ("... HLO temporaries (16.79G) exceeds
    available HBM (15.75G)"), or None when the line does not say."""
    m = re.search(r"\(([\d.]+)([KMGT]?)\) exceeds available", line)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


def row_total(row: dict) -> float:
    """A row's per-device bytes (infinite when the compiler refused the program)."""
    return row["memory"]["total"] if row["memory"] is not None else math.inf


def _row_line(row: dict) -> str:
    if row["memory"] is None:
        return f"{row['name']}: refused by the compiler after {row['seconds']:.1f} s ({row['refused']})"
    return f"compiled {row['name']} in {row['seconds']:.1f} s: {row['memory']['total'] / GIB:.2f} GiB per device"


def _micro_batch_candidates(cfg: TrainConfig, mesh) -> list[int]:
    """Micro-batch sizes below the configured one that divide the batch and the data axes, largest first."""
    s = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    cur = cfg.optim.micro_batch_size or s
    div = batch_divisor(mesh)
    return [m for m in range(cur - 1, 0, -1) if s % m == 0 and m % div == 0]


def pool_line(pool: dict, option: str) -> str:
    """One line: the KV pool an engine call allocates (`engine.pool_info`) and how it was sized."""
    how = {"kv_pages": f"{option}={pool['pages']}", "worst case": "the worst case: no sequence is ever preempted",
           "smallest": "the smallest pool (one sequence), compiled because the worst case was refused",
           "fitted": f"fitted to the device's memory ({option}=0; the worst case is {pool['worst_case_pages']:,} "
                     f"pages, preemption covers the rest)"}[pool["sized"]]
    groups = pool.get("groups", 1)
    split = f", split over {groups} data groups" if groups > 1 else ""
    return (f"KV pool: {pool['pages']:,} pages of {pool['page_size']} tokens ({pool['tokens']:,} tokens for "
            f"{pool['slots']} slots{split}), {pool['bytes_per_device'] / GIB:.2f} GiB per device; {how}")


@dataclass
class FitReport:
    rows: list[dict]  # one per compiled program: name, memory (None: refused by the compiler), flops, seconds
    hbm: int | None
    fits: bool
    largest_fitting_micro_batch: int | None = None
    pool: dict | None = None  # the engine's KV pool (`engine.pool_info`)
    fitting_kv_pages: int | None = None  # a set pool that did not fit: the pages found to fit
    # rollout.placement: {"placement", "learner": mesh shape, "sampler": mesh shape, chips of each}
    placement: dict | None = None
    estimate: dict | None = None  # `step_estimate`: roofline seconds of a step, labelled an estimate

    @property
    def budget(self) -> float | None:
        return self.hbm * (1 - HEADROOM) if self.hbm else None

    def table(self) -> str:
        gib = lambda b: f"{b / GIB:.2f}"
        head = "| program | arguments | temporaries | outputs | aliased | total (GiB) | of HBM | XLA TFLOP* | compile s |"
        lines = [head, "|" + "---|" * 9]
        for r in self.rows:
            m = r["memory"]
            if m is None:
                lines.append(f"| {r['name']} | refused by the compiler: {r['refused'][:160]} | | | | | | | "
                             f"{r['seconds']:.1f} |")
                continue
            share = f"{m['total'] / self.hbm:.0%}" if self.hbm else "?"
            lines.append(f"| {r['name']} | {gib(m['arguments'])} | {gib(m['temporaries'])} | {gib(m['outputs'])} | "
                         f"{gib(m['aliased'])} | {gib(m['total'])} | {share} | {r['flops'] / 1e12:.2f} | "
                         f"{r['seconds']:.1f} |")
        lines.append("* XLA's cost analysis counts each loop body once (one micro-batch, one scanned layer, one "
                     "decode step), so it is a per-iteration figure, not the program's total")
        return "\n".join(lines)


def _fits(rows: list[dict], budget: float | None) -> bool:
    """Every row compiled (a refused program never fits) and within `budget` (None: the memory is unknown)."""
    return all(r["memory"] is not None and (budget is None or row_total(r) <= budget) for r in rows)


def fit_line(report: FitReport) -> str:
    """'fits: X GiB per device of Y GiB usable' (or 'does not fit: ...') for the report's largest program."""
    worst = max(report.rows, key=row_total)
    if worst["memory"] is None:
        return f"does not fit: the compiler ran out of device memory for the {worst['name']} ({worst['refused']})"
    return (f"{'fits' if report.fits else 'does not fit'}: {worst['memory']['total'] / GIB:.2f} GiB per device"
            + (f" of {report.budget / GIB:.1f} GiB usable" if report.hbm else ""))


def fit_pool(attempt, rows: list[dict], pages: int, minimum: int, bytes_per_page: int, budget: float, log=print,
             tries: int = 4) -> tuple[int, list[dict]] | None:
    """(pages, rows) of the largest pool found whose programs fit `budget`, starting from the `rows` of a pool of
    `pages` that did not: each try drops the pages past the budget (memory grows linearly with the pool: at first
    `bytes_per_page`, then the slope measured between two tries), or scales the pool by what the compiler said
    it needed when it refused a program, and compiles `attempt(pages) -> rows`. None when the
    pool is down to `minimum` (one sequence) and still does not fit: then the pool is not what is too large."""
    prev = None  # (pages, bytes) of the previous try: the measured bytes per page once two pools compiled
    for _ in range(tries):
        worst = max(row_total(r) for r in rows)
        if math.isinf(worst):  # refused: scale the pool by what the compiler said it needed, else halve it
            asked = [refused_bytes(r["refused"]) for r in rows if r["memory"] is None]
            smaller = (int(0.95 * pages * budget / max(asked)) if all(asked) else pages // 2)
        else:
            slope = bytes_per_page
            if prev is not None and not math.isinf(prev[1]) and prev[0] > pages:
                slope = max(slope, (prev[1] - worst) / (prev[0] - pages))
            smaller = pages - math.ceil(1.02 * (worst - budget) / slope)
        prev = (pages, worst)
        smaller = max(minimum, smaller)
        if smaller >= pages:
            return None
        pages = smaller
        log(f"trying a KV pool of {pages:,} pages")
        rows = attempt(pages)
        if _fits(rows, budget):
            total = max(row_total(r) for r in rows)
            if not math.isinf(prev[1]):  # two pools compiled: grow back to the budget on the measured slope
                slope = max(bytes_per_page, (prev[1] - total) / (prev[0] - pages))
                larger = pages + int((budget - total) / (1.02 * slope))
                if larger > 1.05 * pages and larger < prev[0]:
                    log(f"trying a KV pool of {larger:,} pages")
                    more = attempt(larger)
                    if _fits(more, budget):
                        return larger, more
            return pages, rows
    return None


def _engine_rows(graphdef, state, mesh, engine: EngineConfig, names=("prefill", "decode"), **kw):
    return [program_row(name, lambda name=name: compile_generate(graphdef, state, mesh, engine=engine,
                                                                          programs=(name,), **kw)[name])
            for name in names]


def check_generate(graphdef, state, mesh, *, engine: EngineConfig, requests: int, slots_option: str,
                   pages_option: str = "kv_pages", fraction: float = 0.9, log=print,
                   **kw) -> tuple[FitReport, str]:
    """Compile the engine's programs (`compile_generate`) and check them against HBM: (report, verdict line).
    With engine.pages = 0 the pool is sized to the device as vLLM's gpu_memory_utilization: the worst-case pool
    (every slot at full length) when the programs with it take at most `fraction` of the device's memory, else
    `fraction` of the memory less what the programs need besides the pool (measured: their total with the
    worst-case pool, or with the smallest pool when the compiler refused that, less the pool), compiled again.
    The report's `pool` is the pool compiled. A program the compiler refuses (RESOURCE_EXHAUSTED) or one past the
    budget does not fit: a set pool (`pages_option`) is shrunk to the largest that fits (`fit_pool`); when the
    pool is not what is too large, fewer decode slots are tried (powers of two, worst-case pools, searched from the
    count the failed programs' memory points to: `largest_fitting`) and the verdict names the largest count that
    fits (as `slots_option`). Never raises for memory."""
    model_cfg = kw["model_cfg"]
    sizes = (requests, kw["prompt_len"], kw["max_new"])
    hbm = hbm_bytes(mesh.devices.flat[0])
    rows_of = lambda cfg: _engine_rows(graphdef, state, mesh, cfg, requests=requests, **kw)
    info_of = lambda cfg: pool_info(cfg, model_cfg, mesh, *sizes)

    def attempt(cfg, sized=True):
        rows = rows_of(cfg)
        if sized and not cfg.pages and hbm and max(map(row_total, rows)) > fraction * hbm:
            worst = info_of(cfg)
            # what the programs need besides the pool; a program the compiler refused is measured again with
            # the smallest pool (one sequence)
            rest = max([row_total(r) - worst["bytes_per_device"] for r in rows if r["memory"] is not None] or [0])
            refused = tuple(r["name"] for r in rows if r["memory"] is None)
            if refused:
                smallest = dataclasses.replace(cfg, pages=_min_pages(worst))
                probe = []
                for name in refused:  # one at a time: the first refused again ends the search
                    probe += _engine_rows(graphdef, state, mesh, smallest, names=(name,), requests=requests, **kw)
                    if probe[-1]["memory"] is None:
                        break
                if not all(r["memory"] for r in probe):  # the pool is not what is too large: the slots are
                    rows = [next((q for q in probe if q["name"] == r["name"]), r) for r in rows]
                    return FitReport(rows, hbm, False, pool={**info_of(smallest), "sized": "smallest"})
                rest = max(rest, max(map(row_total, probe)) - info_of(smallest)["bytes_per_device"])
            cfg = dataclasses.replace(cfg, pool_bytes=pool_budget(hbm, rest, fraction))
            log(f"the worst-case KV pool ({worst['pages']:,} pages) does not fit in {fraction:.0%} of the device's "
                f"memory: compiling {info_of(cfg)['pages']:,} pages")
            rows = rows_of(cfg)
        report = FitReport(rows, hbm, False, pool=info_of(cfg))
        report.fits = _fits(rows, report.budget)
        return report

    report = attempt(engine)
    log(pool_line(report.pool, pages_option))
    if report.fits:
        return report, fit_line(report)
    why = fit_line(report)
    if engine.pages:
        found = fit_pool(lambda p: _engine_rows(graphdef, state, mesh, dataclasses.replace(engine, pages=p),
                                                requests=requests, **kw),
                         report.rows, engine.pages, _min_pages(report.pool),
                         report.pool["bytes_per_device"] // report.pool["pages"], report.budget, log)
        if found is not None:
            report.fitting_kv_pages = found[0]
            return report, f"{why}; {pages_option}={found[0]} fits"
    slots = engine.slots or min(requests, 256)
    # the largest power-of-two multiple of the data-parallel divisor below `slots` that fits with the worst-case
    # pool (no preemption; one compile per program and count), searched from the count the failed programs'
    # memory points to (`_slot_guess`) and bisected from there
    counts = [batch_divisor(mesh) << k for k in range(64) if batch_divisor(mesh) << k < slots]

    def fits_at(i):
        log(f"trying {counts[i]} decode slots")
        return attempt(dataclasses.replace(engine, slots=counts[i], pages=0), sized=False)

    best = largest_fitting(len(counts), fits_at, _slot_guess(counts, slots, report))
    if best is not None:
        return report, f"{why}; {slots_option}={counts[best[0]]} fits ({fit_line(best[1])})"
    return report, f"{why}; no slot count fits: use more devices, pack the weights, or fewer new tokens"


def largest_fitting(n: int, attempt, first: int | None = None) -> tuple[int, FitReport] | None:
    """(index, report) of the largest i < n whose `attempt(i)` report fits, when fitting is monotone (every index
    below a fitting one fits): a bisection whose first probe is `first` (a guess near the answer) and whose second
    is the guess's neighbour on the side the first one points to (the next count up when the guess fits, down when
    it does not), so a guess off by at most one takes two attempts; else the middle. None when none fits."""
    lo, hi, best = 0, n, None  # [0, lo) fit, [hi, n) do not
    guessed = first is not None and 0 <= first < n
    mid = first if guessed else (lo + hi) // 2
    while lo < hi:
        report = attempt(mid)
        if report.fits:
            lo, best = mid + 1, (mid, report)
        else:
            hi = mid
        neighbour = mid + 1 if report.fits else mid - 1
        mid = neighbour if mid == first and guessed and lo <= neighbour < hi else (lo + hi) // 2
    return best


def _slot_guess(counts: list[int], slots: int, report: FitReport) -> int | None:
    """The index of the largest count under `slots` * budget / needed, where needed is the most memory a program
    of the failed `report` took (or asked for, when the compiler refused it): memory that grows in proportion
    to the slots points at the count that fits. None when the report says nothing usable."""
    budget = report.budget
    asked = [row_total(r) if r["memory"] is not None else refused_bytes(r["refused"]) or 0.0 for r in report.rows]
    needed = max(asked, default=0.0)
    if not budget or not needed or math.isinf(needed):
        return None
    slots = report.pool["slots"] if report.pool else slots
    fitting = [i for i, c in enumerate(counts) if c <= slots * budget / needed]
    return fitting[-1] if fitting else 0


def _min_pages(pool: dict) -> int:
    """The smallest pool an engine call runs with: in each data group (`engine.pool_info`), the null page and one
    sequence's pages."""
    groups = pool.get("groups", 1)
    return groups * (1 + (pool["worst_case_pages"] // groups - 1) // (pool["slots"] // groups))


def check_fit(cfg: TrainConfig, devices=None, *, search: bool = True, all_updates: bool = True,
              log=print) -> FitReport:
    """Compile the train step and the rollout for `devices` (default: this process's view of all devices)
    and compare per-device memory with HBM minus HEADROOM. When the step does not fit, find the largest
    micro-batch that does (compiling smaller ones, largest first). With rollout.kv_pages = 0 the rollout's KV
    pool is sized to the device (`kv_pool.pool_budget`): rollout.kv_memory_fraction of HBM less the update's
    per-device total (its weights, optimizer state and peak; the fitting micro-batch's when the configured one
    does not fit), at most the worst case, then shrunk until the rollout's programs fit (`fit_pool`); a set
    rollout.kv_pages that does not fit gets the largest pool that does (`fitting_kv_pages`). A program the
    compiler refuses is a row marked refused, never an exception. The step is compiled for every shape of
    `update_shapes` (`all_updates`, as the trainer does before its first rollout): the first row is the largest
    ("train_step"), then the rollout's prefill and decode, then the smaller update shapes ("train_step 2/5")."""
    devices = list(devices) if devices is not None else jax.devices()
    mesh, sampler_mesh = placement_meshes(cfg, devices)  # the learner's and the sampler's (the same: colocated)
    if is_split(mesh, sampler_mesh):
        # each role's programs compiled for a slice of its own size, its first chips: libtpu compiles a program for
        # the device ids it names, and refuses one over the slice's later chips ("Unexpected device_id 6 in replica
        # group :: target has 4 device_id"); the chips are alike, so the per-chip memory is the same
        mesh, sampler_mesh = (Mesh(np.asarray(devices[:m.devices.size]).reshape(m.devices.shape), m.axis_names,
                                   axis_types=m.axis_types) for m in (mesh, sampler_mesh))
    hbm = hbm_bytes(devices[0])
    report = FitReport([], hbm, False)
    report.placement = {"placement": cfg.rollout.placement, "learner": dict(mesh.shape),
                        "sampler": dict(sampler_mesh.shape), "learner_chips": mesh.devices.size,
                        "sampler_chips": sampler_mesh.devices.size}
    budget = report.budget
    fits = lambda row: _fits([row], budget)
    run = abstract_run(cfg, mesh)
    srun = abstract_run(cfg, sampler_mesh) if is_split(mesh, sampler_mesh) else run
    shapes = update_shapes(cfg, batch_divisor(mesh))
    n = len(shapes)

    def add(row):
        report.rows.append(row)
        log(_row_line(row))
        return row

    log(f"compiling update 1/{n}: {shapes[0].label()}")
    reserved = add(program_row("train_step", lambda: compile_train_step(run, shape=shapes[0])))
    if not fits(reserved) and search:
        for mb in _micro_batch_candidates(cfg, mesh):
            row = program_row(f"micro-batch {mb}", lambda mb=mb: compile_train_step(run, mb))
            log(_row_line(row))
            if fits(row):
                report.largest_fitting_micro_batch, reserved = mb, row
                break
    r = cfg.rollout
    engine = r.engine_config(moe=bool(run.model_cfg.num_experts))  # as the trainer's: MoE rollouts record experts
    # what else lives on the sampler's chips: the update (colocated), or only the sampler's own weights (split)
    others = (bytes_per_device(rollout_model(srun)[1]) if srun is not run
              else reserved["memory"]["total"] if reserved["memory"] is not None else None)
    if not r.kv_pages and others is not None:
        engine = dataclasses.replace(engine, pool_bytes=pool_budget(hbm, others, r.kv_memory_fraction))
    sizes = dict(requests=r.prompts_per_step * r.group_size, prompt_len=r.max_prompt_len, max_new=r.max_new_tokens)
    report.pool = pool_info(engine, run.model_cfg, sampler_mesh, *sizes.values())
    log(pool_line(report.pool, "rollout.kv_pages"))

    def rollout_rows(eng):
        return [program_row(f"rollout {p}", lambda p=p: compile_rollout(srun, p, eng)) for p in ("prefill", "decode")]

    rows = rollout_rows(engine)
    for row in rows:
        log(_row_line(row))
    if budget is not None and not _fits(rows, budget):
        pool = report.pool
        found = fit_pool(lambda p: rollout_rows(dataclasses.replace(engine, pages=p)), rows, pool["pages"],
                         _min_pages(pool), pool["bytes_per_device"] // pool["pages"], budget, log)
        if found is not None and r.kv_pages:
            report.fitting_kv_pages = found[0]
        elif found is not None:  # the default pool is the largest that fits
            rows = found[1]
            report.pool = {**pool_info(dataclasses.replace(engine, pages=found[0]), run.model_cfg, sampler_mesh,
                                       *sizes.values()), "sized": "fitted"}
            log(pool_line(report.pool, "rollout.kv_pages"))
    report.rows += rows
    if all_updates:
        for i, sh in enumerate(shapes[1:], start=2):
            log(f"compiling update {i}/{n}: {sh.label()}")
            add(program_row(f"train_step {i}/{n}", lambda sh=sh: compile_train_step(run, shape=sh)))
    report.fits = _fits(report.rows, budget)
    report.estimate = step_estimate(cfg, report, devices[0].device_kind)
    return report


def step_estimate(cfg: TrainConfig, report: FitReport, device_kind: str) -> dict | None:
    """A roofline ESTIMATE of one step's seconds (None off TPU/GPU or without the rows): the update as compute-bound,
    6 x parameters x tokens FLOPs (8 x with model.remat=full: the forward again; the active parameters,
    `ModelConfig.num_params(active=True)`: a mixture of experts' router and top-k experts) x algo.num_iterations
    over the learner's chips at peak; the rollout as memory-bound decode, max_new_tokens steps each reading the
    sampler's chip share of the compiled decode program's arguments (weights and the KV pool) at HBM bandwidth. Colocated: a
    step is their sum; split: the larger of the two (the update of step j runs while batch j + 1 is sampled).
    XLA's cost analysis counts each loop body once (one scanned layer, one decode step), so the programs' own
    FLOP counts are not totals; the compiled programs give the bytes, the model gives the FLOPs."""
    peaks = chip_peaks(device_kind)
    rows = {r["name"]: r for r in report.rows}
    decode, step = rows.get("rollout decode"), rows.get("train_step")
    if peaks is None or decode is None or step is None or decode["memory"] is None:
        return None
    r, p = cfg.rollout, report.placement
    # the FLOPs a token costs: a mixture of experts computes with its router and top-k experts (active), not all
    params = model_config(cfg).num_params(active=True)
    tokens = r.prompts_per_step * r.group_size * (r.max_prompt_len + r.max_new_tokens)
    flops = (8 if cfg.model.remat == "full" else 6) * params * tokens * cfg.algo.num_iterations
    update_s = flops / (p["learner_chips"] * peaks[0])
    rollout_s = r.max_new_tokens * decode["memory"]["arguments"] / peaks[1]
    total = max(update_s, rollout_s) if p["placement"] == "split" else update_s + rollout_s
    return {"update_s": update_s, "rollout_s": rollout_s, "step_s": total, "params": params,
            "how": "roofline estimate: update 6-8 x active params x tokens FLOPs at peak over the learner's chips; "
                   "rollout max_new_tokens decode steps reading the decode program's per-chip arguments at HBM "
                   "bandwidth; "
                   + ("split: max of the two" if p["placement"] == "split" else "colocated: their sum")}


def report_dict(report: FitReport, cfg: TrainConfig, target: str) -> dict:
    """A JSON-able record of a check (docs/tpu.md's table is built from these)."""
    return {"target": target, "hbm_bytes": report.hbm, "headroom": HEADROOM, "fits": report.fits,
            "micro_batch": cfg.optim.micro_batch_size, "largest_fitting_micro_batch": report.largest_fitting_micro_batch,
            "kv_pool": report.pool, "kv_memory_fraction": cfg.rollout.kv_memory_fraction,
            "fitting_kv_pages": report.fitting_kv_pages,
            "mode": cfg.quant.mode, "model": cfg.model.shapes or cfg.model.checkpoint, "programs": report.rows,
            "placement": report.placement, "step_estimate": report.estimate}


def verdict(report: FitReport, cfg: TrainConfig) -> str:
    """One line: fits, or what does not fit and the setting that makes it fit (optim.micro_batch_size,
    rollout.kv_pages, rollout.generation_batch)."""
    budget = report.budget
    if report.fits:
        worst = max(r["memory"]["total"] for r in report.rows)
        room = f" of {budget / GIB:.1f} GiB usable per device" if budget else " (device memory unknown)"
        return f"fits: at most {worst / GIB:.2f} GiB{room}"
    bad = [r for r in report.rows if not _fits([r], budget)]
    over = ", ".join(f"{r['name']} needs {r['memory']['total'] / GIB:.2f} GiB" if r["memory"] is not None else
                     f"the compiler refused the {r['name']} ({r['refused']})" for r in bad)
    room = f"{budget / GIB:.1f} GiB usable per device ({HEADROOM:.0%} headroom)" if budget else "the device's memory"
    msg = f"does not fit: {over} of {room}"
    step_over = any(r["name"].startswith("train_step") for r in bad)
    rollout_over = any(r["name"].startswith("rollout") for r in bad)
    if step_over and report.largest_fitting_micro_batch:
        msg += (f"; the largest micro-batch whose train step fits is {report.largest_fitting_micro_batch} "
                f"(optim.micro_batch_size={report.largest_fitting_micro_batch})")
    elif step_over:
        msg += "; no smaller micro-batch fits either (shard over more chips, or use remat / QLoRA)"
    if rollout_over and report.fitting_kv_pages:
        msg += f"; the rollout fits with rollout.kv_pages={report.fitting_kv_pages}"
    elif rollout_over:
        msg += ("; no smaller KV pool tried fits the rollout either: lower rollout.generation_batch (decode slots; "
                "the prefill runs them all at once)")
    return msg
