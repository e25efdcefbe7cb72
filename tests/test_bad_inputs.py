"""Bad inputs to every CLI: exit status 2, one line `lrmq.NAME: error: ...` naming the problem, no traceback,
nothing written, and no input file changed (checksums before / after). One row per bad-input class.

The CLIs run in-process (`main(argv)`), so a row costs the work up to the check, not a Python start-up.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lrmq import atomic
from lrmq import convert as convert_cli
from lrmq import generate as generate_cli
from lrmq import perplexity as perplexity_cli
from lrmq import quantize as quantize_cli
from lrmq.checkpoint.load import TINY_MODEL_DIR
from lrmq.data import synthetic as synthetic_cli
from lrmq.ptq import pseudo_ft as pseudo_ft_cli

CLIS = {"convert": convert_cli.main, "generate": generate_cli.main, "perplexity": perplexity_cli.main,
        "quantize": quantize_cli.main, "ptq.pseudo_ft": pseudo_ft_cli.main,
        "data.synthetic": synthetic_cli.main}


def _tree_sums(root: str) -> dict[str, str]:
    if os.path.isfile(root):
        return {root: hashlib.sha256(open(root, "rb").read()).hexdigest()}
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[p] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Inputs: a copy of the tiny model (and broken variants), a text file, lrmq data JSONL, a run dir."""
    root = tmp_path_factory.mktemp("bad_inputs")
    e = {"root": str(root)}
    ck = root / "ckpt"
    shutil.copytree(TINY_MODEL_DIR, ck)
    e["ckpt"] = str(ck)
    (root / "text.txt").write_text(" ".join(f"{i} + {i} = {2 * i}." for i in range(400)))
    e["text"] = str(root / "text.txt")
    rows = [{"problem": f"{i}+{i}", "answer": str(2 * i)} for i in range(8)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    e["data"] = str(root / "train.jsonl")

    # non-finite weight
    nan = root / "nan_ckpt"
    shutil.copytree(TINY_MODEL_DIR, nan)
    t = load_file(str(nan / "model.safetensors"))
    name = sorted(k for k in t if k.endswith("q_proj.weight"))[0]
    t[name] = t[name].copy()
    t[name][0, 0] = np.nan
    save_file(t, str(nan / "model.safetensors"), metadata={"format": "pt"})
    e["nan"], e["nan_tensor"] = str(nan), name

    # architectures vs model_type
    arch = root / "arch_ckpt"
    shutil.copytree(TINY_MODEL_DIR, arch)
    cfg = json.loads((arch / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (arch / "config.json").write_text(json.dumps(cfg))
    e["arch"] = str(arch)

    # a shard index pointing outside the checkpoint
    esc = root / "escape_ckpt"
    esc.mkdir()
    shutil.copy(arch.parent / "ckpt" / "config.json", esc / "config.json")
    shutil.copy(TINY_MODEL_DIR + "/model.safetensors", root / "outside.safetensors")
    names = list(load_file(str(root / "outside.safetensors")))
    (esc / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {n: "../outside.safetensors" for n in names}}))
    e["escape"] = str(esc)

    # a finished-looking GRPO run dir (QuantLRM pair)
    run = root / "run"
    shutil.copytree(TINY_MODEL_DIR, run / "final_policy")
    shutil.copytree(TINY_MODEL_DIR, run / "initial_policy")
    e["run"] = str(run)
    (root / "ptq.yaml").write_text(f"model: {ck}\nmethod: rtn\noutputs:\n  dir: {ck}\n  overwrite: true\n")
    e["ptq_yaml"] = str(root / "ptq.yaml")
    return e


# (id, cli, argv with {placeholders} from env / {out}, text the error line must contain)
ROWS = [
    # silent wrong results
    ("perplexity-window-past-limit", "perplexity",
     ["--checkpoint", "{ckpt}", "--text-file", "{text}", "--window", "512"], "max_position_embeddings 256"),
    ("generate-prompt-past-limit", "generate",
     ["--checkpoint", "{ckpt}", "--prompt", "1+1=", "--max-new-tokens", "300"], "max_position_embeddings 256"),
    ("generate-temperature-nan", "generate", ["--checkpoint", "{ckpt}", "--prompt", "1", "--temperature", "nan"],
     "--temperature: must be a finite number"),
    ("generate-nonfinite-weights", "generate", ["--checkpoint", "{nan}", "--prompt", "1"], "{nan_tensor}"),
    ("convert-nonfinite-weights", "convert", ["--to", "lrmq", "{nan}", "{out}"], "non-finite"),
    ("convert-architectures-vs-model_type", "convert", ["--to", "lrmq", "{arch}", "{out}"],
     "architectures ['LlamaForCausalLM'] disagrees with model_type 'qwen3'"),
    # lost or exposed data
    ("quantize-out-is-checkpoint", "quantize",
     ["--checkpoint", "{ckpt}", "--method", "rtn", "--group-size", "32", "--out", "{ckpt}", "--overwrite"],
     "--out {ckpt} is --checkpoint {ckpt}"),
    ("quantize-out-inside-checkpoint", "quantize",
     ["--checkpoint", "{ckpt}", "--method", "rtn", "--out", "{ckpt}/q"], "is inside --checkpoint"),
    ("quantize-out-contains-checkpoint", "quantize",
     ["--checkpoint", "{ckpt}", "--method", "rtn", "--out", "{root}", "--overwrite"], "contains --checkpoint"),
    ("quantize-fake-contains-inputs", "quantize",
     ["--checkpoint", "{ckpt}", "--method", "awq", "--calibration", "{data}", "--out", "{out}",
      "--export-hf-fake", "{root}", "--overwrite"], "contains --checkpoint"),
    ("quantize-config-outputs-dir-is-model", "quantize", ["--config", "{ptq_yaml}", "--print-config"],
     "outputs.dir {ckpt} is model {ckpt}"),
    ("convert-dst-inside-src", "convert", ["--to", "lrmq", "{ckpt}", "{ckpt}/sub"], "DST {ckpt}/sub is inside SRC"),
    ("convert-index-escapes-dir", "convert", ["--to", "lrmq", "{escape}", "{out}"],
     "names files outside the checkpoint directory"),
    # one-line errors
    ("quantize-awq-no-calibration", "quantize", ["--checkpoint", "{ckpt}", "--method", "awq", "--out", "{out}"],
     "--method awq needs --calibration FILE"),
    ("quantize-base-with-run-dir", "quantize",
     ["--run-dir", "{run}", "--base", "{ckpt}", "--method", "quantlrm", "--calibration", "{data}", "--out", "{out}"],
     "--base and --run-dir"),
    ("quantize-base-for-rtn", "quantize", ["--checkpoint", "{ckpt}", "--method", "rtn", "--base", "{ckpt}",
                                           "--out", "{out}"], "--base is used by --method quantlrm only"),
    ("quantize-calibration-for-rtn", "quantize", ["--checkpoint", "{ckpt}", "--method", "rtn", "--calibration",
                                                  "{data}", "--out", "{out}"], "--method rtn ignores it"),
    ("quantize-checkpoint-vs-run-dir", "quantize",
     ["--run-dir", "{run}", "--checkpoint", "{ckpt}", "--method", "quantlrm", "--calibration", "{data}",
      "--out", "{out}"], "conflicts with it"),
    ("quantize-targets-not-a-regex", "quantize", ["--checkpoint", "{ckpt}", "--method", "rtn", "--targets", "(",
                                                  "--out", "{out}"], "--targets '(' is not a regular expression"),
    ("quantize-config-targets-not-a-regex", "quantize", ["--config", "{ptq_yaml}", "targets=(", "outputs.dir={out}",
                                                         "--print-config"], "is not a regular expression"),
    ("pseudo_ft-out-is-checkpoint", "ptq.pseudo_ft", ["--checkpoint", "{ckpt}", "--traces", "{data}", "--out",
                                                      "{ckpt}", "--overwrite"], "--out {ckpt} is --checkpoint"),
    ("pseudo_ft-steps-0", "ptq.pseudo_ft", ["--checkpoint", "{ckpt}", "--traces", "{data}", "--out", "{out}",
                                            "--steps", "0"], "--steps: must be >= 1"),
    ("synthetic-n-train-0", "data.synthetic", ["--out", "{out}", "--n-train", "0"], "--n-train: must be >= 1"),
    ("synthetic-min-ops-over-max", "data.synthetic", ["--out", "{out}", "--min-ops", "4", "--max-ops", "2"],
     "--min-ops 4 is greater than --max-ops 2"),
    ("quantize-group-size-0", "quantize", ["--checkpoint", "{ckpt}", "--method", "rtn", "--group-size", "0",
                                           "--out", "{out}"], "--group-size: must be >= 1 or -1, found 0"),
    ("quantize-bits-9", "quantize", ["--checkpoint", "{ckpt}", "--method", "rtn", "--bits", "9", "--out", "{out}"],
     "--bits 9"),
    ("quantize-config-bound", "quantize", ["--config", "{ptq_yaml}", "calibration.block_size=0",
                                           "outputs.dir={out}", "--print-config"],
     "calibration.block_size: must be >= 2, found 0"),
    ("quantize-config-calibration-past-limit", "quantize",
     ["--config", "{ptq_yaml}", "method=awq", "calibration.path={data}", "calibration.block_size=512",
      "outputs.dir={out}"], "calibration.block_size = 512 positions exceeds the model's max_position_embeddings 256"),
    ("quantize-config-nan", "quantize", ["--config", "{ptq_yaml}", "awq.max_shrink=.nan", "outputs.dir={out}",
                                         "--print-config"], "awq.max_shrink: expected a number, found nan"),
    ("generate-max-new-tokens-negative", "generate",
     ["--checkpoint", "{ckpt}", "--prompt", "1", "--max-new-tokens", "-5"], "--max-new-tokens: must be >= 1"),
    ("generate-top-p", "generate", ["--checkpoint", "{ckpt}", "--prompt", "1", "--top-p", "1.5"],
     "--top-p: must be > 0 and <= 1"),
    ("generate-top-k", "generate", ["--checkpoint", "{ckpt}", "--prompt", "1", "--top-k", "-1"], "--top-k"),
    ("generate-missing-prompts-file", "generate", ["--checkpoint", "{ckpt}", "--prompts-file", "{root}/nope.txt"],
     "nope.txt: file does not exist"),
    ("generate-bad-jsonl", "generate", ["--checkpoint", "{ckpt}", "--prompts-file", "{data}"],
     "has no field 'prompt'"),
    ("perplexity-window-0", "perplexity", ["--checkpoint", "{ckpt}", "--text-file", "{text}", "--window", "0"],
     "--window: must be >= 2"),
    ("perplexity-batch-size-0", "perplexity", ["--checkpoint", "{ckpt}", "--text-file", "{text}", "--batch-size",
                                               "0"], "--batch-size: must be >= 1"),
    ("perplexity-missing-text", "perplexity", ["--checkpoint", "{ckpt}", "--text-file", "{root}/nope.txt"],
     "nope.txt"),
    ("convert-shard-size-0", "convert", ["--to", "hf", "--max-shard-gb", "0", "{ckpt}", "{out}"],
     "--max-shard-gb: must be > 0"),
    ("convert-missing-to", "convert", ["{ckpt}", "{out}"], "--to"),
]


def _fill(x: str, env: dict, out: str) -> str:
    return x.format(out=out, **env)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input(row, env, tmp_path, capsys):
    _, cli, argv, needle = row
    out = str(tmp_path / "out")
    argv = [_fill(a, env, out) for a in argv]
    needle = _fill(needle, env, out)
    inputs = [env[k] for k in ("ckpt", "text", "data", "nan", "arch", "escape", "run", "ptq_yaml")]
    before = {p: _tree_sums(p) for p in inputs}
    listing = sorted(os.listdir(env["root"]))
    capsys.readouterr()
    try:
        rc = CLIS[cli](argv)
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.startswith(f"lrmq.{cli}: error: ")]
    assert len(lines) == 1, err
    assert needle in lines[0], (needle, err)
    assert not err.strip().endswith(":"), err
    assert {p: _tree_sums(p) for p in inputs} == before  # no input changed
    assert not os.path.exists(out)  # nothing written
    assert sorted(os.listdir(env["root"])) == listing  # no temporaries left


def test_disk_full_is_one_line_and_leaves_nothing(env, tmp_path, capsys, monkeypatch):
    """ENOSPC while an output is written: one line naming the output; no output, no temporary."""
    import lrmq.checkpoint.hf as hf

    def full(tensors, filename, *a, **k):
        with open(filename, "wb") as f:  # part of the shard made it before the disk filled
            f.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf, "save_file", full)
    out = str(tmp_path / "hf_out")
    before = _tree_sums(env["ckpt"])
    assert convert_cli.main(["--to", "hf", env["ckpt"], out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lrmq.convert: error: no space left on device while writing ") and out in err, err
    assert "it needs more than the " in err and " bytes written before the disk filled" in err, err
    assert " bytes are free there" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == [] and _tree_sums(env["ckpt"]) == before


def test_outputs_get_the_umask_and_stale_temporaries_go(tmp_path):
    """safetensors' save_file writes 0600; the atomic writer gives every file 0o666 & ~umask. A temporary of
    a dead process (pid in its name) is removed by the next atomic write into the same parent."""
    old = os.umask(0o022)
    try:
        dead = tmp_path / f".o.tmp-{atomic._HOST}-999999999-0123456789ab"
        dead.mkdir()
        (dead / "x").write_text("half")
        live = tmp_path / f".o.tmp-{atomic._HOST}-{os.getpid()}-0123456789ab"
        live.mkdir()
        with atomic.atomic_dir(str(tmp_path / "o")) as tmp:
            save_file({"a": np.zeros(3, np.float32)}, os.path.join(tmp, "model.safetensors"))
        mode = stat.S_IMODE(os.stat(tmp_path / "o" / "model.safetensors").st_mode)
        assert mode == 0o644, oct(mode)
        assert not dead.exists() and live.exists()
        atomic.atomic_write_text(str(tmp_path / "t.txt"), "x")
        assert stat.S_IMODE(os.stat(tmp_path / "t.txt").st_mode) == 0o644
    finally:
        os.umask(old)


def test_lrmq_data_jsonl_is_a_prompt_calibration_set(env, tmp_path):
    """lrmq's own data JSONL (problem / answer) is read as a prompt dataset without a hidden flag."""
    assert quantize_cli.sniff_calibration_source(env["data"]) == "prompts"
    assert quantize_cli.sniff_calibration_source(env["text"]) == "text"
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "hello"}) + "\n")
    assert quantize_cli.sniff_calibration_source(str(docs)) == "text"


def test_train_config_bounds_at_print_config(capsys):
    """Config bounds apply to the training config too, --print-config included (lrmq.train's own error prefix
    is owned by lrmq/train.py)."""
    from lrmq.configlib import ConfigError, load_config
    from lrmq.rl.config import TrainConfig

    for override, needle in [("run.save_every=0", "run.save_every: must be >= 1, found 0"),
                             ("rollout.max_new_tokens=0", "rollout.max_new_tokens: must be >= 1"),
                             ("optim.lr=-1", "optim.lr: must be > 0"),
                             ("rollout.temperature=.nan", "expected a number, found nan"),
                             ("mesh.fsdp=0", "mesh.fsdp: must be >= 1 or -1")]:
        with pytest.raises(ConfigError) as e:
            load_config(TrainConfig, None, [override])
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    load_config(TrainConfig, None, ["mesh.fsdp=-1", "rollout.top_p=1"])  # the allowed extremes


def test_position_limit_helper():
    from lrmq.configlib import ConfigError
    from lrmq.model.config import ModelConfig, check_position_limit

    cfg = ModelConfig.from_hf_file(TINY_MODEL_DIR)
    check_position_limit(cfg, 256, "x")
    with pytest.raises(ConfigError, match=r"rollout.max_prompt_len \+ rollout.max_new_tokens = 257 positions "
                                          r"exceeds the model's max_position_embeddings 256"):
        check_position_limit(cfg, 257, "rollout.max_prompt_len + rollout.max_new_tokens")


def test_perplexity_default_window_is_the_model_limit(env, capsys):
    """No --window: the tiny model's 256 positions (not 2048, past its limit)."""
    assert perplexity_cli.main(["--checkpoint", env["ckpt"], "--text-file", env["text"], "--max-windows", "1"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["window"] == 256 and res["windows"] == 1


def test_disk_full_message_gives_the_bytes(tmp_path):
    e = atomic.disk_full_error(str(tmp_path / "x.json"), needed=12345)
    assert "(it needs 12,345 bytes; " in str(e) and "bytes are free there)" in str(e) and str(tmp_path) in str(e)
