"""Running a study: one job per (arm, seed), each a chain of separate processes, up to `parallel` at once.

Study directory (`out_dir`):

    study_config.yaml       the resolved StudyConfig
    train_config.yaml       the resolved train config every arm starts from and every arm is evaluated with
    arms.json               the expanded matrix
    data/train.jsonl        calibration problems (when a ptq arm needs calibration and none is given)
    runs/ARM/seedS/         one job: run/ (lrmq.train), quant/ (lrmq.quantize outputs), pft/ (pseudo-FT),
                            eval.json or eval/ (lrmq.evaluate), logs/STEP.log, result.json (the job is done)
    results.json, results.md, plots/     (lrmq.studies.report)

A job whose `result.json` exists is skipped, and inside a job each step whose output exists is skipped
(`run/final_policy`, `quant/packed`, `eval.json`); lrmq.train itself resumes from its last checkpoint. So
rerunning a killed study continues where it stopped. A failing step fails its job (its log path is reported),
jobs that depend on it are skipped, and the others go on; the command then exits 1.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

from lrmq import paths
from lrmq.atomic import atomic_write_text
from lrmq.checkpoint.load import read_model_config
from lrmq.config_help import to_plain
from lrmq.configlib import dump_config, load_config
from lrmq.generation.kv_format import KVFormat
from lrmq.generation.kv_pool import page_bytes
from lrmq.ptq.methods import needs_calibration
from lrmq.ptq.qat_export import QUANTIZED_POLICY
from lrmq.rl.config import TrainConfig
from lrmq.studies.config import ArmSpec, StudyConfig
from lrmq.studies.matrix import expand

RESULT = "result.json"
STUDY_CONFIG = "study_config.yaml"
TRAIN_CONFIG = "train_config.yaml"


class StudyError(ValueError):
    """A study that cannot run as configured."""


@dataclasses.dataclass
class Step:
    name: str
    done: Callable[[], bool]
    cmd: Optional[list[str]] = None  # a process
    fn: Optional[Callable[[], None]] = None  # or a function run in the job's thread (file I/O only)


@dataclasses.dataclass
class Job:
    arm: ArmSpec
    seed: int
    dir: str
    deps: list[tuple[str, int]]
    steps: list[Step] = dataclasses.field(default_factory=list)
    model: str = ""  # the checkpoint the job evaluates
    status: str = "pending"  # pending | done | failed | skipped
    error: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return (self.arm.name, self.seed)

    @property
    def result_path(self) -> str:
        return os.path.join(self.dir, RESULT)


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def job_dir(out_dir: str, arm: str, seed: int) -> str:
    return os.path.join(out_dir, "runs", arm, f"seed{seed}")


def _exists(*parts: str) -> Callable[[], bool]:
    path = os.path.join(*parts)
    return lambda: os.path.exists(path)


class Study:
    """A planned study: `plan()` builds the jobs, `run()` executes them, `report()` writes the results."""

    def __init__(self, cfg: StudyConfig, *, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)):
        self.cfg = cfg
        self.out = os.path.abspath(cfg.out_dir)
        self.log = log
        self.arms = expand(cfg)
        self.by_name = {a.name: a for a in self.arms}
        self.train_cfg = load_config(TrainConfig, cfg.train.config, cfg.train.overrides)
        self.train_cfg_path = os.path.join(self.out, TRAIN_CONFIG)
        self.calibration = cfg.quantize.calibration
        self.jobs: dict[tuple[str, int], Job] = {}

    # ------------------------------------------------------------------ plan
    def needs_calibration(self) -> bool:
        return any(a.kind == "ptq" and needs_calibration(a.method) for a in self.arms)

    def prepare(self) -> None:
        """The study dir's fixed files; a study dir of a different study refuses to be reused."""
        paths.check_dir_path(self.out, "study directory (out_dir)")  # a file there: a sentence, not [Errno 17]
        os.makedirs(self.out, exist_ok=True)
        path = os.path.join(self.out, STUDY_CONFIG)
        text = dump_config(self.cfg)
        if os.path.exists(path):
            old = load_config(StudyConfig, path)
            keys = ("train", "quantize", "eval")
            diff = [k for k in keys if to_plain(getattr(old, k)) != to_plain(getattr(self.cfg, k))]
            if diff:
                raise StudyError(f"{self.out} holds a study with different {', '.join(diff)} settings (see {path}); "
                                 "use another out_dir, or delete it")
        atomic_write_text(path, text)
        atomic_write_text(self.train_cfg_path, dump_config(self.train_cfg))
        atomic_write_text(os.path.join(self.out, "arms.json"),
                          json.dumps([dataclasses.asdict(a) for a in self.arms], indent=2) + "\n")
        if self.needs_calibration() and not self.calibration:
            d = self.train_cfg.data
            if d.train_files:
                raise StudyError("quantize.calibration is empty and the train config reads data.train_files: name a "
                                 "calibration file (e.g. the training set)")
            self.calibration = os.path.join(self.out, "data", "train.jsonl")
            if not os.path.exists(self.calibration):  # the trainer's own split: same seed, held-out excluded
                self._call("calibration", _py("lrmq.data.synthetic", "--out", os.path.join(self.out, "data"),
                                              "--n-train", str(self.cfg.quantize.calibration_size),
                                              "--n-eval", str(d.synthetic_eval_size), "--seed", str(d.synthetic_seed)),
                           os.path.join(self.out, "logs", "calibration.log"))

    def plan(self) -> list[Job]:
        for seed in self.cfg.seeds:
            for arm in self.arms:
                d = job_dir(self.out, arm.name, seed)
                job = Job(arm, seed, d, [(arm.source, seed)] if arm.kind == "ptq" else [])
                self.jobs[job.key] = job
        for job in self.jobs.values():
            getattr(self, f"_plan_{job.arm.kind}")(job)
            job.steps.append(self._eval_step(job))
        return list(self.jobs.values())

    def _plan_base(self, job: Job) -> None:
        job.model = self.train_cfg.model.checkpoint

    def _plan_train(self, job: Job) -> None:
        run = os.path.join(job.dir, "run")
        cmd = _py("lrmq.train", "--config", self.cfg.train.config, *self.cfg.train.overrides, *job.arm.train,
                  f"run.out_dir={run}", f"run.seed={job.seed}", "run.progress=false", "run.export_hf=true")
        qat = _qat_scheme(job.arm)
        if qat and qat != "w8a8":  # the QAT policy as it was trained to run: its quantized export (qat_export)
            job.steps.append(Step("train", _exists(run, QUANTIZED_POLICY, "packed", "config.json"), cmd))
            job.model = os.path.join(run, QUANTIZED_POLICY, "packed")
        else:
            job.steps.append(Step("train", _exists(run, "final_policy", "config.json"), cmd))
            job.model = os.path.join(run, "final_policy")

    def _plan_ptq(self, job: Job) -> None:
        a = job.arm
        src = self.jobs[(a.source, job.seed)]
        src_arm = self.by_name[a.source]
        qdir = os.path.join(job.dir, "quant")
        ov = []
        if needs_calibration(a.method):
            ov += [f"calibration.path={self.calibration}"]
            if not self.cfg.quantize.calibration:  # the study's own file: problems rendered as in training
                ov += ["calibration.source=prompts", f"calibration.template={self.train_cfg.data.template}"]
        ov += [*self.cfg.quantize.overrides, f"method={a.method}", f"bits={a.bits}", f"group_size={a.group_size}",
               f"outputs.dir={qdir}", "outputs.formats=[packed]", "progress=false"]
        if a.method == "quantlrm" and a.before == "run":
            ov += [f"quantlrm.run_dir={os.path.dirname(src.model)}", "model=null"]
        elif a.method == "quantlrm":  # pseudo-fine-tuning: SFT of the policy on its own correct rollouts
            pft = os.path.join(job.dir, "pft")
            traces = os.path.join(job.dir, "traces.jsonl")
            job.steps.append(Step("traces", _exists(traces), fn=lambda: write_traces(src, src_arm, traces)))
            seq_len = min(512, self.train_cfg.rollout.max_prompt_len + self.train_cfg.rollout.max_new_tokens)
            job.steps.append(Step("pseudo_ft", _exists(pft, "after", "config.json"), _py(
                "lrmq.ptq.pseudo_ft", "--checkpoint", src.model, "--traces", traces, "--out", pft,
                "--steps", str(self.cfg.quantize.pseudo_ft_steps), "--seed", str(job.seed), "--overwrite",
                "--seq-len", str(seq_len))))
            ov += [f"model={os.path.join(pft, 'after')}", f"quantlrm.base={os.path.join(pft, 'before')}",
                   "quantlrm.quantize=base"]
        else:
            ov += [f"model={src.model}"]
        ov += a.quantize
        cmd = _py("lrmq.quantize", "--config", self.cfg.quantize.config, *ov) if self.cfg.quantize.config else \
            _py("lrmq.quantize", "--config", os.devnull, *ov)
        job.steps.append(Step("quantize", _exists(qdir, "packed"), cmd))
        job.model = os.path.join(qdir, "packed")

    def _eval_step(self, job: Job) -> Step:
        e = self.cfg.eval
        a = job.arm
        qat = _qat_scheme(a)
        mem = []
        if a.kind == "train":
            mem = ["--train-memory", os.path.join(job.dir, "run", "config.yaml")]
        if qat == "w8a8":  # no weight-only export: the held-out eval applies the QAT forward to the float weights
            mem += ["--qat-scheme", qat, "--qat-group-size",
                    _train_value(a.train, "quant.qat_group_size", str(self.train_cfg.quant.qat_group_size))]
        heldout = _py("lrmq.studies.heldout", "--checkpoint", job.model, "--train-config", self.train_cfg_path,
                      "--seed", str(job.seed), *mem)
        if e.kind == "heldout":
            out = os.path.join(job.dir, "eval.json")
            cmd = heldout + ["--out", out, "--size", str(e.size), "--samples", str(e.samples)] + \
                ([] if e.greedy else ["--no-greedy"])
            return Step("eval", _exists(out), cmd)
        out = os.path.join(job.dir, "eval")
        cmd = _py("lrmq.evaluate", "--config", e.config, f"checkpoint={job.model}", f"out_dir={out}",
                  f"generation.seed={job.seed}", "progress=false", *e.overrides,
                  *(["float_qat_policy=true"] if qat == "w8a8" else []))
        job.steps.append(Step("memory", _exists(job.dir, "memory.json"),
                              heldout + ["--out", os.path.join(job.dir, "memory.json"), "--memory-only"]))
        return Step("eval", _exists(out, "results.json"), cmd)

    # ------------------------------------------------------------------ run
    def _env(self) -> dict:
        env = dict(os.environ)
        if self.cfg.threads:
            n = str(self.cfg.threads)
            for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
                env[k] = n
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        return env

    def _call(self, name: str, cmd: list[str], log_path: str) -> None:
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            try:
                p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=self._env(),
                                   timeout=self.cfg.timeout_s or None)
            except subprocess.TimeoutExpired:
                raise StudyError(f"{name} passed timeout_s={self.cfg.timeout_s:g}; log {log_path}") from None
        if p.returncode:
            raise StudyError(f"{name} exited with status {p.returncode}; log {log_path}")

    def run_job(self, job: Job) -> None:
        for step in job.steps:
            if step.done():
                continue
            log_path = os.path.join(job.dir, "logs", f"{step.name}.log")
            if step.fn is not None:
                step.fn()
            else:
                self._call(f"{job.arm.name} seed {job.seed}: {step.name}", step.cmd, log_path)
            if not step.done():  # e.g. lrmq.train stopped by a signal: it saved a checkpoint and exited 0
                raise StudyError(f"{job.arm.name} seed {job.seed}: {step.name} ended without its output "
                                 f"(interrupted?); rerun to resume; log {log_path}")
        atomic_write_text(job.result_path, json.dumps(self.collect(job), indent=2, sort_keys=True) + "\n")

    def collect(self, job: Job) -> dict:
        """The job's result: eval metrics, memory, and the source's training memory for ptq arms."""
        out: dict = {"arm": job.arm.name, "seed": job.seed, "model": job.model}
        if self.cfg.eval.kind == "heldout":
            ev = _read_json(os.path.join(job.dir, "eval.json"))
            out["metrics"] = {k: v for k, v in ev.items() if isinstance(v, (int, float)) and not k.startswith("train_")
                              and k not in ("weight_bytes", "linear_bytes", "seconds")}
            mem = ev
        else:
            ev = _read_json(os.path.join(job.dir, "eval", "results.json"))
            out["metrics"] = {"headline": ev["headline"]["value"], "headline_se": ev["headline"]["se"],
                              **{f"{b}_accuracy": s.get("accuracy") for b, s in ev["benchmarks"].items()}}
            mem = _read_json(os.path.join(job.dir, "memory.json"))
        out["memory"] = {k: mem[k] for k in ("weight_bytes", "linear_bytes", "train_param_bytes",
                                             "train_trainable_bytes", "train_opt_bytes") if k in mem}
        if job.arm.kind == "ptq":
            src = _read_json(self.jobs[(job.arm.source, job.seed)].result_path)
            for k in ("train_param_bytes", "train_trainable_bytes", "train_opt_bytes"):
                if k in src.get("memory", {}):
                    out["memory"][k] = src["memory"][k]
        if job.arm.kind == "train":
            out["train_metrics"] = last_metrics(os.path.join(job.dir, "run", "metrics.jsonl"))
            run_config = os.path.join(job.dir, "run", "config.yaml")
            if os.path.exists(run_config):
                out["train_metrics"]["rollout/kv_bytes_per_token"] = rollout_kv_bytes_per_token(run_config)
        return out

    def run(self, *, progress: bool = True) -> dict:
        """Runs every job not yet done; returns {"done", "skipped", "failed", "ran"} counts and failures."""
        self.prepare()
        jobs = self.plan()
        for j in jobs:
            if os.path.exists(j.result_path):
                j.status = "done"
        todo = [j for j in jobs if j.status == "pending"]
        n_done = len(jobs) - len(todo)
        if n_done:
            self.log(f"[lrmq.study] {n_done} of {len(jobs)} jobs already done (results found), skipped")
        bar = _progress(len(jobs), n_done, progress)
        lock = threading.Lock()
        ran, failures = 0, []
        running: dict[cf.Future, Job] = {}
        try:
            with cf.ThreadPoolExecutor(max_workers=self.cfg.parallel) as pool:
                while todo or running:
                    for j in list(todo):
                        if len(running) >= self.cfg.parallel:
                            break
                        dep_status = [self.jobs[d].status for d in j.deps]
                        if any(s in ("failed", "skipped") for s in dep_status):
                            j.status, j.error = "skipped", f"its source {j.arm.source} seed {j.seed} did not finish"
                            todo.remove(j)
                            failures.append(j)
                            bar.update(1)
                            continue
                        if all(s == "done" for s in dep_status):
                            todo.remove(j)
                            running[pool.submit(self.run_job, j)] = j
                    if not running:
                        continue
                    bar.set_postfix_str(", ".join(f"{j.arm.name}/s{j.seed}" for j in running.values())[:60])
                    finished, _ = cf.wait(list(running), return_when=cf.FIRST_COMPLETED)
                    for fut in finished:
                        j = running.pop(fut)
                        err = fut.exception()
                        with lock:
                            if err is None:
                                j.status = "done"
                                ran += 1
                            else:
                                j.status, j.error = "failed", str(err)
                                failures.append(j)
                                self.log(f"[lrmq.study] {j.arm.name} seed {j.seed} failed: {err}")
                        bar.update(1)
        finally:
            bar.close()
        return {"jobs": len(jobs), "ran": ran, "already_done": n_done,
                "failed": [{"arm": j.arm.name, "seed": j.seed, "status": j.status, "error": j.error} for j in failures]}


def write_traces(src: Job, src_arm: ArmSpec, path: str) -> None:
    """Pseudo-FT traces: the source run's correct rollouts (reward >= 1) as prompt + completion (a base source
    has no rollouts: refused)."""
    comp = os.path.join(src.dir, "run", "completions.jsonl")
    if src_arm.kind != "train" or not os.path.exists(comp):
        raise StudyError(f"pseudo-fine-tuning traces come from the source run's completions.jsonl; {comp} is missing")
    rows = []
    with open(comp, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if r.get("reward", 0) >= 1.0:
                    rows.append({"prompt": r["prompt"], "completion": r["completion"]})
    if not rows:
        raise StudyError(f"{comp} has no correct completion to fine-tune on")
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _qat_scheme(arm) -> Optional[str]:
    """The QAT scheme an arm trains with (None: not a QAT arm)."""
    if _train_value(arm.train, "quant.mode") != "qat":
        return None
    return _train_value(arm.train, "quant.qat_scheme", "paper_int8")


def _train_value(overrides: list[str], key: str, default: Optional[str] = None) -> Optional[str]:
    out = default
    for o in overrides:
        k, _, v = o.partition("=")
        if k.strip() == key:
            out = v.strip()
    return out


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# Train metrics a study keeps: the last value of each, the mean over the run's steps of the AVERAGED ones
# (the reward over training; the sampler/learner mismatch of quantized rollouts, `mismatch/*_avg`), and the
# mean over the steps after the first of the TIMED ones (the CPU speed as measured; step 1 compiles or loads
# the compiled programs).
KEEP_LAST = ("step", "eval/sampled_accuracy", "eval/greedy_accuracy", "reward/mean", "reward/accuracy", "perf/step_s",
             "rollout/weight_bytes")
AVERAGED = {"reward/mean": "reward/mean_avg", "train/mismatch/kl_k1": "mismatch/kl_k1_avg",
            "train/mismatch/kl_k3": "mismatch/kl_k3_avg", "train/mismatch/corrected_frac": "mismatch/corrected_frac_avg"}
TIMED = {"perf/step_s": "perf/step_s_avg", "perf/rollout_s": "perf/rollout_s_avg",
         "perf/rollout_tokens_per_s": "perf/rollout_tokens_per_s_avg"}


def last_metrics(path: str) -> dict:
    rows = read_metrics(path)
    out: dict = {}
    for r in rows:
        out.update({k: v for k, v in r.items() if isinstance(v, (int, float))})
    kept = {k: out[k] for k in KEEP_LAST if k in out}
    for averaged, skip in ((AVERAGED, 0), (TIMED, 1)):
        for key, name in averaged.items():
            values = [r[key] for r in rows if isinstance(r.get(key), (int, float))][skip:]
            if values:
                kept[name] = sum(values) / len(values)
    return kept


def rollout_kv_bytes_per_token(run_config: str) -> float:
    """Bytes one cached token takes in the rollout engine's KV pool of the run whose config.yaml this is: K and V
    of every layer and KV head in `rollout.kv_cache`'s format, with its per-token scales where it keeps them
    (`kv_pool.page_bytes` on one device, the interleaved pool of the XLA and TPU paths; the model's config only,
    no weights read)."""
    cfg = load_config(TrainConfig, run_config)
    model_cfg = read_model_config(cfg.model.checkpoint, dtype=cfg.model.dtype)
    page = cfg.rollout.page_size
    return page_bytes(model_cfg, page, fmt=KVFormat(cfg.rollout.kv_cache)) / page


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="study", unit="job", dynamic_ncols=True)


def wall_clock() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
