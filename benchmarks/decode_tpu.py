"""The rollout engine's decode program compiled for TPU slices (no TPU needed): memory, traffic, a speed bound.

For each case (model preset, topology, decode slots, prompt + new tokens) the engine's decode program is
compiled ahead of time through libtpu (`lrmq.aot.compile_generate`, mesh data=1 x fsdp=8 as the paper-1
recipes) in a fresh process (a case that does not finish in --timeout is recorded as such), and the script
records, per chip:

* memory: XLA's per-chip bytes of the compiled program (arguments, temporaries, total) against HBM;
* HBM bytes per decode step: each chip's share of the weights in the decode layout (`sharding.DECODE_RULES`,
  all of them read every step) plus the KV pages its attention reads at the mean
  context of a rollout (prompt + new / 2 tokens per slot, rounded up to the TPU kernel's blocks, the chip's
  share of the KV heads). Not XLA's `cost_analysis()["bytes accessed"]`: XLA counts each loop body once (the
  decode loop and the layer scan inside it) and a Pallas call as touching its whole operand (the
  layer-flattened pool), so that figure is neither per step nor per layer; it is kept in the JSON as
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


def _case(model, topology, slots, prompt, new, layout="tp", weights="bf16"):
    name = (f"{model}/{topology}/{slots}x{prompt}+{new}" + ("" if layout == "tp" else f"/{layout}")
            + ("" if weights == "bf16" else f"/{weights}"))
    return name, dict(model=model, topology=topology, slots=slots, prompt=prompt, new=new, layout=layout,
                      weights=weights)


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
    import jax.numpy as jnp

    from lrmq import aot, sharding
    from lrmq.generation import engine as engine_mod, paged
    from lrmq.generation.engine import Engine, EngineConfig
    from lrmq.generation.sampling import SamplingConfig
    from lrmq.hlo import Module, decode_loop
    from lrmq.model.presets import preset_config
    from lrmq.sharding import MeshConfig, make_mesh, state_shardings

    if spec["layout"] != "tp":  # the decode layout before: weights whole over the data axes
        sharding.DECODE_RULES = engine_mod.DECODE_RULES = paged.DECODE_RULES = {**sharding.RULES, "embed": None}
    if spec["layout"] == "replicated":
        paged.kv_head_axes = lambda mesh, kv_heads: ()
    DECODE_RULES = sharding.DECODE_RULES
    cfg = preset_config(spec["model"], dtype="bfloat16", param_dtype="bfloat16")
    devices = list(aot.topology_devices(spec["topology"]))
    mesh = make_mesh(MeshConfig(1, len(devices), 1), devices=devices)
    chips, kind = len(devices), devices[0].device_kind
    graphdef, state = aot.abstract_model(cfg, mesh)
    if spec.get("weights", "bf16") != "bf16":  # the trainer's rollout copy of that policy (rollout.quant)
        from flax import nnx

        from lrmq.rl.rollout_copy import RolloutCopy, RolloutQuant

        model = nnx.merge(graphdef, state)
        graphdef, trainable, rest = nnx.split(model, nnx.Param, ...)
        copy = RolloutCopy(graphdef, trainable, rest, RolloutQuant(spec["weights"]), mesh=mesh)
        graphdef, state = copy.graphdef, copy.abstract_states(trainable, rest)
    engine = EngineConfig(slots=spec["slots"])  # the rollout's defaults: 16-token pages, 64 steps per call
    sampling = SamplingConfig(temperature=1.0, top_p=1.0)
    slots, pages, width = Engine(None, eos_ids=(0,), pad_id=0, graphdef=graphdef, model_cfg=cfg, config=engine,
                                 mesh=mesh).sizes(spec["slots"], spec["prompt"], spec["new"])
    out = {**spec, "device_kind": kind, "chips": chips, "pages": pages, "page_table_width": width,
           "page_size": engine.page_size, "hbm_gbps": HBM_GBPS.get(kind)}
    t0 = time.perf_counter()
    try:
        compiled, secs = aot.compile_generate(graphdef, state, mesh, model_cfg=cfg, engine=engine,
                                              requests=spec["slots"], prompt_len=spec["prompt"],
                                              max_new=spec["new"], sampling=sampling, programs=("decode",))["decode"]
    except jax.errors.JaxRuntimeError as e:  # the compiler refuses a program past HBM
        out.update(error=str(e).splitlines()[0][:300], compile_s=time.perf_counter() - t0, fits=False)
        return out
    text = compiled.as_text()
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
    heads = paged.kv_head_axes(mesh, cfg.num_kv_heads)
    head_shards = math.prod(mesh.shape[a] for a in heads) if heads else 1
    # rows each chip attends for: all slots when the KV heads split over every data axis, else its batch share
    row_shards = chips // head_shards
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * 2 // head_shards * cfg.num_layers  # bf16 K+V, all layers
    impl = "tpu" if "ragged_paged_attention" in text else "xla"
    if impl == "tpu":
        blk, _, _ = paged.tpu_block_sizes(kind, q_heads=cfg.num_heads // head_shards,
                                          pool_shape=(cfg.num_layers, pages, engine.page_size,
                                                      2 * cfg.num_kv_heads // head_shards, cfg.head_dim),
                                          dtype=jnp.bfloat16, width=width, slots=slots // row_shards)
        block_tokens = blk * engine.page_size
    else:
        block_tokens = engine.block_pages * engine.page_size
    context = spec["prompt"] + spec["new"] / 2
    read_tokens = math.ceil(context / block_tokens) * block_tokens
    kv_bytes = slots // row_shards * read_tokens * per_token
    step_bytes = weight_bytes + kv_bytes + embed * slots // cfg.vocab_size

    # collectives per decode step
    module = Module(text)
    loop = decode_loop(module)
    colls = [c for part in ("body", "condition") for c in module.collectives(loop.attr(part))]
    by_op: dict[str, int] = {}
    for c in colls:
        by_op[c["op"]] = by_op.get(c["op"], 0) + c["operand_bytes"] * c["times"]
    largest = max(colls, key=lambda c: c["bytes"], default=None)
    gbps = HBM_GBPS.get(kind)
    out.update(
        impl=impl, compile_s=round(secs, 1), memory=mem, hbm_bytes=hbm,
        fits=bool(hbm) and mem["total"] <= hbm * (1 - aot.HEADROOM),
        pool_bytes_per_chip=math.prod((cfg.num_layers, pages, engine.page_size)) * 2 * cfg.num_kv_heads
        * cfg.head_dim * 2 // head_shards, kv_head_axes=list(heads),
        weight_bytes_per_chip=weight_bytes, kv_read_bytes_per_step=kv_bytes, mean_context=context,
        kv_block_tokens=block_tokens, step_hbm_bytes=step_bytes,
        step_interconnect_bytes=sum(by_op.values()), interconnect_by_op=by_op,
        collectives_in_loop=len(colls), unknown_trip_counts=any(c.get("unknown_trips") for c in colls),
        largest_collective_in_loop=None if largest is None else {k: largest[k] for k in ("op", "bytes", "shapes")},
        tokens_per_s_per_chip=None if not gbps else slots / chips * gbps * 1e9 / step_bytes,
        xla_bytes_accessed=cost.get("bytes accessed"), xla_flops=cost.get("flops"))
    return out


def run_case(name: str, timeout: float) -> dict:
    t0 = time.time()
    load = os.getloadavg()[0]
    try:
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(CASES[name])], cwd=REPO,
                           capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1"))
    except subprocess.TimeoutExpired:
        return {**CASES[name], "error": f"did not finish within {timeout:.0f} s", "wall_s": time.time() - t0,
                "load_at_start": load, "commit": source_commit()}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        res = {**CASES[name], "error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
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
