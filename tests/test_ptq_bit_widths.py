"""`lrmq.quantize`'s config takes every width the quantizers and compressed_tensors support (2..8), end to end.

The config used to refuse 2/5/6/7 bits (`bits must be 3, 4 or 8`) although the flag form, the packed lrmq
format and the compressed-tensors exporter take 2..8. Here each width runs the config-form pipeline on the
shipped tiny model and the outputs are read back: the packed lrmq checkpoint (its QuantizedWeight width and
its forward against the fake-quant HF export) and the compressed_tensors export's config and packed width.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import TINY_MODEL_DIR
from lrmq.configlib import ConfigError
from lrmq.ptq.config import load_quantize_config


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    from lrmq.data.synthetic import make_splits, write_jsonl

    d = tmp_path_factory.mktemp("calib")
    train, _ = make_splits(32, 4, seed=3)
    path = d / "train.jsonl"
    write_jsonl(path, [{"text": f"{r['problem']} Answer: {r['solution']}"} for r in train])
    return str(path)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_config_accepts_2_to_8(bits, tmp_path, calib_file):
    cfg = load_quantize_config(None, ["model=tiny", "method=gptq", f"bits={bits}", f"calibration.path={calib_file}",
                                      "outputs.formats=[packed,compressed_tensors]", f"outputs.dir={tmp_path / 'o'}"])
    assert cfg.bits == bits


@pytest.mark.parametrize("override", ["bits=1", "bits=9"])
def test_config_refuses_outside_2_to_8(override):
    with pytest.raises((ConfigError, ValueError), match="bits"):
        load_quantize_config(None, ["model=tiny", override])


@pytest.mark.parametrize("method,bits", [("awq", 5), ("gptq", 2)])
def test_autoawq_output_stays_4_bit_only(method, bits, calib_file):
    with pytest.raises((ConfigError, ValueError), match="autoawq"):
        load_quantize_config(None, ["model=tiny", f"method={method}", f"bits={bits}", f"calibration.path={calib_file}",
                                    "outputs.formats=[packed,autoawq]"])


@pytest.mark.parametrize("method,bits,symmetric", [("rtn", 2, False), ("gptq", 5, False), ("awq", 6, True),
                                                   ("rtn", 7, False)])
def test_odd_widths_end_to_end(tmp_path, calib_file, method, bits, symmetric):
    import jax.numpy as jnp

    from lrmq.checkpoint.load import load_model
    from lrmq.ptq.pipeline import run_quantize
    from lrmq.quant.qkernel import QuantizedKernel
    from lrmq.quant.transforms import iter_linears

    out = tmp_path / "out"
    cfg = load_quantize_config(None, [
        "model=tiny", f"method={method}", f"bits={bits}", "group_size=-1", f"symmetric={str(symmetric).lower()}",
        f"calibration.path={calib_file}", "calibration.source=text", "calibration.block_size=64",
        "calibration.n_samples=16", "progress=false", f"outputs.dir={out}", "outputs.dtype=float32",
        "outputs.formats=[packed,fake_quant,compressed_tensors]"])
    report = run_quantize(cfg)
    assert report["bits"] == bits
    packed, fake = load_model(str(out / "packed")), load_model(str(out / "fake_quant"))
    lins = iter_linears(packed)
    assert lins
    for _, lin in lins:
        assert isinstance(lin.kernel, QuantizedKernel) and lin.kernel.get_value().bits == bits
    tok = (jnp.arange(32).reshape(2, 16) * 7) % 300
    np.testing.assert_allclose(np.asarray(packed(tok)), np.asarray(fake(tok)), atol=2e-5, rtol=1e-5)
    with open(out / "compressed_tensors" / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert group["weights"]["num_bits"] == bits and group["weights"]["symmetric"] == symmetric
    from safetensors.numpy import load_file

    ct = {}
    for name in os.listdir(out / "compressed_tensors"):
        if name.endswith(".safetensors"):
            ct.update(load_file(str(out / "compressed_tensors" / name)))
    packed_w = {k: v for k, v in ct.items() if k.endswith("weight_packed")}
    assert packed_w
    for k, v in packed_w.items():
        n_out, k_in = ct[k.replace("weight_packed", "weight_shape")]
        assert v.shape == (n_out, -(-k_in * bits // 32)), (k, v.shape)  # dense: ceil(K*b/32) int32 words
