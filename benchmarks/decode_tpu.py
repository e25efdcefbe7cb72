"""The rollout engine's decode program compiled for TPU slices (no TPU needed): memory, traffic, a speed bound.

For each case (model preset, topology, decode slots, prompt + new tokens) the engine's decode program is
compiled ahead of time through libtpu (`lrmq.aot.compile_generate`, mesh data=1 x fsdp=8 as the paper-1
recipes) in a fresh process (a case that does not finish in --timeout is recorded as such), and the script
records, per chip:

* memory: XLA's per-chip bytes of the compiled program (arguments, temporaries, total) against HBM;
* HBM bytes per decode step: each chip's share of the weights in the decode layout (`sharding.DECODE_RULES`,
  all of them read every step) plus the KV pages its attention reads at the mean
  context of a rollout (prompt + new / 2 tokens per slot, rounded up to the TPU kernel's blocks, the chip's
  share of the KV heads), at the bytes per token of the compiled program's pool argument (its input sharding and
  dtype: bf16, or fp8 / int8 pages with their scales in the cases of benchmarks/kv_cache_tpu.py), plus
  whole-pool copies XLA put in the compiled decode loop (and, amortized over a call, around it) and gathered
  blocks it keeps in HBM, each a write and a read. Not XLA's `cost_analysis()["bytes accessed"]`: XLA counts each
  loop body once (the decode loop and the layer scan inside it) and a Pallas call as touching its whole operand
  (the layer-flattened pool), so that figure is neither per step nor per layer; it is kept in the JSON as
  `xla_bytes_accessed` for reference;
* interconnect bytes per decode step: the operands of every collective in the decode loop's body and
  condition (lrmq.hlo), layer-scan bodies counted once per layer;
* the memory-bound decode rate: (slots / chips) tokens per step at HBM bandwidth / bytes per step, against
  the chips' published HBM bandwidth (v5e 819 GB/s, v5p 2765 GB/s, v6e 1640 GB/s). An upper bound: it
  ignores compute, the interconnect, the host between device calls and the kernel's own efficiency.

    python benchmarks/decode_tpu.py --out docs/figures/decode_tpu.json                 # every case (resumable)
    python benchmarks/decode_tpu.py --out F --only qwen3-0.6b/v5e:2x4/256x512+512      # one case
    python benchmarks/decode_tpu.py --out F --table                                    # the markdown table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

from common import REPO, machine_info, md_table, source_commit, write_json

HBM_GBPS = {"TPU v5 lite": 819, "TPU v5": 2765, "TPU v6 lite": 1640}


def _case(model, topology, slots, prompt, new, layout="tp", weights="bf16", kv_cache="auto", impl="auto", mesh=None,
          prefill=False):
    name = (f"{model}/{topology}/{slots}x{prompt}+{new}" + ("" if layout == "tp" else f"/{layout}")
            + ("" if weights == "bf16" else f"/{weights}") + ("" if kv_cache == "auto" else f"/kv={kv_cache}")
            + ("" if impl == "auto" else f"/{impl}") + ("" if mesh is None else f"/mesh={mesh[0]}x{mesh[1]}"))
    spec = dict(model=model, topology=topology, slots=slots, prompt=prompt, new=new, layout=layout, weights=weights)
    # benchmarks/kv_cache_tpu.py: the KV pages' format (EngineConfig.kv_cache), a forced decode attention (Engine's
    # impl), a mesh (data, fsdp) other than data=1 x fsdp=all, and the prefill program compiled too
    spec.update({k: v for k, v in dict(kv_cache=kv_cache, impl=impl, mesh=mesh, prefill=prefill).items()
                 if v not in ("auto", None, False)})
    return name, spec


# Decode layouts: "tp" (lrmq's: tensor parallel over the fsdp axis, the pool's KV heads split alike);
# "weights-replicated" (the decode layout before: every weight whole on every chip; the pool split over KV
# heads); "replicated" (weights and pool whole on every chip: the engine as it was before this work).
LAYOUTS = ("tp", "weights-replicated", "replicated")

# paper-1 rollouts: Qwen3-0.6B 32 prompts x 8 samples of 512 + 512 tokens on v5e-8 (1024 and 4096 new tokens for
# longer reasoning; 64 slots of 4096), Qwen3-8B 32 x 8 of 512 + 1024 on v6e-8 (and on v5e-8).
CASES = dict([
    _case("qwen3-0.6b", "v5e:2x4", 256, 512, 512),
    _case("qwen3-0.6b", "v5e:2x4", 256, 512, 512, layout="weights-replicated"),
    _case("qwen3-0.6b", "v5e:2x4", 256, 512, 512, layout="replicated"),
    _case("qwen3-0.6b", "v5e:2x4", 256, 512, 1024),
    _case("qwen3-0.6b", "v5e:2x4", 256, 512, 4096),
    _case("qwen3-0.6b", "v5e:2x4", 128, 512, 4096),
    _case("qwen3-0.6b", "v5e:2x4", 64, 512, 4096),
    _case("qwen3-0.6b", "v6e:2x4", 256, 512, 512),
    _case("qwen3-0.6b", "v6e:2x4", 256, 512, 1024),
    _case("qwen3-0.6b", "v6e:2x4", 256, 512, 4096),
    _case("qwen3-8b", "v6e:2x4", 256, 512, 1024),
    _case("qwen3-8b", "v6e:2x4", 256, 512, 1024, layout="replicated"),
    _case("qwen3-8b", "v5e:2x4", 256, 512, 1024),
    # quantized rollouts (rollout.quant): the decode program on the packed copy the trainer samples from
    # (`RolloutCopy`, group 128; NF4 block 64), against the bf16 rows above
    *[_case(m, t, 256, 512, 1024, weights=w) for m, t in (("qwen3-0.6b", "v5e:2x4"), ("qwen3-8b", "v6e:2x4"),
                                                         ("qwen3-8b", "v5e:2x4"))
      for w in ("int8", "int4", "nf4")],
    # a smaller batch (one prompt's 32 samples per call): the weights, not the KV pages, dominate a step's bytes
    *[_case("qwen3-8b", "v6e:2x4", 32, 512, 1024, weights=w) for w in ("bf16", "int4")],
])


def measure(spec: dict) -> dict:
    """Compile one case's decode program and measure it (runs in the child process)."""
    import jax

    from lrmq import aot, sharding
    from lrmq.generation import attention, kv_pool
    from lrmq.generation import engine as engine_mod
    from lrmq.generation.attention import tpu as attn_tpu
    from lrmq.generation.kv_format import KVFormat
    from lrmq.generation.engine import Engine, EngineConfig
    from lrmq.generation.sampling import SamplingConfig
    from lrmq.hlo import Module, array_shapes, decode_loop
    from lrmq.model.presets import preset_config
    from lrmq.sharding import MeshConfig, make_mesh, state_shardings

    if spec["layout"] != "tp":  # the decode layout before: weights whole over the data axes
        sharding.DECODE_RULES = engine_mod.DECODE_RULES = kv_pool.DECODE_RULES = {**sharding.RULES, "embed": None}
    if spec["layout"] == "replicated":
        kv_pool.kv_head_axes = attention.kv_head_axes = lambda mesh, kv_heads: ()
    DECODE_RULES = sharding.DECODE_RULES
    cfg = preset_config(spec["model"], dtype="bfloat16", param_dtype="bfloat16")
    devices = list(aot.topology_devices(spec["topology"]))
    data, fsdp = spec.get("mesh") or (1, len(devices))
    mesh = make_mesh(MeshConfig(data, fsdp, 1), devices=devices)
    chips, kind = len(devices), devices[0].device_kind
    graphdef, state = aot.abstract_model(cfg, mesh)
    if spec.get("weights", "bf16") != "bf16":  # the trainer's rollout copy of that policy (rollout.quant)
        from flax import nnx

        from lrmq.rl.rollout_copy import RolloutCopy, RolloutQuant

        model = nnx.merge(graphdef, state)
        graphdef, trainable, rest = nnx.split(model, nnx.Param, ...)
        copy = RolloutCopy(graphdef, trainable, rest, RolloutQuant(spec["weights"]), mesh=mesh)
        graphdef, state = copy.graphdef, copy.abstract_states(trainable, rest)
    kv_cache = spec.get("kv_cache", "auto")
    # the rollout's defaults: 16-token pages, 64 steps per call
    engine = EngineConfig(slots=spec["slots"], kv_cache=kv_cache, attention=spec.get("impl", "auto"))
    sampling = SamplingConfig(temperature=1.0, top_p=1.0)
    eng = Engine(None, eos_ids=(0,), pad_id=0, graphdef=graphdef, model_cfg=cfg, config=engine, mesh=mesh)
    slots, pages, width = eng.sizes(spec["slots"], spec["prompt"], spec["new"])
    out = {**spec, "device_kind": kind, "chips": chips, "pages": pages, "page_table_width": width,
           "page_size": engine.page_size, "hbm_gbps": HBM_GBPS.get(kind)}
    t0 = time.perf_counter()
    try:  # what aot.compile_generate compiles (its decode program), keeping the abstract pool it was given
        calls = eng.abstract_calls(state, n_requests=spec["slots"], prompt_len=spec["prompt"], max_new=spec["new"],
                                   sampling=sampling, mesh=mesh)
        if spec.get("prefill"):  # the largest prefill (every slot's prompt at once) must fit too
            pre_fn, pre_args = calls["prefill"]
            out["prefill"] = aot.program_row("prefill", lambda: aot._compile(pre_fn, *pre_args, mesh=mesh))
        fn, args = calls["decode"]
        compiled, secs = aot._compile(fn, *args, mesh=mesh)
    except jax.errors.JaxRuntimeError as e:  # the compiler refuses a program past HBM
        out.update(error=str(e).splitlines()[0][:300], compile_s=time.perf_counter() - t0, fits=False)
        return out
    text = compiled.as_text()
    if os.environ.get("DECODE_TPU_HLO"):  # keep the compiled program's text (debugging the parsers below)
        with open(os.environ["DECODE_TPU_HLO"], "w") as f:
            f.write(text)
    mem = aot.memory_report(compiled)
    hbm = aot.hbm_bytes(devices[0])
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}

    # HBM bytes one decode step reads per chip
    shardings = jax.tree.leaves(state_shardings(state, mesh, DECODE_RULES))
    leaves = jax.tree_util.tree_leaves_with_path(state)
    assert len(shardings) == len(leaves), (len(shardings), len(leaves))
    weights = {jax.tree_util.keystr(path): math.prod(sh.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for (path, leaf), sh in zip(leaves, shardings)}
    embed = 0
    if not cfg.tie_word_embeddings:  # the embedding is looked up (one row per slot), not read whole
        embed = sum(weights.pop(k) for k in [k for k in weights if "embedding" in k])
    weight_bytes = sum(weights.values())
    heads = kv_pool.kv_head_axes(mesh, cfg.num_kv_heads)
    head_shards = math.prod(mesh.shape[a] for a in heads) if heads else 1
    # rows each chip attends for: all slots when the KV heads split over every data axis, else its batch share
    row_shards = chips // head_shards
    # the formula (bf16 K+V, all layers), kept to check the compiled pool's bytes per token against
    per_token_formula = 2 * cfg.num_kv_heads * cfg.head_dim * 2 // head_shards * cfg.num_layers
    # the compiled program's pool argument on each chip (its input sharding, its dtypes): the leaves with a page
    # axis (the pages, and int8's per-token scale pages) per token held, and the per-head scales (read whole)
    pool_chip = pool_leaf_bytes(args[1], compiled)
    # the pool's pages split over the data groups (each chip holds its group's pages/groups: `kv_pool.kv_page_axes`)
    groups = kv_pool.kv_groups(mesh, cfg.num_kv_heads)
    per_token = sum(b for b, per_page in pool_chip if per_page) * groups / (pages * engine.page_size)
    scale_bytes = sum(b for b, per_page in pool_chip if not per_page)
    impl = "tpu" if "ragged_paged_attention" in text else "xla"
    pool_dtype = KVFormat(kv_cache).dtype(cfg)
    if impl == "tpu":
        blk, _, _ = attn_tpu.tpu_block_sizes(kind, q_heads=cfg.num_heads // head_shards,
                                          pool_shape=(cfg.num_layers, pages, engine.page_size,
                                                      2 * cfg.num_kv_heads // head_shards, cfg.head_dim),
                                          dtype=pool_dtype, width=width, slots=slots // row_shards)
        block_tokens = blk * engine.page_size
    else:
        block_tokens = engine.block_pages * engine.page_size
    context = spec["prompt"] + spec["new"] / 2
    read_tokens = math.ceil(context / block_tokens) * block_tokens
    kv_bytes = int(slots // row_shards * read_tokens * per_token) + scale_bytes
    step_bytes = weight_bytes + kv_bytes + embed * slots // cfg.vocab_size

    # collectives per decode step
    module = Module(text)
    loop = decode_loop(module)
    kernel_pages = kernel_pool_operands(module, engine.page_size, 2 * cfg.num_kv_heads // head_shards, cfg.head_dim)
    # whole-pool relayouts inside the decode loop (each reads and writes the chip's pool): HBM traffic of the step
    chip_pool = (cfg.num_layers, pages // groups, engine.page_size, 2 * cfg.num_kv_heads // head_shards, cfg.head_dim)
    copies = pool_copies(module, loop, chip_pool)
    pages_leaf = max((b for b, per_page in pool_chip if per_page), default=0)
    copy_bytes = sum(2 * pages_leaf * c["times"] for c in copies)
    # and before / after the loop (the entry computation: once per device call of up to sync_steps steps)
    call_copies = [{"name": i.name, "type": i.type.split("{")[0]} for i in module.computations[module.entry]
                   if i.op in ("copy", "copy-start") and chip_pool in array_shapes(i.type)]
    copy_bytes += 2 * pages_leaf * len(call_copies) // engine.sync_steps
    # the XLA path's gathered blocks of pages, when kept in HBM (each written, then read)
    gathered = hbm_gathers(module, loop, unknown_trips=math.ceil(read_tokens / block_tokens))
    gather_bytes = sum(2 * g["bytes"] * g["times"] for g in gathered)
    step_bytes += copy_bytes + gather_bytes
    colls = [c for part in ("body", "condition") for c in module.collectives(loop.attr(part))]
    by_op: dict[str, int] = {}
    for c in colls:
        by_op[c["op"]] = by_op.get(c["op"], 0) + c["operand_bytes"] * c["times"]
    largest = max(colls, key=lambda c: c["bytes"], default=None)
    gbps = HBM_GBPS.get(kind)
    out.update(
        impl=impl, compile_s=round(secs, 1), memory=mem, hbm_bytes=hbm,
        fits=bool(hbm) and mem["total"] <= hbm * (1 - aot.HEADROOM),
        pool_bytes_per_chip=sum(b for b, _ in pool_chip), kv_head_axes=list(heads), kv_groups=groups,
        kv_cache=kv_cache, kv_bytes_per_token_per_chip=per_token, kv_bf16_formula_bytes_per_token=per_token_formula,
        kv_scale_bytes_per_chip=scale_bytes, kernel_pool_operands=kernel_pages, pool_copies_per_step=copies,
        pool_copy_bytes_per_step=copy_bytes, pool_copies_per_call=call_copies, sync_steps=engine.sync_steps,
        hbm_gathers_per_step=gathered, hbm_gather_bytes_per_step=gather_bytes,
        weight_bytes_per_chip=weight_bytes, kv_read_bytes_per_step=kv_bytes, mean_context=context,
        kv_block_tokens=block_tokens, step_hbm_bytes=step_bytes,
        step_interconnect_bytes=sum(by_op.values()), interconnect_by_op=by_op,
        collectives_in_loop=len(colls), unknown_trip_counts=any(c.get("unknown_trips") for c in colls),
        largest_collective_in_loop=None if largest is None else {k: largest[k] for k in ("op", "bytes", "shapes")},
        tokens_per_s_per_chip=None if not gbps else slots / chips * gbps * 1e9 / step_bytes,
        **({"fits_with_prefill": bool(hbm) and mem["total"] <= hbm * (1 - aot.HEADROOM)
            and out["prefill"]["memory"] is not None and aot.row_total(out["prefill"]) <= hbm * (1 - aot.HEADROOM)}
           if "prefill" in out else {}),
        xla_bytes_accessed=cost.get("bytes accessed"), xla_flops=cost.get("flops"))
    return out


def pool_leaf_bytes(pool, compiled) -> list[tuple[int, bool]]:
    """(bytes on one chip, has a page axis) of each leaf of the decode program's pool argument (argument 1), from
    the compiled program's input shardings (the abstract pool's own where jax does not give them per argument)."""
    import jax

    leaves = jax.tree.leaves(pool)
    try:
        shardings = jax.tree.leaves(compiled.input_shardings[0][1])
    except (TypeError, IndexError, KeyError):  # pragma: no cover - another jax's layout of input_shardings
        shardings = []
    if len(shardings) != len(leaves):
        shardings = [leaf.sharding for leaf in leaves]
    return [(math.prod(sh.shard_shape(leaf.shape)) * leaf.dtype.itemsize, leaf.ndim >= 4)
            for leaf, sh in zip(leaves, shardings)]


def kernel_pool_operands(module, page_size: int, combined: int, head_dim: int) -> list[str]:
    """The distinct pool operands (type as printed, e.g. "f8e4m3fn[7168,16,4,128]") of the compiled program's Mosaic
    calls: arrays [layers * pages, page_size, 2 * kv_heads per chip, head_dim], the layer-flattened pool the TPU
    kernel reads in place. Shows the dtype the kernel reads (fp8 pages, not a bf16 copy); [] on the XLA path."""
    from lrmq.hlo import _ARRAY

    types = {i.name: i.type for ins in module.computations.values() for i in ins}
    found = set()
    for ins in (i for c in module.computations.values() for i in c):
        if ins.op != "custom-call" or 'custom_call_target="tpu_custom_call"' not in ins.line:
            continue
        names = re.findall(r"%([\w.\-]+)", ins.line.split("custom-call(", 1)[1].split(")", 1)[0])
        for name in names:
            for dtype, dims in _ARRAY.findall(types.get(name, "")):
                shape = tuple(int(d) for d in dims.split(",") if d)
                if len(shape) == 4 and shape[1:] == (page_size, combined, head_dim):
                    found.add(f"{dtype}[{dims}]")
    return sorted(found)


def _step_instructions(module, loop, unknown_trips: int = 1, into: tuple[str, ...] | None = None):
    """(instruction, times) of what one decode step runs: the loop's body, nested loops (the layer scan, the XLA
    path's loop over blocks of pages) counted trip-count times, or `unknown_trips` times where the trip count is
    unknown; `into`: the ops whose callees are walked too (None: every op's, fusions included)."""
    def walk(comp, times, seen):
        if comp in seen or comp not in module.computations:
            return
        seen = seen | {comp}
        for ins in module.computations[comp]:
            if ins.op == "while":
                trips = module.trip_count(ins) or unknown_trips
                for part in ("body", "condition"):
                    yield from walk(ins.attr(part), times * trips, seen)
                continue
            yield ins, times
            if into is None or ins.op in into:
                for callee in ins.callees:
                    yield from walk(callee, times, seen)

    yield from walk(loop.attr("body"), 1, frozenset())


def pool_copies(module, loop, shape: tuple[int, ...]) -> list[dict]:
    """Copies of a whole pool-shaped array (the chip's `shape`: pages, or a scale-page array) that one decode step
    runs (`_step_instructions`, loops of unknown length once): a relayout XLA inserted, each reading and writing
    the whole array. [{"name", "type", "times"}]."""
    from lrmq.hlo import array_shapes

    return [{"name": ins.name, "type": ins.type.split("{")[0], "times": times}
            for ins, times in _step_instructions(module, loop)
            if ins.op in ("copy", "copy-start") and shape in array_shapes(ins.type)]


def hbm_gathers(module, loop, unknown_trips: int) -> list[dict]:
    """Gathers (a gather, or a fusion holding one) of 1 MiB or more that one decode step runs with the result in
    HBM (its layout not in memory space S(1), VMEM): the XLA attention path's blocks of pages when XLA does not keep
    them on chip; each is written, then read. Loops with an unknown trip count (the XLA path's loop over blocks
    of pages, as long as the longest live row) are counted `unknown_trips` times. [{"name", "type", "bytes",
    "times"}]."""
    from lrmq.hlo import array_bytes

    out = []
    for ins, times in _step_instructions(module, loop, unknown_trips, into=("call", "conditional", "async-start")):
        gathers = ins.op == "gather" or (ins.op == "fusion" and any(
            i.op == "gather" for c in ins.callees for i in module.computations.get(c, [])))
        size = sum(array_bytes(ins.type))
        if gathers and size >= 2 ** 20 and "S(1)" not in ins.type:
            out.append({"name": ins.name, "type": ins.type.split("{")[0], "bytes": size, "times": times})
    return out


def run_case(name: str, timeout: float, spec: dict | None = None) -> dict:
    spec = CASES[name] if spec is None else spec
    t0 = time.time()
    load = os.getloadavg()[0]
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], cwd=REPO,
                           capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1"))
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"did not finish within {timeout:.0f} s", "wall_s": time.time() - t0,
                "load_at_start": load, "commit": source_commit()}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        err = p.stderr.strip().splitlines() or ["?"]
        # the exception's own line (JAX prints a note on its filtered frames after it)
        res = {**spec, "error": next((ln for ln in reversed(err) if re.match(r"[\w.]+(Error|Exception): ", ln)),
                                     err[-1])[:300]}
    else:
        res = json.loads(lines[-1])
    return {**res, "wall_s": round(time.time() - t0, 1), "load_at_start": round(load, 1), "commit": source_commit()}


def table(results: dict) -> str:
    gib = lambda b: b / 2 ** 30  # noqa: E731
    mib = lambda b: b / 2 ** 20  # noqa: E731
    rows = []
    order = [n for n in CASES if n in results] + [n for n in results if n not in CASES]
    for name in order:
        r = results[name]
        if "error" in r:
            m = re.search(r"temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", r["error"])
            why = f"compiler: {m.group(1)} of temporaries > {m.group(2)} HBM" if m else r["error"][:90]
            rows.append([r["model"], r["topology"], r["slots"], f"{r['prompt']}+{r['new']}", r["layout"],
                         r.get("weights", "bf16"), "-", "-", why,
                         "no" if "RESOURCE_EXHAUSTED" in r["error"] else "-", "-", "-", "-", "-"])
            continue
        m = r["memory"]
        rows.append([r["model"], r["topology"], r["slots"], f"{r['prompt']}+{r['new']}", r["layout"],
                     r.get("weights", "bf16"), mib(r["weight_bytes_per_chip"]), gib(r["pool_bytes_per_chip"]),
                     f"{gib(m['total']):.2f} of {gib(r['hbm_bytes']):.0f}",
                     "yes" if r["fits"] else "no", mib(r["step_hbm_bytes"]), mib(r["step_interconnect_bytes"]),
                     r["tokens_per_s_per_chip"], f"{r['compile_s']:.0f}"])
    return md_table(["model", "topology", "slots", "prompt+new", "layout", "weights", "weights MiB/chip",
                     "pool GiB/chip", "decode GiB/chip",
                     "fits (10% headroom)", "HBM MiB/step/chip", "interconnect MiB/step", "tok/s/chip bound",
                     "compile s"], rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "figures", "decode_tpu.json"))
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--redo", action="store_true")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(json.loads(args.child)), default=float))
        return
    data = json.load(open(args.out)) if os.path.exists(args.out) else {"results": {}}
    if args.table:
        print(table(data["results"]))
        return
    data["machine"] = machine_info()
    for name in CASES:
        if (args.only and name not in args.only) or (name in data["results"] and not args.redo):
            continue
        print(f"compiling {name} ...", flush=True)
        data["results"][name] = run_case(name, args.timeout)
        r = data["results"][name]
        print(json.dumps({k: r.get(k) for k in ("fits", "error", "compile_s", "step_hbm_bytes",
                                                 "step_interconnect_bytes", "tokens_per_s_per_chip")}), flush=True)
        write_json(args.out, data)
    print(table(data["results"]))


if __name__ == "__main__":
    main()
