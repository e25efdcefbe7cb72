"""The quantized KV cache against the float cache at long context, per model family, with and without QK-norm.

Issue 36 asks for the per-token log-prob error and the greedy agreement of fp8 / int8 KV caches against the float
cache "at long context: the tiny models at 2k+ positions, with and without QK-norm (Qwen3 vs Qwen2 / Llama
families)". This script measures them through the engine the trainer's rollouts use (`lrmq.generation.engine`,
XLA decode attention on CPU, the quantized pool `kv_pool.QuantPool`), per family lrmq supports:

* qwen3 (QK-norm per head), olmo3 (QK-norm over all heads; its sliding-window layers get Olmo-3's 4,096-token
  window, so at these lengths every layer sees the whole context), qwen2 (no QK-norm, q/k/v biases), llama
  (Llama-3 RoPE scaling, no QK-norm);
* one tiny random model per family of the same shape (hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 16,
  MLP 128, vocabulary 256, 4,096 positions, float32), initialised so that its activations are of the size of a
  trained model's rather than of the 0.02-std init (linears N(0, 1/fan_in), embeddings N(0, 1), norms 1 + 0.1 N,
  biases 0.1 N, an lm head giving logits of std ~3; the stop token's logit is held at 0 so sequences run their
  whole budget);
* two variants of each: "plain", and "outlier keys", a SYNTHETIC STAND-IN for the massive key channels of real
  Qwen2 / Llama checkpoints: in every layer and KV head the K projection's two output channels of the
  lowest-frequency RoPE pair (dims d/2 - 1 and d - 1) are scaled up `--outlier-gain` times (30). With QK-norm the
  norm after the projection bounds the keys again; without it the keys, and the attention logits, are that much
  larger, and so are the absolute errors of a format whose error is relative (fp8) or a share of the token's
  absmax (int8 per token).

For each model, 4 prompts of `--prompt` (1,900) random tokens each generate `--new` (200) tokens, so the new
tokens sit at positions 1,900-2,099 (>= 2,048 at the end). Per KV cache format (fp8_e4m3, fp8_e5m2 with the
engine's per-layer / KV-head scales calibrated on the prompts' prefill, 4x headroom; int8 per token) against the
float cache (`auto`):

* sampled (temperature 1, the same per-sequence keys): the |log-prob error| of each sampled token before the
  sequence's first disagreement (mean and max over every such token; the quantity TIS / MIS correct), and the
  share of tokens before the first disagreement;
* greedy: the share of tokens before the first disagreement (greedy agreement);
* entries clipped at the format's max (`GenerationResult.stats["kv_saturated"]`, both runs) and, for fp8, the
  largest key magnitude the calibration saw (scale x format max / 4).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/kv_cache_error.py --out docs/figures/kv_cache_error.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8")
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False,
            rms_norm_eps=1e-6)
# (HF config fields, QK-norm?) per family; RoPE as the family's released models set it
FAMILIES = {
    "qwen3": (dict(model_type="qwen3", rope_theta=1e6), "per head"),
    "olmo3": (dict(model_type="olmo3", rope_theta=5e5, sliding_window=4096,
                   layer_types=["sliding_attention", "full_attention"]), "over all heads"),
    "qwen2": (dict(model_type="qwen2", rope_theta=1e6), "none"),
    "llama": (dict(model_type="llama", rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0,
                                                            low_freq_factor=1.0, high_freq_factor=4.0,
                                                            original_max_position_embeddings=8192)), "none"),
}
EOS = 0  # its lm-head column is zero: a logit of 0 against logits of std ~3, so sequences run their budget
LOGIT_STD = 3.0


def model_config(family: str):
    from lrmq.model.config import ModelConfig

    return ModelConfig.from_hf_dict(dict(BASE, **FAMILIES[family][0]))


def init_model(cfg, seed: int, outlier_gain: float):
    """A Decoder of `cfg` with trained-size activations (module docstring); outlier_gain > 1 scales the K
    projection's lowest-frequency RoPE pair of channels of every KV head (kernel and bias) by it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from lrmq.model.decoder import Decoder

    model = Decoder(cfg, nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)
    d = cfg.head_dim
    outliers = [h * d + j for h in range(cfg.num_kv_heads) for j in (d // 2 - 1, d - 1)]

    def new(path, x):
        name = jax.tree_util.keystr(path)
        shape = x.shape
        if "embedding" in name:
            v = rng.normal(size=shape)
        elif "kernel" in name:
            v = rng.normal(size=shape) / np.sqrt(shape[0])
            if "lm_head" in name:
                v = v * LOGIT_STD
                v[:, EOS] = 0.0
        elif "bias" in name:
            v = 0.1 * rng.normal(size=shape)
        else:  # norm scales
            v = 1.0 + 0.1 * rng.normal(size=shape)
        if "k_proj" in name and outlier_gain != 1.0:
            v[..., outliers] *= outlier_gain
        return jnp.asarray(v, x.dtype)

    nnx.update(model, jax.tree_util.tree_map_with_path(new, state))
    return model


def compare(ref, got) -> dict:
    """Per-token |log-prob error| before each sequence's first disagreement, and the share of tokens before it."""
    import numpy as np

    errs, agree = [], []
    for i in range(len(ref.lengths)):
        n = int(min(ref.lengths[i], got.lengths[i]))
        same = ref.tokens[i, :n] == got.tokens[i, :n]
        first = n if same.all() else int(np.argmin(same))
        agree.append(first / n)
        errs.append(np.abs(ref.logprobs[i, :first] - got.logprobs[i, :first]))
    err = np.concatenate(errs)
    return {"mean_abs_logprob_err": float(err.mean()) if err.size else None,
            "max_abs_logprob_err": float(err.max()) if err.size else None,
            "tokens_compared": int(err.size), "agreement": float(np.mean(agree))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1900, help="prompt tokens")
    ap.add_argument("--new", type=int, default=200, help="generated tokens")
    ap.add_argument("--outlier-gain", type=float, default=30.0)
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    threads = common.set_threads(args.threads)

    import jax
    import numpy as np

    from lrmq.generation.engine import Engine, EngineConfig, sequence_keys
    from lrmq.generation.kv_format import KVFormat
    from lrmq.generation.kv_pool import FP8_HEADROOM
    from lrmq.generation.sampling import SamplingConfig

    t_start, cpu_start = time.perf_counter(), time.process_time()
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(1, BASE["vocab_size"], size=args.prompt).tolist() for _ in range(args.prompts)]
    keys = sequence_keys(jax.random.key(args.seed + 1), args.prompts)
    samplings = {"sampled": SamplingConfig(temperature=1.0), "greedy": SamplingConfig(greedy=True)}
    variants = {"plain": 1.0, "outlier keys": args.outlier_gain}
    rows = []
    for family in args.families:
        cfg = model_config(family)
        models = {v: init_model(cfg, args.seed, gain) for v, gain in variants.items()}
        # one engine per format, shared by the variants (same graph and shapes: compiled once)
        engines = {fmt: Engine(models["plain"], eos_ids=[EOS], pad_id=EOS,
                               config=EngineConfig(page_size=16, kv_cache=fmt)) for fmt in ("auto",) + FORMATS}

        def run(variant, fmt, sampling):
            return engines[fmt].generate(models[variant], prompts, max_new_tokens=args.new,
                                         sampling=samplings[sampling], keys=keys)

        for variant in variants:
            ref = {s: run(variant, "auto", s) for s in samplings}
            for fmt in FORMATS:
                t0 = time.perf_counter()
                got = {s: run(variant, fmt, s) for s in samplings}
                sampled, greedy = compare(ref["sampled"], got["sampled"]), compare(ref["greedy"], got["greedy"])
                row = {"family": family, "qk_norm": FAMILIES[family][1], "variant": variant, "kv_cache": fmt,
                       "mean_abs_logprob_err": sampled["mean_abs_logprob_err"],
                       "max_abs_logprob_err": sampled["max_abs_logprob_err"],
                       "tokens_compared": sampled["tokens_compared"],
                       "sampled_agreement": sampled["agreement"], "greedy_agreement": greedy["agreement"],
                       "kv_saturated": sum(g.stats["kv_saturated"] for g in got.values()),
                       "positions": [args.prompt, args.prompt + int(max(g.lengths.max() for g in got.values())) - 1],
                       "seconds": round(time.perf_counter() - t0, 1)}
                scales = got["sampled"].kv_scales
                if scales is not None:
                    row["key_absmax"] = float(scales.k.max() * KVFormat(fmt).fmax / FP8_HEADROOM)
                rows.append(row)
                print(f"{family:6s} {variant:13s} {fmt:9s} err mean {row['mean_abs_logprob_err']:.4f} "
                      f"max {row['max_abs_logprob_err']:.3f}  sampled agree {row['sampled_agreement']:.3f}  "
                      f"greedy agree {row['greedy_agreement']:.3f}  clipped {row['kv_saturated']}"
                      + (f"  key absmax {row['key_absmax']:.1f}" if "key_absmax" in row else ""), flush=True)
    payload = {
        "machine": common.machine_info(threads),
        "setup": {"prompts": args.prompts, "prompt_tokens": args.prompt, "new_tokens": args.new,
                  "outlier_gain": args.outlier_gain, "seed": args.seed, "model": BASE, "logit_std": LOGIT_STD,
                  "families": {f: {"hf": FAMILIES[f][0], "qk_norm": FAMILIES[f][1]} for f in args.families}},
        "rows": rows,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "cpu_s": round(time.process_time() - cpu_start, 1),
    }
    headers = ["family", "QK-norm", "variant", "kv_cache", "mean |dlogp|", "max", "sampled agree", "greedy agree",
               "clipped"]
    print(common.md_table(headers, [[r["family"], r["qk_norm"], r["variant"], r["kv_cache"],
                                     f"{r['mean_abs_logprob_err']:.4f}", f"{r['max_abs_logprob_err']:.3f}",
                                     f"{r['sampled_agreement']:.3f}", f"{r['greedy_agreement']:.3f}",
                                     r["kv_saturated"]] for r in rows]))
    common.write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
