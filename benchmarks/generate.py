"""Generation throughput: lrmq (jitted prefill + while_loop decode) vs transformers `generate` (torch CPU).

Both sides run the SAME random Qwen3-shaped checkpoint (built with transformers from a seed, saved with
`save_pretrained`, loaded into lrmq with `load_hf_model`), float32, greedy, a fixed prompt length and
exactly `--new` generated tokens (EOS disabled on both sides: HF gets `min_new_tokens == max_new_tokens`
and no eos id; lrmq gets an eos id equal to the vocab size, which argmax can never return). Everything is
timed in one process after a warmup call; lrmq's compile time (first call minus steady state) is
reported separately. The HF baseline is the fastest of its stock attention paths (eager, sdpa), both
measured. Greedy outputs are compared token for token.

    .venv/bin/python benchmarks/generate.py --quick            # small config, 16 new tokens (seconds)
    .venv/bin/python benchmarks/generate.py --out gen.json     # ~100M config, batch 1 and 16, 128 tokens
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

FULL = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
            intermediate_size=2048, vocab_size=32000)
QUICK = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             intermediate_size=256, vocab_size=1024)


def build_hf(arch: dict, path: str, seed: int):
    import torch
    import transformers

    cfg = transformers.Qwen3Config(**arch, tie_word_embeddings=True, max_position_embeddings=1024,
                                   rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(path)
    return model


def hf_generate(model, prompts, new: int, attn: str):
    import torch

    model.config._attn_implementation = attn
    for m in model.modules():  # transformers 5 reads the implementation off each attention module's config
        if getattr(m, "config", None) is not None and hasattr(m.config, "_attn_implementation"):
            m.config._attn_implementation = attn
    with torch.inference_mode():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                             use_cache=True)
    return out[:, prompts.shape[1]:].numpy()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small config, 16 new tokens, 1 repeat")
    ap.add_argument("--out", help="write figures as JSON here")
    ap.add_argument("--threads", type=int, default=0, help="torch + XLA CPU threads (default: all cores)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=None, help="new tokens (default 128, --quick 16)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per case (default 3, --quick 1)")
    ap.add_argument("--attn", default="eager,sdpa", help="HF attention implementations to measure")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    threads = common.set_threads(args.threads)
    import jax
    import numpy as np
    import torch

    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.generation.engine import Engine
    from lrmq.generation.sampling import SamplingConfig

    arch = QUICK if args.quick else FULL
    new = args.new or (16 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    batches = [int(b) for b in args.batches.split(",")]
    attns = args.attn.split(",")

    tmp = tempfile.mkdtemp(prefix="lrmq_bench_gen_")
    hf = build_hf(arch, tmp, args.seed)
    n_params = sum(p.numel() for p in hf.parameters())
    model = load_hf_model(tmp, dtype="float32", param_dtype="float32")
    n_lrmq = common.count_params(jax.tree.leaves(__import__("flax").nnx.state(model)))
    assert n_lrmq == n_params, (n_lrmq, n_params)
    vocab = arch["vocab_size"]
    gen = Engine(model, eos_ids=[vocab], pad_id=0)  # eos outside [0, vocab): never sampled
    from flax import nnx

    state = nnx.state(model)
    greedy = SamplingConfig(greedy=True)
    info = common.machine_info(threads)
    print(common.machine_str(info))
    print(f"config: {arch}, tie_word_embeddings, float32: {n_params:,} parameters; prompt {args.prompt_len}, "
          f"{new} new tokens, greedy, {repeats} timed repeats after a warmup call")

    rng = np.random.default_rng(args.seed)
    results = []
    for b in batches:
        prompts = rng.integers(1, vocab, size=(b, args.prompt_len)).astype(np.int32)
        plist = prompts.tolist()
        # lrmq: the prompt bucket is the prompt length itself when it is a power of two (no padding)
        run_l = lambda: gen.generate(state, plist, max_new_tokens=new, sampling=greedy)
        pt = torch.from_numpy(prompts.astype(np.int64))
        fns = {"lrmq": run_l}
        for attn in attns:
            fns[attn] = (lambda a: lambda: hf_generate(hf, pt, new, a))(attn)
        timed = common.time_interleaved(fns, repeats=repeats)  # alternating calls: fair under shared load
        t_l = timed["lrmq"]
        res = run_l()
        assert (res.lengths == new).all(), res.lengths
        hf_times, hf_outs = {}, {}
        for attn in attns:
            t = timed[attn]
            out = hf_generate(hf, pt, new, attn)
            assert out.shape == (b, new), out.shape
            hf_times[attn] = t
            hf_outs[attn] = out
            print(f"  HF {attn:5s} batch {b:3d}: {t['median_s']:.3f}s  ({b * new / t['median_s']:.1f} tok/s)")
        best = min(hf_times, key=lambda a: hf_times[a]["median_s"])
        hf_out = hf_outs[best]
        match = float((res.tokens == hf_out).mean())
        first_div = [int(np.argmax(res.tokens[i] != hf_out[i])) if (res.tokens[i] != hf_out[i]).any() else None
                     for i in range(b)]
        row = {
            "batch": b,
            "lrmq_s": t_l["median_s"],
            "lrmq_tok_s": b * new / t_l["median_s"],
            "lrmq_compile_s": t_l["first_s"][0] - t_l["median_s"],
            "lrmq_times_s": t_l["times_s"],
            "hf_attn": best,
            "hf_s": hf_times[best]["median_s"],
            "hf_tok_s": b * new / hf_times[best]["median_s"],
            "hf_all": {a: {"median_s": t["median_s"], "tok_s": b * new / t["median_s"], "times_s": t["times_s"]}
                       for a, t in hf_times.items()},
            "greedy_token_match": match,
            "first_divergence": first_div,
        }
        row["ratio"] = row["lrmq_tok_s"] / row["hf_tok_s"]
        results.append(row)
        print(f"  lrmq       batch {b:3d}: {row['lrmq_s']:.3f}s  ({row['lrmq_tok_s']:.1f} tok/s), compile "
              f"{row['lrmq_compile_s']:.2f}s; lrmq/HF({best}) = {row['ratio']:.2f}x; greedy match {match:.3f}")

    headers = ["batch", "lrmq tok/s", "HF tok/s (attn)", "lrmq / HF", "lrmq compile s", "greedy match"]
    rows = [[r["batch"], r["lrmq_tok_s"], f"{r['hf_tok_s']:.1f} ({r['hf_attn']})", f"{r['ratio']:.2f}x",
             r["lrmq_compile_s"], f"{r['greedy_token_match']:.3f}"] for r in results]
    print()
    print(common.md_table(headers, rows))
    hf_rows = [[r["batch"]] + [f"{r['hf_all'][a]['tok_s']:.1f}" for a in attns] for r in results]
    print()
    print(common.md_table(["batch"] + [f"HF {a} tok/s" for a in attns], hf_rows))
    common.write_json(args.out, {"benchmark": "generate", "machine": info, "config": arch, "params": n_params,
                                 "prompt_len": args.prompt_len, "new_tokens": new, "repeats": repeats,
                                 "results": results, "time": time.strftime("%Y-%m-%d %H:%M:%S")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
