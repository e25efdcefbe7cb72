"""`python -m lrmq.quantize`: packed lrmq checkpoint + fake-quant HF checkpoint round trip, errors, generate."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from lrmq import quantize as qcli
from test_train_modes import scratch_ckpt  # noqa: F401  (session fixture)

TOK = (jnp.arange(16).reshape(2, 8) * 7) % 200


@pytest.mark.parametrize("method,extra,fmt,bits", [("rtn", ["--bits", "4", "--group-size", "32"], "int", 4),
                                                   ("rtn", ["--bits", "3", "--group-size", "64", "--symmetric"], "int", 3),
                                                   ("int8", [], "int", 8), ("nf4", [], "nf4", 4)])
def test_quantize_round_trip(scratch_ckpt, tmp_path, method, extra, fmt, bits):  # noqa: F811
    from lrmq.checkpoint.load import checkpoint_kind, load_model
    from lrmq.quant.qkernel import QuantizedKernel
    from lrmq.quant.transforms import iter_linears

    out, fake = str(tmp_path / "packed"), str(tmp_path / "fake")
    rc = qcli.main(["--checkpoint", scratch_ckpt, "--method", method, *extra, "--out", out, "--export-hf-fake", fake])
    assert rc == 0
    assert checkpoint_kind(out) == "lrmq" and checkpoint_kind(fake) == "hf"
    packed, fq, base = load_model(out), load_model(fake), load_model(scratch_ckpt)
    lins = iter_linears(packed)
    assert len(lins) == 14
    for _, lin in lins:
        qw = lin.kernel.get_value()
        assert isinstance(lin.kernel, QuantizedKernel) and qw.fmt == fmt and (fmt == "nf4" or qw.bits == bits)
    y = packed(TOK)
    np.testing.assert_allclose(y, fq(TOK), atol=2e-5, rtol=1e-5)
    assert float(jnp.abs(y - base(TOK)).max()) > 1e-5
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
