"""launch/tpu_pod.sh: what it will run on every worker, shown before it runs (--dry-run runs nothing), tested with a
stand-in gcloud that records its arguments; launch/local_multiprocess.sh: its coordinator port and what it does when a
process fails, with a stand-in Python."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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


def test_local_multiprocess_port_and_a_failed_process_stops_the_launch(tmp_path):
    """launch/local_multiprocess.sh picks a free coordinator port below the kernel's ephemeral range (one there can be
    an outgoing connection's: process 0 then failed to start the coordinator, "Failed to add port to server", and
    test_pod_path's two-process launch hung 300 s with process 1 waiting for it); when a process fails the others are
    stopped and the launch exits at once with its status. Stand-in Python: process 0 fails (or not), the others wait."""
    started = tmp_path / "started"
    py = tmp_path / "python"
    py.write_text(f"""#!/usr/bin/env bash
if [ "$1" = - ]; then exec {sys.executable} "$@"; fi  # the script's port pick
echo "$LRMQ_PROCESS_ID $LRMQ_NUM_PROCESSES $LRMQ_COORDINATOR $*" >> {started}
if [ "$LRMQ_PROCESS_ID" = 0 ] && [ -n "${{FAIL:-}}" ]; then echo "Failed to start RPC server" >&2; exit 3; fi
exec sleep "${{WAIT:-0}}"
""")
    py.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "LRMQ_PORT"}
    script = os.path.join(REPO_ROOT, "launch", "local_multiprocess.sh")
    run = lambda **e: subprocess.run(["bash", script, "3", "1", "run.steps=1"], cwd=REPO_ROOT,  # noqa: E731
                                     env=dict(env, PYTHON=str(py), **e), capture_output=True, text=True, timeout=60)
    t0 = time.monotonic()
    r = run(FAIL="1", WAIT="60")
    assert r.returncode == 3, r.stdout + r.stderr
    assert time.monotonic() - t0 < 20  # not the 60 s the others wait: they were stopped
    assert "exited with status 3; stopping the others" in r.stderr and "[proc 0] Failed to start RPC server" in r.stdout
    rows = [line.split() for line in started.read_text().splitlines()]
    assert sorted(row[0] for row in rows) == ["0", "1", "2"] and {row[1] for row in rows} == {"3"}
    ports = {row[2] for row in rows}
    assert len(ports) == 1 and all(row[3:] == ["-m", "lrmq.train", "run.steps=1"] for row in rows)
    port = int(ports.pop().removeprefix("127.0.0.1:"))
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert 20000 <= port < int(f.read().split()[0])
    started.unlink()
    r = run(LRMQ_PORT="23456")  # every process ends well: status 0; LRMQ_PORT is taken as given
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert {line.split()[2] for line in started.read_text().splitlines()} == {"127.0.0.1:23456"}
