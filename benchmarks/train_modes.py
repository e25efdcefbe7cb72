"""Train-mode benchmark: step time and param / optimizer-state memory of bf16 vs QAT-int8 vs QAT-int4 vs
QLoRA-NF4, as ratios against bf16.

One "step" is a jitted forward+backward+AdamW update on a random token batch (the GRPO update's cost
without rollouts). Memory is the bytes of the parameter tree (float master weights / packed base +
adapters) and of the optax state over the trainable parameters.

    python benchmarks/train_modes.py --quick     # tiny config only
    python benchmarks/train_modes.py             # tiny and a ~100M Qwen3-style config
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from lrmq.model.config import ModelConfig  # noqa: E402
from lrmq.model.decoder import Decoder  # noqa: E402
from lrmq.quant.training import param_bytes, prepare_for_training, tree_bytes  # noqa: E402
from lrmq.rl.config import QuantSection  # noqa: E402

BASE = dict(model_type="qwen3", rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=1024,
            tie_word_embeddings=True)
CONFIGS = {
    "tiny": dict(BASE, vocab_size=320, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "100m": dict(BASE, vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=64),
}
MODES = {
    "bf16": QuantSection(mode="none"),
    "qat-int8": QuantSection(mode="qat", qat_scheme="int8"),
    "qat-int4": QuantSection(mode="qat", qat_scheme="int4", qat_group_size=64),
    "qlora-nf4": QuantSection(mode="qlora", base_format="nf4"),
}


def bench(cfg_name: str, mode: str, *, batch: int, seq: int, iters: int) -> dict:
    cfg = ModelConfig.from_hf_dict(dict(CONFIGS[cfg_name]), dtype="bfloat16", param_dtype="bfloat16")
    model = Decoder(cfg, nnx.Rngs(0))
    q = MODES[mode]
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

    t0 = time.perf_counter()
    trainable, opt, loss = step(trainable, opt, rest, tokens)
    jax.block_until_ready(loss)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(iters):
        trainable, opt, loss = step(trainable, opt, rest, tokens)
    jax.block_until_ready(loss)
    pb = param_bytes(nnx.merge(gdef, trainable, rest))
    return {"config": cfg_name, "mode": mode, "step_s": (time.perf_counter() - t0) / iters, "compile_s": compile_s,
            "param_bytes": pb["total"], "adapter_bytes": pb["adapters"], "opt_bytes": tree_bytes(opt),
            "loss": float(loss)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny config only, fewer iterations")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    a = ap.parse_args(argv)
    names = ["tiny"] if a.quick else ["tiny", "100m"]
    rows = []
    for name in names:
        iters = 3 if a.quick or name != "tiny" else 10
        base = None
        for mode in MODES:
            r = bench(name, mode, batch=a.batch, seq=a.seq, iters=iters)
            base = base or r
            r.update(step_ratio=r["step_s"] / base["step_s"], param_ratio=r["param_bytes"] / base["param_bytes"],
                     opt_ratio=r["opt_bytes"] / base["opt_bytes"])
            rows.append(r)
            print(f"{name:5s} {mode:10s} step {r['step_s'] * 1e3:8.1f} ms ({r['step_ratio']:.2f}x)  params "
                  f"{r['param_bytes'] / 2**20:8.2f} MiB ({r['param_ratio']:.2f}x)  opt {r['opt_bytes'] / 2**20:8.2f} MiB "
                  f"({r['opt_ratio']:.3f}x)  compile {r['compile_s']:.1f} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
