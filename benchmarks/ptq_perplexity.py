"""W3 g128 perplexity of FP / RTN / AWQ / GPTQ on the tiny structured Qwen3 model of tests/test_awq.py.

The model (Qwen3 shape, hidden 256, 2 layers, vocab 128, byte-level BPE of 96 tokens) is trained for
150 steps on synthetic arithmetic text (`lrmq.data.synthetic`, seed 3), exactly as `structured_model`
in tests/test_awq.py builds it; variant `outliers` then plants activation-outlier channels by a
function-preserving rescale (the model the tests use), variant `plain` skips that step. Each method
quantizes the seven projections of both layers at 3 bits, group 128, asymmetric (`rtn_quantize_model`,
`awq_quantize_model`, `gptq_quantize_model`: the functions `python -m lrmq.quantize --method rtn|awq|gptq`
runs), AWQ / GPTQ calibrated on the first 64 training documents, concatenated and cut into blocks of
128 tokens (14 blocks; `calib_blocks` of tests/test_awq.py). Perplexity is
`lrmq.perplexity`'s protocol on the held-out documents (300, joined by "\\n\\n"): non-overlapping
windows of 128 tokens, exp(mean NLL), computed per window so that the spread is known:

* `se_nll`: standard error of the mean NLL over the windows (windows as independent samples);
  `ppl_se` = ppl * se_nll (delta method).
* `vs_fp`: the paired per-window NLL difference to FP (same windows), its standard error and z.

    python benchmarks/ptq_perplexity.py --out docs/figures/ptq_perplexity.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import REPO, machine_info, machine_str, md_table, set_threads, source_commit, write_json  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "tests"))


class _TmpFactory:
    """The one method of pytest's tmp_path_factory that `structured_model` uses."""

    def __init__(self, root):
        self.root = root

    def mktemp(self, name):
        import pathlib

        p = pathlib.Path(self.root) / name
        p.mkdir(parents=True, exist_ok=False)
        return p


def stats(nll, fp=None) -> dict:
    import numpy as np

    nll = np.asarray(nll, np.float64)
    n = len(nll)
    m, se = float(nll.mean()), float(nll.std(ddof=1) / np.sqrt(n))
    out = {"ppl": float(np.exp(m)), "ppl_se": float(np.exp(m) * se), "nll": m, "se_nll": se, "windows": n,
           "window_nll": [float(x) for x in nll]}
    if fp is not None:
        d = nll - np.asarray(fp, np.float64)
        dse = float(d.std(ddof=1) / np.sqrt(n))
        out["vs_fp"] = {"nll_diff": float(d.mean()), "se": dse, "z": float(d.mean() / dse) if dse else None,
                        "ppl_ratio": float(np.exp(d.mean()))}
    return out


def run_variant(name: str, root: str, *, bits: int, group_size: int) -> dict:
    import test_awq as ta

    from lrmq.checkpoint.load import load_model
    from lrmq.ptq.awq import AWQOptions, awq_quantize_model
    from lrmq.ptq.gptq_model import GPTQOptions, gptq_quantize_model
    from lrmq.ptq.rtn import rtn_quantize_model

    ta._CACHE.clear()
    plant = ta.plant_outlier_channels
    if name == "plain":
        ta.plant_outlier_channels = lambda model, **kw: None
    try:
        t0 = time.perf_counter()
        d = ta.structured_model(_TmpFactory(os.path.join(root, name)))
        build_s = time.perf_counter() - t0
    finally:
        ta.plant_outlier_channels = plant
    ev = ta.eval_blocks(d)
    calib = ta.calib_blocks(d)
    nll, secs = {}, {}
    nll["fp"] = ta.window_nll(load_model(d["model"]), ev)
    for method in ("rtn", "awq", "gptq"):
        m = load_model(d["model"])
        t0 = time.perf_counter()
        if method == "rtn":
            rtn_quantize_model(m, bits=bits, group_size=group_size)
        elif method == "awq":
            awq_quantize_model(m, calib, AWQOptions(bits=bits, group_size=group_size), progress=False)
        else:
            gptq_quantize_model(m, calib, GPTQOptions(bits=bits, group_size=group_size), progress=False)
        secs[method] = time.perf_counter() - t0
        nll[method] = ta.window_nll(m, ev)
        print(f"{name}: {method} done ({secs[method]:.1f} s)", flush=True)
    methods = {k: dict(stats(v, None if k == "fp" else nll["fp"]), quantize_s=secs.get(k)) for k, v in nll.items()}
    return {"variant": name, "outliers_planted": name == "outliers", "build_s": build_s,
            "eval_windows": int(ev.shape[0]), "window": int(ev.shape[1]), "calib_blocks": list(calib.shape),
            "methods": methods}


def table(res: dict) -> str:
    rows = []
    for k, r in res["methods"].items():
        v = r.get("vs_fp")
        rows.append([k.upper() if k != "fp" else "FP", f"{r['ppl']:.3f} ± {r['ppl_se']:.3f}",
                     "" if v is None else f"{v['nll_diff']:+.4f} ± {v['se']:.4f}",
                     "" if v is None else f"{v['z']:.1f}"])
    return md_table(["method", "ppl ± SE", "NLL - FP (nats/token) ± SE, paired", "z"], rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="outliers,plain", help="comma-separated: outliers, plain")
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    a = ap.parse_args(argv)
    threads = set_threads(a.threads)
    import tempfile

    info = machine_info(threads)
    info["lrmq_commit"] = source_commit()
    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as root:
        for v in a.variants.split(","):
            res = run_variant(v, root, bits=a.bits, group_size=a.group_size)
            results.append(res)
            print(f"\n{v} (W{a.bits} g{a.group_size}, {res['eval_windows']} windows of {res['window']}):\n"
                  f"{table(res)}\n", flush=True)
    info["wall_s"] = time.perf_counter() - t0
    print(machine_str(info))
    write_json(a.out, {"benchmark": "ptq_perplexity", "argv": sys.argv[1:] if argv is None else argv,
                       "bits": a.bits, "group_size": a.group_size, "machine": info, "results": results})
    return results


if __name__ == "__main__":
    main()
