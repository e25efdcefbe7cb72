"""A study's results: `results.json`, `results.md` and `plots/` from the jobs' `result.json` files.

* Per arm: the metric over seeds (mean, sample std, n), the other metrics' means, the memory of its model
  (weight bytes of the evaluated model; training-time parameters + AdamW state of the recipe that made it).
* Each arm is compared with its baseline (a ptq arm: its source; a preset's QAT/QLoRA arm: the FP run of
  the same algorithm; the FP run: the base model): the difference of means and its standard error
  sqrt(s_a^2/n_a + s_b^2/n_b); `beyond 2 SE` says whether the difference exceeds the seed spread.
* PTQ arms of the same source and bits are compared head to head, paired by seed (they quantize the same
  policy and are scored on the same problems with the same key): mean and SE of the per-seed differences.
  Every Δ to a baseline is also given paired by seed (`vs_baseline_paired`): the arms of one seed share the
  evaluation problems and sampling key, and train arms of one seed the prompt order.
* Paper 1's question, quantized training vs quantizing after training (`equal_bits_pairs`), paired by seed: a QAT
  arm against the PTQ arms its `compare` names, each row labelled ("same format": RTN of the FP policy in exactly
  the QAT scheme's weight format; "paper 1 pairing": the paper's own, another format); an arm without `compare`
  (QLoRA) against every PTQ arm of its FP baseline's policy at its nominal bits ("equal bits"). Every arm's
  weight format (`lrmq.quant.formats.WeightFormat.describe`) is in the tables.
* Rollouts (train arms that logged a sampler/learner mismatch: quantized weights or KV cache in the rollouts):
  the reward and the mismatch KL averaged over training, the rollout's weight and KV bytes per cached token, and
  the CPU speed as measured (rollout s, rollout tokens/s, step s over the steps after the first).
* Plots (matplotlib, Agg): reward curves of the train arms (mean over seeds of reward/mean, min-max band),
  accuracy vs bits per weight, accuracy vs model bytes with the Pareto frontier, and the QuantLRM channel
  importance histograms of the arms that wrote `quant/importance.npz`.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from typing import Optional

import numpy as np

from lrmq.atomic import atomic_write_text
from lrmq.studies.matrix import FLOAT_BITS, arm_format, nominal_bits
from lrmq.studies.runner import RESULT, Study, job_dir, read_metrics, wall_clock

PLOTS = ("reward_curves.png", "accuracy_vs_bits.png", "accuracy_vs_bytes.png", "importance_hist.png", "mismatch_kl.png")


def _stats(values: list[float]) -> dict:
    v = np.asarray(values, np.float64)
    n = len(v)
    return {"mean": float(v.mean()) if n else None, "std": float(v.std(ddof=1)) if n > 1 else 0.0 if n else None,
            "n": n}


def aggregate(study: Study) -> dict:
    cfg = study.cfg
    metric = cfg.eval.metric
    fbits = FLOAT_BITS.get(study.train_cfg.model.param_dtype, 32.0)
    arms_out = []
    for arm in study.arms:
        per_seed, mem = {}, {}
        for seed in cfg.seeds:
            path = os.path.join(job_dir(study.out, arm.name, seed), RESULT)
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    r = json.load(f)
                train = {f"train/{k}": v for k, v in r.get("train_metrics", {}).items()}
                per_seed[str(seed)] = {**r["metrics"], **train}
                mem = mem or r.get("memory", {})
        keys = sorted({k for m in per_seed.values() for k, v in m.items() if isinstance(v, (int, float))})
        means = {k: _stats([m[k] for m in per_seed.values() if isinstance(m.get(k), (int, float))]) for k in keys}
        fmt = arm_format(cfg, arm)
        entry = {"name": arm.name, "kind": arm.kind, "group": arm.group or arm.kind, "source": arm.source,
                 "weight_format": fmt.describe() if fmt else None, "compare": dict(arm.compare),
                 "method": arm.method, "bits": arm.bits if arm.kind == "ptq" else None,
                 "group_size": arm.group_size if arm.kind == "ptq" else None,
                 "nominal_bits": nominal_bits(arm, study.by_name, fbits),
                 "baseline": arm.baseline or (arm.source if arm.kind == "ptq" else ""),
                 "metric": metric, **(means.get(metric) or {"mean": None, "std": None, "n": 0}),
                 "metrics": means, "seeds": per_seed, "memory": mem}
        arms_out.append(entry)
    by = {a["name"]: a for a in arms_out}
    for a in arms_out:
        b = by.get(a["baseline"])
        a["vs_baseline"] = _diff(a, b) if b else None
        a["vs_baseline_paired"] = paired(a, b, metric) if b else None
    return {"study": cfg.name, "written": wall_clock(), "metric": metric, "seeds": list(cfg.seeds),
            "eval": {"kind": cfg.eval.kind, "size": cfg.eval.size, "samples": cfg.eval.samples},
            "arms": arms_out, "ptq_pairs": ptq_pairs(arms_out, metric),
            "equal_bits_pairs": equal_bits_pairs(arms_out, metric)}


def paired(a: dict, b: dict, metric: str) -> Optional[dict]:
    """a − b paired by seed over the seeds both have: mean of the per-seed differences, SE std(d)/sqrt(n)
    (None with one seed), and whether |mean| > 2 SE."""
    seeds = [s for s in a["seeds"] if s in b["seeds"] and metric in a["seeds"][s] and metric in b["seeds"][s]]
    if not seeds:
        return None
    d = np.array([a["seeds"][s][metric] - b["seeds"][s][metric] for s in seeds], np.float64)
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else None
    return {"a": a["name"], "b": b["name"], "diff": float(d.mean()), "se": se, "n": len(d),
            "beyond_2se": bool(abs(d.mean()) > 2 * se) if se else None}


def equal_bits_pairs(arms: list[dict], metric: str) -> list[dict]:
    """Quantized training vs PTQ, paired by seed. An arm with `compare` ({label: ptq arm}): a row per pair, with
    its label; another quantized-training arm (a train arm whose baseline is a train arm of more bits: QLoRA)
    against every PTQ arm of that baseline's policy at the same nominal bits ("equal bits"). Each row carries both
    arms' weight formats."""
    by = {a["name"]: a for a in arms}
    out = []

    def row(a, p, label, source):
        r = paired(a, p, metric)
        if r:
            out.append({"source": source, "bits": p["bits"], "pairing": label, "a_format": a.get("weight_format"),
                        "b_format": p.get("weight_format"), **r})

    for a in arms:
        if a.get("compare"):
            for label, b in a["compare"].items():
                if b in by:
                    row(a, by[b], label, by[b]["source"])
            continue
        base = by.get(a.get("baseline", ""))
        if a["kind"] != "train" or not base or base["kind"] != "train" or \
                not (a.get("nominal_bits") or 0) < (base.get("nominal_bits") or 0):
            continue
        for p in arms:
            if p["kind"] == "ptq" and p["source"] == base["name"] and p["bits"] == a["nominal_bits"]:
                row(a, p, "equal bits", base["name"])
    return out


def ptq_pairs(arms: list[dict], metric: str) -> list[dict]:
    """Every two PTQ arms of the same source at the same bits, paired by seed (same policy, same evaluation
    problems and sampling key): the mean of the per-seed differences and its SE std(d)/sqrt(n)."""
    groups = defaultdict(list)
    for a in arms:
        if a["kind"] == "ptq":
            groups[(a["source"], a["bits"])].append(a)
    out = []
    for (src, bits), items in groups.items():
        for i, a in enumerate(items):
            for b in items[i + 1:]:
                seeds = [s for s in a["seeds"]
                         if s in b["seeds"] and metric in a["seeds"][s] and metric in b["seeds"][s]]
                if not seeds:
                    continue
                d = np.array([a["seeds"][s][metric] - b["seeds"][s][metric] for s in seeds], np.float64)
                se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else None
                out.append({"source": src, "bits": bits, "a": a["name"], "b": b["name"], "diff": float(d.mean()),
                            "se": se, "n": len(d), "beyond_2se": bool(abs(d.mean()) > 2 * se) if se else None})
    return out


def _diff(a: dict, b: dict) -> Optional[dict]:
    if not a.get("n") or not b.get("n"):
        return None
    d = a["mean"] - b["mean"]
    se = math.sqrt((a["std"] ** 2) / a["n"] + (b["std"] ** 2) / b["n"])
    spread = min(a["n"], b["n"]) > 1
    return {"baseline": b["name"], "diff": d, "se": se if spread else None,
            "beyond_2se": bool(abs(d) > 2 * se) if spread else None,
            "n": [a["n"], b["n"]]}


def _mib(x) -> str:
    return f"{x / 2**20:.3f}" if isinstance(x, (int, float)) else "-"


def _pm(s: Optional[dict], digits: int = 3) -> str:
    """mean ± std, or the mean alone when one seed gives no spread."""
    if not s or s.get("mean") is None:
        return "-"
    if s.get("n", 0) < 2:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"


def _paired_cell(p: Optional[dict]) -> str:
    if not p:
        return "-"
    if p["se"] is None:
        return f"{p['diff']:+.3f} (1 seed)"
    return f"{p['diff']:+.3f} ± {p['se']:.3f}{' *' if p['beyond_2se'] else ''}"


def markdown(res: dict, failed: list[dict] = ()) -> str:
    metric = res["metric"]
    lines = [f"# Study `{res['study']}`", "",
             f"Metric: **{metric}** ({res['eval']['kind']}, {res['eval']['size']} problems x {res['eval']['samples']} "
             f"sample(s)), mean ± sample std over seeds {res['seeds']} (n = seeds with a result; one seed: the "
             "value alone). Weight MiB: the "
             "evaluated model's variables (packed codes + scales for quantized linears); train MiB: the recipe's "
             "training-time parameters + AdamW state. Δ: difference of means to the baseline arm, ± its SE "
             "sqrt(s²/n + s²/n); * = |Δ| > 2 SE (beyond the seed spread). Δ paired by seed: the mean of the per-seed "
             "differences ± std/sqrt(n) (the arms of a seed are scored on the same problems with the same "
             "sampling key).", "",
             f"Written {res['written']}.", ""]
    other = [k for k in ("greedy_accuracy", "sampled_accuracy", "sampled_reward") if k != metric and any(
        k in a["metrics"] for a in res["arms"])]
    head = ["arm", "group", "bits", "weight format", f"{metric}", "n", *other, "Δ vs baseline", "Δ paired by seed",
            "weight MiB", "train params + opt MiB"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in res["arms"]:
        m = a["memory"]
        train = (_mib(m["train_param_bytes"]) + " + " + _mib(m["train_opt_bytes"])) if "train_param_bytes" in m \
            else "-"
        v = a.get("vs_baseline")
        if not v:
            delta = "-"
        elif min(v["n"]) < 2:  # no seed spread to compare with
            delta = f"{v['diff']:+.3f} ({v['baseline']}; 1 seed, no spread)"
        else:
            delta = f"{v['diff']:+.3f} ± {v['se']:.3f}{' *' if v['beyond_2se'] else ''} ({v['baseline']})"
        cells = [a["name"], a["group"], f"{a['nominal_bits']:g}", a.get("weight_format") or "float", _pm(a),
                 str(a["n"]),
                 *[_pm(a["metrics"].get(k)) for k in other], delta, _paired_cell(a.get("vs_baseline_paired")),
                 _mib(m.get("weight_bytes")), train]
        lines.append("| " + " | ".join(cells) + " |")
    if res.get("ptq_pairs"):
        lines += ["", f"PTQ methods head to head (same source and bits, {metric} differences paired by seed: "
                      "mean ± SE of the per-seed differences; * = beyond 2 SE):", "",
                  "| source | bits | arm A | arm B | A − B | seeds |", "|---|---|---|---|---|---|"]
        for p in res["ptq_pairs"]:
            d = f"{p['diff']:+.3f}" + (f" ± {p['se']:.3f}{' *' if p['beyond_2se'] else ''}" if p["se"] is not None
                                      else " (1 seed)")
            lines.append(f"| {p['source']} | {p['bits']} | {p['a']} | {p['b']} | {d} | {p['n']} |")
    if res.get("equal_bits_pairs"):
        lines += ["", f"Quantized training (QAT / QLoRA) vs PTQ of the full-precision policy ({metric} differences "
                      "paired by seed: mean ± SE of the per-seed differences; * = beyond 2 SE; > 0: training under "
                      "quantization is better). Pairing: *same format* = RTN of the FP policy in exactly the QAT "
                      "scheme's weight format; *paper 1 pairing* = the paper's own comparison (another format); "
                      "*equal bits* = every PTQ arm at the arm's bits:", "",
                  "| pairing | FP policy | trained quantized (A) | A's format | PTQ (B) | B's format | A − B | seeds |",
                  "|---|---|---|---|---|---|---|---|"]
        for p in res["equal_bits_pairs"]:
            lines.append(f"| {p.get('pairing', 'equal bits')} | {p['source']} | {p['a']} | "
                         f"{p.get('a_format') or 'float'} | {p['b']} | {p.get('b_format') or 'float'} | "
                         f"{_paired_cell(p)} | {p['n']} |")
    rollout_arms = [a for a in res["arms"] if "train/mismatch/kl_k3_avg" in a["metrics"]]
    if rollout_arms:
        lines += ["", "Rollouts (train arms; means over training steps, then mean ± std over seeds): the reward, "
                      "the sampler/learner mismatch KL(sampler || learner) (k1, k3 estimators), the fraction of "
                      "tokens the correction truncated or masked, the bytes of the rollout's weights and of one "
                      "token in its KV cache, and the speed as measured on the study's machine (means over the "
                      "steps after the first, which compiles: seconds of a rollout, its sampled tokens per "
                      "second, seconds of a whole training step):", "",
                  "| arm | reward over training | KL k1 | KL k3 | corrected | rollout weight MiB | KV bytes / token "
                  "| rollout s | rollout tokens/s | step s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for a in rollout_arms:
            m = a["metrics"]
            wb, kv = m.get("train/rollout/weight_bytes"), m.get("train/rollout/kv_bytes_per_token")
            kv_cell = f"{kv['mean']:g}" if kv else "-"
            lines.append(f"| {a['name']} | {_pm(m.get('train/reward/mean_avg'))} | "
                         f"{_pm(m.get('train/mismatch/kl_k1_avg'), 5)} | {_pm(m.get('train/mismatch/kl_k3_avg'), 5)} | "
                         f"{_pm(m.get('train/mismatch/corrected_frac_avg'))} | "
                         f"{_mib(wb['mean']) if wb else '-'} | {kv_cell} | "
                         f"{_pm(m.get('train/perf/rollout_s_avg'), 2)} | "
                         f"{_pm(m.get('train/perf/rollout_tokens_per_s_avg'), 0)} | "
                         f"{_pm(m.get('train/perf/step_s_avg'), 2)} |")
    if failed:
        lines += ["", "Jobs without a result:", ""]
        lines += [f"* {f['arm']} seed {f['seed']}: {f['status']}: {f['error']}" for f in failed]
    lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_reward_curves(study: Study, res: dict, path: str) -> bool:
    return plot_train_curves(study, res, path, "reward/mean", "rollout reward", "reward curves")


def plot_train_curves(study: Study, res: dict, path: str, key: str, ylabel: str, title: str) -> bool:
    """`key` from the train arms' metrics.jsonl against the step: mean over seeds, min-max band. False (and no
    file) when no arm logged it."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    drew = False
    for a in res["arms"]:
        if a["kind"] != "train":
            continue
        curves = []
        for seed in study.cfg.seeds:
            rows = [r for r in read_metrics(os.path.join(job_dir(study.out, a["name"], seed), "run", "metrics.jsonl"))
                    if key in r]
            if rows:
                curves.append({int(r["step"]): float(r[key]) for r in rows})
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        y = np.array([[c[s] for s in steps] for c in curves])
        line, = ax.plot(steps, y.mean(0), label=f"{a['name']} (n={len(curves)})")
        if len(curves) > 1:
            ax.fill_between(steps, y.min(0), y.max(0), color=line.get_color(), alpha=0.15)
        drew = True
    ax.set_xlabel("step")
    ax.set_ylabel(f"{ylabel} (mean over seeds; band: min-max)")
    ax.set_title(f"{res['study']}: {title}")
    if drew:
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drew


def _scatter(res: dict, path: str, x_of, xlabel: str, title: str, logx: bool = False, pareto: bool = False) -> bool:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    groups = defaultdict(list)
    for a in res["arms"]:
        x = x_of(a)
        if a.get("mean") is None or x is None:
            continue
        groups[a["group"]].append((x, a["mean"], a["std"] or 0.0, a["name"]))
    pts = []
    for g, items in groups.items():
        xs, ys, es, names = zip(*items)
        ax.errorbar(xs, ys, yerr=es, fmt="o", capsize=3, label=g)
        for x, y, n in zip(xs, ys, names):
            ax.annotate(n, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        pts += list(zip(xs, ys))
    if pareto and pts:
        front, best = [], -np.inf
        for x, y in sorted(pts, key=lambda p: (p[0], -p[1])):
            if y > best:
                front.append((x, y))
                best = y
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="k", lw=0.8, alpha=0.6,
                label="Pareto frontier")
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{res['metric']} (mean ± std over seeds)")
    ax.set_title(title)
    if pts:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return bool(pts)


def plot_importance(study: Study, res: dict, path: str) -> bool:
    plt = _plt()
    files = []
    for a in res["arms"]:
        for seed in study.cfg.seeds:
            f = os.path.join(job_dir(study.out, a["name"], seed), "quant", "importance.npz")
            if os.path.exists(f):
                files.append((a["name"], seed, f))
                break
    if not files:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, seed, f in files:
        with np.load(f) as z:
            v = np.concatenate([np.asarray(z[k], np.float64).ravel() for k in z.files])
        v = v[np.isfinite(v) & (v > 0)]
        if v.size:
            bins = np.logspace(np.log10(v.min()), np.log10(v.max()) + 1e-9, 50)
            ax.hist(v, bins=bins, histtype="step", label=f"{name} (seed {seed}, {v.size} channels)")
    ax.set_xscale("log")
    ax.set_xlabel("QuantLRM channel importance")
    ax.set_ylabel("channels")
    ax.set_title(f"{res['study']}: QuantLRM importance")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(study: Study, failed: list[dict] = ()) -> dict:
    """results.json, results.md and (cfg.plots) plots/*.png; returns the results dict."""
    res = aggregate(study)
    res["failed"] = list(failed)
    plots = {}
    if study.cfg.plots:
        d = os.path.join(study.out, "plots")
        os.makedirs(d, exist_ok=True)
        made = {
            "reward_curves.png": plot_reward_curves(study, res, os.path.join(d, "reward_curves.png")),
            "accuracy_vs_bits.png": _scatter(res, os.path.join(d, "accuracy_vs_bits.png"), lambda a: a["nominal_bits"],
                                             "bits per linear weight", f"{res['study']}: accuracy vs bits"),
            "accuracy_vs_bytes.png": _scatter(res, os.path.join(d, "accuracy_vs_bytes.png"),
                                              lambda a: a["memory"].get("weight_bytes"), "model weight bytes",
                                              f"{res['study']}: accuracy vs model bytes", logx=True, pareto=True),
            "importance_hist.png": plot_importance(study, res, os.path.join(d, "importance_hist.png")),
            "mismatch_kl.png": plot_train_curves(study, res, os.path.join(d, "mismatch_kl.png"),
                                                 "train/mismatch/kl_k3", "KL(sampler || learner), k3",
                                                 "rollout/learner mismatch"),
        }
        plots = {k: os.path.join("plots", k) for k, ok in made.items() if ok}
        for k, ok in made.items():
            if not ok and os.path.exists(os.path.join(d, k)) and k == "importance_hist.png":
                os.remove(os.path.join(d, k))
    res["plots"] = plots
    atomic_write_text(os.path.join(study.out, "results.json"), json.dumps(res, indent=2, sort_keys=True) + "\n")
    md = markdown(res, failed)
    if plots:
        md += "\n" + "\n".join(f"![{k}]({v})" for k, v in plots.items()) + "\n"
    atomic_write_text(os.path.join(study.out, "results.md"), md)
    return res
