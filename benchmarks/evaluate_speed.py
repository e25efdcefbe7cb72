"""Items per second of the paper1 suite: `lrmq.evals.run_suite` vs transformers `generate` doing the same work.

Both sides take the same items (the paper1 fixture items of tests/fixtures/evals, repeated to `--items`),
render the same Qwen-math prompts, sort them by prompt length, cut them into batches of `--batch`, left-pad,
sample at T=1.0 / top_p=1.0 up to `--new` tokens (stopping at the tokenizer's EOS ids), decode and score
with the same scorer (`paper_reward`). Scoring is inside both timings. The models are the same weights:
the shipped tiny model, or (`--model 100m`) a random ~100M Qwen3 built with transformers and read by lrmq
(`benchmarks/generate.py`'s FULL config) with the tiny tokenizer. Calls alternate lrmq / HF after one
warm-up call each (lrmq's first call includes its compiles, reported separately).

    .venv/bin/python benchmarks/evaluate_speed.py --out docs/figures/evaluate_speed.json
    .venv/bin/python benchmarks/evaluate_speed.py --model 100m --items 32 --new 64

Items/s depends on what the random or tiny model generates (EOS early or not); the JSON records the new
tokens of each side, so the two can be compared as tokens/s too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

FIXTURES = os.path.join(common.REPO, "tests", "fixtures", "evals")


def hf_run(model, tok, items, *, batch: int, new: int, seed: int, eos, pad: int):
    """transformers generate on the same length-sorted batches, decode, score; returns records and tokens."""
    import torch

    from lrmq.evals.scorers import score

    ids = [tok.encode(it.prompt) for it in items]
    order = sorted(range(len(items)), key=lambda i: (len(ids[i]), i))
    completions, new_tokens = [None] * len(items), 0
    torch.manual_seed(seed)
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        width = max(len(ids[i]) for i in idx)
        x = torch.full((len(idx), width), pad, dtype=torch.long)
        m = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            x[r, width - len(ids[i]):] = torch.tensor(ids[i])
            m[r, width - len(ids[i]):] = 1
        with torch.inference_mode():
            out = model.generate(x, attention_mask=m, max_new_tokens=new, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, eos_token_id=list(eos), pad_token_id=pad, use_cache=True)
        for r, i in enumerate(idx):
            toks = out[r, width:].tolist()
            for j, t in enumerate(toks):
                if t in eos:
                    toks = toks[:j]
                    break
            new_tokens += len(toks)
            completions[i] = tok.decode(toks)
    by_bench = {}
    for it, c in zip(items, completions):
        by_bench.setdefault(it.benchmark, []).append((c, it.answer))
    for name, pairs in by_bench.items():
        score("paper_reward", [c for c, _ in pairs], [a for _, a in pairs], extractor="last_boxed")
    return new_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "100m"], default="tiny")
    ap.add_argument("--items", type=int, default=64, help="items (fixture items repeated)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=128, help="max new tokens (the tiny model has 256 positions)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write figures as JSON here")
    args = ap.parse_args(argv)

    threads = common.set_threads(args.threads)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import dataclasses

    import torch
    import transformers

    from lrmq.checkpoint.load import TINY_MODEL_DIR, load_model
    from lrmq.evals.benchmarks import BENCHMARKS, SUITES, load_items
    from lrmq.evals.config import GenerationSection
    from lrmq.evals.runner import run_suite
    from lrmq.generation.engine import Engine
    from lrmq.tokenizer import Tokenizer

    if args.model == "tiny":
        path = TINY_MODEL_DIR
    else:
        import generate as genbench

        path = tempfile.mkdtemp(prefix="lrmq_bench_eval_")
        genbench.build_hf(genbench.FULL, path, args.seed)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(os.path.join(TINY_MODEL_DIR, f), path)
    model = load_model(path, dtype="float32", param_dtype="float32")
    tok = Tokenizer.from_dir(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    base = [it for n in SUITES["paper1"].benchmarks for it in load_items(BENCHMARKS[n], FIXTURES)]
    items = [dataclasses.replace(base[i % len(base)], id=str(i)) for i in range(args.items)]
    gen_cfg = GenerationSection(temperature=1.0, top_p=1.0, max_new_tokens=args.new, batch_size=args.batch,
                                seed=args.seed, max_positions=max(model.cfg.max_position_embeddings, 1024))
    engine = Engine(model, eos_ids=tok.eos_ids, pad_id=tok.pad_id, config=gen_cfg.engine_config())
    lrmq_tokens = []

    def run_lrmq():
        r = run_suite(model, tok, items, gen_cfg, engine=engine)
        lrmq_tokens.append(r["timing"]["new_tokens"])

    hf_tokens = []

    def run_hf():
        hf_tokens.append(hf_run(hf, tok, items, batch=args.batch, new=args.new, seed=args.seed, eos=set(tok.eos_ids),
                                pad=tok.pad_id))

    info = common.machine_info(threads)
    print(common.machine_str(info))
    timed = common.time_interleaved({"lrmq": run_lrmq, "hf": run_hf}, repeats=args.repeats)
    rows = {}
    for name, toks in (("lrmq", lrmq_tokens), ("hf", hf_tokens)):
        t = timed[name]
        rows[name] = {"median_s": t["median_s"], "times_s": t["times_s"], "first_s": t["first_s"],
                      "items_per_s": args.items / t["median_s"], "new_tokens": toks,
                      "tokens_per_s": float(sum(toks[1:]) / sum(t["times_s"])) if len(toks) > 1 else None}
        print(f"{name:5s}: {rows[name]['items_per_s']:.2f} items/s (median {t['median_s']:.2f}s of {args.items} items; "
              f"first call {t['first_s'][0]:.2f}s; new tokens per call {toks})")
    ratio = rows["hf"]["median_s"] / rows["lrmq"]["median_s"]
    print(f"lrmq / HF items/s: {ratio:.2f}x")
    common.write_json(args.out, {"benchmark": "evaluate_speed", "machine": info, "commit": common.source_commit(),
                                 "model": args.model, "items": args.items, "batch": args.batch, "new": args.new,
                                 "repeats": args.repeats, "lrmq": rows["lrmq"], "hf": rows["hf"],
                                 "lrmq_over_hf_items_per_s": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
