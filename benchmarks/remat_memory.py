"""What `model.remat` saves: the GRPO train step compiled ahead of time with remat none / dots / full, and
its per-device memory (arguments, temporaries, total) from XLA's memory analysis. Nothing runs.

Default: the 100M Qwen3-shaped config of benchmarks/grpo_step.py on this machine's CPU (seconds per
compile). With --config / --topology: any train config for any TPU topology, compiled through libtpu
without a TPU (docs/tpu.md), e.g. the paper's Qwen3-0.6B recipe on one v5e-8 slice:

    .venv/bin/python benchmarks/remat_memory.py --out docs/figures/remat_memory.json
    .venv/bin/python benchmarks/remat_memory.py --config configs/paper1/qwen3_0.6b_grpo.yaml --topology v5e:2x4
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MODES = ("none", "dots", "full")


def cpu_100m_config():
    from lrmq.configlib import config_from_dict
    from lrmq.rl.config import TrainConfig

    import grpo_step

    return config_from_dict(TrainConfig, {
        "model": {"checkpoint": "none", "shapes": "", "dtype": "float32", "param_dtype": "float32"},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_prompt_len": 64, "max_new_tokens": 256},
    }, source="benchmarks/remat_memory.py"), dict(grpo_step.ARCH_100M)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="a train config (default: the 100M CPU config)")
    ap.add_argument("--topology", help="TPU topology to compile for, e.g. v5e:2x4 (default: this machine's CPU)")
    ap.add_argument("--micro-batch", type=int, help="optim.micro_batch_size override")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax

    from lrmq import aot
    from lrmq.configlib import load_config
    from lrmq.model.config import ModelConfig
    from lrmq.rl.config import TrainConfig
    from lrmq.sharding import MeshConfig, make_mesh

    if args.config:
        cfg, arch = load_config(TrainConfig, args.config), None
    else:
        cfg, arch = cpu_100m_config()
    if args.micro_batch:
        cfg.optim.micro_batch_size = args.micro_batch
    devices = aot.topology_devices(args.topology) if args.topology else jax.devices()[:1]
    mesh = make_mesh(MeshConfig(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) if args.topology else
                     MeshConfig(1, 1, 1), devices=devices)
    if arch is not None:  # the 100M shapes with the tiny model's vocabulary, as benchmarks/grpo_step.py
        import grpo_step

        b = grpo_step._build_tools()
        base = ModelConfig.from_hf_dict(dict(b.BASE_CONFIG, **arch, vocab_size=320))
        model_config = lambda _cfg: base
    else:
        model_config = aot.model_config
    info = common.machine_info()
    print(common.machine_str(info), f"target: {args.topology or 'cpu'}", flush=True)
    rows = []
    for mode in args.modes.split(","):
        c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=mode))
        mcfg = model_config(c)
        run = aot.abstract_run(c, mesh, mcfg)
        compiled, secs = aot.compile_train_step(run)
        mem = aot.memory_report(compiled)
        rows.append({"remat": mode, "memory": mem, "seconds": secs, "flops": aot._flops(compiled)})
        print(f"remat {mode:5s}: total {mem['total'] / aot.GIB:.3f} GiB (temporaries {mem['temporaries'] / aot.GIB:.3f},"
              f" arguments {mem['arguments'] / aot.GIB:.3f}) per device, {rows[-1]['flops'] / 1e12:.2f} TFLOP; "
              f"compiled in {secs:.1f} s", flush=True)
    base = next((r for r in rows if r["remat"] == "none"), None)
    if base:
        for r in rows:
            r["total_vs_none"] = r["memory"]["total"] / base["memory"]["total"]
            r["temporaries_vs_none"] = r["memory"]["temporaries"] / max(base["memory"]["temporaries"], 1)
    s = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    common.write_json(args.out, {
        "benchmark": "remat_memory", "machine": info, "target": args.topology or "cpu",
        "config": args.config or "100M Qwen3-shaped (benchmarks/grpo_step.py ARCH_100M), f32",
        "sequences": s, "micro_batch": cfg.optim.micro_batch_size or s,
        "tokens_per_sequence": cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens, "rows": rows})
    print(common.md_table(["remat", "total GiB", "temporaries GiB", "vs none"],
                          [[r["remat"], f"{r['memory']['total'] / aot.GIB:.3f}",
                            f"{r['memory']['temporaries'] / aot.GIB:.3f}", f"{r.get('total_vs_none', 1):.2f}x"]
                           for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
