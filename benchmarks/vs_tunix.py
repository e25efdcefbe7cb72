"""One GRPO step, lrmq vs google-tunix 0.1.7 (the JAX peer), same checkpoint, prompts and settings, on CPU.

Tunix runs in a side environment (``--tunix-python``, default /tmp/tunix-venv/bin/python) with jax, jaxlib and
flax pinned as lrmq's; it is never one of lrmq's dependencies. To make it::

    python3.11 -m venv /tmp/tunix-venv
    /tmp/tunix-venv/bin/pip install google-tunix==0.1.7 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 optax==0.2.8

Contenders, each in its own process, interleaved in rounds (the starting one rotates), every process on the same
``--devices`` emulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count) over all the machine's cores:

* ``tunix``: Tunix's own ``GRPOLearner`` on an ``RLCluster`` with its ``vanilla`` rollout engine (its
  ``Sampler``), its Qwen3 model (``tunix.models.qwen3``) loaded from the checkpoint below; actor, rollout and
  reference roles on one mesh (fsdp = every device, tp = 1: Tunix's default shardings), so the rollout shares the
  actor's weights (no weight sync) and Tunix's own in-step asynchrony (meshes that differ) is off;
* ``lrmq``: ``python -m lrmq.train``'s loop (``GRPOTrainer.train``), colocated and synchronous (mesh data=1 x
  fsdp=every device);
* ``lrmq-split``: the same loop with rollout.placement=split, rollout.max_staleness=1: the sampler on half the
  devices (data=1 x fsdp=half, as benchmarks/async_rollout.py pins it), the learner on the other half, the rollout
  of step j+1 sampled while update j runs.

Same work on both sides: one random Qwen3-architecture checkpoint (``ARCH``: ~3.4M parameters, the tiny
tokenizer, tied embeddings, written once by lrmq and read by both from its HF safetensors), the same prompts in
the same order (synthetic arithmetic rendered with lrmq's ``arith`` template; lrmq's ``PromptPipeline`` order,
handed to Tunix), 8 prompts x G=8 completions, temperature 1, top-p 1, no top-k, float32, beta = 0 (no
reference model), mu = 1, the same reward (lrmq's ``boxed_exact``, imported by the Tunix worker), AdamW
(b1 0.9, b2 0.999, eps 1e-8, weight decay 0, lr 1e-6 constant, no gradient clipping on either side).

Completion lengths are imposed, the same on both sides, step by step and row by row:

* case ``fixed``: every completion exactly 256 new tokens;
* case ``heavy``: per-row lengths drawn from a reasoning-length distribution (benchmarks/heavy_tail.draw_lengths:
  lognormal, mean ``--mean`` (256), capped at ``--cap`` (4,096), the longest row of each step set to the cap), as
  benchmarks/vs_trl.py draws them.

How: no stop token is ever sampled (both sides get a stop id outside the vocabulary). lrmq's rollout engine gets
each row's length as its budget, so a row leaves the batch when it is done. Tunix's vanilla sampler has no
per-row budget (one ``max_generation_steps`` for the batch, ``done`` set only by a stop token), so it generates
every row to the step's longest length (``max_tokens_to_generate``: 256, or the 4,096 cap) and each row's tokens
are cut to its drawn length afterwards: its update then masks the rest, as Tunix pads every completion to
``max_tokens_to_generate`` anyway. That is what a static batch costs whether its short rows stop or not: the
batch runs until its longest row is done. Both workers assert they produced exactly the drawn lengths.

Reported per contender and case (medians over the timed steps of all rounds; the first ``--warmup`` steps of
each process are left out: they compile): ``step_s`` (wall time between the ends of consecutive steps), its
rollout / update split (Tunix: ``_generate_and_compute_advantage``, i.e. generation + reward + advantages, vs the
rest; lrmq sync: the rollout taken inline vs the update; lrmq-split: the sampler's generation time, the time the
loop waited for it and the update) and the ratio to Tunix's step time.

A Tunix step on this 2-core machine (8 emulated devices) takes ~41 s at 256 fixed tokens and ~6.5 min at a 1,024 cap,
so docs/figures/vs_tunix.json was measured with ``--cap 1024 --mean 256`` (the draws of vs_trl.py --heavy-tail), one
round per case, and also on 1 device (``--devices 1 --contenders tunix,lrmq``). At the 4,096 cap, on 1 device and a
loaded machine, Tunix's first step took ~36 min (~22 of them generating) and its update needs XLA's memory-minimizing
CPU scheduler to fit 23.5 GiB (``run_worker``), so a full run (1 warm-up + 2 timed steps) takes about 1.5 hours; the
figures hold lrmq's run at that cap (``--contenders lrmq``) and Tunix's first step is quoted from its own metrics log.
The commands are in docs/benchmarks.md.

    python benchmarks/vs_tunix.py --quick                                  # a smoke test (~5 min on 2 cores)
    python benchmarks/vs_tunix.py --case fixed --out /tmp/vs_tunix_fixed.json
    python benchmarks/vs_tunix.py --case heavy --out /tmp/vs_tunix_heavy.json
    python benchmarks/vs_tunix.py --merge /tmp/vs_tunix_fixed.json /tmp/vs_tunix_heavy.json \\
        --out docs/figures/vs_tunix.json
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

TUNIX_PYTHON = "/tmp/tunix-venv/bin/python"
# ~3.4M parameters with the tiny vocabulary (320), tied embeddings; RoPE: no learned positions
ARCH = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            intermediate_size=832)
PROMPTS, GROUP, MAX_PROMPT_LEN, LR = 8, 8, 32, 1e-6
CASES = {  # case: (max new tokens = the cap, timed steps per process, warmup steps per process)
    "fixed": (256, 6, 2),
    "heavy": (4096, 2, 1),
}
QUICK = {"fixed": (32, 2, 1), "heavy": (256, 1, 1)}
CONTENDERS = ("tunix", "lrmq", "lrmq-split")


def step_lengths(case: str, step: int, *, cap: int, mean: int, seed: int) -> list[int]:
    """The completion length of each of the PROMPTS x GROUP rows of rollout `step` (the same on every side)."""
    if case == "fixed":
        return [cap] * (PROMPTS * GROUP)
    import vs_trl

    return vs_trl.forced_lengths(step, PROMPTS * GROUP, mean=mean, cap=cap, seed=seed)


def _compile_clock() -> list[tuple[float, float]]:
    """(end time, seconds) of every XLA compile from now on (JAX's monitoring events)."""
    import jax

    events: list[tuple[float, float]] = []

    def listen(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append((time.perf_counter(), seconds))

    jax.monitoring.register_event_duration_secs_listener(listen)
    return events


def _per_step(ends: list[float], start: float, compiles, extra: list[dict]) -> list[dict]:
    """Per step: wall seconds since the previous step ended (the first: since `start`), the compile seconds that
    fell in it, and the worker's own split (`extra`)."""
    out, prev = [], start
    for end, x in zip(ends, extra):
        c = [s for t, s in compiles if prev < t <= end]
        out.append({"step_s": end - prev, "compile_s": sum(c), "compiles": len(c), **x})
        prev = end
    return out


# ----------------------------------------------------------------------------- Tunix (runs in the side venv)


def worker_tunix(a) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from transformers import PreTrainedTokenizerFast
    from tunix.models.qwen3 import model as qwen3_model
    from tunix.models.qwen3 import params as qwen3_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
    from tunix.sft import metrics_logger

    from lrmq.rl.rewards import score_completions  # pure Python: the same reward as lrmq's

    compiles = _compile_clock()
    hf = json.load(open(os.path.join(a.ckpt, "config.json")))
    vocab = hf["vocab_size"]
    cfg = qwen3_model.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=vocab, embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]), norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=hf["tie_word_embeddings"], dtype=jnp.float32, param_dtype=jnp.float32)
    # Auto axes (jax.make_mesh's default is Explicit now: Tunix's model is written for Auto)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1, 1), ("fsdp", "tp"))
    model = qwen3_params.create_model_from_safe_tensors(a.ckpt, cfg, mesh, dtype=jnp.float32)
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(a.ckpt, "tokenizer.json"))
    tok.eos_token = tok.convert_ids_to_tokens(hf["eos_token_id"])
    tok.pad_token = tok.pad_token or tok.eos_token

    batches = [json.loads(x) for x in open(a.prompts)]
    steps = a.warmup + a.steps
    for b in batches[:steps]:  # the prompt ids lrmq's sampler encodes are the ones Tunix's sampler will
        for text, ids in zip(b["problem"], b["ids"]):
            assert tok.encode(text) == ids, f"tokenizers disagree on {text!r}"
    cap = a.max_new
    rollout_cfg = base_rollout.RolloutConfig(
        max_tokens_to_generate=cap, temperature=1.0, top_p=1.0, top_k=None, max_prompt_length=MAX_PROMPT_LEN,
        kv_cache_size=MAX_PROMPT_LEN + cap, eos_tokens=[vocab], seed=a.seed)  # an int: a fresh key per call (a key array is donated)
    # one update of all PROMPTS x GROUP rows per step (Tunix counts its batch sizes in prompts); past 256 tokens in
    # micro-batches (gradient accumulation) of 2 prompts' groups (1 past 1,024): Tunix's attention materializes
    # [rows, heads, T, T] scores, 64 x 4 x 1,056^2 floats = 1.1 GB per layer at 1,024 new tokens
    micro = PROMPTS if cap <= 256 else 2 if cap <= 1024 else 1
    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0),
        eval_every_n_steps=10 ** 9, max_steps=steps, mini_batch_size=PROMPTS, train_micro_batch_size=micro,
        rollout_micro_batch_size=PROMPTS,
        metrics_logging_options=metrics_logger.MetricsLoggerOptions(log_dir=tempfile.mkdtemp(prefix="tunix_log_")),
        pbar_description=None)
    cluster = rl_cluster_lib.RLCluster(
        actor=model, reference=None, tokenizer=tok,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={r: mesh for r in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
                                             rl_cluster_lib.Role.ROLLOUT)},
            rollout_engine="vanilla", offload_to_cpu=False, training_config=training, rollout_config=rollout_cfg))

    def reward(prompts, completions, answer, **_):
        return [float(x) for x in score_completions(list(completions), [str(s) for s in answer], "boxed_exact")[0]]

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=[reward],
        algo_config=grpo_learner.GRPOConfig(num_generations=GROUP, num_iterations=1, beta=0.0, epsilon=0.2,
                                            loss_agg_mode="sequence-mean-token-mean"))

    # benchmark instrumentation only: impose the drawn lengths on the rollout's output, time the phases
    calls = {"generate": 0}
    gen = cluster.generate

    def generate(prompts, *args, **kw):
        out = gen([str(x) for x in prompts], *args, **kw)  # numpy strings: transformers 5 wants str
        lengths = step_lengths(a.case, calls["generate"], cap=cap, mean=a.mean, seed=a.seed)
        calls["generate"] += 1
        assert [len(t) for t in out.tokens] == [cap] * len(prompts), "Tunix stopped a row before the cap"
        out.tokens = [np.asarray(t[:n]) for t, n in zip(out.tokens, lengths)]
        out.text = [tok.decode(t.tolist()) for t in out.tokens]
        if out.logprobs is not None:
            out.logprobs = [lp[:n] for lp, n in zip(out.logprobs, lengths)]
        assert [len(t) for t in out.tokens] == lengths, "Tunix did not produce the drawn lengths"
        return out

    cluster.generate = generate
    phase = {"rollout": 0.0}
    adv = learner._generate_and_compute_advantage

    def timed_advantage(*args, **kw):
        t0 = time.perf_counter()
        res = adv(*args, **kw)
        jax.block_until_ready(res.advantages)
        phase["rollout"] += time.perf_counter() - t0
        return res

    learner._generate_and_compute_advantage = timed_advantage
    ends, extra = [], []
    run_step = learner._run_global_step

    def timed_step(*args, **kw):
        phase["rollout"] = 0.0
        t0 = time.perf_counter()
        run_step(*args, **kw)
        jax.block_until_ready(jax.tree.leaves(cluster.actor_trainer.model))
        ends.append(time.perf_counter())
        extra.append({"rollout_s": phase["rollout"], "update_s": ends[-1] - t0 - phase["rollout"]})

    learner._run_global_step = timed_step
    data = [{"prompts": np.array(b["problem"]), "answer": np.array(b["answer"])} for b in batches[:steps]]
    start = time.perf_counter()
    learner.train(data)
    assert len(ends) == steps, f"Tunix ran {len(ends)} steps, not {steps}"
    return _per_step(ends, start, compiles, extra)


# ----------------------------------------------------------------------------- lrmq


def _never_stop_engine(tr, lengths_of, calls) -> None:
    """Instrumentation (as benchmarks/vs_trl.py): the rollout engine runs row i of the k-th rollout to
    `lengths_of(k)[i]` new tokens (per-row budgets) and stops on no token (the stop id is outside the vocabulary)."""
    import dataclasses

    import jax
    import numpy as np

    from lrmq.generation.engine import Engine, sequence_keys

    sampler = tr.sampler
    r = tr.cfg.rollout
    engine = Engine(None, eos_ids=[tr.learner.model_cfg.vocab_size], pad_id=tr.tokenizer.pad_id,
                    graphdef=tr.learner.rollout_graphdef, model_cfg=tr.learner.model_cfg,
                    config=sampler.rollout_engine.config, mesh=sampler.mesh)
    max_new = r.max_new_tokens

    def generate(_engine, states, tokens, mask, key, sampling, kv_scales=None):
        prompts = [row[m > 0].tolist() for row, m in zip(tokens, mask)]
        if not calls["n"]:  # compile every row bucket now, as the sampler's warm-up did for its own engine
            with jax.set_mesh(sampler.mesh):
                engine.warmup(states, sampling=sampling, n_requests=len(prompts), prompt_len=r.max_prompt_len,
                              max_new=max_new)
        budgets = lengths_of(calls["n"])
        calls["n"] += 1
        with jax.set_mesh(sampler.mesh):
            res = engine.generate(states, prompts, max_new_tokens=budgets, sampling=sampling,
                                  keys=sequence_keys(key, len(prompts)), prompt_capacity=r.max_prompt_len,
                                  new_capacity=max_new, kv_scales=kv_scales)
        assert res.lengths.tolist() == budgets, "lrmq did not produce the drawn lengths"
        tokens_out = np.full((len(prompts), max_new), tr.tokenizer.pad_id, np.int32)  # the trainer's width
        logp_out = np.zeros((len(prompts), max_new), np.float32)
        tokens_out[:, :res.tokens.shape[1]], logp_out[:, :res.logprobs.shape[1]] = res.tokens, res.logprobs
        return dataclasses.replace(res, tokens=tokens_out, logprobs=logp_out)

    sampler.generate = generate


def worker_lrmq(a) -> list[dict]:
    from lrmq.configlib import config_from_dict
    from lrmq.rl.config import TrainConfig
    from lrmq.rl.run_state import NullWriter
    from lrmq.rl.trainer import GRPOTrainer

    compiles = _compile_clock()
    steps = a.warmup + a.steps
    run_dir = tempfile.mkdtemp(prefix="lrmq_vs_tunix_")
    split = a.worker == "lrmq-split"
    cfg = config_from_dict(TrainConfig, {
        "model": {"checkpoint": a.ckpt, "dtype": "float32", "param_dtype": "float32"},
        "data": {"train_files": [a.prompts_rows], "template": "raw"},
        "rollout": {"prompts_per_step": PROMPTS, "group_size": GROUP, "max_prompt_len": MAX_PROMPT_LEN,
                    "max_new_tokens": a.max_new, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                    **({"placement": "split", "max_staleness": 1} if split else {})},
        "mesh": ({"rollout_fraction": 0.5, "rollout_data": 1, "rollout_fsdp": a.devices // 2} if split else {}),
        "algo": {"reward": "boxed_exact", "beta": 0.0, "num_iterations": 1,
                 "loss_aggregation": "sequence-mean-token-mean"},
        "optim": {"lr": LR, "warmup_steps": 0, "schedule": "constant", "max_grad_norm": 0.0, "weight_decay": 0.0},
        "run": {"out_dir": run_dir, "steps": steps, "seed": a.seed, "export_hf": False, "progress": False,
                "save_every": 10 ** 6, "eval_every": 0, "eval_size": 0, "completions_jsonl": True},
    }, source="benchmarks/vs_tunix.py")
    ends: list[float] = []

    class Clock(NullWriter):  # the loop logs each step's metrics once, when the step is done
        def flush(self) -> None:
            ends.append(time.perf_counter())

    tr = GRPOTrainer(cfg, writer_factory=lambda path: Clock())
    calls = {"n": 0}
    original = type(tr).preflight

    def preflight():  # the sampler exists after the preflight: swap its generate before the first rollout
        mem = original(tr)
        _never_stop_engine(tr, lambda k: step_lengths(a.case, k, cap=a.max_new, mean=a.mean, seed=a.seed), calls)
        return mem

    tr.preflight = preflight
    start = time.perf_counter()
    try:
        tr.train()
        metrics = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
        records = [json.loads(x) for x in open(os.path.join(run_dir, "completions.jsonl"))]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    metrics = [m for m in metrics if "perf/step_s" in m]
    ends = ends[:steps]  # the loop's last flush (after the final save) ends no step
    assert len(metrics) == steps == len(ends), (len(metrics), steps, len(ends))
    batches = [json.loads(x) for x in open(a.prompts)]
    for s in range(1, steps + 1):  # the same prompts, in the same order, as Tunix's
        got = [r["prompt"] for r in records if r["step"] == s][::GROUP]
        assert got == batches[s - 1]["problem"], f"step {s}: prompts differ from the batches given to Tunix"
    extra = []
    for m in metrics:
        wait = m["perf/rollout_wait_s"]
        extra.append({"rollout_s": m["perf/rollout_s"] if split else wait, "rollout_wait_s": wait,
                      "generate_s": m["perf/rollout_s"], "update_s": m["perf/step_s"] - wait,
                      "version_lag": m.get("rollout/version_lag", 0.0)})
    return _per_step(ends, start, compiles, extra)


# ----------------------------------------------------------------------------- the interleaved runs


def write_inputs(scratch: str, seed: int, steps: int) -> tuple[str, str]:
    """(rows file lrmq reads, batches file Tunix reads): arithmetic prompts rendered with the arith template, and
    the first `steps` batches in the order lrmq's PromptPipeline draws them (with their token ids)."""
    from lrmq.data.pipeline import PromptPipeline
    from lrmq.data.prompts import format_prompt
    from lrmq.data.synthetic import make_splits
    from lrmq.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(os.path.join(scratch, "ckpt"))
    train, _ = make_splits(512, 8, seed=seed)
    rows = [{"problem": format_prompt("arith", r["problem"], tok), "answer": str(r["answer"])} for r in train]
    longest = max(len(tok.encode(r["problem"])) for r in rows)
    assert MAX_PROMPT_LEN // 2 < longest <= MAX_PROMPT_LEN, f"prompts of {longest} tokens: both sides pad to 32"
    rows_path, batches_path = os.path.join(scratch, "rows.jsonl"), os.path.join(scratch, "batches.jsonl")
    with open(rows_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    pipe = PromptPipeline(rows, batch_size=PROMPTS, seed=seed, process_index=0, process_count=1)
    with open(batches_path, "w") as f:
        for _ in range(steps):
            b = next(pipe)
            b = {"problem": list(b["problem"]), "answer": [str(x) for x in b["answer"]]}
            b["ids"] = [tok.encode(p) for p in b["problem"]]
            f.write(json.dumps(b) + "\n")
    return rows_path, batches_path


def run_worker(kind: str, a, case: str, files, scratch: str, shape) -> list[dict]:
    max_new, steps, warmup = shape
    python = a.tunix_python if kind == "tunix" else sys.executable
    cmd = [python, os.path.abspath(__file__), "--worker", kind, "--case", case, "--ckpt",
           os.path.join(scratch, "ckpt"), "--prompts-rows", files[0], "--prompts", files[1], "--max-new", str(max_new),
           "--steps", str(steps), "--warmup", str(warmup), "--seed", str(a.seed), "--mean", str(a.mean),
           "--devices", str(a.devices)]
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.devices}"
    if kind == "tunix" and max_new > 1024:
        # at the 4,096 cap one micro-batch (8 rows) of Tunix's update asks XLA's default CPU scheduler for 32.5 GB of
        # temporaries, more than this 23.5 GiB machine has; with the memory-minimizing scheduler its model's forward +
        # backward compiles to 16.3 GB. (Tunix's own remat, RematConfig.DECODER, does not help: 32.2 GB, and its
        # sampler fails under nnx.remat.)
        flags += " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false", XLA_FLAGS=flags.strip(),
               PYTHONPATH=common.REPO)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} worker ({case}) failed:\n{p.stderr[-6000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def summarize(runs: list[list[dict]], warmup: int) -> dict:
    """Medians over the timed steps (each process's first `warmup` left out) of every round."""
    timed = [x for r in runs for x in r[warmup:]]
    med = lambda k: statistics.median(x[k] for x in timed)
    out = {"step_s": med("step_s"), "rollout_s": med("rollout_s"), "update_s": med("update_s"),
           "step_s_all": [round(x["step_s"], 3) for x in timed],
           "timed_steps_compiling": sum(1 for x in timed if x["compiles"]),
           "compile_s_in_timed_steps": sum(x["compile_s"] for x in timed),
           "warmup_s": statistics.median(sum(x["step_s"] for x in r[:warmup]) for r in runs)}
    for k in ("rollout_wait_s", "generate_s", "version_lag"):
        if k in timed[0]:
            out[k] = med(k)
    return out


def run_case(a, case: str, shape, scratch: str, files, info) -> dict:
    max_new, steps, warmup = shape
    runs: dict[str, list] = {c: [] for c in a.contenders}
    for r in range(a.rounds):
        order = a.contenders[r % len(a.contenders):] + a.contenders[:r % len(a.contenders)]
        for kind in order:
            t0 = time.perf_counter()
            runs[kind].append(run_worker(kind, a, case, files, scratch, shape))
            print(f"  {case} round {r} {kind}: steps {[round(s['step_s'], 2) for s in runs[kind][-1]]} "
                  f"({time.perf_counter() - t0:.0f}s with start-up)", flush=True)
    res = {c: summarize(v, warmup) for c, v in runs.items()}
    row = {"case": case, "devices": a.devices, "max_new_tokens": max_new, "rounds": a.rounds, "timed_steps_per_round": steps,
           "warmup_steps_per_round": warmup, "results": res, "raw": runs,
           "lengths": [step_lengths(case, i, cap=max_new, mean=a.mean, seed=a.seed) for i in range(steps + warmup)]}
    if case == "heavy":
        row["mean"] = a.mean
        row["useful_tokens_per_step"] = [sum(x) for x in row["lengths"]]
    if "tunix" in res:
        t = res["tunix"]
        row["ratio_over_tunix"] = {c: {k: v[k] / t[k] for k in ("step_s", "rollout_s", "update_s")}
                                   for c, v in res.items() if c != "tunix"}
    return row


def print_table(cases: list[dict]) -> None:
    headers = ["case", "new tokens (cap)", "devices", "contender", "step s", "rollout s", "update s", "step / Tunix's",
               "rollout / Tunix's",
               "update / Tunix's", "timed steps"]
    rows = []
    for c in cases:
        for name, r in c["results"].items():
            q = c.get("ratio_over_tunix", {}).get(name)
            rows.append([c["case"], c["max_new_tokens"], c.get("devices", ""), name, r["step_s"], r["rollout_s"],
                         r["update_s"],
                         f"{q['step_s']:.2f}x" if q else "-", f"{q['rollout_s']:.2f}x" if q else "-",
                         f"{q['update_s']:.2f}x" if q else "-", len(r["step_s_all"])])
    print(common.md_table(headers, rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short lengths, 1 round, few steps: a smoke test")
    ap.add_argument("--case", default="fixed,heavy", help="comma list of fixed, heavy")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma list of {', '.join(CONTENDERS)}")
    ap.add_argument("--rounds", type=int, default=None, help="alternations per case (default 2; --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per process (default: fixed 6, heavy 2)")
    ap.add_argument("--devices", type=int, default=8, help="emulated CPU devices of every contender")
    ap.add_argument("--mean", type=int, default=256, help="heavy: mean completion length (256: vs_trl.py's draws)")
    ap.add_argument("--cap", type=int, default=None, help="heavy: the length cap (default 4,096; --quick 256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tunix-python", default=TUNIX_PYTHON, help="the side venv's python with google-tunix 0.1.7")
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--merge", nargs="+", help="merge these JSON outputs (cases run one by one) into --out")
    # worker mode (internal)
    ap.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-rows", help=argparse.SUPPRESS)
    ap.add_argument("--max-new", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        import logging

        logging.basicConfig(level=logging.ERROR)
        res = worker_tunix(a) if a.worker == "tunix" else worker_lrmq(a)
        print(json.dumps(res))
        return 0
    if a.merge:
        docs = [json.load(open(p)) for p in a.merge]
        cases = [{"devices": d["devices"], **c} for d in docs for c in d["cases"]]
        print_table(cases)
        # a merged file merged again (the committed figures plus a new run) keeps the provenance of its own inputs
        common.write_json(a.out, {**docs[0], "cases": cases, "merged_from": [
            m for d in docs for m in d.get("merged_from") or
            [{"date_run": d["date_run"], "machine": d["machine"], "devices": d["devices"]}]]})
        return 0

    a.contenders = [c.strip() for c in a.contenders.split(",")]
    bad = [c for c in a.contenders if c not in CONTENDERS]
    if bad:
        ap.error(f"unknown contender(s) {bad}; known: {', '.join(CONTENDERS)}")
    cases = [c.strip() for c in a.case.split(",")]
    if any(c not in CASES for c in cases):
        ap.error(f"--case: one of {', '.join(CASES)} (comma-separated), got {a.case!r}")
    if "tunix" in a.contenders and not os.access(a.tunix_python, os.X_OK):
        raise SystemExit(f"--tunix-python {a.tunix_python}: no such executable; make the side venv (see --help) or "
                         "pass --contenders lrmq,lrmq-split")
    a.rounds = a.rounds or (1 if a.quick else 2)
    shapes = {c: (QUICK if a.quick else CASES)[c] for c in cases}
    if a.steps:
        shapes = {c: (m, a.steps, w) for c, (m, _, w) in shapes.items()}
    if a.cap and "heavy" in shapes:
        shapes["heavy"] = (a.cap, *shapes["heavy"][1:])
    import grpo_step

    info = common.machine_info()
    info["lrmq_commit"] = common.source_commit()
    info["tunix"] = subprocess.run([a.tunix_python, "-c", "import importlib.metadata as m; print(m.version("
                                    "'google-tunix'), m.version('jax'), m.version('flax'))"],
                                   capture_output=True, text=True).stdout.strip() if "tunix" in a.contenders else None
    print(common.machine_str(info), flush=True)
    scratch = tempfile.mkdtemp(prefix="lrmq_vs_tunix_")
    out = {"benchmark": "vs_tunix", "machine": info, "devices": a.devices, "quick": a.quick,
           "date_run": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "setup": {"prompts_per_step": PROMPTS, "group_size": GROUP, "max_prompt_len": MAX_PROMPT_LEN, "lr": LR,
                     "arch": ARCH, "beta": 0.0, "num_iterations": 1, "temperature": 1.0, "reward": "boxed_exact",
                     "meshes": {"tunix": f"actor = rollout: fsdp={a.devices} x tp=1",
                                "lrmq": f"data=1 x fsdp={a.devices}",
                                "lrmq-split": f"learner fsdp={a.devices // 2}, sampler data=1 x fsdp={a.devices // 2}"}},
           "cases": []}
    try:
        positions = MAX_PROMPT_LEN + max(m for m, _, _ in shapes.values()) + 64
        out["params"] = grpo_step.write_random_checkpoint(os.path.join(scratch, "ckpt"),
                                                          dict(ARCH, max_position_embeddings=positions), a.seed)
        files = write_inputs(scratch, a.seed, max(s + w for _, s, w in shapes.values()))
        for case in cases:
            out["cases"].append(run_case(a, case, shapes[case], scratch, files, info))
            common.write_json(a.out, out)  # after every case: a run cut short keeps what it measured
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_table(out["cases"])
    common.write_json(a.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
