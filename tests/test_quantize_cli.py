"""`python -m lrmq.quantize`: packed lrmq checkpoint + fake-quant HF checkpoint round trip, errors, generate."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import jit_forward
from lrmq import quantize as qcli
from test_train_modes import scratch_ckpt  # noqa: F401  (session fixture)

TOK = (jnp.arange(16).reshape(2, 8) * 7) % 200


@pytest.mark.parametrize("method,extra,fmt,bits,name", [
    ("rtn", ["--bits", "4", "--group-size", "32"], "int", 4, "int4 asym g32 f32-scale (rtn)"),
    ("rtn", ["--bits", "3", "--group-size", "64", "--symmetric"], "int", 3, "int3 sym g64 f32-scale (rtn)"),
    ("int8", ["--group-size", "0"], "int", 8, "int8 sym per-tensor f32-scale (int8)"),
    ("nf4", [], "nf4", 4, "nf4 block64 double-quant (nf4)")])
def test_quantize_round_trip(scratch_ckpt, tmp_path, capsys, method, extra, fmt, bits, name):  # noqa: F811
    from lrmq.checkpoint.load import checkpoint_kind, load_model
    from lrmq.checkpoint.orbax_io import read_weight_formats
    from lrmq.quant.qkernel import QuantizedKernel
    from lrmq.quant.transforms import iter_linears

    out, fake = str(tmp_path / "packed"), str(tmp_path / "fake")
    rc = qcli.main(["--checkpoint", scratch_ckpt, "--method", method, *extra, "--out", out, "--export-hf-fake", fake])
    assert rc == 0
    # the format is named in the output line and recorded in the packed checkpoint, with flags that write it again
    assert f"quantized 14 linears to {name}:" in capsys.readouterr().err
    (wf,) = read_weight_formats(out)
    assert wf.describe() == name
    if method == "rtn":
        assert wf.quantize_args() == ["--method", "rtn", *extra]
    assert checkpoint_kind(out) == "lrmq" and checkpoint_kind(fake) == "hf"
    packed, fq, base = load_model(out), load_model(fake), load_model(scratch_ckpt)
    lins = iter_linears(packed)
    assert len(lins) == 14
    for _, lin in lins:
        qw = lin.kernel.get_value()
        assert isinstance(lin.kernel, QuantizedKernel) and qw.fmt == fmt and (fmt == "nf4" or qw.bits == bits)
        if wf.group_size == 0:  # per tensor: one scale and zero in every column
            assert np.unique(np.asarray(qw.scales)).size == 1 and np.unique(np.asarray(qw.zeros)).size == 1
    y = jit_forward(packed, TOK)
    np.testing.assert_allclose(y, jit_forward(fq, TOK), atol=2e-5, rtol=1e-5)
    assert float(jnp.abs(y - jit_forward(base, TOK)).max()) > 1e-5
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))


def test_quantize_errors(scratch_ckpt, tmp_path, capsys):  # noqa: F811
    out = str(tmp_path / "o")
    assert qcli.main(["--checkpoint", str(tmp_path / "missing"), "--method", "rtn", "--out", out]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert qcli.main(["--checkpoint", scratch_ckpt, "--method", "bogus", "--out", out]) == 2
    assert "--method" in capsys.readouterr().err
    assert qcli.main(["--checkpoint", scratch_ckpt, "--method", "rtn", "--group-size", "48", "--out", out]) == 2
    assert "--group-size" in capsys.readouterr().err
    assert qcli.main(["--checkpoint", scratch_ckpt, "--method", "rtn", "--bits", "9", "--out", out]) == 2
    assert "--bits" in capsys.readouterr().err
    assert not os.path.exists(out)  # nothing written on errors
    os.makedirs(out)
    assert qcli.main(["--checkpoint", scratch_ckpt, "--method", "rtn", "--out", out]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert qcli.main(["--checkpoint", scratch_ckpt, "--method", "rtn", "--group-size", "32", "--out", out, "--overwrite"]) == 0
    # an already packed checkpoint is refused
    assert qcli.main(["--checkpoint", out, "--method", "rtn", "--out", str(tmp_path / "o2")]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert set(qcli.PTQ_METHODS.names()) >= {"rtn", "int8", "nf4"}


def test_generate_runs_on_packed_checkpoint(scratch_ckpt, tmp_path, capsys):  # noqa: F811
    from lrmq import generate

    out = str(tmp_path / "packed")
    assert qcli.main(["--checkpoint", scratch_ckpt, "--method", "nf4", "--out", out]) == 0
    capsys.readouterr()
    assert generate.main(["--checkpoint", out, "--prompt", "Compute 1+2", "--max-new-tokens", "4", "--greedy",
                          "--json"]) == 0
    assert '"token_ids"' in capsys.readouterr().out


def test_flag_form_format_writes_what_the_config_form_writes(scratch_ckpt, tmp_path, capsys):  # noqa: F811
    """`--format compressed_tensors|autoawq|fake_quant` writes --out in that format: the same files, byte for byte,
    as the config form's `outputs.formats` subdirectory for the same method; refused combinations name --format."""
    import json

    from lrmq.checkpoint.load import checkpoint_kind
    from lrmq.ptq.config import load_quantize_config
    from lrmq.ptq.pipeline import run_quantize

    rtn = ["--checkpoint", scratch_ckpt, "--method", "rtn", "--bits", "4", "--group-size", "32"]
    cfg = load_quantize_config(None, [f"model={scratch_ckpt}", "method=rtn", "bits=4", "group_size=32",
                                      "outputs.formats=[compressed_tensors,autoawq,fake_quant]", "outputs.dtype=float16",
                                      f"outputs.dir={tmp_path / 'cfg'}", "progress=false"])
    run_quantize(cfg)
    for fmt in ("compressed_tensors", "autoawq", "fake_quant"):
        out = str(tmp_path / fmt)
        assert qcli.main([*rtn, "--format", fmt, "--out", out]) == 0
        assert f"({fmt})" in capsys.readouterr().err
        assert checkpoint_kind(out) == "hf"
        ref = tmp_path / "cfg" / fmt
        for name in ("model.safetensors", "config.json"):
            assert (ref / name).read_bytes() == open(os.path.join(out, name), "rb").read(), (fmt, name)
    qc = json.load(open(tmp_path / "compressed_tensors" / "config.json"))["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    # refused before any work, naming the flag; nothing written
    bad = str(tmp_path / "bad")
    assert qcli.main([*rtn[:4], "--bits", "3", "--format", "autoawq", "--out", bad]) == 2
    assert "--format autoawq is 4-bit only" in capsys.readouterr().err
    assert qcli.main(["--checkpoint", scratch_ckpt, "--method", "nf4", "--format", "compressed_tensors", "--out", bad]) == 2
    assert "--format" in capsys.readouterr().err
    assert qcli.main([*rtn, "--format", "fake_quant", "--export-hf-fake", str(tmp_path / "f2"), "--out", bad]) == 2
    assert "--export-hf-fake" in capsys.readouterr().err
    assert not os.path.exists(bad)
