"""One GRPO step, lrmq vs TRL's GRPOTrainer (no vLLM), same checkpoint, prompts and settings, on CPU.

Needs the bench extra (``pip install -e '.[bench]'``: trl); installs nothing itself. For each model
(``tiny`` = lrmq/assets/tiny; ``100m`` = a random ~100M Qwen3-shaped checkpoint, benchmarks/grpo_step.py's)
and each thread count, the two contenders run alternately, each in its own process pinned to that many
cores (taskset; XLA's and torch's pools sized to match), ``--rounds`` times. A process runs one warmup
step (compiles; reported apart as the first step) and ``--steps`` timed steps.

Same work on both sides: the same prompts (synthetic arithmetic, lrmq's ``arith`` template rendered once
and given to both), G completions per prompt, temperature 1, top-p 1, top-k 0, ``max_new_tokens``,
float32, mu = 1, beta = 0, the same exact-match boxed reward (lrmq's ``boxed_exact``), AdamW lr 1e-6.
Reported per step (median over all timed steps of all rounds): wall time, its rollout / update split
(TRL: ``_generate_and_score_completions`` vs the rest of the training step), generated tokens per
second, and CPU-seconds (user + system of the process). lrmq compiles once per new batch shape (prompt
bucket, packed rows); the seconds XLA spent compiling inside each timed step are recorded (JAX's
monitoring events), and ``step_s_no_compile`` is the median over the timed steps that compiled nothing.

Reasoning lengths (``--heavy-tail``): 1,024 new tokens, and every completion's length fixed in advance,
drawn heavy-tailed (lognormal, mean ``--mean`` = 256, capped at 1,024, the longest row of each step set to the
cap: the tail that hits the limit). Both sides produce exactly those lengths, step by step and row by row:
TRL's model gets a logits processor that forbids the stop tokens before the row's length and forces one at
it; lrmq's rollout engine gets the lengths as per-row budgets and no stop token. The model is
lrmq/assets/tiny with its position limit raised to hold 64 + 1,024 tokens (the weights are the same). What
differs is only how each side spends the work: TRL's generate runs every row until the longest is done and
pads the update to the longest completion; lrmq's engine frees a row as it finishes and packs the update.

    .venv/bin/python benchmarks/vs_trl.py --quick                               # tiny, 1 thread, 1 round
    .venv/bin/python benchmarks/vs_trl.py --heavy-tail --threads 1 --out docs/figures/vs_trl_heavy_tail.json
    .venv/bin/python benchmarks/vs_trl.py --out docs/figures/vs_trl.json        # tiny + 100m, 1 and 2 threads
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu is installed for AOT compiles; never probe for a TPU here
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

TINY_DIR = os.path.join(common.REPO, "lrmq", "assets", "tiny")
# (prompts_per_step, group_size, max_new_tokens)
SHAPES = {"tiny": (8, 8, 64), "100m": (4, 4, 64)}
STEPS = {"tiny": 6, "100m": 3}  # timed steps per process (tiny: more, since a step is short next to a compile)
QUICK_SHAPES = {"tiny": (4, 4, 32), "100m": (2, 2, 16)}
HEAVY_SHAPE, HEAVY_STEPS = (8, 8, 1024), 4
MAX_PROMPT_LEN = 64


def forced_lengths(step: int, n: int, *, mean: int, cap: int, seed: int) -> list[int]:
    """--heavy-tail: the completion length of each of the n rows of GRPO step `step` (the same on both sides)."""
    import heavy_tail

    return heavy_tail.draw_lengths(n, mean, cap, seed=seed * 100_003 + step)


# ----------------------------------------------------------------------------- workers (one process each)


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def worker_lrmq(a) -> list[dict]:
    import jax

    from lrmq.configlib import config_from_dict
    from lrmq.rl.config import TrainConfig
    from lrmq.rl.trainer import GRPOTrainer, NullWriter

    prompts, group, max_new = a.shape
    run_dir = tempfile.mkdtemp(prefix="lrmq_vs_trl_")
    cfg = config_from_dict(TrainConfig, {
        "model": {"checkpoint": a.ckpt, "dtype": "float32", "param_dtype": "float32"},
        "data": {"train_files": [a.prompts], "template": "raw"},
        "rollout": {"prompts_per_step": prompts, "group_size": group, "max_prompt_len": MAX_PROMPT_LEN,
                    "max_new_tokens": max_new, "temperature": 1.0},
        "algo": {"reward": "boxed_exact"},
        "optim": {"lr": 1e-6},
        "run": {"out_dir": run_dir, "steps": a.steps + 1, "seed": a.seed, "export_hf": False, "progress": False,
                "save_every": 10_000, "compile_cache": a.compile_cache},
    }, source="benchmarks/vs_trl.py")
    tr = GRPOTrainer(cfg, writer_factory=lambda path: NullWriter())
    key = jax.random.key(a.seed)
    out = []
    current = {"step": 0}
    if a.heavy_tail:
        _force_lengths_lrmq(tr, a, current)
    compiles = {"s": 0.0, "n": 0}

    def on_event(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles["s"] += duration
            compiles["n"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        for i in range(a.steps + 1):
            current["step"] = i
            compiles["s"], compiles["n"] = 0.0, 0
            c0, t0 = _cpu(), time.perf_counter()
            ro = tr.rollout(next(tr.pipeline), jax.random.fold_in(key, i))
            rb, stats = ro.batch, ro.stats
            t1 = time.perf_counter()
            tr.learner.update(rb)
            t2 = time.perf_counter()
            out.append({"step_s": t2 - t0, "rollout_s": t1 - t0, "update_s": t2 - t1, "cpu_s": _cpu() - c0,
                        "gen_tokens": float(stats["completion/length_mean"]) * rb.num_sequences,
                        "width": int(rb.tokens.shape[1]), "compile_s": compiles["s"], "compiles": compiles["n"]})
            tr.step += 1
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def _force_lengths_lrmq(tr, a, current) -> None:
    """--heavy-tail instrumentation: the rollout engine runs each row to its drawn length (per-row budgets) and
    stops on no token (the stop id is outside the vocabulary); otherwise the sampler's own generate."""
    import dataclasses

    import jax
    import numpy as np

    from lrmq.generation.engine import Engine, sequence_keys

    engine = Engine(None, eos_ids=[tr.learner.model_cfg.vocab_size], pad_id=tr.tokenizer.pad_id,
                    graphdef=tr.learner.graphdef, model_cfg=tr.learner.model_cfg,
                    config=tr.cfg.rollout.engine_config(), mesh=tr.sampler_mesh)
    max_new = tr.cfg.rollout.max_new_tokens

    def generate(_engine, states, tokens, mask, key, sampling, kv_scales=None):
        prompts = [row[m > 0].tolist() for row, m in zip(tokens, mask)]
        budgets = forced_lengths(current["step"], len(prompts), mean=a.mean, cap=a.shape[2], seed=a.seed)
        with jax.set_mesh(tr.sampler_mesh):
            res = engine.generate(states, prompts, max_new_tokens=budgets, sampling=sampling,
                                  keys=sequence_keys(key, len(prompts)), prompt_capacity=tr.cfg.rollout.max_prompt_len,
                                  new_capacity=max_new)
        assert res.lengths.tolist() == budgets, "lrmq did not produce the drawn lengths"
        tokens_out = np.full((len(prompts), max_new), tr.tokenizer.pad_id, np.int32)  # the trainer's width
        logp_out = np.zeros((len(prompts), max_new), np.float32)
        tokens_out[:, :res.tokens.shape[1]], logp_out[:, :res.logprobs.shape[1]] = res.tokens, res.logprobs
        return dataclasses.replace(res, tokens=tokens_out, logprobs=logp_out)

    tr.sampler.generate = generate


def _stop_at_lengths_model(ckpt: str, a, stop_ids: list[int]):
    """--heavy-tail instrumentation: the HF model whose generate() ends row b of the k-th call at its drawn
    length (a logits processor: no stop token before it, only a stop token at it)."""
    import torch
    import transformers
    from transformers import LogitsProcessor, LogitsProcessorList

    base = getattr(transformers, transformers.AutoConfig.from_pretrained(ckpt).architectures[0])

    class StopAt(LogitsProcessor):
        def __init__(self, lengths, prompt_len):
            self.lengths, self.prompt_len = torch.tensor(lengths), prompt_len

        def __call__(self, input_ids, scores):
            t = input_ids.shape[1] - self.prompt_len  # tokens generated so far
            scores[:, stop_ids] = float("-inf")
            at = self.lengths - 1 == t
            scores[at] = float("-inf")
            scores[at, stop_ids[0]] = 0.0
            return scores

    class Model(base):
        generate_calls = 0

        def generate(self, input_ids=None, **kw):
            lengths = forced_lengths(type(self).generate_calls, input_ids.shape[0], mean=a.mean, cap=a.shape[2],
                                     seed=a.seed)
            type(self).generate_calls += 1
            kw["logits_processor"] = LogitsProcessorList([StopAt(lengths, input_ids.shape[1])])
            out = super().generate(input_ids=input_ids, **kw)
            got = [int(n) for n in ((out[:, input_ids.shape[1]:, None] == torch.tensor(stop_ids)).any(-1).int()
                                    .argmax(1) + 1)]
            assert got == lengths, "TRL did not produce the drawn lengths"
            return out

    return Model.from_pretrained(ckpt, dtype=torch.float32)


def worker_trl(a) -> list[dict]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lrmq.rl.rewards import score_completions

    prompts, group, max_new = a.shape
    rows = [json.loads(x) for x in open(a.prompts)]
    torch.manual_seed(a.seed)
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(a.ckpt, "tokenizer.json"))
    cfg_json = json.load(open(os.path.join(a.ckpt, "config.json")))
    tok.eos_token = tok.convert_ids_to_tokens(cfg_json["eos_token_id"])
    tok.pad_token = tok.pad_token or tok.eos_token

    def reward(completions, answer, **_):
        return [float(x) for x in score_completions(completions, [str(s) for s in answer], "boxed_exact")[0]]

    if a.heavy_tail:
        gen_eos = json.load(open(os.path.join(a.ckpt, "generation_config.json"))).get("eos_token_id", [])
        stops = [cfg_json["eos_token_id"]] + sorted(set(gen_eos if isinstance(gen_eos, list) else [gen_eos]) -
                                                    {cfg_json["eos_token_id"]})
        model = _stop_at_lengths_model(a.ckpt, a, stops)
    else:
        model = AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=torch.float32)
    out_dir = tempfile.mkdtemp(prefix="trl_vs_lrmq_")
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=prompts * group, num_generations=group,
                      max_completion_length=max_new, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
                      num_iterations=1, learning_rate=1e-6, use_cpu=True, bf16=False, fp16=False,
                      gradient_checkpointing=False, report_to=[], logging_steps=1, max_steps=a.steps + 1,
                      save_strategy="no", seed=a.seed, dataloader_num_workers=0, shuffle_dataset=False,
                      disable_tqdm=True)
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=ds, processing_class=tok)

    steps: list[dict] = []
    gen = {"s": 0.0, "tokens": 0.0}
    orig = trainer._generate_and_score_completions

    def timed_generate(inputs):  # benchmark instrumentation only: time TRL's rollout phase
        t0 = time.perf_counter()
        res = orig(inputs)
        gen["s"] += time.perf_counter() - t0
        gen["tokens"] += float(res["completion_mask"].sum())
        return res

    trainer._generate_and_score_completions = timed_generate

    class Clock(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            gen["s"], gen["tokens"] = 0.0, 0.0
            self.c0, self.t0 = _cpu(), time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            step = time.perf_counter() - self.t0
            steps.append({"step_s": step, "rollout_s": gen["s"], "update_s": step - gen["s"],
                          "cpu_s": _cpu() - self.c0, "gen_tokens": gen["tokens"]})

    trainer.add_callback(Clock())
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return steps


# ----------------------------------------------------------------------------- the interleaved runs


def write_prompts(path: str, n: int, seed: int) -> None:
    """Synthetic arithmetic problems rendered with lrmq's arith template: the prompt text both sides get."""
    from lrmq.data.prompts import format_prompt
    from lrmq.data.synthetic import make_splits
    from lrmq.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(TINY_DIR)
    train, _ = make_splits(n, 8, seed=seed)
    with open(path, "w") as f:
        for r in train:
            f.write(json.dumps({"problem": format_prompt("arith", r["problem"], tok),
                                "prompt": format_prompt("arith", r["problem"], tok), "answer": str(r["answer"])}) + "\n")


def long_context_copy(src: str, dst: str, positions: int) -> str:
    """The checkpoint at `src` with max_position_embeddings raised (RoPE has no learned positions: same weights)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    cfg = json.load(open(path))
    cfg["max_position_embeddings"] = positions
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def run_worker(kind: str, ckpt: str, prompts: str, shape, steps: int, threads: int, seed: int, cache: str,
               heavy_mean: int | None = None) -> list[dict]:
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])
    cmd = ["taskset", "-c", cores, sys.executable, os.path.abspath(__file__), "--worker", kind, "--ckpt", ckpt,
           "--prompts", prompts, "--shape", ",".join(map(str, shape)), "--steps", str(steps),
           "--threads", str(threads), "--seed", str(seed), "--compile-cache", cache]
    if heavy_mean is not None:
        cmd += ["--heavy-tail", "--mean", str(heavy_mean)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def summarize(steps: list[list[dict]]) -> dict:
    """Medians over the timed steps of every round; the first step of round 0 is the cold start (lrmq: empty
    compile cache), the first steps of later rounds warm (lrmq: the cache the first round filled)."""
    timed = [x for s in steps for x in s[1:]]
    med = lambda k, xs=timed: statistics.median(x[k] for x in xs)
    out = {"step_s": med("step_s"), "rollout_s": med("rollout_s"), "update_s": med("update_s"),
           "cpu_s_per_step": med("cpu_s"), "gen_tokens_per_s": sum(x["gen_tokens"] for x in timed) /
           sum(x["step_s"] for x in timed), "first_step_cold_s": steps[0][0]["step_s"],
           "step_s_all": [x["step_s"] for x in timed]}
    if "compiles" in timed[0]:
        quiet = [x for x in timed if not x["compiles"]]
        out["step_s_no_compile"] = med("step_s", quiet) if quiet else None
        out["timed_steps_compiling"] = sum(1 for x in timed if x["compiles"])
        out["compile_s_in_timed_steps"] = sum(x["compile_s"] for x in timed)
    if len(steps) > 1:
        out["first_step_warm_s"] = statistics.median(s[0]["step_s"] for s in steps[1:])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 thread, 1 round, 1 timed step, small batch")
    ap.add_argument("--models", default=None, help="comma list of tiny,100m (default both; --quick: tiny)")
    ap.add_argument("--threads", default=None, help="comma list of thread counts (default 1,2; --quick: 1)")
    ap.add_argument("--rounds", type=int, default=None, help="alternations per model and thread count (default 2)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per process after the first (default: tiny 6, 100m 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--heavy-tail", action="store_true",
                    help="reasoning lengths: 8x8 rows, 1,024 new tokens, lengths drawn heavy-tailed (see above)")
    ap.add_argument("--mean", type=int, default=256, help="--heavy-tail: mean completion length")
    # worker mode (internal)
    ap.add_argument("--worker", choices=("lrmq", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--compile-cache", default="off", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        common.set_threads(int(a.threads))
        a.shape = tuple(int(x) for x in a.shape.split(","))
        import logging

        logging.basicConfig(level=logging.ERROR)
        res = worker_lrmq(a) if a.worker == "lrmq" else worker_trl(a)
        print(json.dumps(res))
        return 0

    import grpo_step

    models = (a.models or ("tiny" if a.quick or a.heavy_tail else "tiny,100m")).split(",")
    threads = [int(t) for t in (a.threads or ("1" if a.quick else "1,2")).split(",")]
    rounds = a.rounds or (1 if a.quick else 2)
    shapes = QUICK_SHAPES if a.quick else SHAPES
    mode = "heavy_tail" if a.heavy_tail else "equal_lengths"
    if a.heavy_tail:
        if models != ["tiny"]:
            raise SystemExit("--heavy-tail runs the tiny model only (a 100M model's 1,024-token TRL step takes hours here)")
        shapes = {"tiny": HEAVY_SHAPE if not a.quick else (2, 4, 128)}
    info = common.machine_info(max(threads))
    print(common.machine_str(info), flush=True)
    scratch = tempfile.mkdtemp(prefix="lrmq_vs_trl_")
    prompts = os.path.join(scratch, "prompts.jsonl")
    write_prompts(prompts, 512, a.seed)
    results = []
    try:
        for name in models:
            if name == "tiny":
                ckpt, n = TINY_DIR, None
                if a.heavy_tail:  # room for the prompt and 1,024 new tokens
                    ckpt = long_context_copy(TINY_DIR, os.path.join(scratch, "tiny-long"),
                                             MAX_PROMPT_LEN + shapes[name][2] + 64)
            elif name == "100m":
                ckpt = os.path.join(scratch, "100m")
                n = grpo_step.write_random_checkpoint(ckpt, grpo_step.ARCH_100M, a.seed)
            else:
                raise SystemExit(f"unknown model {name!r}; known: tiny, 100m")
            steps = a.steps or (1 if a.quick else HEAVY_STEPS if a.heavy_tail else STEPS[name])
            for t in threads:
                runs: dict[str, list] = {"lrmq": [], "trl": []}
                cache = os.path.join(scratch, f"jax-cache-{name}-{t}")  # empty at round 0: a cold first step
                for r in range(rounds):
                    order = ("lrmq", "trl") if r % 2 == 0 else ("trl", "lrmq")
                    for kind in order:
                        t0 = time.perf_counter()
                        runs[kind].append(run_worker(kind, ckpt, prompts, shapes[name], steps, t, a.seed + r, cache,
                                                           a.mean if a.heavy_tail else None))
                        print(f"  {name} {t}t round {r} {kind}: steps {[round(s['step_s'], 2) for s in runs[kind][-1]]}"
                              f" ({time.perf_counter() - t0:.0f}s with start-up)", flush=True)
                row = {"model": name, "params": n, "threads": t, "shape": dict(zip(
                    ("prompts_per_step", "group_size", "max_new_tokens"), shapes[name])), "rounds": rounds,
                    "timed_steps_per_round": steps, "lrmq": summarize(runs["lrmq"]), "trl": summarize(runs["trl"]),
                    "raw": runs}
                row["step_ratio_lrmq_over_trl"] = row["lrmq"]["step_s"] / row["trl"]["step_s"]
                if a.heavy_tail:  # the drawn completion lengths of every step of every round (both sides)
                    rows, cap = shapes[name][0] * shapes[name][1], shapes[name][2]
                    row["heavy_tail"] = {"mean": a.mean, "cap": cap, "lengths": {
                        f"round{r}": [forced_lengths(i, rows, mean=a.mean, cap=cap, seed=a.seed + r)
                                      for i in range(steps + 1)] for r in range(rounds)}}
                results.append(row)
                L, T = row["lrmq"], row["trl"]
                print(f"{name} {t} thread(s): lrmq step {L['step_s']:.2f}s (rollout {L['rollout_s']:.2f} / update "
                      f"{L['update_s']:.2f}), TRL {T['step_s']:.2f}s ({T['rollout_s']:.2f} / {T['update_s']:.2f}); "
                      f"ratio {row['step_ratio_lrmq_over_trl']:.2f}; first step cold {L['first_step_cold_s']:.1f}s"
                      f" (warm {L.get('first_step_warm_s', float('nan')):.1f}s) vs {T['first_step_cold_s']:.1f}s; cpu-s/step {L['cpu_s_per_step']:.2f} vs {T['cpu_s_per_step']:.2f}"
                      f"; lrmq timed steps compiling {L['timed_steps_compiling']}, step without compiles {L['step_s_no_compile']}",
                      flush=True)
                if a.out:  # after every (model, threads): a run cut short keeps what it measured
                    common.write_json(a.out, {"benchmark": "vs_trl", "mode": mode, "machine": info, "results": results,
                                              "loadavg_now": list(os.getloadavg()), "partial": True})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    headers = ["model", "threads", "lrmq step s (rollout/update)", "TRL step s (rollout/update)", "lrmq/TRL",
               "gen tok/s lrmq / TRL", "CPU-s/step lrmq / TRL", "first step s lrmq cold / warm / TRL",
               "lrmq timed steps compiling; step s without"]
    table = [[r["model"], r["threads"],
              f"{r['lrmq']['step_s']:.2f} ({r['lrmq']['rollout_s']:.2f}/{r['lrmq']['update_s']:.2f})",
              f"{r['trl']['step_s']:.2f} ({r['trl']['rollout_s']:.2f}/{r['trl']['update_s']:.2f})",
              f"{r['step_ratio_lrmq_over_trl']:.2f}",
              f"{r['lrmq']['gen_tokens_per_s']:.0f} / {r['trl']['gen_tokens_per_s']:.0f}",
              f"{r['lrmq']['cpu_s_per_step']:.2f} / {r['trl']['cpu_s_per_step']:.2f}",
              f"{r['lrmq']['first_step_cold_s']:.1f} / {r['lrmq'].get('first_step_warm_s', float('nan')):.1f} / "
              f"{r['trl']['first_step_cold_s']:.1f}",
              f"{r['lrmq']['timed_steps_compiling']} of {len(r['lrmq']['step_s_all'])}; "
              f"{r['lrmq']['step_s_no_compile'] or float('nan'):.2f}"] for r in results]
    print(common.md_table(headers, table))
    common.write_json(a.out, {"benchmark": "vs_trl", "mode": mode, "machine": info, "results": results,
                              "loadavg_at_end": list(os.getloadavg()),
                              "note": "first step (compile / warm-up) excluded from step_s; first_step_cold_s: round 0 "
                                      "(lrmq's compile cache empty), first_step_warm_s: later rounds (cache filled)"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
