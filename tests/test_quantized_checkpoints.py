"""Quantized Hugging Face checkpoints read by every command (lrmq.checkpoint.quantized).

The fixture tests/fixtures/llmc_w4a16 is llmcompressor's own W4A16 checkpoint of the shipped tiny model
(bfloat16, symmetric int4, group 128, pack-quantized; written by tools/llmcompressor_w4a16_fixture.py in a side
venv) with llmcompressor's own dequantized logits (transformers' compressed-tensors integration,
``dequantize=True``, float32). lrmq's own exports read back are tested where they are written
(test_exports.py, test_exports_consumers.py).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLMC = os.path.join(REPO, "tests", "fixtures", "llmc_w4a16")
TINY = os.path.join(REPO, "lrmq", "assets", "tiny")
FORMAT = "compressed-tensors pack-quantized int4 sym g128"


def _tokens():
    import jax.numpy as jnp

    return jnp.asarray(json.load(open(os.path.join(LLMC, "reference.json")))["tokens"])


@pytest.fixture(scope="module")
def llmc_model():
    from lrmq.checkpoint.load import load_model

    return load_model(LLMC, dtype="float32", param_dtype="float32")


def test_llmcompressor_w4a16_reads_back_to_its_own_logits(llmc_model):
    """Every Linear but lm_head a packed int4 sym g128 QuantizedKernel (the Pallas int4 kernel's layout), and the
    logits llmcompressor's own dequantized model gives (observed max |diff| 3.6e-6 on logits of magnitude 10)."""
    from lrmq.checkpoint.quantized import quantized_format
    from lrmq.quant.formats import packing_of
    from lrmq.quant.transforms import iter_linears

    assert quantized_format(LLMC) == FORMAT
    linears = dict(iter_linears(llmc_model, None))
    packed = {p: lin.kernel.get_value() for p, lin in linears.items() if hasattr(lin.kernel.get_value(), "codes")}
    assert len(packed) == 14 and all(not p.startswith("lm_head") for p in packed)
    for qw in packed.values():
        assert (qw.bits, qw.group_size, qw.symmetric) == (4, 128, True) and packing_of(qw).name == "int4"
    want = np.load(os.path.join(LLMC, "reference_logits.npy"))
    np.testing.assert_allclose(np.asarray(llmc_model(_tokens())), want, rtol=0, atol=1e-4)
    # lrmq.quantize --method quantlrm --base: the base's Linears, dequantized (checked against a fine-tuned tiny)
    from lrmq.ptq.quantlrm import TensorSource, check_pair
    from lrmq.quant.formats import dequantize

    base = TensorSource(LLMC)
    check_pair(TensorSource(TINY), base)
    np.testing.assert_array_equal(base.get("layers.1.mlp.down_proj").astype(np.float32),
                                  np.asarray(dequantize(packed["layers.1.mlp.down_proj"])).astype(base.get(
                                      "layers.1.mlp.down_proj").dtype).astype(np.float32))


def test_convert_qlora_base_and_float_only_refusals(llmc_model, cli, tmp_path):
    """convert --to lrmq keeps the packed model (same logits); a QLoRA run takes it as its packed base; every
    command that needs float weights refuses it in one line naming config.json and the format."""
    from lrmq.checkpoint.load import load_model
    from lrmq.configlib import config_from_dict
    from lrmq.quant.transforms import iter_linears
    from lrmq.rl.config import TrainConfig
    from lrmq.rl.setup import build_model

    ref = np.asarray(llmc_model(_tokens()))
    out = str(tmp_path / "packed")
    r = cli("convert", "--to", "lrmq", LLMC, out)
    assert r.returncode == 0, r.stderr
    conv = load_model(out, dtype="float32", param_dtype="float32")
    np.testing.assert_array_equal(np.asarray(conv(_tokens())), ref)
    assert "quantization_config" not in json.load(open(os.path.join(out, "config.json")))

    # QLoRA: the checkpoint's packed Linears are the base (not re-quantized), adapters on top
    cfg = config_from_dict(TrainConfig, {"model": {"checkpoint": LLMC, "dtype": "float32", "param_dtype": "float32"},
                                         "quant": {"mode": "qlora", "lora_rank": 2}})
    m = build_model(cfg, None)
    for path, lin in iter_linears(m, None):
        if not path.startswith("lm_head"):
            qw = lin.kernel.get_value()
            assert (qw.fmt, qw.bits, qw.group_size, qw.symmetric) == ("int", 4, 128, True), path
            assert getattr(lin, "lora", None) is not None, path

    cfg_path = os.path.join(LLMC, "config.json")
    (tmp_path / "t.txt").write_text("one two three four five six seven eight nine ten " * 8)
    for what, call in (
        ("convert --to hf", lambda: cli("convert", "--to", "hf", LLMC, str(tmp_path / "hf"))),
        ("PTQ", lambda: cli("quantize", "--checkpoint", LLMC, "--method", "rtn", "--out", str(tmp_path / "q"))),
        ("--fake-quant", lambda: cli("perplexity", "--checkpoint", LLMC, "--tokenizer", "tiny", "--text-file",
                                     str(tmp_path / "t.txt"), "--fake-quant", "rtn_asym")),
    ):
        r = call()
        lines = [x for x in r.stderr.strip().splitlines() if x]
        assert r.returncode == 2 and len(lines) == 1, (what, r.stderr)
        assert cfg_path in lines[0] and what in lines[0] and FORMAT in lines[0], (what, lines[0])
    assert not os.path.exists(tmp_path / "hf") and not os.path.exists(tmp_path / "q")
    from lrmq.checkpoint.hf import CheckpointError

    cfg = config_from_dict(TrainConfig, {"model": {"checkpoint": LLMC}, "quant": {"mode": "none"}})
    with pytest.raises(CheckpointError, match=f"{cfg_path}: model.checkpoint with quant.mode=none needs float "
                                              f"weights, this checkpoint is already quantized \\({FORMAT}\\)"):
        build_model(cfg, None)


def _edited(tmp_path, edit_config=None, drop=()):
    d = tmp_path / "ckpt"
    shutil.copytree(LLMC, d)
    if edit_config:
        c = json.load(open(d / "config.json"))
        edit_config(c["quantization_config"])
        json.dump(c, open(d / "config.json", "w"))
    if drop:
        from safetensors.numpy import load_file, save_file

        t = load_file(str(d / "model.safetensors"))
        save_file({k: v for k, v in t.items() if k not in drop}, str(d / "model.safetensors"))
    return str(d)


@pytest.mark.parametrize("edit, match", [
    (lambda q: q.update(quant_method="gptq"), "quant_method 'gptq' is not read by lrmq"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
     "config_groups.group_0.input_activations is set: lrmq reads weight-only"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=1), "config_groups.group_0.weights.num_bits 1"),
    (lambda q: (q.update(version="0.12.2"), q["config_groups"]["group_0"]["weights"].update(num_bits=3)),
     "written by compressed-tensors 0.12.2, whose 3-bit packing"),
])
def test_unreadable_quantization_config_is_one_line(tmp_path, edit, match):
    from lrmq.checkpoint.load import check_checkpoint
    from lrmq.cli import UsageError

    d = _edited(tmp_path, edit)
    with pytest.raises(UsageError, match=f"--checkpoint: {d}/config.json: quantization_config: {match}") as e:
        check_checkpoint(d)
    assert "\n" not in str(e.value)


def test_missing_packed_tensor_is_named(tmp_path):
    from lrmq.checkpoint.hf import CheckpointError
    from lrmq.checkpoint.load import load_model

    d = _edited(tmp_path, drop=("model.layers.1.mlp.up_proj.weight_scale",))
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.up_proj \(compressed-tensors pack-quantized int4 "
                                              r"sym g128\): missing weight_scale"):
        load_model(d)
    from safetensors.numpy import load_file, save_file

    t = load_file(os.path.join(d, "model.safetensors"))
    t["model.layers.1.mlp.up_proj.weight_scale"] = t["model.layers.0.mlp.up_proj.weight_scale"] * np.inf
    save_file(t, os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.up_proj .*weight_scale has non-finite values"):
        load_model(d)


def test_compressed_tensors_dense_is_its_fake_quant_weights(llmc_model, tmp_path):
    """format "dense" (llmcompressor's save_compressed=False): the float weights are read, the quantization
    parameters beside them skipped -- a float model with the packed model's logits."""
    from safetensors.numpy import load_file, save_file

    from lrmq.checkpoint.load import load_model
    from lrmq.quant.transforms import iter_linears, module_at

    d = tmp_path / "dense"
    shutil.copytree(LLMC, d)
    t = load_file(str(d / "model.safetensors"))
    for hf in [k[: -len(".weight_packed")] for k in t if k.endswith(".weight_packed")]:
        path = hf.removeprefix("model.").replace("self_attn", "attn")
        for k in ("weight_packed", "weight_shape"):
            del t[f"{hf}.{k}"]
        t[f"{hf}.weight"] = np.ascontiguousarray(np.asarray(module_at(llmc_model, path).float_weight()).T)
    save_file(t, str(d / "model.safetensors"))
    c = json.load(open(d / "config.json"))
    c["quantization_config"].update(format="dense", quantization_status="frozen")
    c["quantization_config"]["config_groups"]["group_0"]["format"] = "dense"
    c["dtype"] = "float32"
    json.dump(c, open(d / "config.json", "w"))
    m = load_model(str(d))
    assert not any(hasattr(lin.kernel.get_value(), "codes") for _, lin in iter_linears(m, None))
    np.testing.assert_allclose(np.asarray(m(_tokens())), np.asarray(llmc_model(_tokens())), rtol=0, atol=1e-5)
