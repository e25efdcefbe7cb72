"""GRPO trainer end to end on the shipped tiny model: resume exactness, signals, sharding, config errors."""

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
from flax import nnx

from conftest import REPO_ROOT, run_polling_launch, run_with_devices, tiny_train_config
from lrmq.configlib import ConfigError


def _params(trainer) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(trainer.learner.trainable)
    return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in flat}


def _metrics(run_dir: str) -> list[dict]:
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and k != "rollout/sync_s"} for r in rows]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """One uninterrupted in-process run of two steps (checkpoints after each): its dir, its parameters before
    and after. test_resume_is_exact resumes against it, test_sharded_step_matches_single_device compares the
    sharded run with it (run.save_every changes what is saved, not what is computed)."""
    from lrmq.rl.trainer import GRPOTrainer

    out = tmp_path_factory.mktemp("two_steps")
    trainer = GRPOTrainer(tiny_train_config(str(out), run={"steps": 2, "save_every": 1}))
    initial = {k: v.copy() for k, v in _params(trainer).items()}  # host copies: training donates the buffers
    trainer.train()
    return out, initial, _params(trainer)


@pytest.mark.slow(reason="an interrupted and an uninterrupted in-process training run must end bit for bit equal")
def test_resume_is_exact(tmp_path, two_steps):
    from lrmq.rl.trainer import GRPOTrainer

    # two steps, stopped after the first: the resumed step needs the saved optimizer state, data position and
    # RNG as much as any later one would (the same programs as the other tests here: compiled once)
    run = {"steps": 2, "save_every": 1}
    straight_dir, initial, a = two_steps
    first = GRPOTrainer(tiny_train_config(str(tmp_path / "b"), run=run))
    first.train(stop_after=1)
    assert first.step == 1 and first.ckpt.latest_step() == 1
    resumed = GRPOTrainer(tiny_train_config(str(tmp_path / "b"), run=run))
    resumed.train()
    assert resumed.step == 2
    b = _params(resumed)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    ma, mb = _metrics(str(straight_dir)), _metrics(str(tmp_path / "b"))
    assert ma == mb
    # the run actually trained: parameters moved away from the initial policy
    assert any(not np.array_equal(v, initial[k]) for k, v in a.items())
    assert os.path.exists(straight_dir / "config.yaml")


@pytest.mark.slow(reason="an lrmq.train subprocess SIGTERM'd mid-run, then the resume")
def test_sigterm_saves_and_resume_continues(tmp_path, train_main_in_process):
    """SIGTERM to an lrmq.train process mid-run: it saves and exits 0; the resume (lrmq.train.main in this
    process: its start-up as a process is not the point) continues from the saved step."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lrmq.train", "--config", os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml"),
           f"run.out_dir={out}", "run.steps=200", "run.save_every=100", "run.eval_size=0",
           "run.export_hf=false", "run.progress=false", "rollout.prompts_per_step=4", "rollout.group_size=4",
           "data.synthetic_train_size=256", "data.synthetic_eval_size=8", "rollout.update_shapes=1",
           # 24 new tokens: the programs of test_train_hardening.py's kill -9 runs (one compile per test session)
           "rollout.max_new_tokens=24"]
    if os.environ.get("LRMQ_TEST_TINY"):
        cmd.append(f"model.checkpoint={os.environ['LRMQ_TEST_TINY']}")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline:  # wait for the first completed training step
        if metrics.exists() and any('"step": 1' in l for l in metrics.read_text().splitlines()):
            break
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "interrupted at step" in err
    ckpts = [d for d in os.listdir(out / "checkpoints") if d.isdigit()]
    assert ckpts, "no checkpoint written on SIGTERM"
    saved = max(int(d) for d in ckpts)
    assert 1 <= saved < 200
    r = train_main_in_process(cmd[3:] + ["--stop-after", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines()]
    assert steps[-1] == saved + 1  # resumed from the saved step, not from scratch


@pytest.mark.slow(reason="compiles the step on one device and on a sharded mesh of CPU devices (a subprocess) to compare them")
def test_sharded_step_matches_single_device(tmp_path, two_steps):
    single_dir, _, single = two_steps
    env_tiny = os.environ.get("LRMQ_TEST_TINY", "")
    res = run_with_devices("scripts/train_sharded.py", str(tmp_path / "multi"), str(tmp_path / "multi.npz"), env_tiny,
                           timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    b = np.load(tmp_path / "multi.npz")
    assert sorted(single) == sorted(b.files)
    for k in b.files:
        np.testing.assert_allclose(single[k], b[k], rtol=0, atol=2e-5, err_msg=k)
    ma, mb = _metrics(str(single_dir)), _metrics(str(tmp_path / "multi"))
    for ra, rb in zip(ma, mb):
        for k in ra:
            if k.startswith("reward/") or k.startswith("eval/") or k == "step":
                assert ra[k] == rb[k], k


@pytest.mark.parametrize("section,override,needle", [
    ({"rollout": {"prompts_per_step": 3, "group_size": 4}, "optim": {"micro_batch_size": 8}}, None,
     "micro_batch_size"),
    ({"rollout": {"group_size": 1}}, None, "group_size"),
    ({"algo": {"advantage": "nope"}}, None, "algo.advantage"),
])
def test_config_errors(tmp_path, section, override, needle):
    with pytest.raises(ConfigError, match=needle):
        tiny_train_config(str(tmp_path), **section)


@pytest.fixture
def train_main_in_process(cli):
    """train_main_in_process(argv) -> (returncode, stdout, stderr) of lrmq.train as its main() in this process
    (conftest's cli: its process-wide settings put back afterwards)."""
    return lambda argv: cli("train", *argv)


# backend compiles while a test watches (the listener stays registered: JAX has no public way to remove one)
_compiles: list[str] = []
_watch = {"registered": False, "on": False}


def _on_duration(event: str, duration: float, **kw) -> None:
    if _watch["on"] and event.endswith("backend_compile_duration"):
        _compiles.append(event)


def test_cli_config_errors_exit_before_compiling(tmp_path, train_main_in_process):
    """A bad override is one error line and exit status 2 before anything compiles. In process (main()): the
    command's own start-up and exit status as a process are checked by
    test_first_run.py::test_commands_start_quietly_without_jax_platforms (lrmq.train, mesh.data=2 -> 2)."""
    from jax import monitoring

    if not _watch["registered"]:
        monitoring.register_event_duration_secs_listener(_on_duration)
        _watch["registered"] = True
    base = ["--config", os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml")]
    for extra, needle in ((["rollout.gruop_size=4"], "gruop_size"), (["optim.lr=fast"], "optim.lr"),
                          (["mesh.data=3"], "does not divide")):
        _compiles.clear()
        _watch["on"] = True
        try:
            r = train_main_in_process(base + extra + [f"run.out_dir={tmp_path}"])
        finally:
            _watch["on"] = False
        err = r.stderr
        assert r.returncode == 2, (extra, err[-2000:])
        assert needle in err, (needle, err[-2000:])
        assert [l for l in err.splitlines() if l.startswith("lrmq.train: error:")] and "Traceback" not in err, err
        assert not _compiles, (extra, _compiles)


def launch_two_processes(run_dir: str, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """launch/local_multiprocess.sh: 2 JAX processes x 2 CPU devices, one global (fsdp=4) mesh, one step.

    2 devices per process, not 4: each process still holds several devices of a mesh that spans both (as a pod
    host does), and the cross-process collectives (gloo over TCP) run over 4 ranks instead of 8: a launch with
    the gs:// test's two evaluations fell from 95 to 51 s of CPU. gloo's polling threads run at SCHED_IDLE
    (conftest.run_polling_launch): the gs:// test alone on one core took 84 s of CPU without that, 44 s with it.
    Evaluations (when on) score 4 held-out problems, one per device: each is a greedy and a sampled generation
    over both processes, 8 problems cost 12 s more."""
    cmd = ["bash", os.path.join(REPO_ROOT, "launch", "local_multiprocess.sh"), "2", "2", "--config",
           os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml"), f"run.out_dir={run_dir}", "run.steps=1",
           "run.eval_size=4", "rollout.prompts_per_step=4", "rollout.group_size=4", "run.progress=false",
           "data.synthetic_train_size=256", "data.synthetic_eval_size=8", "optim.warmup_steps=0",
           "rollout.update_shapes=1", *extra]
    if os.environ.get("LRMQ_TEST_TINY"):
        cmd.append(f"model.checkpoint={os.environ['LRMQ_TEST_TINY']}")
    env = dict(os.environ, PYTHON=sys.executable)
    r = run_polling_launch(cmd, cwd=REPO_ROOT, timeout=timeout, env=env)  # gloo's pollers at SCHED_IDLE
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("done: step 1") == 2, r.stdout[-3000:]
    return r


def checkpoint_params(run_dir: str, step: int) -> dict[str, np.ndarray]:
    """{lrmq param path: array} of a run checkpoint, read back as numpy on this 1-device process (orbax
    reassembles the shards each process wrote; independent of the trainer's own gather)."""
    import orbax.checkpoint as ocp
    from etils import epath

    path = epath.Path(run_dir) / "checkpoints" / str(step) / "state"
    ckptr = ocp.PyTreeCheckpointer()
    tree = ckptr.metadata(path).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    out = {}
    for part in ("trainable", "rest"):
        for keys, v in jax.tree_util.tree_flatten_with_path(state[part])[0]:
            out[".".join(str(k.key) for k in keys[:-1])] = v  # the last key is the Variable's "value"
    return out


def check_exported_run(run_dir: str, local_copy, steps=(0, 1, 1)) -> None:
    """What a pod run must leave behind: config, logs written once (`steps`: the metrics rows' steps; by default
    initial eval, step 1, final eval), a checkpoint, and both HF exports, the final one equal to the trained
    (checkpointed) parameters. Works on a local dir or a URL."""
    from etils import epath

    from lrmq.checkpoint.hf import flat_params, load_hf_model

    run = epath.Path(run_dir)
    assert (run / "config.yaml").exists()
    logged = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(steps)  # written once, by process 0
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tb").iterdir())
    exported = {}
    for name in ("initial_policy", "final_policy"):
        dst = local_copy / name  # load_hf_model reads local files
        dst.mkdir(parents=True)
        for f in (run / name).iterdir():
            (dst / f.name).write_bytes(f.read_bytes())
        exported[name] = {k: np.asarray(v.get_value()) for k, v in flat_params(load_hf_model(str(dst))).items()}
    trained = checkpoint_params(run_dir, 1)
    final, initial = exported["final_policy"], exported["initial_policy"]
    assert final.keys() <= trained.keys() and final
    for k in final:
        np.testing.assert_array_equal(final[k], trained[k], err_msg=k)
    assert any(not np.array_equal(final[k], initial[k]) for k in final)  # the step changed the policy


@pytest.mark.slow(reason="two JAX processes x 2 CPU devices: each compiles the update and the rollout, one step")
@pytest.mark.skipif(os.environ.get("LRMQ_SKIP_MULTIPROCESS") == "1", reason="LRMQ_SKIP_MULTIPROCESS=1")
def test_two_process_launch(tmp_path):
    """launch/local_multiprocess.sh: 2 JAX processes x 2 CPU devices with rollout.placement=split: each process
    gives one local device to the sampler and one to the learner, so both meshes (fsdp=2) span the two processes;
    the weights cross from the learner's mesh to the sampler's, and the sampler runs in its thread
    (rollout.max_staleness=1). HF export on: parameters sharded over both processes are gathered for the export
    (process 0 alone cannot read them). Also guards the start-up race of two processes creating the shared
    TensorBoard dir (process 1 crashed, process 0 hung in its first collective until the 5-minute coordination
    timeout). The colocated multi-process run is test_pod_path.py's gs:// launch."""
    out = tmp_path / "mp"
    # no held-out evaluation here (it took 42 of the launch's 92 s of CPU): the gs:// launch of
    # test_pod_path.py::test_two_process_launch_gs_run_dir evaluates before and after, on the same two processes
    r = launch_two_processes(str(out), "run.export_hf=true", "run.eval_size=0", "rollout.placement=split",
                             "rollout.max_staleness=1")
    assert "sampler {'data': 1, 'fsdp': 2, 'tensor': 1} (2 devices)" in r.stdout + r.stderr
    check_exported_run(str(out), tmp_path / "exported", steps=[1])


@pytest.mark.slow(reason="learning is the point: enough GRPO steps on the tiny model for the reward to rise")
def test_short_grpo_run_improves_reward(tmp_path, optimized_xla):
    """The shipped tiny model learns: training accuracy over the last 5 steps beats the first 5 by 0.08. 20 steps
    at lr 2e-4 (was 40 at 1e-4: 44 s of CPU instead of ~60); run.seed 0, 1, 2 gain +0.19, +0.30, +0.14. Optimized
    XLA code: 44 s of CPU, 64 s without LLVM's optimizations (the 20 steps' rollouts outweigh the dearer compiles)."""
    from lrmq.rl.trainer import GRPOTrainer

    cfg = tiny_train_config(str(tmp_path), data={"synthetic_train_size": 16, "synthetic_eval_size": 8},
                            rollout={"prompts_per_step": 8, "group_size": 8, "max_new_tokens": 64},
                            optim={"lr": 2e-4}, run={"steps": 20, "save_every": 100, "eval_size": 8})
    GRPOTrainer(cfg).train()
    acc = [r["reward/accuracy"] for r in _metrics(str(tmp_path)) if "reward/accuracy" in r]
    assert len(acc) == 20
    first, last = np.mean(acc[:5]), np.mean(acc[-5:])
    assert last > first + 0.08, (first, last, acc)
