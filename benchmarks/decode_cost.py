"""Per-step decode cost against the allowed completion length, at the same live length.

The dense engine lrmq had before read its whole preallocated cache on every step: 21.5 ms per step with 128
new tokens allowed, 54.1 ms with 512 (issue 24's measurement, 8-layer Qwen3-shaped model, batch 16). The paged
engine reads each row's live pages only. Here the same model (hidden 512, 8 heads, 4 KV heads, head_dim 64,
8 layers, random weights, float32, greedy, 16-token prompts, batch 16) decodes with the engine's page table
and KV pool sized for 512 ... 8,192 allowed new tokens (`Engine.generate(new_capacity=...)`), every sequence
stopping at `--long` tokens (default 160). A step's cost is (time for --long tokens - time for --short tokens
(32)) / (long - short), best of `--repeats`, the sizes interleaved in each round; compiles happen in a warmup
call. The difference removes what a call pays once (prefill, and the KV pool, which a call allocates whole:
`call_s_short` records that part, which does grow with the allowed length); 128 steps keep the difference well
above the timer noise of two runs of a few seconds.

    .venv/bin/python benchmarks/decode_cost.py --out docs/figures/decode_cost.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ARCH = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
            intermediate_size=1536, vocab_size=4096)


def model_config(max_positions: int):
    """The ARCH model as an lrmq ModelConfig (Qwen3 layers, tied embeddings, float32)."""
    from lrmq.model.presets import preset_config

    return dataclasses.replace(
        preset_config("qwen3-0.6b", dtype="float32"), num_layers=ARCH["num_hidden_layers"],
        layer_types=("full_attention",) * ARCH["num_hidden_layers"], hidden_size=ARCH["hidden_size"],
        intermediate_size=ARCH["intermediate_size"], num_heads=ARCH["num_attention_heads"],
        num_kv_heads=ARCH["num_key_value_heads"], head_dim=ARCH["head_dim"], vocab_size=ARCH["vocab_size"],
        max_position_embeddings=max_positions, tie_word_embeddings=True, param_dtype="float32")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--allowed", default="512,1024,2048,4096,8192")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--long", type=int, default=160)
    args = ap.parse_args(argv)
    threads = common.set_threads(args.threads)
    import numpy as np
    from flax import nnx

    from lrmq.generation.engine import Engine, EngineConfig
    from lrmq.generation.sampling import SamplingConfig
    from lrmq.model.decoder import Decoder

    allowed = [int(a) for a in args.allowed.split(",")]
    cfg = model_config(16 + max(allowed) + max(128, args.long))
    model = Decoder(cfg, nnx.Rngs(0))
    state = nnx.state(model)
    prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (args.batch, 16)).tolist()
    greedy = SamplingConfig(greedy=True)
    engines = {a: Engine(model, eos_ids=[cfg.vocab_size], pad_id=0, config=EngineConfig(slots=args.batch))
               for a in allowed}

    def run(a: int, n: int) -> float:
        t0 = time.perf_counter()
        engines[a].generate(state, prompts, max_new_tokens=n, sampling=greedy, new_capacity=a)
        return time.perf_counter() - t0

    lens = (args.short, args.long)
    for a in allowed:  # compiles (the row buckets the shrinking tail would use never come up: all stop together)
        for n in lens:
            run(a, n)
    times = {a: {n: [] for n in lens} for a in allowed}
    for _ in range(args.repeats):
        for a in allowed:
            for n in lens:
                times[a][n].append(run(a, n))
    per_step = {a: (min(times[a][args.long]) - min(times[a][args.short])) / (args.long - args.short) for a in allowed}
    base = per_step[allowed[0]]
    rows = [[a, engines[a].sizes(args.batch, 16, a)[1], f"{per_step[a] * 1e3:.2f}", f"{per_step[a] / base:.2f}x"]
            for a in allowed]
    print(common.md_table(["allowed new tokens", "KV pages", "ms per decode step", f"vs {allowed[0]}"], rows))
    common.write_json(args.out, {
        "benchmark": "decode_cost", "machine": common.machine_info(threads), "commit": common.source_commit(),
        "model": ARCH, "batch": args.batch, "prompt_len": 16,
        "live_tokens": f"{args.short} -> {args.long}", "call_s_short": {str(a): min(times[a][args.short]) for a in allowed},
        "ms_per_step": {str(a): per_step[a] * 1e3 for a in allowed},
        "ratio_to_smallest": {str(a): per_step[a] / base for a in allowed},
        "times_s": {str(a): {str(n): v for n, v in t.items()} for a, t in times.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
