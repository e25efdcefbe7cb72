"""lrmq's compressed-tensors export vs llmcompressor's own output for the same quantized values, and which
consumer stack loads which (transformers ``CompressedTensorsConfig(dequantize=True|False)``).

Needs llmcompressor in a side virtualenv (never a dependency of lrmq), given by ``--llmc-python`` or
$LLMC_PYTHON (default /work/llmcvenv/bin/python), as for benchmarks/ptq_vs_llmcompressor.py::

    python3.11 -m venv /work/llmcvenv
    /work/llmcvenv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1

(llmcompressor 0.14.0.1 pins compressed-tensors 0.19.0 and transformers <= 5.17, so that venv is also the
"older consumer stack"; this venv, with lrmq's ``test`` extra, is transformers 5.24 + compressed-tensors 0.20.1.)

Per case (bits, symmetric, group size, PTQ method) on the shipped tiny model (lrmq/assets/tiny: 2 layers,
14 Linears of 128..384 rows, tied embeddings):

1. lrmq quantizes (RTN or AWQ) and writes its ``fake_quant`` (float32) and ``compressed_tensors``
   (float32 scales) exports, plus the values: dequantized weight, scales, signed zero points ``z - 2^(b-1)``.
2. llmcompressor (``tests/scripts/ct_llmcompressor_worker.py write``) runs ``oneshot`` with a data-free
   ``QuantizationModifier`` of the same scheme on lrmq's fake_quant export (so AWQ's folded norms are the
   same), overwrites each quantized Linear's ``weight``/``weight_scale``/``weight_zero_point`` with lrmq's
   values and saves with ``save_compressed=True``; compressed-tensors 0.20.1 alone (this venv, the worker's
   ``ct-write``: the steps of llmcompressor's save wrapper) writes a third checkpoint of the same values.
3. lrmq's ``model.safetensors`` is compared with each reference's tensor by tensor (names, shapes, dtypes,
   bytes), and the ``quantization_config`` s key by key (``compare_dirs`` in the worker).
4. All three are loaded by transformers both ways in both stacks (the worker's ``load``); the logits are
   compared with lrmq's own forward of the quantized model (float32).

    .venv/bin/python benchmarks/ct_export_vs_llmcompressor.py --out docs/figures/ct_export_vs_llmcompressor.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

sys.path.insert(0, os.path.join(common.REPO, "tests", "scripts"))
import ct_llmcompressor_worker as worker  # noqa: E402

TINY = os.path.join(common.REPO, "lrmq", "assets", "tiny")
WORKER = worker.__file__
TOKS_SHAPE = (1, 24)
WRITERS = {"lrmq": "lrmq", "llmc": "llmcompressor", "ct": "compressed-tensors (this venv)"}
# (bits, symmetric, group_size, method)
CASES = [(b, s, 32, "rtn") for b in (4, 8) for s in (True, False)] + [
    (3, False, 32, "rtn"), (3, True, 32, "rtn"), (4, False, 32, "awq"), (8, True, -1, "rtn"), (4, False, -1, "rtn")]


def lrmq_side(bits, symmetric, group, method, out):
    """lrmq's exports + the values npz; returns lrmq's own logits (float32)."""
    import jax.numpy as jnp
    import numpy as np

    from lrmq.checkpoint.hf import load_hf_model
    from lrmq.ptq.exports import save_compressed_tensors, save_fake_quant

    m = load_hf_model(TINY)
    if method == "rtn":
        from lrmq.ptq.rtn import rtn_quantize_model

        r = rtn_quantize_model(m, bits=bits, group_size=group, symmetric=symmetric)
    else:
        from lrmq.ptq.awq import AWQOptions, awq_quantize_model

        toks = np.random.default_rng(0).integers(0, 300, (2, 64))
        r = awq_quantize_model(m, toks, AWQOptions(bits=bits, group_size=group, symmetric=symmetric, n_grid=5,
                                                   batch_size=2), progress=False)
    save_compressed_tensors(m, r, os.path.join(out, "lrmq"), dtype="float32", tokenizer_from=TINY)
    save_fake_quant(m, os.path.join(out, "fake_quant"), dtype="float32", tokenizer_from=TINY)
    np.savez(os.path.join(out, "values.npz"), **worker.lrmq_values(m, r, "float32"))
    toks = np.arange(TOKS_SHAPE[1])[None] % 300
    return np.asarray(m(jnp.asarray(toks)), np.float32), toks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--work", default="/tmp/lrmq_ct_vs_llmc")
    ap.add_argument("--llmc-python", default=os.environ.get("LLMC_PYTHON", "/work/llmcvenv/bin/python"))
    ap.add_argument("--cases", default="", help="indices into CASES, comma-separated (default: all)")
    args = ap.parse_args(argv)
    import numpy as np

    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    rows, results, dirs = [], [], []
    for bits, sym, group, method in cases:
        name = f"{method}_w{bits}_{'sym' if sym else 'asym'}_g{group}"
        d = os.path.join(args.work, name)
        os.makedirs(d)
        t0 = time.perf_counter()
        ref, toks = lrmq_side(bits, sym, group, method, d)
        np.save(os.path.join(d, "ref_logits.npy"), ref)
        p = subprocess.run([args.llmc_python, WORKER, "write", os.path.join(d, "fake_quant"),
                            os.path.join(d, "values.npz"), os.path.join(d, "llmc")], capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"llmcompressor worker failed for {name}:\n{p.stderr[-4000:]}")
        p = subprocess.run([sys.executable, WORKER, "ct-write", os.path.join(d, "fake_quant"),
                            os.path.join(d, "values.npz"), os.path.join(d, "ct")], capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"compressed-tensors writer failed for {name}:\n{p.stderr[-4000:]}")
        cmp = {"llmc": worker.compare_dirs(os.path.join(d, "lrmq"), os.path.join(d, "llmc")),
               "ct": worker.compare_dirs(os.path.join(d, "lrmq"), os.path.join(d, "ct"))}
        results.append({"case": name, "bits": bits, "symmetric": sym, "group_size": group, "method": method,
                        "compare": cmp, "seconds": time.perf_counter() - t0})
        dirs += [os.path.join(d, w) for w in WRITERS]
        for w, c in cmp.items():
            print(f"{name} lrmq vs {WRITERS[w]}: {c['n_tensors']} tensors, identical: {c['tensors_identical']} "
                  f"{c['mismatched'][:3]}; quantization_config only in {w}: {c['config_only_in_b']}, only in lrmq: "
                  f"{c['config_only_in_a']}, different: {c['config_differ']}", flush=True)
    np.save(os.path.join(args.work, "toks.npy"), toks)
    stacks = {}
    for stack, py in (("this venv", sys.executable), ("llmcompressor venv", args.llmc_python)):
        res = os.path.join(args.work, f"load_{len(stacks)}.json")
        p = subprocess.run([py, WORKER, "load", os.path.join(args.work, "toks.npy"), res, *dirs],
                           capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"load worker failed in {stack}:\n{p.stderr[-4000:]}")
        with open(res) as f:
            stacks[stack] = json.load(f)
    for r in results:
        d = os.path.join(args.work, r["case"])
        ref = np.load(os.path.join(d, "ref_logits.npy"))
        r["loads"] = {}
        for stack, s in stacks.items():
            v = s["versions"]
            key = f"transformers {v['transformers']} + compressed-tensors {v['compressed_tensors']}"
            for who in WRITERS:
                for mode, x in s["loads"][os.path.join(d, who)].items():
                    e = {"ok": x["ok"]}
                    if x["ok"]:
                        e["max_abs_logit_diff_vs_lrmq_forward"] = float(np.abs(np.load(x["logits"]) - ref).max())
                    else:
                        e["error"] = x["error"]
                    r["loads"].setdefault(key, {}).setdefault(who, {})[mode] = e
        for key, by in r["loads"].items():
            cell = lambda who: "/".join(("yes" if by[who][m]["ok"] else "NO") for m in ("dequantize", "compressed"))  # noqa: E731
            diffs = [e["max_abs_logit_diff_vs_lrmq_forward"] for w in by.values() for e in w.values() if e["ok"]]
            same = all(c["tensors_identical"] for c in r["compare"].values())
            rows.append([r["case"], same, key, *(cell(w) for w in WRITERS), f"{max(diffs):.1e}" if diffs else "-"])
    print(common.md_table(["case", "tensors identical (llmc, ct)", "stack",
                           *(f"{w} loads (dequantize/compressed)" for w in WRITERS.values()),
                           "max |logit diff| vs lrmq forward"], rows))
    common.write_json(args.out, {
        "benchmark": "ct_export_vs_llmcompressor", "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "lrmq_commit": common.source_commit(), "model": "lrmq/assets/tiny (float32, tied embeddings)",
        "stacks": {k: v["versions"] for k, v in stacks.items()},
        "llmcompressor": json.load(open(os.path.join(args.work, results[0]["case"], "llmc", "versions.json"))),
        "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
