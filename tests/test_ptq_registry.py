"""One PTQ method registry, one RTN, one CLI path (flags and --config) over the shipped tiny model."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import TINY_MODEL_DIR

from lrmq import quantize as qcli
from lrmq.ptq.methods import PTQ_METHODS, needs_calibration


def test_one_registry():
    assert qcli.PTQ_METHODS is PTQ_METHODS
    assert PTQ_METHODS.names() == sorted(["rtn", "int8", "nf4", "awq", "gptq", "quantlrm"])
    assert [m for m in PTQ_METHODS.names() if needs_calibration(m)] == ["awq", "gptq", "quantlrm"]


def test_config_checks_methods_against_the_registry():
    from lrmq.configlib import ConfigError
    from lrmq.ptq.config import load_quantize_config

    base = [f"model={TINY_MODEL_DIR}"]
    with pytest.raises(ConfigError, match=r"unknown ptq method 'bogus'; known: \['awq'"):
        load_quantize_config(None, base + ["method=bogus"])
    with pytest.raises(ConfigError, match="int8 is 8-bit"):
        load_quantize_config(None, base + ["method=int8"])
    with pytest.raises(ConfigError, match="needs calibration"):
        load_quantize_config(None, base + ["method=gptq"])
    with pytest.raises(ConfigError, match="targets applies to rtn"):
        load_quantize_config(None, base + ["method=awq", "calibration.path=x.jsonl", r"targets=.*q_proj"])
    with pytest.raises(ConfigError, match="cannot be exported"):
        load_quantize_config(None, base + ["method=nf4", "group_size=64", "outputs.formats=[compressed_tensors]"])
    assert load_quantize_config(None, base + ["method=nf4", "group_size=64"]).method == "nf4"


@pytest.mark.parametrize("method,bits,group", [("rtn", 4, 128), ("int8", 8, -1), ("nf4", 4, 64), ("awq", 4, 128)])
def test_flag_defaults(method, bits, group):
    args = qcli.parse_args(["--checkpoint", "c", "--method", method, "--out", "o"])
    cfg = qcli.config_from_flags(args)
    assert (cfg.method, cfg.bits, cfg.group_size, cfg.quantlrm.plot) == (method, bits, group, False)


def _packed(path):
    from lrmq.checkpoint.load import load_model
    from lrmq.quant.transforms import iter_linears

    return {p: lin.kernel.get_value() for p, lin in iter_linears(load_model(path))}


def _same_packed(a: dict, b: dict):
    """Same Linears, same static metadata, same codes / scales / zeros bit for bit."""
    import jax

    assert sorted(a) == sorted(b) and a
    for p in a:
        la, ta = jax.tree.flatten(a[p])
        lb, tb = jax.tree.flatten(b[p])
        assert ta == tb, p
        for x, y in zip(la, lb):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=p)


@pytest.mark.parametrize("flags,overrides", [
    (["--method", "rtn", "--bits", "3", "--group-size", "64", "--symmetric"],
     ["method=rtn", "bits=3", "group_size=64", "symmetric=true"]),
    (["--method", "nf4"], ["method=nf4", "group_size=64"]),
])
def test_flag_and_config_forms_write_the_same_weights(tmp_path, flags, overrides):
    from safetensors.numpy import load_file

    out, fake = str(tmp_path / "flags"), str(tmp_path / "flags_hf")
    assert qcli.main(["--checkpoint", TINY_MODEL_DIR, *flags, "--out", out, "--export-hf-fake", fake]) == 0
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"model: {TINY_MODEL_DIR}\noutputs:\n  formats: [packed, fake_quant]\n  dtype: float32\n")
    cdir = str(tmp_path / "cfg")
    assert qcli.main(["--config", str(cfg_file), *overrides, f"outputs.dir={cdir}"]) == 0
    _same_packed(_packed(out), _packed(os.path.join(cdir, "packed")))
    a, b = load_file(os.path.join(fake, "model.safetensors")), load_file(os.path.join(cdir, "fake_quant",
                                                                                          "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_awq_without_scales_or_clipping_is_rtn():
    """AWQ ends with the one RTN: with the search and the clip off it quantizes exactly as rtn does."""
    from lrmq.checkpoint.load import load_model
    from lrmq.ptq.awq import AWQOptions, awq_quantize_model
    from lrmq.ptq.rtn import rtn_quantize_model

    tokens = np.random.default_rng(0).integers(0, 300, (2, 16))
    a = awq_quantize_model(load_model(TINY_MODEL_DIR), tokens, AWQOptions(bits=3, group_size=64, scale=False,
                                                                          clip=False), progress=False)
    r = rtn_quantize_model(load_model(TINY_MODEL_DIR), bits=3, group_size=64)
    _same_packed(a.packed, r.packed)


def test_flag_errors_name_the_flag(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert qcli.main(["--checkpoint", TINY_MODEL_DIR, "--method", "awq", "--out", out]) == 2
    assert "calibration" in capsys.readouterr().err
    assert qcli.main(["--checkpoint", TINY_MODEL_DIR, "--method", "rtn", "--targets", "nothing", "--out", out]) == 2
    assert "--targets" in capsys.readouterr().err
    assert qcli.main(["--checkpoint", TINY_MODEL_DIR, "--method", "int8", "--bits", "4", "--out", out]) == 2
    assert "8-bit" in capsys.readouterr().err
    assert not os.path.exists(out)
