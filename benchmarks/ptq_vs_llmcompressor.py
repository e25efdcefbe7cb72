"""PTQ wall time and quality: lrmq (`python -m lrmq.quantize`) vs llmcompressor (`oneshot`), AWQ and GPTQ.

Needs llmcompressor in a side virtualenv (never a dependency of lrmq), given by ``--llmc-python`` or
$LLMC_PYTHON (default /work/llmcvenv/bin/python), e.g.::

    python3.11 -m venv /work/llmcvenv
    /work/llmcvenv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1

The model: a Qwen3-shaped ~100M checkpoint (hidden 768, 12 layers, 12 heads / 4 kv heads, head_dim 64,
intermediate 3072, tied embeddings; lrmq's shipped tiny character tokenizer, vocab 320, so 104M of the
parameters are the 84 quantized Linears), trained briefly with torch (AdamW) on lrmq's synthetic arithmetic
text so that its predictions are sharp and quantization damage shows in the perplexity. Built once into
``--work`` and reused.

Same work on both sides: W``bits`` g``group`` asymmetric, every Linear of the decoder layers (lm_head
left float), the SAME calibration tokens (lrmq's ``text`` recipe over the calibration file, computed here
with lrmq's own ``calibration_tokens`` and handed to llmcompressor as ``input_ids``; default 4 blocks of
256 tokens, far below the usual 128 x 512, to fit a 2-core machine: both passes scale with it), float32 weights,
all cores (torch and XLA pools sized alike). lrmq runs its defaults (AWQ = llm-awq: activation-only scale
search, 20-point grid, auto-clip; GPTQ: blocksize 128, percdamp 0.01, true-sequential); llmcompressor
runs its documented recipes (``AWQModifier(scheme="W4A16_ASYM")`` = its AWQ transform, default
duo_scaling, no clip search, + a QuantizationModifier; ``GPTQModifier(scheme="W4A16_ASYM")``,
block_size 128, dampening 0.01, sequential pipeline). Each run is its own process (start-up, imports,
model load, calibration, the pass and writing the output all count); contenders alternate run by run, the
order flips every round, and all rounds of one method run before the next method (``--methods`` order;
``--method-rounds awq=1`` caps one method), the JSON rewritten after each pair, so a run cut short keeps
its complete pairs. "pass" = lrmq's per-layer loop (report.json ``seconds_per_layer``) / llmcompressor's
``oneshot`` call. Each process's peak RSS is read with ``os.wait4``.

One evaluator for every output: transformers (this venv) loads each output in float32 and computes the
perplexity of held-out arithmetic text (non-overlapping windows, ``window - 1`` predictions each).
llmcompressor's output is its compressed-tensors checkpoint (decompressed on load); lrmq writes the same
kind of output, its ``compressed_tensors`` export (bf16 scales, decompressed on load), and the perplexity
difference compares the two. ``--lrmq-formats fake_quant,compressed_tensors`` also has lrmq write its
float32 ``fake_quant`` export (its dequantized weights as computed; 416 MB more to write, inside the time).

    .venv/bin/python benchmarks/ptq_vs_llmcompressor.py --quick      # 2-layer model, 1 round (minutes)
    .venv/bin/python benchmarks/ptq_vs_llmcompressor.py --out docs/figures/ptq_vs_llmcompressor.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

TINY_DIR = os.path.join(common.REPO, "lrmq", "assets", "tiny")
ARCH = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
            intermediate_size=3072)
QUICK_ARCH = dict(ARCH, num_hidden_layers=2)
EOS = 271  # the tiny tokenizer's end-of-text id, between documents in the training / eval streams


# ----------------------------------------------------------------------------- model and data


def build(work: str, arch: dict, train_steps: int, seq: int, batch: int, seed: int, n_eval_windows: int) -> dict:
    """Model (HF dir), calibration file, eval tokens; returns the build record (cached in work/build.json)."""
    rec_path = os.path.join(work, "build.json")
    if os.path.exists(rec_path):
        with open(rec_path) as f:
            return json.load(f)
    import numpy as np
    import torch
    import transformers

    from lrmq.data.synthetic import make_splits
    from lrmq.tokenizer import Tokenizer

    os.makedirs(work, exist_ok=True)
    tok = Tokenizer.from_dir(TINY_DIR)
    n_train_docs = max(train_steps * batch * seq // 40, 4000)
    train, held = make_splits(n_train_docs + 4000, 3000, seed=seed)
    calib_docs, train = train[:4000], train[4000:]
    doc = lambda r: f"{r['problem']} {r['solution']}"  # noqa: E731
    with open(os.path.join(work, "calib.jsonl"), "w") as f:
        for r in calib_docs:
            f.write(json.dumps({"text": doc(r)}) + "\n")

    def stream(rows):
        ids = []
        for r in rows:
            ids.extend(tok.encode(doc(r)))
            ids.append(EOS)
        return np.asarray(ids, np.int64)

    train_ids, eval_ids = stream(train), stream(held)
    win = seq
    n_win = min(n_eval_windows, len(eval_ids) // win)
    np.save(os.path.join(work, "eval_tokens.npy"), eval_ids[: n_win * win].reshape(n_win, win))

    cfg = transformers.Qwen3Config(**arch, vocab_size=tok.vocab_size, tie_word_embeddings=True,
                                   max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
                                   bos_token_id=None, eos_token_id=EOS, pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    rng = np.random.default_rng(seed)
    losses, t0 = [], time.perf_counter()
    for step in range(train_steps):
        starts = rng.integers(0, len(train_ids) - seq - 1, size=batch)
        x = torch.from_numpy(np.stack([train_ids[s:s + seq] for s in starts]))
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if step % 10 == 0 or step == train_steps - 1:
            print(f"  train step {step}: loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    model.eval()
    mdir = os.path.join(work, "model")
    model.save_pretrained(mdir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TINY_DIR, name), mdir)
    rec = {"arch": arch, "vocab": tok.vocab_size, "params": sum(p.numel() for p in model.parameters()),
           "linear_params": sum(m.weight.numel() for n, m in model.named_modules()
                                if isinstance(m, torch.nn.Linear) and "layers." in n),
           "train": {"steps": train_steps, "batch": batch, "seq": seq, "lr": 1e-3, "optimizer": "AdamW(0.9, 0.95)",
                     "warmup_steps": 10, "loss_first": losses[0], "loss_last": losses[-1],
                     "loss_last10_mean": statistics.mean(losses[-10:]), "seconds": time.perf_counter() - t0},
           "text": "lrmq.data.synthetic arithmetic, '<problem> <solution>' documents separated by EOS",
           "eval_windows": n_win, "eval_window": win, "seed": seed}
    with open(rec_path, "w") as f:
        json.dump(rec, f, indent=2)
    return rec


# --matched: both sides on the same algorithm choices where their defaults differ. GPTQ: no activation
# ordering (lrmq's default; llmcompressor's default is actorder="static"). AWQ: llm-awq's activation-only
# scale search (lrmq's default; llmcompressor's default duo_scaling also uses the weights) and no clip
# search (llmcompressor has none; lrmq's default runs llm-awq's auto-clip).
MATCHED_LRMQ = {"awq": ["awq.clip=false"], "gptq": []}
MATCHED_LLMC = {"awq": "AWQModifier(duo_scaling=False)", "gptq": "GPTQModifier(actorder=None)"}


def lrmq_overrides(method: str, bits: int, group: int, n_blocks: int, block: int, work: str,
                   formats: str = "compressed_tensors") -> list[str]:
    return [f"model={os.path.join(work, 'model')}", f"method={method}", f"bits={bits}", f"group_size={group}",
            "symmetric=false", f"calibration.path={os.path.join(work, 'calib.jsonl')}", "calibration.source=text",
            f"calibration.block_size={block}", "calibration.n_samples=4000", "calibration.max_doc_tokens=512",
            f"calibration.max_blocks={n_blocks}", "progress=false", "outputs.dtype=float32",
            f"outputs.formats=[{formats}]"]


def calibration_npy(args, work: str) -> str:
    """lrmq's own calibration tokens for the run's settings, saved for llmcompressor (the same blocks)."""
    import numpy as np

    from lrmq.ptq.config import load_quantize_config
    from lrmq.ptq.pipeline import calibration_tokens

    cfg = load_quantize_config(None, lrmq_overrides("gptq", args.bits_list[0], args.group, args.n_blocks,
                                                    args.block, work) + [f"outputs.dir={work}/unused"])
    toks = np.asarray(calibration_tokens(cfg, os.path.join(work, "model")))
    assert toks.shape == (args.n_blocks, args.block), toks.shape
    path = os.path.join(work, f"calib_{args.n_blocks}x{args.block}.npy")
    np.save(path, toks)
    return path


# ----------------------------------------------------------------------------- workers


def worker_llmc(a) -> int:
    """Runs in the llmcompressor venv: oneshot on the saved calibration blocks, compressed save."""
    t_start = time.perf_counter()
    import numpy as np
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    if not torch.accelerator.is_available():
        # llmcompressor 0.14's AWQ pins its cached activations unconditionally (`IntermediatesCache.pin_memory`,
        # called from AWQModifier._apply_smoothing), which raises "Cannot access accelerator device when none is
        # available" on a CPU-only torch. Pinning only speeds up host-to-device copies: skip it here.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    toks = np.load(a.calib)
    ds = Dataset.from_dict({"input_ids": toks.tolist(), "attention_mask": np.ones_like(toks).tolist()})
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    scheme = f"W{a.bits}A16_ASYM"
    if a.bits not in (4, 8):  # no preset: the same fields spelled out
        scheme = None
    group = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": a.bits, "type": "int", "symmetric": False,
                                                             "strategy": "group", "group_size": a.group}}}
    kw = dict(scheme=scheme, targets=["Linear"], ignore=["lm_head"]) if scheme and a.group == 128 else \
        dict(config_groups=group, ignore=["lm_head"])
    if a.method == "awq":
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        recipe = [AWQModifier(**({"duo_scaling": False} if a.matched else {})), QuantizationModifier(**kw)]
    else:
        from llmcompressor.modifiers.gptq import GPTQModifier

        recipe = [GPTQModifier(block_size=128, dampening_frac=0.01, **({"actorder": None} if a.matched else {}), **kw)]
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(toks), max_seq_length=toks.shape[1],
            shuffle_calibration_samples=False, pipeline="sequential")
    t_pass = time.perf_counter() - t0
    model.save_pretrained(a.out, save_compressed=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.model, name), a.out)
    import llmcompressor
    import compressed_tensors
    import transformers

    with open(os.path.join(a.out, "bench_timing.json"), "w") as f:
        json.dump({"pass_s": t_pass, "in_process_s": time.perf_counter() - t_start,
                   "versions": {"llmcompressor": llmcompressor.__version__, "torch": torch.__version__,
                                "transformers": transformers.__version__,
                                "compressed_tensors": compressed_tensors.__version__}}, f)
    return 0


def worker_eval(a) -> int:
    """Perplexity of every output directory with one evaluator (transformers, float32)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    torch.set_num_threads(a.threads)
    toks = torch.from_numpy(np.load(a.tokens))
    res = {}
    for d in a.dirs:
        cfg = json.load(open(os.path.join(d, "config.json")))
        kw = {}
        if "quantization_config" in cfg:
            kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw).eval()
        nll, n = 0.0, 0
        with torch.inference_mode():
            for i in range(0, len(toks), 8):
                x = toks[i:i + 8]
                logits = model(input_ids=x).logits.float()
                lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
                nll -= float(lp.double().sum())
                n += lp.numel()
        res[d] = {"nll": nll / n, "ppl": float(np.exp(nll / n)), "tokens": n}
        print(json.dumps({d: res[d]}), flush=True)
        del model
    with open(a.result, "w") as f:
        json.dump(res, f, indent=2)
    return 0


# ----------------------------------------------------------------------------- driver


# A small python process starts the command and reads its rusage with os.wait4: a child forked straight from
# this (large) driver would inherit the driver's peak RSS in ru_maxrss (Linux keeps the pre-exec high-water mark).
WRAPPER = """import json, os, subprocess, sys, time
t0 = time.perf_counter()
p = subprocess.Popen(sys.argv[2:])
_, status, ru = os.wait4(p.pid, 0)
json.dump({"wall_s": time.perf_counter() - t0, "peak_rss_mib": ru.ru_maxrss / 1024, "cpu_s": ru.ru_utime + ru.ru_stime,
           "rc": os.waitstatus_to_exitcode(status)}, open(sys.argv[1], "w"))
"""


def run_timed(cmd: list[str], env: dict, log: str) -> dict:
    """Wall time and peak RSS (os.wait4, via WRAPPER) of one subprocess; raises on failure with the log's tail."""
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-c", WRAPPER, log + ".rusage.json", *cmd], stdout=f, stderr=subprocess.STDOUT,
                       env=env, cwd=common.REPO)
    with open(log + ".rusage.json") as f:
        r = json.load(f)
    if r.pop("rc") != 0:
        with open(log) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{cmd[:4]} failed; log {log}:\n{tail}")
    return r


def finish(args, runs, arms, methods, work, threads, env, info, la0, rec):
    """Evaluate outputs not yet evaluated, summarise, print the table and write the JSON (after every round)."""
    # one evaluator over every output (and the float model)
    dirs = [os.path.join(work, "model")] + [d for r in runs for d in r["eval_dirs"].values()]
    ev_all = os.path.join(work, "eval_all.json")
    ev = json.load(open(ev_all)) if os.path.exists(ev_all) else {}
    todo = [d for d in dirs if d not in ev]
    if todo:
        res_path = os.path.join(work, "eval.json")
        run_timed([sys.executable, os.path.abspath(__file__), "--worker", "eval", "--tokens",
                   os.path.join(work, "eval_tokens.npy"), "--result", res_path, "--threads", str(threads),
                   "--dirs", *todo], env, os.path.join(work, "eval.log"))
        with open(res_path) as f:
            ev.update(json.load(f))
        with open(ev_all, "w") as f:
            json.dump(ev, f, indent=2)
    fp = ev[dirs[0]]
    for r in runs:
        r["ppl"] = {k: ev[d]["ppl"] for k, d in r["eval_dirs"].items()}

    summary = []
    for method, bits in arms:
        row = {"method": method, "bits": bits}
        for who in ("lrmq", "llmcompressor"):
            rs = [r for r in runs if r["contender"] == who and r["method"] == method and r["bits"] == bits]
            if not rs:
                break
            row[who] = {"wall_s_median": statistics.median(r["wall_s"] for r in rs),
                        "wall_s": [r["wall_s"] for r in rs], "pass_s_median": statistics.median(r["pass_s"] for r in rs),
                        "peak_rss_mib_max": max(r["peak_rss_mib"] for r in rs),
                        "cpu_s_median": statistics.median(r["cpu_s"] for r in rs),
                        "ppl": rs[0]["ppl"], "ppl_all_rounds": [r["ppl"] for r in rs]}
        if "llmcompressor" not in row:
            continue
        lq, lc = row["lrmq"], row["llmcompressor"]
        row["speedup_wall"] = lc["wall_s_median"] / lq["wall_s_median"]
        row["speedup_pass"] = lc["pass_s_median"] / lq["pass_s_median"]
        row["ppl_rel_diff"] = lq["ppl"]["compressed_tensors"] / lc["ppl"]["compressed_tensors"] - 1
        row["goal_met"] = row["speedup_wall"] >= 2 and abs(row["ppl_rel_diff"]) <= 0.005
        summary.append(row)

    print(f"\nfloat model perplexity {fp['ppl']:.4f} over {fp['tokens']} predicted tokens")
    headers = ["method", "lrmq wall s", "llmc wall s", "wall ratio", "lrmq pass s", "llmc pass s", "pass ratio",
               "lrmq ppl (formats written)", "llmc ppl", "ppl diff", "peak RSS MiB lrmq / llmc"]
    rows = [[f"{s['method']} W{s['bits']}", s["lrmq"]["wall_s_median"], s["llmcompressor"]["wall_s_median"],
             f"{s['speedup_wall']:.2f}x", s["lrmq"]["pass_s_median"], s["llmcompressor"]["pass_s_median"],
             f"{s['speedup_pass']:.2f}x",
             " / ".join(f"{v:.4f}" for v in s['lrmq']['ppl'].values()),
             f"{s['llmcompressor']['ppl']['compressed_tensors']:.4f}", f"{100 * s['ppl_rel_diff']:+.2f}%",
             f"{s['lrmq']['peak_rss_mib_max']:.0f} / {s['llmcompressor']['peak_rss_mib_max']:.0f}"]
            for s in summary]
    print(common.md_table(headers, rows))
    versions = next((r["versions"] for r in runs if "versions" in r), {})
    common.write_json(args.out, {
        "benchmark": "ptq_vs_llmcompressor", "machine": info, "loadavg_at_start": la0, "loadavg_at_end": os.getloadavg(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "llmcompressor_venv": versions, "model": rec,
        "settings": {"bits": args.bits_list, "group_size": args.group, "symmetric": False, "methods": methods,
                     "rounds_planned": getattr(args, "rounds_of", args.rounds),
                     "rounds_done": {m: len({r["round"] for r in runs if r["method"] == m}) for m in methods}, "calibration_blocks": [args.n_blocks, args.block], "threads": threads,
                     "lrmq_command": "python -m lrmq.quantize --config /dev/null " + " ".join(
                         lrmq_overrides("awq|gptq", args.bits_list[0], args.group, args.n_blocks, args.block, "WORK",
                                        args.lrmq_formats)),
                     "llmcompressor_recipe": {"awq": "AWQModifier() + QuantizationModifier(scheme=W4A16_ASYM, "
                                                     "targets=[Linear], ignore=[lm_head])",
                                              "gptq": "GPTQModifier(scheme=W4A16_ASYM, targets=[Linear], "
                                                      "ignore=[lm_head], block_size=128, dampening_frac=0.01)"},
                     "matched": bool(args.matched),
                     **({"matched_settings": {"lrmq": MATCHED_LRMQ, "llmcompressor": MATCHED_LLMC}}
                        if args.matched else {}),
                     "evaluator": "transformers (lrmq venv), float32, CompressedTensorsConfig(dequantize=True) "
                                  f"for compressed outputs; {fp['tokens']} predicted tokens"},
        "float_ppl": fp["ppl"], "summary": summary, "runs": runs})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["llmc", "eval"], help=argparse.SUPPRESS)
    ap.add_argument("--model"), ap.add_argument("--calib"), ap.add_argument("--method"), ap.add_argument("--bits-one",
                                                                                                        type=int)
    ap.add_argument("--tokens"), ap.add_argument("--result"), ap.add_argument("--dirs", nargs="*")
    ap.add_argument("--out", help="write figures as JSON here")
    ap.add_argument("--work", default="/tmp/lrmq_ptq_vs_llmc", help="model, data and outputs (reused)")
    ap.add_argument("--llmc-python", default=os.environ.get("LLMC_PYTHON", "/work/llmcvenv/bin/python"))
    ap.add_argument("--methods", default="gptq,awq", help="in run order")
    ap.add_argument("--bits", default="4", help="comma-separated widths")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--method-rounds", default="", help="per-method rounds, e.g. awq=1 (default: --rounds)")
    ap.add_argument("--n-blocks", type=int, default=4, help="calibration blocks")
    ap.add_argument("--block", type=int, default=256, help="tokens per calibration block (and eval window)")
    ap.add_argument("--train-steps", type=int, default=20)
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--build-only", action="store_true", help="build (train) the model and data, then stop")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2-layer model, 20 train steps, 1 round, GPTQ only")
    ap.add_argument("--lrmq-formats", default="compressed_tensors",
                    help="lrmq's exports, comma-separated (compressed_tensors: the same output llmcompressor writes)")
    ap.add_argument("--matched", action="store_true",
                    help="same algorithm choices on both sides where the defaults differ (MATCHED_LRMQ / MATCHED_LLMC)")
    args = ap.parse_args(argv)
    args.threads = args.threads or common.cpu_count()
    if args.worker == "llmc":
        args.bits = args.bits_one
        return worker_llmc(args)
    if args.worker == "eval":
        return worker_eval(args)

    threads = common.set_threads(args.threads)
    if args.quick:
        args.rounds, args.train_steps = 1, min(args.train_steps, 20)
        args.work = args.work + "_quick"
    arch = QUICK_ARCH if args.quick else ARCH
    args.bits_list = [int(b) for b in args.bits.split(",")]
    methods = args.methods.split(",")
    work = args.work
    la0 = os.getloadavg()
    info = common.machine_info(threads)
    print(common.machine_str(info), flush=True)
    rec = build(work, arch, args.train_steps, args.block, args.train_batch, args.seed, args.eval_windows)
    print(f"model: {rec['params']:,} parameters ({rec['linear_params']:,} in quantized Linears); "
          f"train loss {rec['train']['loss_first']:.3f} -> {rec['train']['loss_last10_mean']:.3f}", flush=True)
    if args.build_only:
        return 0
    calib = calibration_npy(args, work)
    if os.path.exists(os.path.join(work, "eval_all.json")):  # outputs are rewritten: no stale perplexities
        os.remove(os.path.join(work, "eval_all.json"))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", ""))
    runs_dir = os.path.join(work, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    runs = []
    arms = [(m, b) for b in args.bits_list for m in methods]
    # schedule: every round of one arm before the next arm, so that a run cut short still has complete arms;
    # JSON written after each (arm, round) pair; the contender order flips every round
    rounds_of = {m: args.rounds for m in methods}
    for spec in filter(None, args.method_rounds.split(",")):
        m, n = spec.split("=")
        rounds_of[m] = int(n)
    args.rounds_of = rounds_of
    schedule = [(m, b, rnd) for m, b in arms for rnd in range(rounds_of[m])]
    for method, bits, rnd in schedule:
        order = ["lrmq", "llmcompressor"] if rnd % 2 == 0 else ["llmcompressor", "lrmq"]
        for who in order:
            out = os.path.join(runs_dir, f"{who}_{method}_w{bits}_r{rnd}")
            shutil.rmtree(out, ignore_errors=True)
            if who == "lrmq":
                cmd = [sys.executable, "-m", "lrmq.quantize", "--config", "/dev/null",
                       *lrmq_overrides(method, bits, args.group, args.n_blocks, args.block, work,
                                       args.lrmq_formats),
                       *(MATCHED_LRMQ[method] if args.matched else []), f"outputs.dir={out}"]
            else:
                cmd = [args.llmc_python, os.path.abspath(__file__), "--worker", "llmc", "--model",
                       os.path.join(work, "model"), "--calib", calib, "--method", method, "--bits-one", str(bits),
                       "--group", str(args.group), "--threads", str(threads), "--out", out,
                       *(["--matched"] if args.matched else [])]
            la = os.getloadavg()
            r = run_timed(cmd, env, out + ".log")
            r.update(contender=who, method=method, bits=bits, round=rnd, out=out, loadavg_before=la)
            if who == "lrmq":
                with open(os.path.join(out, "report.json")) as f:
                    rep = json.load(f)
                r["pass_s"] = sum(rep["info"]["seconds_per_layer"])
                r["calibration_blocks"] = rep["calibration_blocks"]
                r["eval_dirs"] = {f: os.path.join(out, f) for f in args.lrmq_formats.split(",")}
            else:
                with open(os.path.join(out, "bench_timing.json")) as f:
                    t = json.load(f)
                r["pass_s"], r["versions"] = t["pass_s"], t["versions"]
                r["eval_dirs"] = {"compressed_tensors": out}
            runs.append(r)
            print(f"round {rnd} {who:13s} {method} W{bits}: wall {r['wall_s']:.1f} s, pass {r['pass_s']:.1f} s, "
                  f"peak RSS {r['peak_rss_mib']:.0f} MiB, load {la[0]:.1f}", flush=True)

        finish(args, runs, arms, methods, work, threads, env, info, la0, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
