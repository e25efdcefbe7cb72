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


def test_every_command_process_tunes_the_garbage_collector_before_main():
    """Every command's `__main__` block calls cli.tune_gc() and then main(): the imports are frozen out of the
    collector's view before the command traces anything."""
    for name, src in _mains().items():
        block = next(n for n in ast.parse(src).body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
        calls = [ast.unparse(s.value.func) for s in block.body if isinstance(s, ast.Expr) and
                 isinstance(s.value, ast.Call)]
        assert calls and calls[0].endswith("tune_gc"), f"{name}: {ast.unparse(block)}"
        assert "main()" in ast.unparse(block.body[-1]), name


def test_tune_gc_freezes_what_exists_and_collects_the_young_less_often():
    import gc

    from lrmq import cli

    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, *saved[1:])
        cli.tune_gc()
        frozen = gc.get_freeze_count()
        assert frozen > 1000 and gc.get_threshold() == (cli.GC_GEN0, *saved[1:])
        import weakref

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after the freeze is still collected
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        # still frozen (a collection that unfroze them would leave ~0); a few frozen objects may have been freed
        # meanwhile by another thread of this worker (a frozen object's refcount can still reach zero)
        assert gone() is None and gc.get_freeze_count() > frozen - 1000
        gc.set_threshold(10 ** 6, *saved[1:])
        cli.tune_gc()  # a larger threshold set by the user is kept
        assert gc.get_threshold()[0] == 10 ** 6
    finally:
        gc.set_threshold(*saved)


@pytest.mark.slow(reason="eight CLI processes (two of them TPU / GPU --compile-only), each starting Python and JAX: "
                         "14 s alone on a busy 2-core host")
@pytest.mark.skipif(cli.tpu_present(), reason="this machine may have a TPU: JAX is meant to start it")
def test_commands_start_quietly_without_jax_platforms(tmp_path):
    """Each command starts a JAX backend (real work, or a bad input found after the backend started), with no
    JAX_PLATFORMS in the environment: no TPU-runtime lines, and none of JAX's CUDA plugin either (the GPU compile
    loads it; lrmq.targets filters its driver lines and libtpu's preamble). The tiny model is named by its alias everywhere.
    The commands run side by side (each is mostly Python start-up and a small compile)."""
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"{i} + {i} = {2 * i}." for i in range(200)))
    adapter = tmp_path / "adapter"  # a config and no weights: evaluate fails after loading the model
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    fixtures = os.path.join(REPO, "tests", "fixtures", "evals")
    # module -> (argv, exit status, text of stdout or of the error line)
    runs = {
        "lrmq.generate": (["--checkpoint", "tiny", "--prompt", "1+1=", "--max-new-tokens", "2"], 0, ""),
        "lrmq.perplexity": (["--checkpoint", "tiny", "--text-file", str(text), "--window", "16", "--max-windows",
                             "1"], 0, '"windows": 1'),
        "lrmq.convert": (["--to", "lrmq", "tiny", str(tmp_path / "converted")], 0, "wrote lrmq checkpoint"),
        "lrmq.quantize": (["--checkpoint", "tiny", "--method", "rtn", "--group-size", "32", "--out",
                           str(tmp_path / "rtn")], 0, ""),
        "lrmq.evaluate": (["--checkpoint", "tiny", "--suite", "amc", "--data-dir", fixtures, "--limit", "1",
                           "--out", str(tmp_path / "eval"), "progress=false", f"adapter={adapter}"], 2,
                          "adapter_model.safetensors: no adapter weights"),
        "lrmq.train": (["--config", os.path.join(REPO, "configs", "tiny_demo.yaml"), f"run.out_dir={tmp_path / 'run'}",
                        "mesh.data=2", "run.progress=false"], 2, "does not divide 1 devices"),
    }
    procs = {m: subprocess.Popen([sys.executable, "-m", m, *argv], env=_env_without_platforms(), cwd=str(tmp_path),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for m, (argv, _, _) in runs.items()}
    for module, p in procs.items():
        out, err = p.communicate(timeout=600)
        _, rc, needle = runs[module]
        assert p.returncode == rc, (module, err[-3000:])
        assert needle in (out if rc == 0 else err), (module, out[-2000:], err[-2000:])
        noise = [l for l in err.splitlines() if any(n in l for n in TPU_NOISE)]
        assert not noise, (module, noise)


# ----------------------------------------------------------------------------- one word, one meaning (item 6)
def test_checkpoint_alias_resolves_in_every_loader():
    """"tiny" is the shipped model wherever a command takes a checkpoint, its tokenizer and config included."""
    from lrmq.checkpoint.load import (TINY_MODEL_DIR, checkpoint_kind, load_tokenizer, read_model_config,
                                      resolve_checkpoint)

    assert resolve_checkpoint("tiny") == TINY_MODEL_DIR == resolve_checkpoint(TINY_MODEL_DIR)
    assert checkpoint_kind("tiny") == "hf"
    assert load_tokenizer("tiny").name == TINY_MODEL_DIR
    assert read_model_config("tiny").max_position_embeddings == 256


def test_text_inputs_are_named_by_their_option(tmp_path, capsys):
    """perplexity reads a Markdown file as text, and its messages say --text-file (not "calibration file");
    --tokenizer takes the alias too."""
    from lrmq import perplexity

    md = tmp_path / "README.md"
    md.write_text("# Notes\n\n" + " ".join(f"{i} + {i} = {2 * i}." for i in range(100)))
    assert perplexity.main(["--checkpoint", "tiny", "--tokenizer", "tiny", "--text-file", str(md), "--window", "32",
                            "--max-windows", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["windows"] == 1
    empty = tmp_path / "empty.md"
    empty.write_text("\n")
    assert perplexity.main(["--checkpoint", "tiny", "--text-file", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err == f"lrmq.perplexity: error: --text-file {empty}: the file has no text\n", err
