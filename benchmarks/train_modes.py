"""Train-mode benchmark: step time and param / optimizer-state memory of bf16 vs QAT-int8 vs QAT-int4 vs
QLoRA-NF4, as ratios against bf16.

One "step" is a jitted forward+backward+AdamW update on a random token batch (the GRPO update's cost
without rollouts). Memory is the bytes of the parameter tree (float master weights / packed base +
adapters) and of the optax state over the trainable parameters.

Timing: every mode of a config is built and compiled first (one warm-up step each, reported as
`compile_s`); then `--repeats` rounds, each round timing one sample of every mode in turn (round-robin,
the starting mode rotating from round to round), a sample being `--iters` consecutive steps. Each round
gives a paired ratio mode / bf16; the median ratio and its min-max and interquartile range over the
rounds are reported, so load from other processes shows up as spread instead of as a biased ratio.

    python benchmarks/train_modes.py --quick                          # tiny config only
    python benchmarks/train_modes.py --out docs/figures/train_modes.json   # tiny and the 38m config
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, machine_str, md_table, set_threads, source_commit, write_json  # noqa: E402

BASE = dict(model_type="qwen3", rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=1024,
            tie_word_embeddings=True)
CONFIGS = {
    "tiny": dict(BASE, vocab_size=320, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # The per-layer shapes of the ~100M generation benchmark config, 4 layers, vocab 16384: 37.8M parameters.
    "38m": dict(BASE, vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=4,
                num_attention_heads=12, num_key_value_heads=4, head_dim=64),
    # The earlier "~88M" config (10 layers, vocab 32768): too slow for a repeated run on 2 loaded cores.
    "100m": dict(BASE, vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=64),
}
MODE_NAMES = ("bf16", "qat-int8", "qat-int4", "qlora-nf4")


def modes():
    from lrmq.rl.config import QuantSection

    return {
        "bf16": QuantSection(mode="none"),
        "qat-int8": QuantSection(mode="qat", qat_scheme="int8"),
        "qat-int4": QuantSection(mode="qat", qat_scheme="int4", qat_group_size=64),
        "qlora-nf4": QuantSection(mode="qlora", base_format="nf4"),
    }


def build(cfg_name: str, mode: str, *, batch: int, seq: int) -> dict:
    """Model + optimizer for one mode; returns the state and a `run(n)` closure doing n steps in place."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from lrmq.model.config import ModelConfig
    from lrmq.model.decoder import Decoder
    from lrmq.quant.training import param_bytes, prepare_for_training, tree_bytes

    cfg = ModelConfig.from_hf_dict(dict(CONFIGS[cfg_name]), dtype="bfloat16", param_dtype="bfloat16")
    model = Decoder(cfg, nnx.Rngs(0))
    q = modes()[mode]
    model = prepare_for_training(model, q, seed=0)
    filt = nnx.LoRAParam if q.mode == "qlora" else nnx.Param
    gdef, trainable, rest = nnx.split(model, filt, ...)
    tx = optax.adamw(1e-4)
    opt = tx.init(trainable)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq), 0, cfg.vocab_size)

    def loss_fn(tr, rest, tokens):
        logits = nnx.merge(gdef, tr, rest)(tokens[:, :-1]).astype(jnp.float32)
        lp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1))

    @jax.jit
    def step(tr, opt, rest, tokens):
        loss, g = jax.value_and_grad(loss_fn)(tr, rest, tokens)
        upd, opt = tx.update(g, opt, tr)
        return optax.apply_updates(tr, upd), opt, loss

    st = {"tr": trainable, "opt": opt, "loss": None}

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            st["tr"], st["opt"], st["loss"] = step(st["tr"], st["opt"], rest, tokens)
        jax.block_until_ready(st["loss"])
        return time.perf_counter() - t0

    compile_s = run(1)
    pb = param_bytes(nnx.merge(gdef, st["tr"], rest))
    n_params = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {"run": run, "st": st, "compile_s": compile_s, "param_bytes": pb["total"],
            "adapter_bytes": pb["adapters"], "opt_bytes": tree_bytes(st["opt"]), "params": n_params}


def spread(xs):
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q[0], "q3": q[2]}


def bench_config(name: str, *, batch: int, seq: int, repeats: int, iters: int) -> dict:
    built = {}
    for m in MODE_NAMES:
        built[m] = build(name, m, batch=batch, seq=seq)
        print(f"{name}: built {m} (compile + first step {built[m]['compile_s']:.1f} s)", flush=True)
    for m in MODE_NAMES:  # one untimed warm-up sample each after compilation
        built[m]["run"](iters)
    samples = {m: [] for m in MODE_NAMES}
    order = []
    for r in range(repeats):
        rot = MODE_NAMES[r % len(MODE_NAMES):] + MODE_NAMES[:r % len(MODE_NAMES)]
        order.append(list(rot))
        for m in rot:
            samples[m].append(built[m]["run"](iters) / iters)
        print(f"{name}: round {r + 1}/{repeats} " + " ".join(f"{m} {samples[m][-1] * 1e3:.1f} ms"
                                                               for m in MODE_NAMES), flush=True)
    base = built["bf16"]
    rows = []
    for m in MODE_NAMES:
        b = built[m]
        ratios = [t / t0 for t, t0 in zip(samples[m], samples["bf16"])]
        rows.append({
            "mode": m, "step_s": spread(samples[m]), "step_s_samples": samples[m],
            "step_ratio": spread(ratios), "step_ratio_samples": ratios,
            "compile_s": b["compile_s"], "param_bytes": b["param_bytes"], "adapter_bytes": b["adapter_bytes"],
            "opt_bytes": b["opt_bytes"], "param_ratio": b["param_bytes"] / base["param_bytes"],
            "opt_ratio": b["opt_bytes"] / base["opt_bytes"], "final_loss": float(b["st"]["loss"]),
        })
    return {"config": name, "model": CONFIGS[name], "params": base["params"], "batch": batch, "seq": seq,
            "repeats": repeats, "iters_per_sample": iters, "round_order": order, "rows": rows}


def table(res: dict) -> str:
    rows = []
    for r in res["rows"]:
        s, q = r["step_ratio"], r["step_s"]
        rows.append([r["mode"], f"{q['median'] * 1e3:.1f}", f"**{s['median']:.2f}**", f"{s['min']:.2f}-{s['max']:.2f}",
                     f"{s['q1']:.2f}-{s['q3']:.2f}", f"{r['param_bytes'] / 2**20:.2f}", f"{r['param_ratio']:.2f}",
                     f"{r['opt_bytes'] / 2**20:.2f}", f"{r['opt_ratio']:.3f}"])
    return md_table(["mode", "step ms (median)", "step ratio (median)", "min-max", "IQR", "params MiB",
                     "params ratio", "opt state MiB", "opt ratio"], rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny config only, 3 rounds")
    ap.add_argument("--configs", default="tiny,38m", help=f"comma-separated, from {sorted(CONFIGS)}")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds (each times every mode once)")
    ap.add_argument("--iters", default="tiny=10,38m=1,100m=1", help="steps per timed sample, per config")
    ap.add_argument("--threads", type=int, default=0, help="XLA CPU threads (0 = all cores)")
    ap.add_argument("--out", "--json", dest="out", default=None, help="write the results as JSON")
    a = ap.parse_args(argv)
    threads = set_threads(a.threads)
    names = ["tiny"] if a.quick else a.configs.split(",")
    repeats = 3 if a.quick else a.repeats
    iters = dict(kv.split("=") for kv in a.iters.split(","))
    info = machine_info(threads)
    info["lrmq_commit"] = source_commit()
    t0 = time.perf_counter()
    results = []
    for name in names:
        res = bench_config(name, batch=a.batch, seq=a.seq, repeats=repeats, iters=int(iters.get(name, 1)))
        results.append(res)
        print(f"\n{name} ({res['params'] / 1e6:.1f}M params, batch {a.batch} x {a.seq}, {repeats} rounds x "
              f"{res['iters_per_sample']} steps):\n{table(res)}\n", flush=True)
    info["loadavg_at_end"] = os.getloadavg()
    info["wall_s"] = time.perf_counter() - t0
    print(machine_str(info))
    write_json(a.out, {"benchmark": "train_modes", "argv": sys.argv[1:] if argv is None else argv,
                       "machine": info, "results": results})
    return results


if __name__ == "__main__":
    main()
