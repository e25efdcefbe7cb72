"""Heavy-tailed generation: useful tokens per second of lrmq's engine, the engine it replaced, and HF `generate`.

RL rollouts of reasoning models are many short completions and a tail that runs to the limit. Here 64
sequences of a ~48M-parameter Qwen3-shaped model (random weights, float32, greedy, 16-token prompts) get
completion lengths drawn from a lognormal with mean about 512, capped at 4,096, the longest set to the cap.
Every contender produces the same useful tokens (sum of the lengths):

* lrmq: the paged, continuously batched engine (`lrmq.generation.engine.Engine`), each sequence with its own
  budget (its drawn length);
* lrmq-static: the dense engine of main before the paged engine (commit BASE, checked out in a temporary git
  worktree): one static batch of 64, preallocated cache, runs until its longest row is done;
* hf: transformers `generate`, one batch of 64 (sdpa attention, dynamic cache), until its longest row is done.

No contender can stop early at a drawn length except lrmq (EOS is never sampled: its id is outside the
vocabulary, as in benchmarks/generate.py), and a static batch costs the same whether its short rows stop
or not: it runs to its longest row either way. Each contender runs in its own process, in turn, from one
saved checkpoint; lrmq's wall time includes its compiles (reported separately too).

    .venv/bin/python benchmarks/heavy_tail.py --out docs/figures/heavy_tail.json
    .venv/bin/python benchmarks/heavy_tail.py --quick        # a tiny model and short lengths (a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

BASE = "659e9ba"  # main before the paged engine
ARCH = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
            intermediate_size=2048, vocab_size=32000)
SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=768, vocab_size=8192)
QUICK = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=512)


def draw_lengths(n: int, mean: float, cap: int, seed: int) -> list[int]:
    import numpy as np

    sigma = 1.0
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, n)
    lengths = np.clip(np.round(raw), 8, cap).astype(int)
    lengths[int(np.argmax(lengths))] = cap  # the tail that hits the limit
    return lengths.tolist()


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed + 1).integers(1, vocab, (n, length)).tolist()


# ----------------------------------------------------------------------------- workers (one process each)


def _compile_seconds():
    import jax

    total = [0.0]

    def listen(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            total[0] += seconds

    jax.monitoring.register_event_duration_secs_listener(listen)
    return total


def worker_lrmq(job: dict) -> dict:
    compiled = _compile_seconds()
    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.generation.engine import Engine, EngineConfig
    from lrmq.generation.sampling import SamplingConfig

    model = load_hf_model(job["ckpt"])
    eng = Engine(model, eos_ids=[job["vocab"]], pad_id=0, config=EngineConfig(slots=job["slots"]))
    t0 = time.perf_counter()
    res = eng.generate(model, job["prompts"], max_new_tokens=job["lengths"], sampling=SamplingConfig(greedy=True))
    wall = time.perf_counter() - t0
    assert res.lengths.tolist() == job["lengths"]
    return {"seconds": wall, "compile_seconds": compiled[0], "stats": res.stats,
            "tokens": [res.tokens[i, :n].tolist() for i, n in enumerate(job["lengths"])]}


def worker_static(job: dict) -> dict:
    sys.path.insert(0, job["base_tree"])  # the engine of main before this one
    compiled = _compile_seconds()
    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.generation.engine import Generator
    from lrmq.generation.sampling import SamplingConfig

    model = load_hf_model(job["ckpt"])
    gen = Generator(model, eos_ids=[job["vocab"]], pad_id=0)
    t0 = time.perf_counter()
    res = gen.generate(model, job["prompts"], max_new_tokens=max(job["lengths"]), sampling=SamplingConfig(greedy=True))
    wall = time.perf_counter() - t0
    return {"seconds": wall, "compile_seconds": compiled[0],
            "tokens": [res.tokens[i, :n].tolist() for i, n in enumerate(job["lengths"])]}


def worker_hf(job: dict) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(job["ckpt"], attn_implementation="sdpa").eval()
    prompts = torch.tensor(job["prompts"])
    new = max(job["lengths"])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True)
    wall = time.perf_counter() - t0
    out = out[:, prompts.shape[1]:].numpy()
    return {"seconds": wall, "tokens": [out[i, :n].tolist() for i, n in enumerate(job["lengths"])]}


WORKERS = {"lrmq": worker_lrmq, "lrmq-static": worker_static, "hf": worker_hf}


# ----------------------------------------------------------------------------- driver


def build_checkpoint(arch: dict, path: str, seed: int, positions: int) -> None:
    import torch
    import transformers

    cfg = transformers.Qwen3Config(**arch, tie_word_embeddings=True, max_position_embeddings=positions,
                                   rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None)
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(cfg).to(torch.float32).eval().save_pretrained(path)


def run_worker(name: str, job: dict, threads: int, tmp: str) -> dict:
    path = os.path.join(tmp, f"{name}.json")
    with open(path, "w") as f:
        json.dump(job, f)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    load_before = os.getloadavg()[0]
    r = subprocess.run([sys.executable, __file__, "--worker", name, "--job", path, "--threads", str(threads)],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{name} failed:\n{r.stderr[-3000:]}")
    with open(path + ".out") as f:
        out = json.load(f)
    out["loadavg_1min_before_after"] = [load_before, os.getloadavg()[0]]  # other work on the machine shows here
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write figures as JSON here")
    ap.add_argument("--quick", action="store_true", help="tiny model, mean 48 / cap 256 tokens")
    ap.add_argument("--threads", type=int, default=0, help="torch + XLA CPU threads (default: all cores)")
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--slots", type=int, default=0, help="lrmq decode slots (0 = all sequences)")
    ap.add_argument("--contenders", default="lrmq,lrmq-static,hf")
    ap.add_argument("--mean", type=int, default=0, help="mean completion length (default 512, --quick 48)")
    ap.add_argument("--cap", type=int, default=0, help="completion length cap (default 4096, --quick 256)")
    ap.add_argument("--small", action="store_true", help="a ~5M-parameter model (hidden 256, 4 layers)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    threads = common.set_threads(args.threads)

    if args.worker:
        with open(args.job) as f:
            job = json.load(f)
        out = WORKERS[args.worker](job)
        with open(args.job + ".out", "w") as f:
            json.dump(out, f)
        return 0

    arch = QUICK if args.quick else SMALL if args.small else ARCH
    mean, cap, prompt_len = (48, 256, 8) if args.quick else (512, 4096, 16)
    mean, cap = args.mean or mean, args.cap or cap
    lengths = draw_lengths(args.sequences, mean, cap, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "model")
        build_checkpoint(arch, ckpt, args.seed, positions=prompt_len + cap + 64)
        base_tree = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", common.REPO, "worktree", "add", "--detach", base_tree, BASE], check=True,
                       capture_output=True)
        try:
            job = {"ckpt": ckpt, "vocab": arch["vocab_size"], "lengths": lengths, "slots": args.slots,
                   "prompts": prompts_for(args.sequences, prompt_len, arch["vocab_size"], args.seed),
                   "base_tree": base_tree}
            results, names = {}, args.contenders.split(",")
            for name in names:
                print(f"running {name} ...", file=sys.stderr, flush=True)
                results[name] = run_worker(name, job, threads, tmp)
                print(f"  {results[name]['seconds']:.1f} s", file=sys.stderr, flush=True)
                # written after each contender: a run of hours that is cut short keeps what it measured
                report(args, arch, lengths, prompt_len, cap, threads, results, complete=len(results) == len(names))
        finally:
            subprocess.run(["git", "-C", common.REPO, "worktree", "remove", "--force", base_tree], capture_output=True)
    return 0


def report(args, arch: dict, lengths: list[int], prompt_len: int, cap: int, threads: int, results: dict, *,
           complete: bool) -> None:
    useful = sum(lengths)
    ref = results.get("hf", {}).get("tokens")
    rows, figures = [], {}
    for name, r in results.items():
        tps = useful / r["seconds"]
        agree = None
        if ref is not None:
            agree = sum(a == b for x, y in zip(r["tokens"], ref) for a, b in zip(x, y)) / useful
        figures[name] = {"seconds": r["seconds"], "useful_tokens_per_s": tps, "compile_seconds": r.get("compile_seconds"),
                         "loadavg_1min_before_after": r["loadavg_1min_before_after"],
                         "greedy_tokens_equal_to_hf": agree, **({"stats": r["stats"]} if "stats" in r else {})}
        rows.append([name, f"{r['seconds']:.1f}", f"{r.get('compile_seconds') or 0:.1f}", f"{tps:.1f}",
                     "" if agree is None else f"{agree:.3f}"])
    ratios = {f"lrmq_vs_{k}": figures["lrmq"]["useful_tokens_per_s"] / v["useful_tokens_per_s"]
              for k, v in figures.items() if k != "lrmq" and "lrmq" in figures}
    print(common.md_table(["contender", "wall s", "of which compile s", "useful tokens/s", "greedy = hf"], rows))
    print(json.dumps(ratios, indent=2))
    info = common.machine_info(threads)
    common.write_json(args.out, {
        "benchmark": "heavy_tail", "complete": complete, "machine": info, "commit": common.source_commit(),
        "base_commit": BASE, "model": {**arch, "params_approx": _params(arch)}, "sequences": args.sequences,
        "prompt_len": prompt_len, "lengths": lengths, "useful_tokens": useful, "mean_length": useful / len(lengths),
        "cap": cap, "lrmq_slots": args.slots or args.sequences, "results": figures, "ratios": ratios,
        "argv": sys.argv[1:]})


def _params(a: dict) -> int:
    d, h, kv, hd, f, v, n = (a["hidden_size"], a["num_attention_heads"], a["num_key_value_heads"], a["head_dim"],
                             a["intermediate_size"], a["vocab_size"], a["num_hidden_layers"])
    return v * d + n * (2 * d * h * hd + 2 * d * kv * hd + 3 * d * f + 2 * d) + d


if __name__ == "__main__":
    sys.exit(main())
