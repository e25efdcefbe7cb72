"""PTQ compiled ahead of time for hardware you may not have: `python -m lrmq.quantize --compile-only`.

    python -m lrmq.quantize --compile-only --shapes r1-distill-llama-70b --method awq --bits 3 --topology v5p:2x2x1

A PTQ run is the same few per-layer programs called again and again (the layer forward with its captures, AWQ's
statistics, grid losses, fold, clip search and quantizer, GPTQ's stage forwards and X^T X), each on one layer's
shapes, replicated weights on every chip of the PTQ mesh and one unit of calibration blocks per chip
(`lrmq.ptq.shard`). Every layer of a model has the same shapes, so compiling the programs of one layer per layer
type, at the real shapes, for the target's chips (libtpu for a TPU topology, JAX's CUDA plugin for a GPU:
`lrmq.aot.target_devices`) gives the run's per-chip peak from XLA's memory analysis without a single weight. The
host side is counted, not compiled: one layer's float32 weights and the next one (prefetched), the calibration
activations and captures, the embedding (`host_bytes`).

The time per layer is an estimate: each program's max(flops / peak FLOP/s, bytes accessed / HBM bandwidth) from
XLA's cost analysis of the compiled program and the chip's published peaks (`lrmq.targets.chip_peaks`), times its
calls per layer; GPTQ's host-side block quantization (numba, `lrmq.ptq.gptq`) is estimated from a rate measured on
this machine. Nothing runs on the target.

`check` ends in a verdict: fits (exit 0), or not (exit 3) with the setting that makes it fit: a smaller
calibration.batch_size (blocks per chip step) or awq.oc_batch (clip-search columns per chip), fewer calibration
blocks where the host is what is short (--host-memory-gib).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
from dataclasses import dataclass, field

import jax
import numpy as np

from lrmq.aot import largest_fitting, program_row, refused_bytes, row_total
from lrmq.hlo import loop_extra_cost
from lrmq.model.config import ModelConfig
from lrmq.model.presets import PRESETS, preset_config  # noqa: F401 (PRESETS: the names --shapes takes)
from lrmq.ptq import awq as awq_mod
from lrmq.ptq import layer_fn as lf
from lrmq.ptq.config import QuantizeConfig
from lrmq.ptq.gptq import gptq_quantize, prepare_hessian
from lrmq.ptq.programs import Program, abstract_layer_params, host_bytes, layer_kinds, layer_programs
from lrmq.ptq.shard import AXIS, ptq_mesh, unit_size
from lrmq.rl.precompile import GIB, HEADROOM, hbm_bytes, lower_compile
from lrmq.targets import chip_peaks

# the QuantLRM paper's models and paper 1's largest (lrmq.model.presets): --shapes
PAPER_SHAPES = ("qwen3-8b", "olmo-3-7b", "r1-distill-qwen-32b", "r1-distill-llama-70b")
COMPILE_METHODS = ("awq", "gptq", "quantlrm")


# ----------------------------------------------------------------------------- the programs
def program_kind(prog) -> str:
    """What a program's per-chip memory grows with, read off its arguments: "unit" (one unit of calibration blocks
    per chip, [chips, blocks, T, K]: calibration.batch_size), "columns" (one chunk of a weight's columns per chip,
    [chips, K, width]: awq.oc_batch), else "weights" (a whole layer, or one weight, on a chip: no setting)."""
    dims = {x.ndim for x in jax.tree.leaves(prog.args)
            if isinstance(x.sharding, jax.sharding.NamedSharding) and tuple(x.sharding.spec)[:1] == (AXIS,)}
    return "unit" if 4 in dims else "columns" if 3 in dims else "weights"


def holds_layer(prog) -> bool:
    """Whether a program takes the layer's replicated weights as an argument (the layer forwards, the grid losses);
    the others run while the driver keeps them on the chips (`LayerContext.on_chips`), so they are counted beside
    them. The fold takes a host copy of the weights on one chip: beside the replicated ones too."""
    return any(isinstance(a, dict) for a in prog.args) and getattr(prog.fn, "fn", None) is not awq_mod._fold


def layer_weight_bytes(cfg: ModelConfig) -> int:
    """The largest decoder layer's float32 weights (what the chips hold replicated)."""
    return max(sum(4 * math.prod(s) for s in abstract_layer_params(cfg, i).values())
               for i in layer_kinds(cfg).values())


def importance_host_bytes(cfg: ModelConfig) -> int:
    """QuantLRM's importance pass (`lrmq.ptq.importance`, before the layers): two pairs of the largest weight in
    float32 in flight (a sparse layer's: a stacked [E, K, N] expert projection), and the median's histograms
    (`lrmq.ptq.median`: ~37 MiB per worker thread, 8 counted)."""
    largest = max(math.prod(s) for i in layer_kinds(cfg).values() for s in abstract_layer_params(cfg, i).values())
    return 2 * 2 * 4 * largest + 8 * 37 * 2 ** 20


# ----------------------------------------------------------------------------- GPTQ's host side
@functools.lru_cache(maxsize=None)
def gptq_host_rate() -> dict:
    """GPTQ's host work rates measured here (`lrmq.ptq.gptq`), best of three timings each: "f32_flops" / "f64_flops"
    (numpy matmuls: the updates of the later rows, float32; the Hessian's Cholesky inverse, float64) and "kn"
    (seconds per weight element of the numba block loop, from a [1024, 1024] weight less its row updates)."""
    rng = np.random.default_rng(0)

    def best(fn):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    n = 1024
    a32 = rng.standard_normal((n, n)).astype(np.float32)
    a64 = a32.astype(np.float64)
    f32 = 2 * n ** 3 / best(lambda: a32 @ a32)
    f64 = 2 * n ** 3 / best(lambda: a64 @ a64)
    x = rng.standard_normal((4 * n, n)).astype(np.float32)
    h = prepare_hessian(x.T @ x)
    w = rng.standard_normal((n, n)).astype(np.float32)
    gptq_quantize(w[:128, :128], prepare_hessian(x[:, :128].T @ x[:, :128]), bits=4, group_size=128)  # numba's jit
    loop = best(lambda: gptq_quantize(w, h, bits=4, group_size=128)) - n * n * n / f32
    return {"f32_flops": f32, "f64_flops": f64, "kn": max(loop, 0.0) / (n * n), "cores": len(os.sched_getaffinity(0))}


def gptq_host_seconds(cfg: ModelConfig, qcfg: QuantizeConfig) -> float:
    """Estimated host seconds of one layer's GPTQ quantization at `gptq_host_rate`: each Linear's block loop
    (K N elements) and updates of the later rows (~K^2 N float32 flops), one Hessian inverse per captured input
    (~2/3 K^3 float64 flops: Cholesky and triangular inverse, K^3 / 3 each)."""
    rate = gptq_host_rate()
    count: dict[tuple[str, bool], int] = {}
    for i, lt in enumerate(cfg.layer_types):
        count[(lt, cfg.is_moe_layer(i))] = count.get((lt, cfg.is_moe_layer(i)), 0) + 1
    return sum(count[kind] * _gptq_host_layer(cfg, qcfg, i, rate)
               for kind, i in layer_kinds(cfg).items()) / cfg.num_layers


def _gptq_host_layer(cfg: ModelConfig, qcfg: QuantizeConfig, i: int, rate: dict) -> float:
    """Layer i's `gptq_host_seconds`. A sparse layer's stacked experts [E, K, N] are E solves of [K, N]
    (`lrmq.ptq.gptq_model.gptq_layer`); their Hessian inverses: down_proj's one per expert, gate/up's one shared
    (mlp_in's) with calibration.moe_experts=all, one per expert with "routed"."""
    shapes = abstract_layer_params(cfg, i)
    secs = 0.0
    for name in lf.LINEARS:
        *e, k, n = shapes[name]
        secs += (e[0] if e else 1) * (rate["kn"] * k * n + k * k * n / rate["f32_flops"])
    inverses = {}
    for name in lf.LINEARS:
        *e, k, _ = shapes[name]
        per_expert = e and (name == "down_proj" or qcfg.calibration.moe_experts != "all")
        inverses[lf.INPUT_OF[name]] = (e[0] if per_expert else 1, k)
    return secs + sum(c * 2 * k ** 3 / 3 / rate["f64_flops"] for c, k in inverses.values())


# ----------------------------------------------------------------------------- the check
def compile_row(prog: Program, mesh, resident: int = 0) -> dict:
    """A report row of one program (`lrmq.aot.program_row`: memory, None when the compiler refused it, flops and
    bytes accessed of one call, compile seconds) with its calls per layer, what its per-chip memory grows with
    (`program_kind`) and the bytes held on the chip beside it (`resident`). XLA's cost analysis counts a loop body
    once: the missing iterations (`lrmq.hlo.loop_extra_cost`: AWQ's n_grid alphas, the clip search's shrink steps)
    are added to flops and bytes; "xla_flops" / "xla_bytes" keep XLA's own figures."""
    held = {}

    def compile_fn():
        held["compiled"], secs = lower_compile(prog.fn, *prog.args, mesh=mesh)
        return held["compiled"], secs

    row = program_row(prog.name, compile_fn)
    row.update(calls=prog.calls, kind=program_kind(prog), resident=resident, xla_flops=row["flops"],
               xla_bytes=row["bytes"], loops=[])
    if row["memory"] is not None:
        extra = loop_extra_cost(held["compiled"].as_text())
        row.update(flops=row["flops"] + extra["flops"], bytes=row["bytes"] + extra["bytes"], loops=extra["loops"])
    return row


def per_chip(row: dict) -> float:
    """A row's bytes per chip: the program's own, plus what is held beside it (infinite when refused)."""
    return row_total(row) + row.get("resident", 0)


@dataclass
class PTQFit:
    """The result of `check`: the compiled rows, the chip's memory, the host's, the estimate and the verdict."""

    target: str
    device_kind: str
    devices: int
    hbm: int | None
    rows: list[dict]
    host: dict[str, int]
    host_limit: int | None = None
    importance_host: int = 0
    peaks: tuple[float, float] | None = None
    layer_seconds: float | None = None
    model_seconds: float | None = None
    gptq_host_layer_seconds: float | None = None
    gptq_rate: dict | None = None
    fitting: dict = field(default_factory=dict)  # setting -> value found to fit

    @property
    def budget(self) -> float | None:
        return self.hbm * (1 - HEADROOM) if self.hbm else None

    @property
    def peak(self) -> float:
        return max(per_chip(r) for r in self.rows)

    @property
    def host_total(self) -> int:
        return max(sum(self.host.values()), self.importance_host)

    @property
    def chips_fit(self) -> bool:
        return all(r["memory"] is not None for r in self.rows) and (self.budget is None or self.peak <= self.budget)

    @property
    def host_fits(self) -> bool:
        return self.host_limit is None or self.host_total <= self.host_limit

    @property
    def fits(self) -> bool:
        return self.chips_fit and self.host_fits


def estimate_seconds(row: dict, peaks: tuple[float, float] | None) -> float | None:
    """One call's estimated seconds: max(flops / peak FLOP/s, bytes accessed / HBM bandwidth); None without peaks
    or a cost analysis."""
    if peaks is None or row["memory"] is None or not (row["flops"] or row["bytes"]):
        return None
    return max(row["flops"] / peaks[0], row["bytes"] / peaks[1])


def layer_type_of(name: str, cfg: ModelConfig) -> tuple[str, bool]:
    """The layer kind a program belongs to, (layer type, sparse) (`lrmq.ptq.programs.layer_tag`: names end in
    "(layer type T)" or "(layer type T, experts)")."""
    m = re.search(r"\(layer type (\w+)(, experts)?\)", name)
    if m and m.group(1) in cfg.layer_types:
        return m.group(1), bool(m.group(2))
    return cfg.layer_types[0], cfg.is_moe_layer(0)


def compile_rows(cfg: ModelConfig, qcfg: QuantizeConfig, mesh, n_blocks: int, block_size: int, names=None,
                 log=print) -> list[dict]:
    """Compile the run's programs (`lrmq.ptq.programs.layer_programs`), those named `names` only when given."""
    rows = []
    weights = layer_weight_bytes(cfg)
    for prog in layer_programs(cfg, qcfg, mesh, n_blocks, block_size):
        if names is not None and prog.name not in names:
            continue
        row = compile_row(prog, mesh, 0 if holds_layer(prog) else weights)
        rows.append(row)
        if row["memory"] is None:
            log(f"{row['name']}: refused by the compiler after {row['seconds']:.1f} s ({row['refused']})")
        else:
            log(f"compiled {row['name']} in {row['seconds']:.1f} s: {per_chip(row) / GIB:.2f} GiB per chip")
    return rows


def check(cfg: ModelConfig, qcfg: QuantizeConfig, devices, *, n_blocks: int, block_size: int, target: str,
          host_limit: int | None = None, search: bool = True, log=print) -> PTQFit:
    """Compile every per-layer program of the run for `devices` and compare the per-chip peak with the chip's
    memory less HEADROOM, and the host's bytes with `host_limit` (None: not compared). When the chips are short,
    the largest calibration.batch_size (unit programs) or awq.oc_batch (clip search) whose programs fit is searched
    (compiling the programs over the budget again; `fitting`); when the host is short, the calibration blocks that
    fit it are computed (the host's bytes grow linearly with them). Never raises for memory."""
    devices = list(devices)
    mesh = ptq_mesh(devices)
    kind = devices[0].device_kind
    fit = PTQFit(target=target, device_kind=kind, devices=len(devices), hbm=hbm_bytes(devices[0]), rows=[],
                 host=host_bytes(cfg, qcfg, n_blocks, block_size), host_limit=host_limit,
                 peaks=chip_peaks(kind, "f32"))
    if qcfg.method == "quantlrm":
        fit.importance_host = importance_host_bytes(cfg)
    fit.rows = compile_rows(cfg, qcfg, mesh, n_blocks, block_size, log=log)
    for row in fit.rows:
        row["estimate_s"] = estimate_seconds(row, fit.peaks)
    per_type: dict[tuple[str, bool], float] = {}
    if all(r["estimate_s"] is not None for r in fit.rows):
        for r in fit.rows:
            lt = layer_type_of(r["name"], cfg)
            per_type[lt] = per_type.get(lt, 0.0) + r["calls"] * r["estimate_s"]
        fit.model_seconds = sum(per_type[(lt, cfg.is_moe_layer(i))] for i, lt in enumerate(cfg.layer_types))
        fit.layer_seconds = fit.model_seconds / cfg.num_layers
    if qcfg.method == "gptq":
        fit.gptq_host_layer_seconds = gptq_host_seconds(cfg, qcfg)
        fit.gptq_rate = gptq_host_rate()
    if search and not fit.chips_fit:
        fit.fitting.update(_search_chips(fit, cfg, qcfg, mesh, n_blocks, block_size, log))
    if not fit.host_fits:
        fixed = sum(host_bytes(cfg, qcfg, 0, block_size).values())
        per_block = (sum(fit.host.values()) - fixed) / n_blocks
        blocks = int((host_limit - fixed) // per_block) if host_limit > fixed else 0
        if blocks >= 1 and fit.importance_host <= host_limit:
            fit.fitting["calibration.max_blocks"] = min(blocks, n_blocks - 1)
    return fit


def _search_chips(fit: PTQFit, cfg, qcfg, mesh, n_blocks, block_size, log) -> dict:
    """{setting: value} that makes the programs over the budget fit: calibration.batch_size for the unit programs
    (the divisors of n_blocks below the unit, `lrmq.aot.largest_fitting`, first tried where the memory points),
    awq.oc_batch for the clip search (halved). Nothing for the fold and the quantizer (a whole layer's weights on
    one chip): no setting shrinks those."""
    budget = fit.budget
    over = [r for r in fit.rows if r["memory"] is None or per_chip(r) > budget]
    found = {}

    def asked(r):
        return per_chip(r) if r["memory"] is not None else (refused_bytes(r["refused"]) or math.inf) + r["resident"]

    def search(names, setting, current, candidates, replace):
        def attempt(i):
            log(f"trying {setting}={candidates[i]}")
            rows = compile_rows(cfg, replace(candidates[i]), mesh, n_blocks, block_size, names=names, log=log)
            return _Attempt(all(r["memory"] is not None and per_chip(r) <= budget for r in rows))

        needed = max(asked(r) for r in fit.rows if r["name"] in names)
        guess = None
        if not math.isinf(needed):
            ok = [i for i, c in enumerate(candidates) if c <= current * budget / needed]
            guess = ok[-1] if ok else 0
        best = largest_fitting(len(candidates), attempt, guess)
        if best is not None:
            found[setting] = candidates[best[0]]

    unit_names = {r["name"] for r in over if r["kind"] == "unit"}
    if unit_names:
        u = unit_size(n_blocks, qcfg.calibration.batch_size)
        cands = [b for b in range(1, u) if n_blocks % b == 0]
        if cands:
            search(unit_names, "calibration.batch_size", u, cands,
                   lambda b: dataclasses.replace(qcfg, calibration=dataclasses.replace(qcfg.calibration, batch_size=b)))
    clip_names = {r["name"] for r in over if r["kind"] == "columns"}
    if clip_names:
        cands = sorted({qcfg.awq.oc_batch >> k for k in range(1, 12) if qcfg.awq.oc_batch >> k >= 8})
        if cands:
            search(clip_names, "awq.oc_batch", qcfg.awq.oc_batch, cands,
                   lambda c: dataclasses.replace(qcfg, awq=dataclasses.replace(qcfg.awq, oc_batch=c)))
    return found


@dataclass
class _Attempt:
    fits: bool


# ----------------------------------------------------------------------------- the report
def _duration(s: float) -> str:
    return f"{s:.2f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def table(fit: PTQFit) -> str:
    """Markdown: one row per compiled program."""
    gib = lambda b: f"{b / GIB:.2f}"
    lines = ["| program | calls / layer | arguments | temporaries | outputs | held beside | per chip (GiB) | of HBM | "
             "GFLOP / call | GB / call | est. ms / layer* | compile s |", "|" + "---|" * 12]
    for r in fit.rows:
        m = r["memory"]
        if m is None:
            lines.append(f"| {r['name']} | {r['calls']} | refused by the compiler: {r['refused'][:160]} | | | | | | | "
                         f"| | {r['seconds']:.1f} |")
            continue
        share = f"{per_chip(r) / fit.hbm:.0%}" if fit.hbm else "?"
        est = f"{1e3 * r['calls'] * r['estimate_s']:.1f}" if r.get("estimate_s") is not None else "?"
        lines.append(f"| {r['name']} | {r['calls']} | {gib(m['arguments'])} | {gib(m['temporaries'])} | "
                     f"{gib(m['outputs'])} | {gib(r['resident'])} | {gib(per_chip(r))} | {share} | "
                     f"{r['flops'] / 1e9:.1f} | {r['bytes'] / 1e9:.2f} | {est} | {r['seconds']:.1f} |")
    lines.append("* an estimate, not a measurement: calls x max(flops / peak FLOP/s, bytes accessed / HBM bandwidth), "
                 "from XLA's cost analysis of the compiled program (with the loop iterations it counts once added: "
                 "lrmq.hlo.loop_extra_cost) against the chip's published peaks")
    return "\n".join(lines)


def host_line(fit: PTQFit) -> str:
    parts = "; ".join(f"{k} {v / GIB:.2f} GiB" for k, v in fit.host.items())
    line = f"host RSS (counted, not compiled): {sum(fit.host.values()) / GIB:.2f} GiB at the layers' peak ({parts})"
    if fit.importance_host:
        line += f"; QuantLRM's importance pass before them: {fit.importance_host / GIB:.2f} GiB"
    if fit.host_limit is not None:
        line += f"; the host has {fit.host_limit / GIB:.1f} GiB"
    return line


def estimate_line(fit: PTQFit, cfg: ModelConfig) -> str:
    if fit.peaks is None:
        return f"estimated time: no published peaks for {fit.device_kind} in lrmq.targets"
    if fit.layer_seconds is None:
        return "estimated time: XLA gave no cost analysis for a program"
    line = (f"estimated time on the chips (an estimate from XLA's cost analysis against {fit.peaks[0] / 1e12:.0f} "
            f"TFLOP/s and {fit.peaks[1] / 1e9:.0f} GB/s per chip, not a measurement): "
            f"{_duration(fit.layer_seconds)} per layer, {_duration(fit.model_seconds)} for {cfg.num_layers} layers")
    if fit.gptq_host_layer_seconds is not None:
        line += (f"; GPTQ's host-side quantization (numba) at the rate measured on this machine "
                 f"({fit.gptq_rate['cores']} cores): {_duration(fit.gptq_host_layer_seconds)} per layer, "
                 f"{_duration(fit.gptq_host_layer_seconds * cfg.num_layers)} for {cfg.num_layers} layers")
    return line


def verdict(fit: PTQFit) -> str:
    """One line: fits, or what does not and the setting that makes it fit."""
    host = f"host RSS {fit.host_total / GIB:.2f} GiB"
    room = f" of {fit.budget / GIB:.1f} GiB usable" if fit.budget else " (the chip's memory is unknown)"
    if fit.fits:
        worst = max(fit.rows, key=per_chip)
        return f"fits: {fit.peak / GIB:.2f} GiB per chip{room} (largest: {worst['name']}); {host}"
    msgs = []
    if not fit.chips_fit:
        bad = [r for r in fit.rows if r["memory"] is None or per_chip(r) > fit.budget]
        over = ", ".join(f"{r['name']} needs {per_chip(r) / GIB:.2f} GiB" if r["memory"] is not None else
                         f"the compiler refused the {r['name']} ({r['refused']})" for r in bad)
        msg = f"does not fit: {over} per chip{room} ({HEADROOM:.0%} headroom)"
        settings = [f"{k}={v}" for k, v in fit.fitting.items() if k != "calibration.max_blocks"]
        shrinks = {"unit": "calibration.batch_size", "columns": "awq.oc_batch"}
        stuck = [r["name"] for r in bad if shrinks.get(r["kind"]) not in fit.fitting]
        if settings:
            msg += f"; {' and '.join(settings)} fits"
        if stuck:
            msg += (f"; no setting shrinks {', '.join(stuck)} enough (the layer's float32 weights replicated on "
                    f"each chip): use chips with more memory")
        msgs.append(msg)
    if not fit.host_fits:
        msg = f"{host} is more than the host's {fit.host_limit / GIB:.1f} GiB"
        if "calibration.max_blocks" in fit.fitting:
            msg += f"; calibration.max_blocks={fit.fitting['calibration.max_blocks']} fits"
        msgs.append("and " + msg if msgs else msg)
    return "; ".join(msgs) if not fit.chips_fit else "does not fit: " + msgs[0]


def report_dict(fit: PTQFit, cfg: ModelConfig, qcfg: QuantizeConfig, shapes: str, n_blocks: int,
                block_size: int) -> dict:
    """A JSON-able record of a check (docs/ptq.md's scale table is built from these)."""
    return {"target": fit.target, "device_kind": fit.device_kind, "devices": fit.devices, "hbm_bytes": fit.hbm,
            "headroom": HEADROOM, "fits": fit.fits, "chips_fit": fit.chips_fit, "host_fits": fit.host_fits,
            "model": shapes, "layers": cfg.num_layers, "method": qcfg.method, "bits": qcfg.bits,
            "group_size": qcfg.group_size, "calibration_blocks": n_blocks, "block_size": block_size,
            "batch_size": qcfg.calibration.batch_size, "peak_bytes_per_chip": fit.peak,
            "host_bytes": fit.host, "host_total_bytes": fit.host_total, "importance_host_bytes": fit.importance_host,
            "peaks": {"flops": fit.peaks[0], "bandwidth": fit.peaks[1]} if fit.peaks else None,
            "estimate_seconds_per_layer": fit.layer_seconds, "estimate_seconds_per_model": fit.model_seconds,
            "gptq_host_seconds_per_layer": fit.gptq_host_layer_seconds, "gptq_host_rate": fit.gptq_rate,
            "fitting": fit.fitting, "verdict": verdict(fit), "programs": fit.rows}
