"""The trainer refuses or stops instead of producing nonsense or losing data: one training per run dir,
resume with an incompatible config, non-finite updates, rewards that keep failing, positions past the
model's limit, duplicate log lines after a resume, SIGTERM during start-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from test_train_loop import train_main_in_process  # noqa: F401 (fixture: restores what lrmq.train.main sets)
from test_train_modes import grpo_config, make_trainer, scratch_ckpt  # noqa: F401 (fixture)

from lrmq.configlib import ConfigError
from lrmq.rl.run_lock import RunDirBusy, RunDirLock
from lrmq.rl.run_state import RunLogs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _write_lock(run_dir, pid):
    import socket

    from lrmq.rl.run_lock import _start_time

    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, ".lock"), "w") as f:
        json.dump({"pid": pid, "host": socket.gethostname(), "started": _start_time(pid), "since": "earlier"}, f)


# ----------------------------------------------------------------------------- run-dir lock


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    run = str(tmp_path / "run")
    live = _sleeper()
    try:
        _write_lock(run, live.pid)
        with pytest.raises(RunDirBusy, match=f"in use by process {live.pid}"):
            RunDirLock(run).acquire()
    finally:
        live.kill()
        live.wait()
    # the holder is gone: its lock is stale and taken over
    lock = RunDirLock(run)
    lock.acquire()
    assert json.load(open(os.path.join(run, ".lock")))["pid"] == os.getpid()
    RunDirLock(run).acquire()  # the same process may take it again
    lock.release()
    assert not os.path.exists(os.path.join(run, ".lock"))


def test_second_training_on_a_run_dir_is_refused(tmp_path):
    run = str(tmp_path / "run")
    holder = _sleeper()
    try:
        _write_lock(run, holder.pid)
        p = subprocess.run([sys.executable, "-m", "lrmq.train", "--config", os.path.join(REPO, "configs", "tiny_demo.yaml"),
                            f"run.out_dir={run}", "run.steps=1", "run.progress=false"],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    finally:
        holder.kill()
        holder.wait()
    assert p.returncode == 2, p.stderr[-2000:]
    err = [line for line in p.stderr.splitlines() if line.startswith("lrmq.train: error:")]
    assert len(err) == 1 and f"in use by process {holder.pid}" in err[0] and "Traceback" not in p.stderr
    assert sorted(os.listdir(run)) == [".lock"]  # nothing written into the other run's dir


# ----------------------------------------------------------------------------- resume


def test_resume_with_an_incompatible_config_keeps_the_config(scratch_ckpt, tmp_path):
    run = str(tmp_path / "run")
    cfg = grpo_config(scratch_ckpt, run, steps=1)
    cfg.run.save_every, cfg.run.eval_size = 1, 2
    make_trainer(cfg).train()
    saved = open(os.path.join(run, "config.yaml")).read()
    other = grpo_config(scratch_ckpt, run, steps=2, mode="qlora")
    with pytest.raises(ConfigError, match="cannot resume.*quant.mode"):
        make_trainer(other).train()
    assert open(os.path.join(run, "config.yaml")).read() == saved
    assert not os.path.exists(os.path.join(run, ".lock"))  # the refused resume left no lock


def test_log_lines_after_the_checkpoint_are_dropped_on_resume(tmp_path):
    logs = RunLogs(str(tmp_path))
    for step in (0, 1, 2, 3):
        logs.append({"step": step, "x": step})
    logs.append_completions([{"step": s, "completion": "c"} for s in (1, 2, 3)])
    with open(logs.metrics_path, "a") as f:
        f.write('{"step": 4, "x"')  # cut by the kill
    logs.truncate_after(2)
    assert [json.loads(x)["step"] for x in open(logs.metrics_path)] == [0, 1, 2]
    assert [json.loads(x)["step"] for x in open(logs.completions_path)] == [1, 2]


# ----------------------------------------------------------------------------- stopping


def test_non_finite_update_stops_and_keeps_the_good_checkpoint(scratch_ckpt, tmp_path, monkeypatch):
    import lrmq.rl.sampler as trainer_mod
    from lrmq.rl.trainer import TrainingStopped

    run = str(tmp_path / "run")
    cfg = grpo_config(scratch_ckpt, run, steps=3)
    cfg.run.save_every, cfg.run.eval_size = 1, 2
    tr = make_trainer(cfg)
    tr.train(stop_after=1)
    good = {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tr.learner.trainable)}
    # a NaN advantage (a broken reward, say) makes the loss, the gradient and then every parameter NaN
    monkeypatch.setattr(trainer_mod, "compute_advantages", lambda *a, **k: np.full(4, np.nan, np.float32))
    with pytest.raises(TrainingStopped, match="step 2: non-finite train/"):
        tr.train()
    assert tr.ckpt.latest_step() == 1
    restored = make_trainer(cfg)
    assert restored.maybe_restore() and restored.step == 1
    for k, v in jax.tree_util.tree_leaves_with_path(restored.learner.trainable):
        np.testing.assert_array_equal(np.asarray(v), good[k])


def test_failing_rewards_stop_training_without_training_on_them(scratch_ckpt, tmp_path, monkeypatch):
    import lrmq.rl.sampler as trainer_mod
    from lrmq.rl.trainer import TrainingStopped

    def failing(texts, answers, name="", **kw):
        n = len(texts)
        return np.zeros(n, np.float32), {"correct": np.zeros(n, bool), "formatted": np.zeros(n, bool),
                                         "timeouts": n, "failed": True}

    cfg = grpo_config(scratch_ckpt, str(tmp_path / "run"), steps=5)
    cfg.algo.max_failed_reward_batches, cfg.run.eval_size = 2, 2
    tr = make_trainer(cfg)
    before = [np.asarray(x) for x in jax.tree.leaves(tr.learner.trainable)]
    monkeypatch.setattr(trainer_mod, "score_completions", failing)
    with pytest.raises(TrainingStopped, match="2 consecutive reward batches"):
        tr.train()
    for a, b in zip(before, jax.tree.leaves(tr.learner.trainable)):
        np.testing.assert_array_equal(a, np.asarray(b))  # nothing was trained on the unscored batches
    rows = [json.loads(x) for x in open(os.path.join(tr.run_dir, "metrics.jsonl"))]
    assert [r["reward/timeouts"] for r in rows if "reward/timeouts" in r] == [4.0]  # step 1 logged, step 2 stopped


def test_positions_past_the_model_limit_are_refused(scratch_ckpt, tmp_path):
    cfg = grpo_config(scratch_ckpt, str(tmp_path / "run"))
    cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens = 200, 100  # the scratch model has 256 positions
    with pytest.raises(ConfigError, match="= 300 positions exceeds the model's max_position_embeddings 256"):
        make_trainer(cfg)
    assert not os.path.exists(tmp_path / "run")  # a refused start removes the run dir it made, lock and all


def test_sigterm_during_start_up_exits_with_a_message(tmp_path):
    run = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-m", "lrmq.train", "--config", os.path.join(REPO, "configs", "tiny_demo.yaml"),
                          f"run.out_dir={run}", "run.progress=false"], stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    lines = []
    deadline = time.monotonic() + 240
    for line in p.stderr:  # the trainer has started (its handlers are in place) once it names its cache
        lines.append(line)
        if "compilation cache" in line or time.monotonic() > deadline:
            break
    p.send_signal(signal.SIGTERM)
    rest = p.stderr.read()
    rc = p.wait(timeout=120)
    assert rc == 143, "".join(lines) + rest
    assert "lrmq.train: error: interrupted by SIGTERM during start-up" in rest and "Traceback" not in rest


@pytest.mark.slow(reason="an lrmq.train subprocess killed mid-run, its resume and the uninterrupted reference")
def test_kill_9_during_training_resumes_exactly(tmp_path, train_main_in_process):
    """SIGKILL at a random moment after the first checkpoint (a save may be in flight; the lock is left
    behind by the dead process), then the same command again: it takes over the stale lock, resumes, and ends
    with the parameters and metrics of an uninterrupted run, each step logged once. The killed run is an
    lrmq.train process; the uninterrupted reference and the resume are lrmq.train.main in this process (their
    start-up as a process is not the point: two Python + JAX starts less). The runs are asynchronous
    (rollout.max_staleness=1: a sampler thread runs a version ahead, each checkpoint holds the rollout it sampled
    ahead), so the resume must also restore the pending rollout and the versions for the runs to match."""
    import random

    from test_train_loop import checkpoint_params

    steps = 4  # killed within 0.3 s of the first save: three steps are left to resume
    args = ["--config", os.path.join(REPO, "configs", "tiny_demo.yaml"),
            f"run.steps={steps}", "run.save_every=1", "run.keep_checkpoints=10", "run.eval_size=0",
            "run.export_hf=false", "run.progress=false", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=24", "data.synthetic_train_size=64", "data.synthetic_eval_size=4",
            "rollout.update_shapes=1", "rollout.max_staleness=1"]
    cmd = [sys.executable, "-m", "lrmq.train", *args]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    ref, run = str(tmp_path / "ref"), str(tmp_path / "run")
    r = train_main_in_process(args + [f"run.out_dir={ref}"])
    assert r.returncode == 0, r.stderr[-3000:]

    p = subprocess.Popen(cmd + [f"run.out_dir={run}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = os.path.join(run, "checkpoints")
    deadline = time.monotonic() + 300
    while not (os.path.isdir(ckpts) and any(d.isdigit() for d in os.listdir(ckpts))):
        assert p.poll() is None and time.monotonic() < deadline, "the run ended or stalled before its first save"
        time.sleep(0.05)
    time.sleep(random.Random(0).uniform(0.0, 0.3))
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL  # killed mid-run, not finished
    assert os.path.exists(os.path.join(run, ".lock"))  # left by the killed process

    r = train_main_in_process(args + [f"run.out_dir={run}"])  # the same command again, as main() here
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = checkpoint_params(ref, steps), checkpoint_params(run, steps)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    ref_rows = [json.loads(x) for x in open(os.path.join(ref, "metrics.jsonl"))]
    train_steps = [r_["step"] for r_ in rows if "reward/mean" in r_]
    assert train_steps == list(range(1, steps + 1))  # each step once
    for a, b in zip([r_ for r_ in rows if "reward/mean" in r_], [r_ for r_ in ref_rows if "reward/mean" in r_]):
        assert a["reward/mean"] == b["reward/mean"] and a["train/loss"] == b["train/loss"]
        assert a["rollout/version"] == b["rollout/version"] == max(0, a["step"] - 2)  # one version behind
        assert a["rollout/version_lag"] == min(a["step"] - 1, 1) and a["rollout/dropped_stale"] == 0
    assert not os.path.exists(os.path.join(run, ".lock"))  # released at the end


@pytest.mark.slow(reason="lrmq.train.main in process: one tiny_demo step and its compiles before the save fails with ENOSPC")
def test_disk_full_while_saving_is_one_line(tmp_path, monkeypatch, train_main_in_process):
    import errno

    from lrmq.rl.run_state import RunCheckpointer

    def full(self, *a, **k):
        raise RuntimeError("checkpoint write failed") from OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RunCheckpointer, "save", full)
    run = str(tmp_path / "run")
    # the kill -9 test's shapes (4 x 4 rows, 24 new tokens, no evaluation): its runs put these programs in the
    # session's compilation cache, so here they load instead of compiling
    r = train_main_in_process([
        "--config", os.path.join(REPO, "configs", "tiny_demo.yaml"), f"run.out_dir={run}", "run.steps=1",
        "run.eval_size=0", "run.export_hf=false", "run.progress=false", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=24", "data.synthetic_train_size=16",
        "data.synthetic_eval_size=4", "rollout.update_shapes=1"])
    err = r.stderr
    line = [x for x in err.splitlines() if x.startswith("lrmq.train: error:")]
    assert r.returncode == 2 and len(line) == 1 and f"no space left on device while writing {run}" in line[0], err
    assert "Traceback" not in err
