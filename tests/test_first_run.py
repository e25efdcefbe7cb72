"""A first run on a plain machine: no TPU-runtime lines on stderr, whatever JAX_PLATFORMS says.

libtpu is installed by the test extra (ahead-of-time TPU compiles) into the one venv that `make demo` also
uses; JAX left to itself would start it at every command's first JAX call and print its metadata-server
and worker-hostname errors. Each command chooses JAX's platforms first (`lrmq.cli.select_platforms`).
`make test` sets JAX_PLATFORMS=cpu for the whole suite: the subprocess tests here remove it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from lrmq import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what libtpu prints when it starts without a TPU (any one of them is a failure)
TPU_NOISE = ("Failed to find host bounds", "could not determine TPU", "unexpected worker hostname",
             "Source Location Trace", "libtpu", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE")


def _env_without_platforms() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" and k not in cli.TPU_ENV_HINTS}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["HF_DATASETS_OFFLINE"] = env["HF_HUB_OFFLINE"] = "1"
    return env


@pytest.fixture
def jax_platforms_restored(monkeypatch):
    """select_platforms updates jax's config when jax is imported: put it back (the backends of this process
    started long ago, so the value changes nothing here)."""
    import jax

    old = jax.config.jax_platforms
    jax.config.update("jax_platforms", None)  # as after `import jax` without JAX_PLATFORMS
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    for k in cli.TPU_ENV_HINTS:
        monkeypatch.delenv(k, raising=False)
    yield jax
    jax.config.update("jax_platforms", old)


def test_select_platforms_without_a_tpu(monkeypatch, jax_platforms_restored, tmp_path):
    jax = jax_platforms_restored
    monkeypatch.setattr(cli, "tpu_present", lambda: False)
    monkeypatch.setattr(cli, "_jax_plugins", lambda: set())
    assert cli.select_platforms() == "cpu"
    assert os.environ["JAX_PLATFORMS"] == "cpu" and jax.config.jax_platforms == "cpu"
    assert cli.select_platforms() is None  # set now: kept

    # an NVIDIA machine with JAX's CUDA plugin: the GPU first, no TPU
    gpu = tmp_path / "nvidia0"
    gpu.write_text("")
    monkeypatch.setattr(cli, "_NVIDIA_DEVICES", (str(gpu),))
    monkeypatch.setattr(cli, "_jax_plugins", lambda: {"xla_cuda12"})
    assert cli.default_platforms() == "cuda,cpu"
    # a GPU without the plugin (JAX could not use it) or the plugin without a GPU: the CPU
    monkeypatch.setattr(cli, "_jax_plugins", lambda: set())
    assert cli.default_platforms() == "cpu"
    monkeypatch.setattr(cli, "_jax_plugins", lambda: {"xla_cuda12"})
    gpu.unlink()
    assert cli.default_platforms() == "cpu"


def test_select_platforms_leaves_tpus_and_explicit_choices_alone(monkeypatch, jax_platforms_restored):
    jax = jax_platforms_restored
    monkeypatch.setattr(cli, "tpu_present", lambda: True)  # a TPU VM: JAX picks the TPU
    assert cli.select_platforms() is None and "JAX_PLATFORMS" not in os.environ
    monkeypatch.setattr(cli, "tpu_present", lambda: False)
    monkeypatch.setenv("JAX_PLATFORMS", "")  # JAX's own "choose for me": kept
    assert cli.select_platforms() is None and os.environ["JAX_PLATFORMS"] == ""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert cli.select_platforms() is None and os.environ["JAX_PLATFORMS"] == "cpu"
    assert jax.config.jax_platforms is None  # nothing was changed


def test_a_tpu_hint_counts_as_a_tpu(monkeypatch):
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    assert cli.tpu_present()


def _mains() -> dict[str, str]:
    """Every `python -m lrmq.X` module -> its source."""
    out = {}
    for d, _, files in os.walk(os.path.join(REPO, "lrmq")):
        for f in files:
            p = os.path.join(d, f)
            if f.endswith(".py") and 'if __name__ == "__main__"' in open(p).read():
                out[os.path.relpath(p, REPO)[:-3].replace(os.sep, ".")] = open(p).read()
    return out


def test_every_command_selects_platforms_first():
    """The first statement of every command's main() is the platform choice (nothing before it can start a
    JAX backend)."""
    mains = _mains()
    assert {"lrmq.train", "lrmq.generate", "lrmq.evaluate", "lrmq.quantize", "lrmq.perplexity", "lrmq.convert",
            "lrmq.study"} <= set(mains)
    for name, src in mains.items():
        fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "main")
        first = fn.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):  # a docstring
            first = fn.body[1]
        call = first.value if isinstance(first, ast.Expr) else None
        assert isinstance(call, ast.Call) and ast.unparse(call.func).endswith("select_platforms"), \
            f"{name}.main does not start with select_platforms(): {ast.unparse(first)}"


def _run_cli(module: str, *args: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], env=_env_without_platforms(), cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(cli.tpu_present(), reason="this machine may have a TPU: JAX is meant to start it")
def test_commands_start_quietly_without_jax_platforms(tmp_path):
    """Real work (each starts a JAX backend), with no JAX_PLATFORMS in the environment: no TPU-runtime lines.
    The tiny model is named by its alias in every command."""
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"{i} + {i} = {2 * i}." for i in range(200)))
    fixtures = os.path.join(REPO, "tests", "fixtures", "evals")
    runs = {
        "lrmq.generate": ["--checkpoint", "tiny", "--prompt", "1+1=", "--max-new-tokens", "2"],
        "lrmq.perplexity": ["--checkpoint", "tiny", "--text-file", str(text), "--window", "16", "--max-windows", "1"],
        "lrmq.convert": ["--to", "lrmq", "tiny", str(tmp_path / "converted")],
        "lrmq.quantize": ["--checkpoint", "tiny", "--method", "rtn", "--group-size", "32", "--out",
                          str(tmp_path / "rtn")],
        "lrmq.evaluate": ["--checkpoint", "tiny", "--suite", "amc", "--data-dir", fixtures, "--limit", "1",
                          "--out", str(tmp_path / "eval"), "progress=false", "generation.max_new_tokens=2"],
        "lrmq.train": ["--config", os.path.join(REPO, "configs", "tiny_demo.yaml"), f"run.out_dir={tmp_path / 'run'}",
                       "run.steps=1", "run.eval_size=2", "run.export_hf=false", "run.progress=false",
                       "data.synthetic_train_size=8", "data.synthetic_eval_size=2", "rollout.group_size=2",
                       "rollout.prompts_per_step=2", "rollout.max_new_tokens=4"],
    }
    for module, args in runs.items():
        p = _run_cli(module, *args, cwd=str(tmp_path))
        assert p.returncode == 0, (module, p.stderr[-3000:])
        noise = [l for l in p.stderr.splitlines() if any(n in l for n in TPU_NOISE)]
        assert not noise, (module, noise)
        if module == "lrmq.perplexity":
            assert json.loads(p.stdout)["windows"] == 1
