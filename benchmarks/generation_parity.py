"""Greedy / sampled generation of lrmq against transformers, and against an earlier lrmq commit.

For each tiny random HF model of `tests/hf_fixtures.py` (default: qwen3, olmo3, qwen3_window = Qwen3
with a sliding window of 4 on layer 1), float32, the three prompts of tests/test_generation.py
(left-padded into one batch for lrmq; one at a time for transformers), up to 16 new tokens, EOS id 127:

* greedy tokens of lrmq's `generate` vs transformers' `generate(do_sample=False)` (eager attention), row by
  row, and the greedy log-probs vs log_softmax of transformers' scores;
* with `--before COMMIT`: the same greedy and sampled (temperature 1, seed 3) generations from the lrmq of
  COMMIT (exported with `git archive` into a temp dir and run in a subprocess), compared token for token and
  by the largest log-prob difference with the working tree's lrmq.

    python benchmarks/generation_parity.py --before 729bee8 --out docs/figures/generation_parity.json

(729bee8 is the commit before f63b934, which changed prefill to project only the last position and stored
the KV cache heads-major; see docs/benchmarks.md.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import REPO, machine_info, md_table, set_threads, source_commit, write_json  # noqa: E402

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [3]]
EOS, PAD, MAX_NEW, SEED = 127, 0, 16, 3


def worker(tree: str, ckpts: dict) -> dict:
    """Runs in a subprocess with `tree`'s lrmq first on sys.path; prints {variant: {greedy, sampled}}."""
    sys.path.insert(0, tree)
    import numpy as np

    import lrmq
    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.generation.engine import generate
    from lrmq.generation.sampling import SamplingConfig

    assert os.path.dirname(os.path.dirname(os.path.abspath(lrmq.__file__))) == os.path.abspath(tree), lrmq.__file__
    out = {}
    for v, path in ckpts.items():
        model = load_hf_model(path)
        out[v] = {}
        for kind, sc in (("greedy", SamplingConfig(greedy=True)), ("sampled", SamplingConfig(temperature=1.0))):
            r = generate(model, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=[EOS], pad_id=PAD, sampling=sc, seed=SEED)
            out[v][kind] = [{"tokens": [int(t) for t in r.tokens[i, : r.lengths[i]]],
                             "logprobs": [float(x) for x in np.asarray(r.logprobs[i, : r.lengths[i]], np.float64)]}
                            for i in range(len(PROMPTS))]
    return out


def run_tree(tree: str, ckpts: dict) -> dict:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", tree, json.dumps(ckpts)],
                       capture_output=True, text=True, env=env, cwd=tree)
    if p.returncode:
        raise RuntimeError(f"worker for {tree} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def hf_greedy(model) -> list:
    import torch

    rows = []
    for p in PROMPTS:
        with torch.no_grad():
            g = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS,
                               pad_token_id=PAD, output_scores=True, return_dict_in_generate=True)
        toks = g.sequences[0, len(p):].tolist()
        lps = [float(torch.log_softmax(s[0].double(), -1)[t]) for s, t in zip(g.scores, toks)]
        rows.append({"tokens": toks, "logprobs": lps})
    return rows


def compare(a: list, b: list) -> dict:
    same = [x["tokens"] == y["tokens"] for x, y in zip(a, b)]
    d = [abs(p - q) for x, y in zip(a, b) if x["tokens"] == y["tokens"] for p, q in zip(x["logprobs"], y["logprobs"])]
    return {"rows": len(same), "identical_rows": int(sum(same)), "max_abs_logprob_diff": max(d) if d else None}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        print(json.dumps(worker(argv[1], json.loads(argv[2]))))
        return None
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="qwen3,olmo3,qwen3_window", help="names from tests/hf_fixtures.py")
    ap.add_argument("--before", default=None, help="also run the lrmq of this git commit and compare")
    ap.add_argument("--git", default=os.environ.get("LRMQ_GIT", REPO), help="git repository holding --before")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    threads = set_threads(a.threads)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import transformers
    from hf_fixtures import save_hf_model_dir

    info = machine_info(threads)
    info["lrmq_commit"] = source_commit()
    info["transformers"] = transformers.__version__
    res = {"benchmark": "generation_parity", "argv": argv, "machine": info, "prompts": PROMPTS,
           "max_new_tokens": MAX_NEW, "eos_id": EOS, "sampling_seed": SEED, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ckpts, hf = {}, {}
        for v in a.variants.split(","):
            ckpts[v] = os.path.join(tmp, v)
            hf[v] = hf_greedy(save_hf_model_dir(v, ckpts[v]))
        now = run_tree(REPO, ckpts)
        before = None
        if a.before:
            full = subprocess.run(["git", "-C", a.git, "rev-parse", a.before], capture_output=True, text=True,
                                  check=True).stdout.strip()
            res["before_commit"] = full
            old = os.path.join(tmp, "before")
            os.makedirs(old)
            arch = subprocess.run(["git", "-C", a.git, "archive", full, "lrmq"], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", old], input=arch.stdout, check=True)
            before = run_tree(old, ckpts)
    rows = []
    for v in ckpts:
        r = {"hf_greedy": hf[v], "lrmq_greedy": now[v]["greedy"], "lrmq_sampled": now[v]["sampled"],
             "greedy_vs_hf": compare(now[v]["greedy"], hf[v])}
        if before:
            r.update(before_greedy=before[v]["greedy"], before_sampled=before[v]["sampled"],
                     greedy_vs_before=compare(now[v]["greedy"], before[v]["greedy"]),
                     sampled_vs_before=compare(now[v]["sampled"], before[v]["sampled"]))
        res["variants"][v] = r
        g = r["greedy_vs_hf"]
        row = [v, f"{g['identical_rows']}/{g['rows']}", f"{g['max_abs_logprob_diff']:.2g}"]
        if before:
            gb, sb = r["greedy_vs_before"], r["sampled_vs_before"]
            row += [f"{gb['identical_rows']}/{gb['rows']}", f"{sb['identical_rows']}/{sb['rows']}",
                    f"{max(gb['max_abs_logprob_diff'] or 0, sb['max_abs_logprob_diff'] or 0):.2g}"]
        rows.append(row)
    hdr = ["model", "greedy rows = HF", "max abs logprob diff vs HF"]
    if before:
        hdr += ["greedy rows = before", "sampled rows = before", "max abs logprob diff vs before"]
    print(md_table(hdr, rows))
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
