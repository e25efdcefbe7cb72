"""launch/tpu_pod.sh: what it will run on every worker, shown before it runs (--dry-run runs nothing), tested with a
stand-in gcloud that records its arguments."""

from __future__ import annotations

import os
import subprocess

from conftest import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "launch", "tpu_pod.sh")
TRAIN = ["--config", "configs/paper1/pod_v5p64_0.6b_grpo.yaml", "run.out_dir=gs://b/runs/x",
         "model.checkpoint=gs://b/models/Qwen3-0.6B-Base"]


def _launch(tmp_path, *args, gcloud: bool, python: bool = False):
    """Runs the script with a stand-in gcloud; the config check runs this checkout's Python (`python=True`) or a
    stand-in that accepts any config ($LRMQ_PYTHON), which must be called first with every argument."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "gcloud.log"
    log.unlink(missing_ok=True)
    if gcloud:  # records each call's arguments, one per line, calls separated by a line "--END--"
        (bin_dir / "gcloud").write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" >> {log}\necho --END-- >> {log}\n')
        (bin_dir / "gcloud").chmod(0o755)
    (bin_dir / "python").write_text(f'#!/usr/bin/env bash\n(echo python; printf "%s\\n" "$@"; echo --END--) >> {log}\n')
    (bin_dir / "python").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", LRMQ_GIT_URL="https://example.invalid/lrmq.git")
    if not python:
        env["LRMQ_PYTHON"] = str(bin_dir / "python")
    r = subprocess.run(["bash", SCRIPT, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    calls = [c.strip("\n").split("\n") for c in log.read_text().split("--END--\n") if c.strip()] if log.exists() else []
    if not python and r.returncode == 0:  # the config check came first: lrmq.train's, with every argument
        check, calls = calls[0], calls[1:]
        want = ["python", "-m", "lrmq.train", *args[args.index("--") + 1:], "--print-config"]
        assert check == want, (check, want)
    return r, calls


def test_dry_run_shows_setup_and_train_and_runs_nothing(tmp_path):
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    r, calls = _launch(tmp_path, "--dry-run", "my-tpu", "us-east5-a", "proj", "--", *TRAIN, gcloud=True)
    assert r.returncode == 0, r.stderr
    assert calls == []  # nothing ran
    out = r.stdout.splitlines()
    assert len(out) == 4, r.stdout
    for line in out[0::2]:
        assert line == "+ gcloud compute tpus tpu-vm ssh my-tpu --zone us-east5-a --project proj --worker=all --command"
    setup, train = out[1], out[3]  # what every worker runs, shown as it is
    for want in ("python3.11", "git clone", "https://example.invalid/lrmq.git", f"--detach {commit}",
                 "make install PY=python3.11", "'jax[tpu]==0.10.2'"):
        assert want in setup, (want, setup)
    assert f"= {commit}" in train and "LRMQ_DISTRIBUTED=auto .venv/bin/python -m lrmq.train" in train
    assert "pod_v5p64_0.6b_grpo.yaml run.out_dir=gs://b/runs/x model.checkpoint=gs://b/models/Qwen3-0.6B-Base" in train


def test_runs_what_it_shows(tmp_path):
    r, calls = _launch(tmp_path, "my-tpu", "us-east5-a", "--", *TRAIN, gcloud=True)
    assert r.returncode == 0, r.stderr
    assert [c[:7] for c in calls] == [["compute", "tpus", "tpu-vm", "ssh", "my-tpu", "--zone", "us-east5-a"]] * 2
    assert "make install PY=python3.11" in calls[0][-1] and "-m lrmq.train --config" in calls[1][-1]
    assert r.stdout.count("+ gcloud") == 2  # shown before running


def test_skip_setup_and_bad_usage(tmp_path):
    r, calls = _launch(tmp_path, "--skip-setup", "my-tpu", "us-east5-a", "--", *TRAIN, gcloud=True)
    assert r.returncode == 0 and len(calls) == 1 and "lrmq.train" in calls[0][-1]
    r, _ = _launch(tmp_path, "--bogus", "my-tpu", "z", "--", *TRAIN, gcloud=True)
    assert r.returncode == 2 and "unknown option --bogus" in r.stderr
    r, _ = _launch(tmp_path, "my-tpu", "z", "--", gcloud=True)
    assert r.returncode == 2 and "no lrmq.train arguments" in r.stderr


def test_config_error_exits_2_before_any_gcloud_call(tmp_path):
    """The config is resolved and validated locally (as --print-config does) before the pod is touched."""
    for extra, want in ((["--config", "configs/paper1/pod_v5p64_0.6b_grpoo.yaml"], "pod_v5p64_0.6b_grpoo.yaml"),
                        ([*TRAIN, "algo.betta=0"], "unknown key 'algo.betta'")):
        r, calls = _launch(tmp_path, "my-tpu", "us-east5-a", "--", *extra, gcloud=True, python=True)
        assert r.returncode == 2 and calls == [] and "+ gcloud" not in r.stdout, (r.stdout, r.stderr)
        assert want in r.stderr and "nothing was run" in r.stderr, r.stderr
