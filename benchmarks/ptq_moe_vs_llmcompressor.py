"""GPTQ per expert on a Qwen3-MoE: lrmq's compressed-tensors export vs llmcompressor's own oneshot GPTQ W4A16 output,
tensor for tensor, on the same model and calibration tokens.

Needs llmcompressor in a side virtualenv (never a dependency of lrmq), ``--llmc-python`` or $LLMC_PYTHON (default
/tmp/llmcvenv/bin/python; llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17, torch CPU), as for
benchmarks/ct_export_vs_llmcompressor.py, whose worker (tests/scripts/ct_llmcompressor_worker.py) runs both the
llmcompressor side (``gptq``) and the transformers loads (``load``).

The model: the shipped tiny MoE (lrmq/assets/tiny-moe, an HF Qwen3-MoE checkpoint in float32: 3 layers sparse /
dense / sparse, 8 experts of width 64, top-2). The calibration: lrmq's ``prompts`` recipe (the flag form's recipe
for lrmq's data JSONL: each problem rendered with the chat template) over synthetic arithmetic problems, cut into
``--blocks`` blocks of ``--block-size`` tokens, computed once by lrmq (``lrmq.ptq.pipeline.calibration_tokens``)
and handed to both sides in the same order.

Both sides run llmcompressor's GPTQ W4A16 recipe as its Qwen3-MoE example does (router ``mlp.gate`` and
``lm_head`` ignored, every expert calibrated on every token, ``moe_calibrate_all_experts=True``, its default):
symmetric int4, group ``--group`` (64: 128, W4A16's preset, does not divide the experts' down_proj K=64, and
llmcompressor 0.14 fails on it in its observer), activation order "static" (llmcompressor's default), block 128,
dampening 0.01, one float forward per layer for the Hessians, the next layer fed by the quantized layer's output.
lrmq: ``gptq.act_order=true gptq.static_groups=true gptq.true_sequential=false calibration.moe_experts=all``
(``gptq_quantize_model`` in process, then ``save_compressed_tensors(dtype="float32")``: float32 scales, as
llmcompressor writes for a float32 model).

Reported: names / shapes / dtypes of every tensor and the ``quantization_config`` key by key (the worker's
``compare_dirs``); per tensor kind (attention q/k/v/o, the dense layer's MLP, the experts' gate/up/down, the
routers and the other float tensors) the max |difference| of the dequantized weights and of the scales, the share
of int4 codes that differ and the largest code difference; and the logits of both checkpoints loaded by
transformers (``CompressedTensorsConfig(dequantize=True)``) on held-out tokens, against each other and against the
float model's.

    .venv/bin/python benchmarks/ptq_moe_vs_llmcompressor.py --out docs/figures/ptq_moe_vs_llmcompressor.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

sys.path.insert(0, os.path.join(common.REPO, "tests", "scripts"))
import ct_llmcompressor_worker as worker  # noqa: E402

TINY_MOE = os.path.join(common.REPO, "lrmq", "assets", "tiny-moe")


def kind(name: str) -> str:
    """The tensor kind of an HF module name, for the per-kind table."""
    if ".experts." in name:
        return "experts." + re.search(r"(gate|up|down)_proj", name).group(0)
    if name.endswith(".mlp.gate"):
        return "router (float)"
    if ".self_attn." in name and name.endswith("_proj"):
        return "attention " + name.rsplit(".", 1)[1]
    if ".mlp." in name:
        return "dense mlp " + name.rsplit(".", 1)[1]
    return "other float"


def calibration(work: str, n_blocks: int, block_size: int):
    """lrmq's prompts-recipe calibration tokens over synthetic arithmetic problems (int [n_blocks, block_size])."""
    import numpy as np

    from lrmq.data.synthetic import make_splits, write_jsonl
    from lrmq.ptq.config import load_quantize_config
    from lrmq.ptq.pipeline import calibration_tokens

    path = os.path.join(work, "calib.jsonl")
    write_jsonl(path, make_splits(512, 0, 7)[0])
    cfg = load_quantize_config(None, [f"model={TINY_MOE}", "method=gptq", f"calibration.path={path}",
                                      "calibration.source=prompts", f"calibration.block_size={block_size}",
                                      "calibration.n_samples=512", f"calibration.max_blocks={n_blocks}"])
    toks = calibration_tokens(cfg, TINY_MOE)
    if toks.shape[0] < n_blocks:
        raise RuntimeError(f"only {toks.shape[0]} calibration blocks of {block_size} tokens")
    return np.asarray(toks, np.int64), path


def lrmq_side(toks, group: int, out: str) -> dict:
    import numpy as np

    from lrmq.checkpoint.load import load_model
    from lrmq.ptq.exports import save_compressed_tensors
    from lrmq.ptq.gptq_model import GPTQOptions, gptq_quantize_model

    model = load_model(TINY_MOE)
    opts = GPTQOptions(bits=4, group_size=group, symmetric=True, act_order=True, static_groups=True,
                       true_sequential=False, propagate="quantized", moe_calibration="all", batch_size=8)
    t0 = time.perf_counter()
    result = gptq_quantize_model(model, np.asarray(toks, np.int32), opts, progress=False)
    t = time.perf_counter() - t0
    save_compressed_tensors(model, result, out, dtype="float32", tokenizer_from=TINY_MOE)
    return {"seconds": t, "options": {k: getattr(opts, k) for k in opts.__dataclass_fields__}}


def tensors_by_kind(a_dir: str, b_dir: str, llmc_values: str) -> dict:
    """Per tensor kind: max |dequantized weight diff|, max |scale diff|, share of differing codes, max code diff."""
    import numpy as np
    from safetensors.numpy import load_file

    from lrmq.ptq import export_formats as ef

    ta, tb = (load_file(os.path.join(d, "model.safetensors")) for d in (a_dir, b_dir))
    vals = np.load(llmc_values)
    rows: dict[str, dict] = {}
    modules = sorted({k.rsplit(".", 1)[0] for k in ta if k.endswith(".weight_packed")})
    for m in modules:
        get = lambda t: {k[len(m) + 1:]: v for k, v in t.items() if k.startswith(m + ".")}  # noqa: E731
        ca, sa, za, _ = ef.ct_pack_quantized_import(get(ta), bits=4, symmetric=True)
        cb, sb, zb, _ = ef.ct_pack_quantized_import(get(tb), bits=4, symmetric=True)
        wa = ef.dequantize(ca, sa, za, dtype="float32").T
        wb = vals["w:" + m]  # llmcompressor's own dequantized weight before compression
        wb_packed = ef.dequantize(cb, sb, zb, dtype="float32").T
        r = rows.setdefault(kind(m), {"tensors": 0, "max_abs_weight_diff": 0.0, "max_abs_scale_diff": 0.0,
                                      "max_rel_scale_diff": 0.0, "codes": 0, "codes_differing": 0,
                                      "max_code_diff": 0, "llmc_packed_equals_its_weight": True})
        r["tensors"] += 1
        r["max_abs_weight_diff"] = max(r["max_abs_weight_diff"], float(np.abs(wa - wb).max()))
        r["max_abs_scale_diff"] = max(r["max_abs_scale_diff"], float(np.abs(sa - sb).max()))
        r["max_rel_scale_diff"] = max(r["max_rel_scale_diff"], float((np.abs(sa - sb) / np.abs(sb)).max()))
        d = np.abs(ca.astype(int) - cb.astype(int))
        r["codes"] += int(d.size)
        r["codes_differing"] += int((d > 0).sum())
        r["max_code_diff"] = max(r["max_code_diff"], int(d.max()))
        r["llmc_packed_equals_its_weight"] &= bool(np.array_equal(wb_packed, wb))
    for k in sorted(set(ta) & set(tb)):
        if k.endswith(".weight") and not any(k.startswith(m + ".") for m in modules):
            r = rows.setdefault(kind(k[: -len(".weight")]), {"tensors": 0, "bit_identical": True})
            r["tensors"] += 1
            r["bit_identical"] &= ta[k].dtype == tb[k].dtype and ta[k].tobytes() == tb[k].tobytes()
    for r in rows.values():
        if "codes" in r:
            r["share_codes_differing"] = r["codes_differing"] / r["codes"]
    return rows


def first_layer_check(toks, group: int, llmc_dir: str, lrmq_dir: str, tf_hessians: str) -> dict:
    """Layer 0 (the same float input on both sides): lrmq's Hessian of every Linear against the one llmcompressor's
    GPTQ used (the worker records them), and lrmq's GPTQ (``gptq_quantize``) run on llmcompressor's Hessian against
    llmcompressor's codes, per kind: what of the code differences is the statistics and what GPTQ's arithmetic."""
    import numpy as np
    from safetensors.numpy import load_file

    from lrmq.checkpoint.load import load_model
    from lrmq.ptq import export_formats as ef
    from lrmq.ptq import layer_fn as lf
    from lrmq.ptq.gptq import gptq_codes, gptq_quantize
    from lrmq.ptq.gptq_model import hessian
    from lrmq.ptq.layerwise import embed_tokens, positions_for

    model = load_model(TINY_MOE)
    cfg = model.cfg
    p0 = {k: np.asarray(v, np.float32) for k, v in lf.get_layer_params(model.layers[0]).items()}
    x0 = embed_tokens(model, np.asarray(toks, np.int32))
    _, caps = lf.layer_forward(p0, lf.layer_spec(cfg, 0), x0, positions_for(*toks.shape), capture=True)
    caps = {k: np.asarray(v) for k, v in caps.items()}
    h_in = {k: hessian(v) for k, v in caps.items()}
    hid = np.asarray(lf.expert_hidden(caps["mlp_in"], p0["gate_proj"], p0["up_proj"]))
    hc = np.load(os.path.join(llmc_dir, "hessians.npz"))
    tf = np.load(tf_hessians)
    rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())  # noqa: E731
    tensors = {w: load_file(os.path.join(d, "model.safetensors")) for w, d in (("llmc", llmc_dir), ("lrmq", lrmq_dir))}
    out: dict[str, dict] = {}
    for m in hc.files:
        leaf = m.rsplit(".", 1)[1]
        if ".experts." in m:
            e = int(m.split(".experts.")[1].split(".")[0])
            w = p0[leaf][e]
            h = h_in["mlp_in"] if leaf != "down_proj" else np.float32(2.0 / toks.shape[0]) * (hid[e].T @ hid[e])
        else:
            w, h = p0[leaf], h_in[lf.INPUT_OF[leaf]]
        ref = hc[m]
        res = gptq_quantize(w, ref, bits=4, group_size=group, symmetric=True, act_order=True, static_groups=True)
        codes = {who: ef.ct_pack_quantized_import({k[len(m) + 1:]: v for k, v in t.items() if k.startswith(m + ".")},
                                                  bits=4, symmetric=True)[0] for who, t in tensors.items()}
        r = out.setdefault(kind(m), {"linears": 0, "max_rel_hessian_diff": 0.0, "codes": 0,
                                     "max_rel_diff_lrmq_vs_transformers_causal": 0.0,
                                     "max_rel_diff_llmc_vs_transformers_causal": 0.0,
                                     "max_rel_diff_llmc_vs_transformers_no_mask": 0.0,
                                     "codes_differing_lrmq_gptq_on_llmc_hessian": 0, "codes_differing_lrmq_run": 0})
        r["linears"] += 1
        r["max_rel_hessian_diff"] = max(r["max_rel_hessian_diff"], rel(h, ref))
        for k, a, b in (("lrmq_vs_transformers_causal", h, tf["causal:" + m]),
                        ("llmc_vs_transformers_causal", ref, tf["causal:" + m]),
                        ("llmc_vs_transformers_no_mask", ref, tf["nomask:" + m])):
            r["max_rel_diff_" + k] = max(r["max_rel_diff_" + k], rel(a, b))
        r["codes"] += codes["llmc"].size
        r["codes_differing_lrmq_gptq_on_llmc_hessian"] += int((gptq_codes(res, 4) != codes["llmc"]).sum())
        r["codes_differing_lrmq_run"] += int((codes["lrmq"] != codes["llmc"]).sum())
    for r in out.values():
        for k in ("codes_differing_lrmq_gptq_on_llmc_hessian", "codes_differing_lrmq_run"):
            r["share_" + k] = r[k] / r["codes"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--work", default="/tmp/lrmq_ptq_moe_vs_llmc")
    ap.add_argument("--llmc-python", default=os.environ.get("LLMC_PYTHON", "/tmp/llmcvenv/bin/python"))
    ap.add_argument("--blocks", type=int, default=16, help="calibration blocks")
    ap.add_argument("--block-size", type=int, default=128, help="tokens per calibration block")
    ap.add_argument("--group", type=int, default=64, help="group size (int4 symmetric, W4A16)")
    args = ap.parse_args(argv)
    import numpy as np

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    toks, calib = calibration(args.work, args.blocks, args.block_size)
    np.save(os.path.join(args.work, "calib.npy"), toks)
    dirs = {w: os.path.join(args.work, w) for w in ("lrmq", "llmc")}
    lrmq_run = lrmq_side(toks, args.group, dirs["lrmq"])
    t0 = time.perf_counter()
    p = subprocess.run([args.llmc_python, worker.__file__, "gptq", TINY_MOE, os.path.join(args.work, "calib.npy"),
                        dirs["llmc"], str(args.group)], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"llmcompressor worker failed:\n{p.stderr[-4000:]}")
    llmc_seconds = time.perf_counter() - t0
    cmp = worker.compare_dirs(dirs["lrmq"], dirs["llmc"])
    by_kind = tensors_by_kind(dirs["lrmq"], dirs["llmc"], os.path.join(dirs["llmc"], "values.npz"))
    tf_h = os.path.join(args.work, "tf_hessians.npz")
    p = subprocess.run([args.llmc_python, worker.__file__, "hessians", TINY_MOE, os.path.join(args.work, "calib.npy"),
                        tf_h], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"hessians worker failed:\n{p.stderr[-4000:]}")
    layer0 = first_layer_check(toks, args.group, dirs["llmc"], dirs["lrmq"], tf_h)
    # transformers loads (both venvs) of both checkpoints and the float model, on held-out tokens
    held = np.asarray(calibration_held_out(args.work, args.block_size), np.int64)
    np.save(os.path.join(args.work, "held.npy"), held)
    loads = {}
    for stack, py in (("lrmq venv", sys.executable), ("llmcompressor venv", args.llmc_python)):
        res = os.path.join(args.work, f"load_{len(loads)}.json")
        p = subprocess.run([py, worker.__file__, "load", os.path.join(args.work, "held.npy"), res, dirs["lrmq"],
                            dirs["llmc"]], capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"load worker failed in {stack}:\n{p.stderr[-4000:]}")
        loads[stack] = json.load(open(res))
    logits = {}
    float_logits = float_forward(held)
    for stack, s in loads.items():
        v = s["versions"]
        key = f"{stack}: transformers {v['transformers']} + compressed-tensors {v['compressed_tensors']}"
        e = {}
        for who in ("lrmq", "llmc"):
            x = s["loads"][dirs[who]]["dequantize"]
            e[who] = x if not x["ok"] else {"ok": True, "logits": np.load(x["logits"])}
        if e["lrmq"]["ok"] and e["llmc"]["ok"]:
            a, b = e["lrmq"]["logits"], e["llmc"]["logits"]
            logits[key] = {"max_abs_logit_diff_lrmq_vs_llmc": float(np.abs(a - b).max()),
                           "max_abs_logit_diff_lrmq_vs_float": float(np.abs(a - float_logits).max()),
                           "max_abs_logit_diff_llmc_vs_float": float(np.abs(b - float_logits).max()),
                           "argmax_agreement_lrmq_vs_llmc": float((a.argmax(-1) == b.argmax(-1)).mean()),
                           "logit_scale_float": float(np.abs(float_logits).max())}
        else:
            logits[key] = {who: e[who].get("error") for who in e if not e[who]["ok"]}
    rows = [[k, r["tensors"], f"{r.get('max_abs_weight_diff', 0):.2e}" if "codes" in r else "-",
             f"{r['max_abs_scale_diff']:.2e}" if "codes" in r else "-",
             f"{100 * r['share_codes_differing']:.3f}% (max {r['max_code_diff']})" if "codes" in r else "-",
             r.get("bit_identical", "-")] for k, r in sorted(by_kind.items())]
    print(common.md_table(["tensor kind", "tensors", "max |dW|", "max |d scale|", "codes differing",
                           "float bit-identical"], rows))
    print(f"names identical: {not cmp['only_in_a'] and not cmp['only_in_b']} ({cmp['n_tensors']} tensors); "
          f"shapes/dtypes differing: {[m for m in cmp['mismatched'] if 'values differ' not in m][:5]}; "
          f"quantization_config only in lrmq: {cmp['config_only_in_a']}, only in llmcompressor: "
          f"{cmp['config_only_in_b']}, different: {cmp['config_differ']}")
    print(common.md_table(["layer 0 kind", "linears", "max rel |H lrmq - H llmc|", "lrmq vs tf causal",
                           "llmc vs tf causal", "llmc vs tf no mask", "codes differing (lrmq run)",
                           "codes differing (lrmq GPTQ on llmc's H)"],
                          [[k, r["linears"], f"{r['max_rel_hessian_diff']:.1e}",
                            f"{r['max_rel_diff_lrmq_vs_transformers_causal']:.1e}",
                            f"{r['max_rel_diff_llmc_vs_transformers_causal']:.1e}",
                            f"{r['max_rel_diff_llmc_vs_transformers_no_mask']:.1e}",
                            f"{100 * r['share_codes_differing_lrmq_run']:.3f}%",
                            f"{100 * r['share_codes_differing_lrmq_gptq_on_llmc_hessian']:.3f}%"]
                           for k, r in sorted(layer0.items())]))
    for k, v in logits.items():
        print(k, json.dumps(v))
    common.write_json(args.out, {
        "benchmark": "ptq_moe_vs_llmcompressor", "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": common.machine_info(), "lrmq_commit": common.source_commit(),
        "model": "lrmq/assets/tiny-moe (Qwen3-MoE, float32: 3 layers sparse/dense/sparse, 8 experts x 64, top-2)",
        "calibration": {"recipe": "prompts (chat template) over lrmq.data.synthetic arithmetic problems",
                        "blocks": list(toks.shape)},
        "scheme": f"W4A16 int4 symmetric group {args.group}, actorder static, ignore lm_head + re:.*mlp.gate$",
        "lrmq": lrmq_run, "llmcompressor": {"seconds_with_start": llmc_seconds,
                                            "versions": json.load(open(os.path.join(dirs["llmc"], "versions.json")))},
        "names_identical": not cmp["only_in_a"] and not cmp["only_in_b"],
        "shape_or_dtype_mismatches": [m for m in cmp["mismatched"] if "values differ" not in m],
        "n_tensors": cmp["n_tensors"], "config_only_in_lrmq": cmp["config_only_in_a"],
        "config_only_in_llmc": cmp["config_only_in_b"], "config_differ": cmp["config_differ"],
        "by_kind": by_kind, "layer0": layer0, "logits": logits})
    return 0


def calibration_held_out(work: str, block_size: int):
    """Held-out tokens for the logit comparison: the prompts recipe over other synthetic problems, 4 blocks."""
    from lrmq.data.synthetic import make_splits, write_jsonl
    from lrmq.ptq.config import load_quantize_config
    from lrmq.ptq.pipeline import calibration_tokens

    path = os.path.join(work, "held.jsonl")
    write_jsonl(path, make_splits(64, 0, 99)[0])
    cfg = load_quantize_config(None, [f"model={TINY_MOE}", "method=gptq", f"calibration.path={path}",
                                      "calibration.source=prompts", f"calibration.block_size={block_size}",
                                      "calibration.max_blocks=4"])
    return calibration_tokens(cfg, TINY_MOE)


def float_forward(toks):
    import jax.numpy as jnp
    import numpy as np

    from lrmq.checkpoint.load import load_model

    return np.asarray(load_model(TINY_MOE)(jnp.asarray(np.asarray(toks, np.int32))), np.float32)


if __name__ == "__main__":
    sys.exit(main())
