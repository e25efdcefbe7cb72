"""Running a suite: batched generation by length buckets, scoring, resumable per-item records, results.

`run_suite` is the library entry point (the CLI and a trainer's periodic eval call it):

    results = run_suite(model, tokenizer, items, gen_cfg, out_dir=..., generator=..., state=...)

* Requests (item x sample) go to the generation engine (`lrmq.generation.engine`) all at once: it decodes
  `batch_size` of them at a time over a paged KV cache, and a finished sequence's slot goes to the next
  one at once, so a 32k-token completion holds nobody else back. An item's samples share its prompt's pages.
* Request i samples with ``fold_in(key(seed), i)``: the tokens depend only on the items and the config,
  so a rerun, or a resume after a kill, produces the same tokens.
* Records go to ``out_dir/completions.jsonl`` one line per (item, sample), appended and fsynced as each
  sequence finishes; a restarted run skips the recorded ones (a truncated last line is dropped).
  ``results.json`` and ``results.md`` are written atomically at the end.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

import jax
import numpy as np
from flax import nnx

from lrmq.atomic import atomic_write_text
from lrmq.evals.benchmarks import BENCHMARKS, Item, Suite
from lrmq.evals.config import GenerationSection
from lrmq.evals.metrics import average_of, summarize
from lrmq.evals.scorers import score
from lrmq.generation.engine import Engine, sequence_keys
from lrmq.generation.sampling import SamplingConfig
from lrmq.tensorboard import summary_writer

log = logging.getLogger(__name__)

COMPLETIONS = "completions.jsonl"
RESULTS = "results.json"
TABLE = "results.md"
TIMING = "timing.json"


class EvalError(ValueError):
    """An evaluation that cannot run as configured (a prompt past the model's positions, a run dir of
    another config)."""


@dataclass(frozen=True)
class Request:
    index: int
    item: Item
    sample: int
    ids: tuple[int, ...]

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.item.benchmark, self.item.id, self.sample)


def sampling_config(gen: GenerationSection) -> SamplingConfig:
    return SamplingConfig(greedy=gen.greedy, temperature=gen.temperature if not gen.greedy else 1.0,
                          top_p=gen.top_p, top_k=gen.top_k)


def max_new_for(prompt_lens: Sequence[int], gen: GenerationSection, max_positions: int, what: str) -> int:
    """New tokens for a batch under the length policy: min(max_new_tokens, max_positions - longest prompt)."""
    longest = max(prompt_lens)
    room = max_positions - longest
    if room <= 0:
        raise EvalError(f"{what}: the prompt has {longest} tokens, the model's max positions are {max_positions}; "
                        f"nothing can be generated (raise generation.max_positions only if the model was trained "
                        f"past it)")
    if gen.max_new_tokens > room:
        if gen.length_policy == "error":
            raise EvalError(f"{what}: prompt {longest} + generation.max_new_tokens {gen.max_new_tokens} tokens pass "
                            f"the model's max positions {max_positions} (length_policy=error; use "
                            f"generation.length_policy=cap to cap the new tokens)")
        return room
    return gen.max_new_tokens


# ----------------------------------------------------------------------------- records


def read_records(path: str, *, repair: bool = True) -> list[dict]:
    """Records of a completions file; a truncated last line (a kill mid-write) is dropped, and with
    `repair` cut off the file so appends continue on a line boundary."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    records, good_end, pos = [], 0, 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break
        line = data[pos:nl]
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
        pos = good_end = nl + 1
    if good_end < len(data):
        log.warning("%s: dropping a truncated record at byte %d", path, good_end)
        if repair:
            with open(path, "r+b") as f:
                f.truncate(good_end)
    return records


def _append(path: str, records: Sequence[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def score_records(records: list[dict], *, timeout_s: float = 1.0) -> list[dict]:
    """(Re)computes extracted / correct / formatted / reward of records with the benchmark's scorer."""
    by_bench: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        by_bench[r["benchmark"]].append(i)
    out = list(records)
    for name, idx in by_bench.items():
        b = BENCHMARKS[name]
        scores = score(b.scorer, [records[i]["completion"] for i in idx], [records[i]["answer"] for i in idx],
                       extractor=b.extractor, timeout_s=timeout_s)
        for i, s in zip(idx, scores):
            out[i] = {**records[i], **s.to_dict()}
    return out


# ----------------------------------------------------------------------------- results


def summarize_records(records: Sequence[dict], suite: Optional[Suite], benchmarks: Sequence[str],
                      pass_k: Sequence[int] = (1,)) -> dict:
    """Per-benchmark metrics, problems pooled over benchmarks, and the average of benchmark means."""
    problems: dict[str, dict[str, dict]] = {b: {} for b in benchmarks}
    for r in sorted(records, key=lambda r: (r["benchmark"], int(r["item_id"]) if r["item_id"].isdigit() else 0,
                                            r["item_id"], r["sample"])):
        p = problems.setdefault(r["benchmark"], {}).setdefault(r["item_id"], defaultdict(list))
        for k in ("correct", "reward", "formatted", "completion_tokens", "truncated"):
            p[k].append(r[k])
    per = {b: summarize(list(problems[b].values()), pass_k) for b in benchmarks}
    pooled = summarize([p for b in benchmarks for p in problems[b].values()], pass_k)
    acc, acc_se = average_of([per[b] for b in benchmarks if per[b].get("n_problems")], "accuracy")
    rew, rew_se = average_of([per[b] for b in benchmarks if per[b].get("n_problems")], "reward")
    out = {"benchmarks": per, "pooled": pooled,
           "average": {"accuracy": acc, "accuracy_se": acc_se, "reward": rew, "reward_se": rew_se}}
    if suite is not None:
        src = out[suite.headline]
        out["headline"] = {"how": suite.headline, "metric": suite.headline_metric,
                           "value": src[suite.headline_metric], "se": src[f"{suite.headline_metric}_se"]}
    return out


def _f(x, se=None, digits=3):
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "-"
    return f"{x:.{digits}f}" + (f" ± {se:.{digits}f}" if se is not None else "")


def markdown_table(results: dict) -> str:
    per = results["benchmarks"]
    ks = sorted({int(k[5:]) for s in per.values() for k in s if k.startswith("pass@") and not k.endswith("_se")})
    head = ["benchmark", "problems", "K", "accuracy", "reward", *[f"pass@{k}" for k in ks], "boxed/answered",
            "mean tokens", "truncated"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if results.get("weight_format"):  # lrmq.evaluate's run_meta: the model scored and its weight format
        lines = [f"Model: {results.get('checkpoint')} ({results['weight_format']})", ""] + lines

    def row(name, s):
        if not s.get("n_problems"):
            return f"| {name} | 0 |" + " - |" * (len(head) - 2)
        cells = [name, str(s["n_problems"]), str(s["samples"]), _f(s["accuracy"], s["accuracy_se"]),
                 _f(s["reward"], s["reward_se"]), *[_f(s.get(f"pass@{k}"), s.get(f"pass@{k}_se")) for k in ks],
                 _f(s["formatted"]), _f(s["completion_tokens"], digits=1), _f(s["truncated"])]
        return "| " + " | ".join(cells) + " |"

    for name, s in per.items():
        lines.append(row(BENCHMARKS[name].title if name in BENCHMARKS else name, s))
    lines.append(row("**pooled**", results["pooled"]))
    a = results["average"]
    lines.append(f"| **average of benchmarks** | | | {_f(a['accuracy'], a['accuracy_se'])} | "
                 f"{_f(a['reward'], a['reward_se'])} |" + " |" * (len(head) - 5))
    if "headline" in results:
        h = results["headline"]
        lines.append("")
        lines.append(f"Headline ({h['how']} {h['metric']}): **{_f(h['value'], h['se'])}**")
    if "kv_saturated" in results:
        lines.append("")
        lines.append(f"Quantized KV cache: {results['kv_saturated']} K / V entries saturated (clipped at the "
                     "format's max)")
    return "\n".join(lines) + "\n"


def tb_tag(key: str) -> str:
    """A metric's TensorBoard tag: TensorBoard's tags take no "@" (tensorboardX renames pass@1 to pass_1 with a
    warning), so pass@K is written as pass_K, the tag TensorBoard shows."""
    return key.replace("@", "_")


def _tb_scalars(writer, results: dict, step: int, prefix: str = "eval") -> None:
    for name, s in results["benchmarks"].items():
        passes = sorted((k for k in s if k.startswith("pass@") and not k.endswith("_se")), key=lambda k: int(k[5:]))
        for k in ("accuracy", "reward", *passes, "formatted", "completion_tokens", "truncated"):
            if k in s:
                writer.add_scalar(f"{prefix}/{name}/{tb_tag(k)}", s[k], step)
    for k in ("accuracy", "reward"):
        if k in results["pooled"]:
            writer.add_scalar(f"{prefix}/pooled/{k}", results["pooled"][k], step)
        writer.add_scalar(f"{prefix}/average/{k}", results["average"][k], step)
    if "kv_saturated" in results:
        writer.add_scalar(f"{prefix}/kv_saturated", results["kv_saturated"], step)
    writer.flush()


def open_writer(out_dir: str):
    return summary_writer(os.path.join(out_dir, "tb"))


# ----------------------------------------------------------------------------- the run


def build_requests(items: Sequence[Item], tokenizer, samples: int) -> list[Request]:
    out = []
    for it in items:
        ids = tuple(tokenizer.encode(it.prompt))
        if not ids:
            raise EvalError(f"{it.benchmark} item {it.id}: empty prompt")
        for s in range(samples):
            out.append(Request(len(out), it, s, ids))
    return out


def run_suite(model_or_state, tokenizer, items: Sequence[Item], gen: GenerationSection, *,
              suite: Optional[Suite] = None, engine: Optional[Engine] = None, max_positions: int = 0,
              out_dir: Optional[str] = None, pass_k: Sequence[int] = (1,), timeout_s: float = 1.0,
              progress: bool = False, writer=None, step: int = 0, tb_prefix: str = "eval",
              meta: Optional[dict] = None) -> dict:
    """Generate, score and summarize `items` (any benchmarks of `BENCHMARKS`); returns the results dict.

    model_or_state: a `Decoder`, or a state with `engine` built for its graphdef (a trainer passes its
    rollout Engine and the current policy state). max_positions: 0 = gen.max_positions, else the
    model's `max_position_embeddings` (needed when a state is passed). out_dir: resumable records and
    results files (None = in memory only); meta: extra keys for results.json (config, checkpoint). writer: a tensorboardX-like writer (`add_scalar`, `flush`).
    """
    is_model = isinstance(model_or_state, nnx.Module)
    if engine is None:
        if not is_model:
            raise ValueError("run_suite: pass engine= (built for the state's graphdef) with a state")
        engine = Engine(model_or_state, eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id, config=gen.engine_config())
    state = nnx.state(model_or_state) if is_model else model_or_state
    max_pos = gen.max_positions or max_positions or (model_or_state.cfg.max_position_embeddings if is_model else 0)
    if not max_pos:
        raise ValueError("run_suite: max_positions is unknown; pass max_positions= with a state")
    benchmarks = list(dict.fromkeys(it.benchmark for it in items))
    sampling = sampling_config(gen)
    requests = build_requests(items, tokenizer, gen.samples)
    path = os.path.join(out_dir, COMPLETIONS) if out_dir else None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    wanted = {r.key for r in requests}
    records = [r for r in (read_records(path) if path else []) if (r["benchmark"], r["item_id"], r["sample"]) in wanted]
    done = {(r["benchmark"], r["item_id"], r["sample"]) for r in records}
    todo = [r for r in requests if r.key not in done]
    n_todo = len(todo)
    if done:
        log.info("resuming: %d of %d sequences already recorded", len(requests) - n_todo, len(requests))
    from tqdm.auto import tqdm

    bar = tqdm(total=n_todo, disable=not progress, desc="eval", unit="seq", dynamic_ncols=True)
    budgets = [max_new_for([len(r.ids)], gen, max_pos, f"{r.item.benchmark} item {r.item.id}") for r in todo]
    if todo and min(budgets) < gen.max_new_tokens:
        log.warning("generation.max_new_tokens %d capped to %d (and similar) so prompt + completion stay within "
                    "the model's %d positions; completions that reach the cap count as truncated",
                    gen.max_new_tokens, min(budgets), max_pos)
    keys = sequence_keys(jax.random.key(gen.seed), len(requests))
    eos = set(engine.eos)
    t0, new_tokens = time.perf_counter(), 0

    def finished(j: int, toks: list[int], _logprobs) -> None:  # as each sequence stops: score, record, report
        nonlocal new_tokens
        r = todo[j]
        stopped = bool(toks) and toks[-1] in eos
        toks = toks[:-1] if stopped else toks
        rec = {"benchmark": r.item.benchmark, "item_id": r.item.id, "sample": r.sample, "prompt": r.item.prompt,
               "completion": tokenizer.decode(toks), "answer": r.item.answer, "prompt_tokens": len(r.ids),
               "completion_tokens": len(toks), "truncated": not stopped, "max_new_tokens": budgets[j]}
        new = score_records([rec], timeout_s=timeout_s)
        if path:
            _append(path, new)
        records.extend(new)
        new_tokens += len(toks)
        bar.update(1)
        if progress:
            bar.set_postfix(acc=f"{np.mean([x['correct'] for x in records]):.3f}", refresh=False)

    stats = {}
    if todo:
        stats = engine.generate(state, [r.ids for r in todo], max_new_tokens=budgets, sampling=sampling,
                                keys=keys[[r.index for r in todo]], on_finish=finished).stats
    bar.close()
    seconds = time.perf_counter() - t0
    # pass@K of the K samples is always reported, besides the asked-for k <= K
    results = summarize_records(records, suite, benchmarks, sorted({k for k in pass_k if k <= gen.samples} | {gen.samples}))
    if "kv_saturated" in stats:  # a quantized KV cache: K / V entries clipped at the format's max, this call's
        results["kv_saturated"] = int(stats["kv_saturated"])  # sequences (a resumed run: the ones it generated)
    if writer is not None:
        _tb_scalars(writer, results, step, tb_prefix)
    if out_dir:
        # results.json holds no timings: the same config and seed give the same file.
        atomic_write_text(os.path.join(out_dir, RESULTS),
                          json.dumps({**(meta or {}), **results}, indent=2, sort_keys=True) + "\n")
        atomic_write_text(os.path.join(out_dir, TABLE), markdown_table({**(meta or {}), **results}))
        atomic_write_text(os.path.join(out_dir, TIMING), json.dumps(
            {"generated_sequences": n_todo, "new_tokens": new_tokens, "seconds": seconds,
             "sequences_per_s": n_todo / seconds if seconds > 0 else None}, indent=2) + "\n")
    results["timing"] = {"generated_sequences": n_todo, "new_tokens": new_tokens, "seconds": seconds}
    return results
