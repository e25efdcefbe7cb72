"""One GRPO step on CPU (rollout + update) with `GRPOTrainer`, for two models:

* ``tiny``: the model shipped in lrmq/assets/tiny; when that directory does not exist yet, a scratch
  one built the same way (the tiny tokenizer of tools/build_tiny_model.py, its Qwen3 config, random init).
* ``100m``: a ~100M-parameter Qwen3-shaped random config (hidden 768, 16 layers, 12/4 heads of 64,
  MLP 2048, tied embeddings) with the tiny tokenizer, so the vocabulary matches the config.

Each model gets a TrainConfig built in code (synthetic arithmetic data, temperature-1 sampling, a temp
run dir, no HF export, no progress bar). After one warmup step (compiles generation and the update),
`--steps` steps are timed; reported: rollout tokens/s (generated tokens over the generation call),
train tokens/s (prompt + completion tokens over the jitted update), and the share of step wall time
spent in `rollout()` (generation + decoding + rewards + advantages) vs `update()`.

    .venv/bin/python benchmarks/grpo_step.py --quick           # tiny model only, small batch (seconds)
    .venv/bin/python benchmarks/grpo_step.py --out grpo.json   # tiny and 100m
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

TINY_DIR = os.path.join(common.REPO, "lrmq", "assets", "tiny")
# 100,936,448 parameters with the tiny vocabulary (320), tied embeddings
ARCH_100M = dict(hidden_size=768, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                 intermediate_size=2048)

# (prompts_per_step, group_size, max_prompt_len, max_new_tokens)
SHAPES = {"tiny": (8, 8, 64, 64), "100m": (4, 4, 64, 64)}
QUICK_SHAPES = {"tiny": (2, 4, 64, 16), "100m": (2, 2, 64, 8)}


def _build_tools():
    sys.path.insert(0, os.path.join(common.REPO, "tools"))
    import build_tiny_model

    return build_tiny_model


def write_random_checkpoint(out: str, arch: dict | None, seed: int = 0) -> int:
    """A random Qwen3 HF checkpoint with the tiny tokenizer; arch None = the tiny BASE_CONFIG. Returns #params."""
    from flax import nnx

    from lrmq.checkpoint.hf import save_hf_model
    from lrmq.model.config import ModelConfig
    from lrmq.model.decoder import Decoder
    from lrmq.tokenizer import Tokenizer

    b = _build_tools()
    tok_dir = tempfile.mkdtemp(prefix="lrmq_bench_tok_")
    hf_tok = b.build_tokenizer()
    b.write_tokenizer_files(hf_tok, tok_dir, b.BASE_CONFIG["max_position_embeddings"])
    tok = Tokenizer.from_dir(tok_dir)
    hf = dict(b.BASE_CONFIG, **(arch or {}), vocab_size=int(math.ceil(tok.vocab_size / 64) * 64),
              bos_token_id=None, eos_token_id=tok.eos_ids[0])
    cfg = ModelConfig.from_hf_dict(hf)
    model = Decoder(cfg, nnx.Rngs(seed))
    n = common.count_params(nnx.state(model, nnx.Param))
    save_hf_model(model, out, overwrite=True)
    b.write_tokenizer_files(hf_tok, out, b.BASE_CONFIG["max_position_embeddings"])
    shutil.rmtree(tok_dir, ignore_errors=True)
    return n


def make_trainer(ckpt: str, run_dir: str, shape: tuple[int, int, int, int], steps: int, seed: int):
    from lrmq.configlib import config_from_dict
    from lrmq.rl.config import TrainConfig
    from lrmq.rl.trainer import GRPOTrainer

    prompts, group, max_prompt, max_new = shape
    cfg = config_from_dict(TrainConfig, {
        "model": {"checkpoint": ckpt, "dtype": "float32", "param_dtype": "float32"},
        "data": {"template": "arith", "synthetic_train_size": 512, "synthetic_eval_size": 8},
        "rollout": {"prompts_per_step": prompts, "group_size": group, "max_prompt_len": max_prompt,
                    "max_new_tokens": max_new, "temperature": 1.0},
        "algo": {"reward": "boxed_math"},
        "optim": {"lr": 1e-6},
        "run": {"out_dir": run_dir, "steps": steps + 1, "seed": seed, "export_hf": False, "progress": False,
                "eval_size": 4, "save_every": 10_000},
    }, source="benchmarks/grpo_step.py")
    return GRPOTrainer(cfg, writer_factory=lambda path: _NullWriter())


class _NullWriter:
    def add_scalar(self, *a, **k):
        pass

    def flush(self):
        pass


def one_step(tr, key):
    t0 = time.perf_counter()
    batch = next(tr.pipeline)
    ro = tr.rollout(batch, key)
    rb, stats = ro.batch, ro.stats
    t1 = time.perf_counter()
    m = tr.learner.update(rb)
    t2 = time.perf_counter()
    tr.step += 1
    return {
        "rollout_s": t1 - t0,  # whole rollout(): tokenize, generate, decode, rewards, advantages
        "gen_s": stats["perf/rollout_s"],  # the generation call alone
        "update_s": t2 - t1,  # whole update(): device_put + jitted step + metrics fetch
        "train_step_s": m["perf/update_s"],
        "step_s": t2 - t0,
        "gen_tokens": float(stats["completion/length_mean"]) * rb.num_sequences,
        "train_tokens": float(rb.mask.sum()),
        "sequences": rb.num_sequences,
        "completion_len_mean": stats["completion/length_mean"],
        "reward_mean": stats["reward/mean"],
    }


def bench_model(name: str, ckpt: str, shape, steps: int, seed: int, n_params: int) -> dict:
    import jax

    run_dir = tempfile.mkdtemp(prefix=f"lrmq_bench_grpo_{name}_")
    try:
        t0 = time.perf_counter()
        tr = make_trainer(ckpt, run_dir, shape, steps, seed)
        setup_s = time.perf_counter() - t0
        base_key = jax.random.key(seed)
        warm = one_step(tr, jax.random.fold_in(base_key, 0))
        timed = [one_step(tr, jax.random.fold_in(base_key, i + 1)) for i in range(steps)]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    med = lambda k: statistics.median(s[k] for s in timed)
    tot = lambda k: sum(s[k] for s in timed)
    res = {
        "model": name, "checkpoint": ckpt, "params": n_params,
        "prompts_per_step": shape[0], "group_size": shape[1], "max_prompt_len": shape[2], "max_new_tokens": shape[3],
        "sequences": timed[0]["sequences"], "setup_s": setup_s,
        "warmup_step_s": warm["step_s"], "warmup_rollout_s": warm["rollout_s"], "warmup_update_s": warm["update_s"],
        "step_s": med("step_s"), "rollout_s": med("rollout_s"), "update_s": med("update_s"),
        "rollout_tok_s": tot("gen_tokens") / tot("gen_s"),
        "train_tok_s": tot("train_tokens") / tot("train_step_s"),
        "rollout_share": tot("rollout_s") / tot("step_s"),
        "update_share": tot("update_s") / tot("step_s"),
        "completion_len_mean": statistics.mean(s["completion_len_mean"] for s in timed),
        "train_tokens_per_step": statistics.mean(s["train_tokens"] for s in timed),
        "steps": timed,
    }
    # compile estimate: the warmup step minus a steady step (both phases compile on first use)
    res["compile_s_est"] = warm["step_s"] - res["step_s"]
    print(f"  {name}: step {res['step_s']:.2f}s (rollout {res['rollout_share']:.0%} / update {res['update_share']:.0%}), "
          f"rollout {res['rollout_tok_s']:.0f} tok/s, train {res['train_tok_s']:.0f} tok/s, "
          f"warmup step {res['warmup_step_s']:.1f}s", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model only, small batch, 1 timed step")
    ap.add_argument("--models", default=None, help="comma list of tiny,100m (default: both; --quick: tiny)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps after the warmup step (default 3, quick 1)")
    ap.add_argument("--out", help="write figures as JSON here")
    ap.add_argument("--threads", type=int, default=0, help="XLA CPU threads (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    threads = common.set_threads(args.threads)
    import logging

    logging.basicConfig(level=logging.WARNING)
    models = (args.models or ("tiny" if args.quick else "tiny,100m")).split(",")
    steps = args.steps or (1 if args.quick else 3)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    info = common.machine_info(threads)
    print(common.machine_str(info))

    scratch = tempfile.mkdtemp(prefix="lrmq_bench_ckpt_")
    results = []
    try:
        for name in models:
            if name == "tiny":
                if os.path.isfile(os.path.join(TINY_DIR, "config.json")):
                    from lrmq.checkpoint.load import load_model

                    ckpt, source = "tiny", "lrmq/assets/tiny"
                    from flax import nnx

                    n = common.count_params(nnx.state(load_model(TINY_DIR), nnx.Param))
                else:
                    ckpt, source = os.path.join(scratch, "tiny"), "scratch (random init, tiny config)"
                    n = write_random_checkpoint(ckpt, None, args.seed)
            elif name == "100m":
                ckpt, source = os.path.join(scratch, "100m"), "random init"
                n = write_random_checkpoint(ckpt, ARCH_100M, args.seed)
            else:
                raise SystemExit(f"unknown model {name!r}; known: tiny, 100m")
            print(f"{name}: {source}, {n:,} params; prompts x group = {shapes[name][0]}x{shapes[name][1]}, "
                  f"prompt len {shapes[name][2]}, max new {shapes[name][3]}; {steps} timed steps after 1 warmup",
                  flush=True)
            r = bench_model(name, ckpt, shapes[name], steps, args.seed, n)
            r["source"] = source
            results.append(r)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    headers = ["model", "params", "seqs x (prompt+new)", "step s", "rollout tok/s", "train tok/s",
               "rollout share", "update share", "mean completion", "warmup step s"]
    rows = [[r["model"], f"{r['params'] / 1e6:.1f}M", f"{r['sequences']} x ({r['max_prompt_len']}+{r['max_new_tokens']})",
             r["step_s"], r["rollout_tok_s"], r["train_tok_s"], f"{r['rollout_share']:.0%}",
             f"{r['update_share']:.0%}", r["completion_len_mean"], r["warmup_step_s"]] for r in results]
    print()
    print(common.md_table(headers, rows))
    common.write_json(args.out, {"benchmark": "grpo_step", "machine": info, "results": results,
                                 "time": time.strftime("%Y-%m-%d %H:%M:%S")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
