"""Rollouts from a quantized copy of the policy on CPU (`rollout.quant`): time against the float policy.

Decoding on an accelerator is memory-bound, and an int4 copy reads about a quarter of bf16's weight bytes per
token (`benchmarks/decode_tpu.py` has those figures, compiled for TPU). On CPU the packed Linears go through the
XLA dequant path: the codes are unpacked and scaled back to float inside every decode step, which is extra work
that a CPU, with its large caches and small batch, need not win back. This script measures it as it is.

The model is the decode-cost model (hidden 512, 8 layers, 8 heads, 4 KV heads, head_dim 64, MLP 1536, vocab
4096, random float32 weights), 16 prompts of 16 tokens, greedy, every sequence running the full `--new` tokens
(no stop token), through the paged engine as the trainer's rollout does. Contenders: the float policy, and the
`RolloutCopy` the trainer builds for rollout.quant = int8 / int4 (group 128) / nf4 (block 64). Per round each
contender generates once, in an order rotated each round; the figure is the median over rounds and the ratio
to float is the median of the per-round ratios. Also recorded: the copy's refresh time (re-quantization, one
jitted program, warm), its packed bytes against the float Linears' bytes, and how many greedy tokens equal
the float policy's.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/rollout_quant.py --out docs/figures/rollout_quant_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from decode_cost import ARCH, model_config  # noqa: E402  (the same model)

FORMATS = ("int8", "int4", "nf4")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    threads = common.set_threads(args.threads)
    import jax
    import numpy as np
    from flax import nnx

    from lrmq.generation.engine import Engine, EngineConfig
    from lrmq.generation.sampling import SamplingConfig
    from lrmq.model.decoder import Decoder
    from lrmq.rl.rollout_copy import RolloutCopy, RolloutQuant

    cfg = model_config(16 + args.new + 128)
    model = Decoder(cfg, nnx.Rngs(0))
    graphdef, trainable, rest = nnx.split(model, nnx.Param, ...)
    prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (args.batch, 16)).tolist()
    greedy = SamplingConfig(greedy=True)
    engine_cfg = EngineConfig(slots=args.batch)

    contenders = {"float": (Engine(None, eos_ids=[cfg.vocab_size], pad_id=0, graphdef=graphdef, model_cfg=cfg,
                                   config=engine_cfg), (trainable, rest))}
    copies, refresh_s, nbytes = {}, {}, {}
    linear_bytes = None
    for fmt in FORMATS:
        copy = RolloutCopy(graphdef, trainable, rest, RolloutQuant(fmt, group_size=128))
        copy.refresh(trainable, rest)  # compiles
        refresh_s[fmt] = min(copy.refresh(trainable, rest) for _ in range(3))
        nbytes[fmt] = copy.weight_bytes(trainable, rest)
        copies[fmt] = copy
        contenders[fmt] = (Engine(None, eos_ids=[cfg.vocab_size], pad_id=0, graphdef=copy.graphdef, model_cfg=cfg,
                                  config=engine_cfg), copy.states(trainable, rest))
    total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((trainable, rest)))
    linear_bytes = total - nbytes["int4"]["shared"]  # the float bytes the packed copy replaces

    def run(name):
        engine, states = contenders[name]
        t0 = time.perf_counter()
        out = engine.generate(states, prompts, max_new_tokens=args.new, sampling=greedy)
        return time.perf_counter() - t0, out

    ref = {name: run(name)[1] for name in contenders}  # compiles; the outputs for the agreement figure
    names = list(contenders)
    times = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            times[n].append(run(n)[0])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names), flush=True)
    tokens = args.batch * args.new
    float_tokens = np.asarray(ref["float"].tokens)
    figures = {}
    for n in names:
        ratios = [f / t for f, t in zip(times["float"], times[n])]
        figures[n] = {"seconds_median": statistics.median(times[n]), "seconds": times[n],
                      "tokens_per_s": tokens / statistics.median(times[n]),
                      "speed_vs_float_median": statistics.median(ratios),
                      "greedy_tokens_equal_to_float": float(np.mean(np.asarray(ref[n].tokens) == float_tokens))}
        if n != "float":
            figures[n].update(refresh_s=refresh_s[n], packed_bytes=nbytes[n]["packed"],
                              packed_vs_float_linears=nbytes[n]["packed"] / linear_bytes)
    rows = [[n, f"{figures[n]['seconds_median']:.2f}", f"{figures[n]['tokens_per_s']:.0f}",
             f"{figures[n]['speed_vs_float_median']:.2f}x",
             "" if n == "float" else f"{figures[n]['packed_vs_float_linears']:.3f}",
             "" if n == "float" else f"{figures[n]['refresh_s'] * 1e3:.0f}",
             f"{figures[n]['greedy_tokens_equal_to_float']:.3f}"] for n in names]
    print(common.md_table(["rollout weights", "s per rollout", "tokens/s", "speed vs float",
                           "Linear bytes vs float", "refresh ms", "greedy tokens = float's"], rows))
    common.write_json(args.out, {
        "benchmark": "rollout_quant_cpu", "machine": common.machine_info(threads), "commit": common.source_commit(),
        "model": ARCH, "dtype": "float32", "batch": args.batch, "prompt_len": 16, "new_tokens": args.new,
        "rounds": args.rounds, "float_linear_bytes": linear_bytes, "results": figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
