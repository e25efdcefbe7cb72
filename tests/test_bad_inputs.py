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

from conftest import command_in_process

from lrmq import atomic
from lrmq import convert as convert_cli
from lrmq import evaluate as evaluate_cli
from lrmq import generate as generate_cli
from lrmq import perplexity as perplexity_cli
from lrmq import quantize as quantize_cli
from lrmq import study as study_cli
from lrmq import train as train_cli
from lrmq.checkpoint.load import TINY_MODEL_DIR
from lrmq.data import synthetic as synthetic_cli
from lrmq.ptq import pseudo_ft as pseudo_ft_cli

CLIS = {"convert": convert_cli.main, "generate": generate_cli.main, "perplexity": perplexity_cli.main,
        "quantize": quantize_cli.main, "ptq.pseudo_ft": pseudo_ft_cli.main,
        "data.synthetic": synthetic_cli.main, "evaluate": evaluate_cli.main, "train": train_cli.main,
        "study": study_cli.main}


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
    ("quantize-group-size-minus-2", "quantize", ["--checkpoint", "{ckpt}", "--method", "rtn", "--group-size", "-2",
                                                 "--out", "{out}"], "--group-size: must be >= 1 or -1 or 0, found -2"),
    ("quantize-group-size-0-awq", "quantize", ["--checkpoint", "{ckpt}", "--method", "awq", "--group-size", "0",
                                               "--calibration", "{data}",
                                               "--out", "{out}"], "group_size 0 (one scale per tensor) is for methods"),
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
    import lrmq.checkpoint.shards as shards  # every safetensors shard lrmq writes goes through it

    def full(part, *a, **k):
        with open(part, "wb") as f:  # part of the shard made it before the disk filled
            f.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards, "write_shard", full)
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


# ----------------------------------------------------------------------------- every file a command reads
# Malformed, truncated and empty variants of each kind of input (checkpoint files, text inputs, YAML configs,
# benchmark data, prompt datasets) and outputs that exist as the wrong kind of thing. Each row once ended in
# a library's traceback, or in a message without the file (issue 26, item 3): now one line naming the file
# (and the line where the file has lines).

def _write(path, data) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if data == "DIR":
        os.makedirs(path)
    else:
        with open(path, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
    return str(path)


def _ckpt_variant(root, name: str, rel: str, data) -> str:
    d = os.path.join(root, name)
    shutil.copytree(TINY_MODEL_DIR, d)
    p = os.path.join(d, rel)
    if os.path.exists(p):
        os.remove(p)
    if data is not None:
        _write(p, data)
    return d


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("broken"))
    b = {"root": root}
    bad_utf8 = b'{"a": 1,\n "b": "\xff"}\n'
    b["cfg_list"] = _ckpt_variant(root, "cfg_list", "config.json", "[1, 2]")
    b["cfg_utf8"] = _ckpt_variant(root, "cfg_utf8", "config.json", bad_utf8)
    b["cfg_dir"] = _ckpt_variant(root, "cfg_dir", "config.json", "DIR")
    cfg = json.load(open(os.path.join(TINY_MODEL_DIR, "config.json")))
    b["cfg_type"] = _ckpt_variant(root, "cfg_type", "config.json", json.dumps({**cfg, "hidden_size": "64"}))
    b["tok_empty"] = _ckpt_variant(root, "tok_empty", "tokenizer.json", "")
    b["tok_trunc"] = _ckpt_variant(root, "tok_trunc", "tokenizer.json",
                                   open(os.path.join(TINY_MODEL_DIR, "tokenizer.json")).read()[:100])
    b["tokcfg_list"] = _ckpt_variant(root, "tokcfg_list", "tokenizer_config.json", "[]")
    b["gencfg_list"] = _ckpt_variant(root, "gencfg_list", "generation_config.json", "[1]")
    b["special_list"] = _ckpt_variant(root, "special_list", "special_tokens_map.json", "[1]")
    b["jinja_syntax"] = _ckpt_variant(root, "jinja_syntax", "chat_template.jinja",
                                      "{% for m in messages %}\n{{ m['content'] }}\n")
    b["jinja_raise"] = _ckpt_variant(root, "jinja_raise", "chat_template.jinja", "{{ raise_exception('no system') }}")
    b["index_list"] = _ckpt_variant(root, "index_list", "model.safetensors.index.json", "[]")
    b["index_utf8"] = _ckpt_variant(root, "index_utf8", "model.safetensors.index.json", bad_utf8)
    # an lrmq checkpoint and broken copies of it
    lr = os.path.join(root, "lrmq")
    assert convert_cli.main(["--to", "lrmq", TINY_MODEL_DIR, lr]) == 0
    for name, rel, data in (("state_list", "lrmq_state.json", "[]"), ("state_trunc", "lrmq_state.json", '{"varia'),
                            ("params_file", "params", "")):
        d = os.path.join(root, name)
        shutil.copytree(lr, d)
        p = os.path.join(d, rel)
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        _write(p, data)
        b[name] = d
    d = os.path.join(root, "params_damaged")
    shutil.copytree(lr, d)
    for dirpath, _, files in os.walk(os.path.join(d, "params", "ocdbt.process_0", "d")):
        for f in files:
            with open(os.path.join(dirpath, f), "r+b") as fh:
                fh.truncate(16)
    b["params_damaged"] = d
    # text inputs
    b["txt_empty"] = _write(os.path.join(root, "t", "empty.txt"), "\n \n")
    b["txt_utf8"] = _write(os.path.join(root, "t", "latin1.txt"), b"one line\ncaf\xe9\n")
    b["txt_dir"] = _write(os.path.join(root, "t", "dir.txt"), "DIR")
    b["readme"] = _write(os.path.join(root, "t", "README.md"), "# Title\n\n" + "1 + 1 = 2. " * 300)
    b["jsonl_bad"] = _write(os.path.join(root, "t", "bad.jsonl"), '{"text": "a", "prompt": "a"}\n{"text": \n')
    b["jsonl_list"] = _write(os.path.join(root, "t", "list.jsonl"), '["a"]\n')
    b["json_bad"] = _write(os.path.join(root, "t", "bad.json"), '[{"prompt": "a"},\n {"prompt": }]')
    b["parquet_bad"] = _write(os.path.join(root, "t", "bad.parquet"), "not parquet")
    b["unknown"] = _write(os.path.join(root, "t", "weights.safetensors"), b"\x00\x01")
    # YAML configs
    b["yaml_bad"] = _write(os.path.join(root, "y", "bad.yaml"), "model: tiny\nmethod: [rtn\n")
    b["yaml_tab"] = _write(os.path.join(root, "y", "tab.yaml"), "generation:\n\tsamples: 2\n")
    b["yaml_dup"] = _write(os.path.join(root, "y", "dup.yaml"), "run:\n  steps: 1\nrun:\n  steps: 2\n")
    b["yaml_utf8"] = _write(os.path.join(root, "y", "latin1.yaml"), b"model: tiny\nmethod: rtn \xe9\n")
    b["yaml_dir"] = _write(os.path.join(root, "y", "dir.yaml"), "DIR")
    # benchmark data and prompt datasets
    b["evdata_json"] = os.path.dirname(_write(os.path.join(root, "ev_json", "amc.json"), '[{"problem": "1+1"},\n {'))
    b["evdata_utf8"] = os.path.dirname(_write(os.path.join(root, "ev_utf8", "amc.jsonl"),
                                              b'{"problem": "1", "answer": "1"}\n\xff\n'))
    b["evdata_list"] = os.path.dirname(_write(os.path.join(root, "ev_list", "amc.jsonl"), '["1+1", "2"]\n'))
    b["train_bad"] = _write(os.path.join(root, "d", "train.jsonl"),
                            '{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", \n')
    b["rescore"] = os.path.dirname(_write(os.path.join(root, "rescore", "completions.jsonl"),
                                          '{"benchmark": "amc", "text": "x"}\n'))
    b["adapter_empty"] = _write(os.path.join(root, "adapter", "adapter_config.json"), "")
    b["adapter"] = os.path.dirname(b["adapter_empty"])
    b["short"] = _write(os.path.join(root, "t", "short.txt"), "1 + 1 = 2.")
    b["ptq_yaml"] = _write(os.path.join(root, "y", "awq.yaml"), "model: tiny\nmethod: awq\n")
    b["file"] = _write(os.path.join(root, "a_file"), "x")
    b["text"] = _write(os.path.join(root, "text.txt"), " ".join(f"{i} + {i} = {2 * i}." for i in range(300)))
    return b


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES_EVALS = os.path.join(REPO, "tests", "fixtures", "evals")
EVAL = ["--suite", "amc", "--limit", "1", "progress=false", "generation.max_new_tokens=2"]
STUDY_QUICK = os.path.join(REPO, "configs", "study", "quick.yaml")
TRAIN = ["--config", os.path.join(REPO, "configs", "tiny_demo.yaml"), "run.progress=false"]

# (id, cli, argv with {placeholders} from `broken` / {out}, text the error line must contain)
BROKEN = [
    # checkpoint files
    ("config.json-a-list", "generate", ["--checkpoint", "{cfg_list}", "--prompt", "1"],
     "cfg_list/config.json: expected a mapping (JSON object), found a list"),
    ("config.json-not-utf8", "convert", ["--to", "lrmq", "{cfg_utf8}", "{out}"],
     "cfg_utf8/config.json line 2: not UTF-8 text (byte 0xff at column 8)"),
    ("config.json-a-directory", "perplexity", ["--checkpoint", "{cfg_dir}", "--text-file", "{text}"],
     "cfg_dir/config.json: is a directory"),
    ("config.json-wrong-type", "quantize", ["--checkpoint", "{cfg_type}", "--method", "rtn", "--out", "{out}"],
     "config.json: hidden_size must be a positive integer, found '64'"),
    ("checkpoint-is-a-file", "generate", ["--checkpoint", "{text}", "--prompt", "1"], "--checkpoint: {text}: is a file"),
    ("tokenizer.json-empty", "generate", ["--checkpoint", "{tok_empty}", "--prompt", "1"],
     "tok_empty/tokenizer.json: not a tokenizers file (EOF while parsing"),
    ("tokenizer.json-truncated", "perplexity", ["--checkpoint", "{tok_trunc}", "--text-file", "{text}"],
     "tok_trunc/tokenizer.json: not a tokenizers file ("),
    ("tokenizer_config.json-a-list", "generate", ["--checkpoint", "{tokcfg_list}", "--prompt", "1"],
     "tokcfg_list/tokenizer_config.json: expected a mapping"),
    ("generation_config.json-a-list", "generate", ["--checkpoint", "{gencfg_list}", "--prompt", "1"],
     "gencfg_list/generation_config.json: expected a mapping"),
    ("special_tokens_map.json-a-list", "perplexity", ["--checkpoint", "{special_list}", "--text-file", "{text}"],
     "special_list/special_tokens_map.json: expected a mapping"),
    ("chat-template-syntax", "generate", ["--checkpoint", "{jinja_syntax}", "--prompt", "1", "--chat"],
     "jinja_syntax/chat_template.jinja line 2: chat template error (Unexpected end of template"),
    ("chat-template-raises", "generate", ["--checkpoint", "{jinja_raise}", "--prompt", "1", "--chat"],
     "jinja_raise/chat_template.jinja: chat template error (no system)"),
    ("index.json-a-list", "convert", ["--to", "lrmq", "{index_list}", "{out}"],
     "index_list/model.safetensors.index.json: expected a mapping"),
    ("index.json-not-utf8", "generate", ["--checkpoint", "{index_utf8}", "--prompt", "1"],
     "index_utf8/model.safetensors.index.json line 2: not UTF-8"),
    ("lrmq_state.json-a-list", "generate", ["--checkpoint", "{state_list}", "--prompt", "1"],
     "state_list/lrmq_state.json: expected a mapping"),
    ("lrmq_state.json-truncated", "convert", ["--to", "hf", "{state_trunc}", "{out}"],
     "state_trunc/lrmq_state.json line 1: not valid JSON"),
    ("lrmq-params-a-file", "convert", ["--to", "hf", "{params_file}", "{out}"],
     "params_file: incomplete lrmq checkpoint, missing params/ (a file is there)"),
    ("lrmq-params-damaged", "generate", ["--checkpoint", "{params_damaged}", "--prompt", "1"],
     "params_damaged/params: cannot restore ("),
    # text inputs: the option, the file, the line
    ("text-file-empty", "perplexity", ["--checkpoint", "tiny", "--text-file", "{txt_empty}"],
     "--text-file {txt_empty}: the file has no text"),
    ("text-file-not-utf8", "perplexity", ["--checkpoint", "tiny", "--text-file", "{txt_utf8}"],
     "--text-file {txt_utf8} line 2: not UTF-8 text (byte 0xe9 at column 4)"),
    ("text-file-a-directory", "perplexity", ["--checkpoint", "tiny", "--text-file", "{txt_dir}"],
     "--text-file {txt_dir}: is a directory, expected a file"),
    ("text-file-bad-jsonl", "perplexity", ["--checkpoint", "tiny", "--text-file", "{jsonl_bad}"],
     "--text-file {jsonl_bad} line 2: not valid JSON"),
    ("text-file-unknown-type", "perplexity", ["--checkpoint", "tiny", "--text-file", "{unknown}"],
     "--text-file {unknown}: unsupported file type '.safetensors'"),
    ("text-file-shorter-than-a-window", "perplexity", ["--checkpoint", "tiny", "--text-file", "{short}", "--window",
                                                       "64"], "--text-file {short}: 10 tokens are fewer than one window of 64 (--window)"),
    ("tokenizer-option-broken", "perplexity", ["--checkpoint", "tiny", "--text-file", "{readme}", "--tokenizer",
                                               "{tok_trunc}"], "tok_trunc/tokenizer.json: not a tokenizers file"),
    ("prompts-file-bad-json", "generate", ["--checkpoint", "tiny", "--prompts-file", "{json_bad}"],
     "--prompts-file {json_bad} line 2: not valid JSON"),
    ("prompts-file-records-not-objects", "generate", ["--checkpoint", "tiny", "--prompts-file", "{jsonl_list}"],
     "--prompts-file {jsonl_list} line 1: expected a JSON object with a 'prompt' field, found a list"),
    ("prompts-file-not-parquet", "generate", ["--checkpoint", "tiny", "--prompts-file", "{parquet_bad}"],
     "--prompts-file {parquet_bad}: not a readable Parquet file"),
    ("calibration-bad-jsonl", "quantize", ["--checkpoint", "tiny", "--method", "gptq", "--calibration", "{jsonl_bad}",
                                           "--out", "{out}"], "--calibration {jsonl_bad} line 2: not valid JSON"),
    ("calibration-not-utf8", "quantize", ["--checkpoint", "tiny", "--method", "awq", "--calibration", "{txt_utf8}",
                                          "--out", "{out}"], "--calibration {txt_utf8} line 2: not UTF-8"),
    ("calibration.path-bad-jsonl", "quantize", ["--config", "{ptq_yaml}", "calibration.path={jsonl_bad}",
                                                "calibration.block_size=64", "outputs.dir={out}"],
     "calibration.path {jsonl_bad} line 2: not valid JSON"),
    ("train-checkpoint-missing", "train", [*TRAIN, "model.checkpoint={root}/nope", "run.out_dir={out}"],
     "model.checkpoint: {root}/nope: no such file or directory"),
    ("generate-checkpoint-missing", "generate", ["--checkpoint", "{root}/nope", "--prompt", "1"],
     "--checkpoint: {root}/nope: no such file or directory"),
    ("quantize-base-missing", "quantize", ["--checkpoint", "tiny", "--base", "{root}/nope", "--method", "quantlrm",
                                           "--calibration", "{readme}", "--out", "{out}"],
     "--base: {root}/nope: no such file or directory"),
    ("perplexity-tokenizer-missing", "perplexity", ["--checkpoint", "tiny", "--text-file", "{readme}", "--tokenizer",
                                                    "{root}/nope"], "--tokenizer: tokenizer directory"),
    ("train-data-bad-jsonl", "train", [*TRAIN, "data.train_files=[{train_bad}]", "run.out_dir={out}"],
     "data.train_files {train_bad} line 2: not valid JSON"),
    # YAML configs
    ("quantize-config-duplicate-key", "quantize", ["--config", "{yaml_dup}", "--print-config"],
     "dup.yaml line 3 column 1: invalid YAML (key 'run' is given twice (first on line 1))"),
    ("quantize-config-not-utf8", "quantize", ["--config", "{yaml_utf8}", "--print-config"],
     "latin1.yaml line 2: not UTF-8 text (byte 0xe9 at column 13)"),
    ("evaluate-config-bad-yaml", "evaluate", ["--config", "{yaml_bad}", "--print-config"],
     "bad.yaml line 3 column 1: invalid YAML"),
    ("evaluate-config-tab", "evaluate", ["--config", "{yaml_tab}", "--print-config"],
     "tab.yaml line 2 column 1: invalid YAML (while scanning for the next token: found character '\\t'"),
    ("train-config-a-directory", "train", ["--config", "{yaml_dir}", "--print-config"],
     "dir.yaml: is a directory, expected a config file"),
    ("train-config-not-utf8", "train", ["--config", "{yaml_utf8}", "--print-config"], "latin1.yaml line 2: not UTF-8"),
    ("study-config-duplicate-key", "study", ["--config", "{yaml_dup}", "--list"], "key 'run' is given twice"),
    # a KV pool smaller than one sequence: refused at start, naming the smallest value that works
    ("train-kv-pages-1", "train", [*TRAIN, "rollout.kv_pages=1", "run.out_dir={out}"],
     "rollout.kv_pages=1: a KV pool of 1 pages of 16 tokens cannot hold one sequence"),
    ("evaluate-kv-pages-1", "evaluate", ["--checkpoint", "tiny", "--data-dir", FIXTURES_EVALS, *EVAL,
                                         "generation.kv_pages=1", "--out", "{out}"],
     "the smallest that works is generation.kv_pages=6"),
    ("generate-kv-pages-1", "generate", ["--checkpoint", "tiny", "--prompt", "1+1=", "--max-new-tokens", "8",
                                         "--kv-pages", "1"], "the smallest that works is --kv-pages=7"),
    # benchmark data, adapters
    ("evaluate-data-bad-json", "evaluate", ["--checkpoint", "tiny", "--data-dir", "{evdata_json}", *EVAL,
                                            "--out", "{out}"], "amc.json line 2: not valid JSON"),
    ("evaluate-data-not-utf8", "evaluate", ["--checkpoint", "tiny", "--data-dir", "{evdata_utf8}", *EVAL,
                                            "--out", "{out}"], "amc.jsonl line 2: not UTF-8"),
    ("evaluate-data-not-objects", "evaluate", ["--checkpoint", "tiny", "--data-dir", "{evdata_list}", *EVAL,
                                               "--out", "{out}"], "amc.jsonl line 1: expected a JSON object"),
    ("pseudo_ft-traces-not-objects", "ptq.pseudo_ft", ["--checkpoint", "tiny", "--traces", "{jsonl_list}", "--out",
                                                       "{out}"], "--traces {jsonl_list} line 1: expected a JSON object"),
    ("pseudo_ft-traces-bad-json", "ptq.pseudo_ft", ["--checkpoint", "tiny", "--traces", "{jsonl_bad}", "--out",
                                                    "{out}"], "--traces {jsonl_bad} line 2: not valid JSON"),
    ("evaluate-rescore-foreign-records", "evaluate", ["--rescore", "--out", "{rescore}", "--suite", "amc"],
     "completions.jsonl record 1 has no 'sample' field"),
    ("evaluate-adapter-config-empty", "evaluate", ["--checkpoint", "tiny", "--data-dir", FIXTURES_EVALS, *EVAL,
                                                   "adapter={adapter}", "--out", "{out}"],
     "adapter/adapter_config.json: empty adapter config"),
    # outputs that exist as the wrong kind of thing
    ("quantize-out-is-a-file", "quantize", ["--checkpoint", "tiny", "--method", "rtn", "--out", "{file}",
                                            "--overwrite"], "--out {file} is a file where a directory belongs"),
    ("quantize-out-under-a-file", "quantize", ["--checkpoint", "tiny", "--method", "rtn", "--out", "{file}/q"],
     "--out {file}/q cannot be made: {file} is a file, not a directory"),
    ("convert-dst-is-a-file", "convert", ["--to", "lrmq", "tiny", "{file}", "--overwrite"],
     "DST {file} is a file where a directory belongs"),
    ("evaluate-out-is-a-file", "evaluate", ["--checkpoint", "tiny", "--data-dir", FIXTURES_EVALS, *EVAL, "--out",
                                            "{file}"], "run directory (--out) {file} is a file where a directory belongs"),
    ("train-report-is-a-directory", "train", [*TRAIN, "--compile-only", "--report", "{root}"],
     "--report {root} is a directory where a file belongs"),
    ("train-run-dir-is-a-file", "train", [*TRAIN, "run.out_dir={file}"], "{file} is a file where a directory belongs"),
    ("study-out-dir-is-a-file", "study", ["--config", STUDY_QUICK, "out_dir={file}", "--no-progress"],
     "study directory (out_dir) {file} is a file where a directory belongs"),
]


@pytest.mark.parametrize("row", BROKEN, ids=[r[0] for r in BROKEN])
def test_broken_input_is_one_line(row, broken, tmp_path, capsys):
    """Exit status 2 and the whole of stderr one line `lrmq.NAME: error: ...` naming the file (and line): no
    traceback (raised here, it fails the test), no second line; nothing written (a refused training start
    removes the run dir it made, and its lock)."""
    _, cli, argv, needle = row
    out = str(tmp_path / "out")
    argv = [_fill(a, broken, out) for a in argv]
    needle = _fill(needle, broken, out)
    capsys.readouterr()
    with command_in_process():  # lrmq.train's logging set-up (force=True) is put back
        try:
            rc = CLIS[cli](argv)
        except SystemExit as e:  # argparse
            rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    lines = [l for l in err.splitlines() if l.strip()]
    if cli == "train":  # its start-up logs come first
        lines = [l for l in lines if l.startswith("lrmq.train: ")]
    assert len(lines) == 1 and lines[0].startswith(f"lrmq.{cli}: error: "), err
    assert needle in lines[0], (needle, err)
    assert "calibration file" not in lines[0] or cli == "quantize", err
    if cli != "train":
        assert not os.path.exists(out)
    else:  # a refused start leaves no run dir it made (nor a lock of a dead process)
        assert not os.path.exists(out), os.listdir(out)
