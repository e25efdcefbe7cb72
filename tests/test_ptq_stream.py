"""Streamed PTQ (issue 48): a checkpoint read layer by layer, each finished layer written straight into sharded
exports, the same bytes as the in-memory path; host memory bounded whatever the model's size."""

from __future__ import annotations

import hashlib
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_with_devices
from safetensors.numpy import load_file

from lrmq.checkpoint.load import load_model
from lrmq.ptq.config import load_quantize_config
from lrmq.ptq.exports import ExportError, StreamedExport, stream_model, write_outputs
from lrmq.ptq.methods import PTQ_METHODS
from lrmq.ptq.pipeline import load_float_model, prepare, run_quantize
from lrmq.ptq.source import CheckpointSource, ModelSource

TOKS = np.asarray([[1, 5, 9, 33, 7, 2, 100, 4, 250, 17]], np.int32)
FORMATS = ("compressed_tensors", "fake_quant", "autoawq", "packed")


def _files(root: str) -> dict[str, str]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def awq_runs(tmp_path_factory):
    """AWQ W4 g32 of the tiny model over 4 blocks of 32 tokens: the streamed run (lrmq.quantize --config's) and the
    same config's in-memory model + result."""
    root = tmp_path_factory.mktemp("ptq_stream")
    calib = root / "calib.txt"
    calib.write_text("\n".join(f"{i} plus {i} is {2 * i}. " * 8 for i in range(16)))
    cfg = load_quantize_config(None, [
        "model=tiny", "method=awq", "bits=4", "group_size=32", f"calibration.path={calib}", "calibration.block_size=32",
        "calibration.max_blocks=4", "calibration.batch_size=2", f"outputs.formats=[{','.join(FORMATS)}]",
        f"outputs.dir={root / 'stream'}", "progress=false"])
    run_quantize(cfg)
    prep = prepare(cfg)
    model = load_float_model(prep.model_path)
    result = PTQ_METHODS.get("awq")(model, cfg, prep.inputs)
    return {"root": root, "cfg": cfg, "prep": prep, "model": model, "result": result}


def test_streamed_run_writes_the_in_memory_bytes(awq_runs):
    r = awq_runs
    mem = str(r["root"] / "mem")
    write_outputs(r["model"], r["result"], mem, formats=FORMATS, dtype=r["cfg"].outputs.dtype,
                  tokenizer_from=r["prep"].tokenizer_dir)
    got, want = _files(str(r["root"] / "stream")), _files(mem)
    assert set(got) - set(want) == {"report.json", "quantize_config.yaml"}
    assert {k: got[k] for k in want} == want
    report = json.loads((r["root"] / "stream" / "report.json").read_text())
    assert report["weight_format"] == r["result"].describe_format() == "int4 asym g32 f32-scale (awq)"


def test_checkpoint_source_reads_what_load_model_gives():
    a, b = CheckpointSource("tiny"), ModelSource(load_model("tiny"))
    for la, lb in zip(a.layers(), b.layers()):
        assert la.keys() == lb.keys()
        for k in la:
            assert la[k].dtype == lb[k].dtype == np.float32 and np.array_equal(la[k], lb[k]), k
    np.testing.assert_array_equal(a.embedding(), b.embedding())


def test_sharded_exports_load_as_one_file(awq_runs, tmp_path):
    """compressed_tensors, fake_quant and packed in 100 kB shards with an index: the same tensors byte for byte, and
    transformers (compressed-tensors; fake_quant) and lrmq load them to the same logits as the one-file export;
    packed to the same arrays as one file and as the orbax checkpoint of the same model (save_lrmq: the writer
    before the streamed one)."""
    import jax
    from flax import nnx

    from lrmq.checkpoint.orbax_io import read_weight_formats, save_lrmq
    from lrmq.ptq.exports import packed_kernels
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, result = awq_runs["model"], awq_runs["result"]
    outs = {}
    for name, limit in (("one", 10**9), ("sharded", 100_000)):
        with StreamedExport(str(tmp_path / name), model.cfg, ["compressed_tensors", "fake_quant", "packed"],
                            dtype="float32", max_shard_bytes=limit, tokenizer_from="lrmq/assets/tiny") as export:
            stream_model(model, result, export)
            export.finish(result)
        outs[name] = tmp_path / name
    ct = outs["sharded"] / "compressed_tensors"
    index = json.loads((ct / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and all(os.path.getsize(ct / f) <= 100_000 + 8 * 2**10 for f in files[:-1])
    tensors = {}
    for f in files:
        tensors.update(load_file(str(ct / f)))
    single = load_file(str(outs["one"] / "compressed_tensors" / "model.safetensors"))
    assert tensors.keys() == single.keys()
    assert all(tensors[k].tobytes() == single[k].tobytes() for k in single)
    logits = {}
    for name, d in outs.items():
        hf = AutoModelForCausalLM.from_pretrained(str(d / "compressed_tensors"),
                                                  quantization_config=CompressedTensorsConfig(dequantize=True))
        with torch.no_grad():
            logits[name, "transformers"] = hf(torch.from_numpy(TOKS)).logits.float().numpy()
        hf = AutoModelForCausalLM.from_pretrained(str(d / "fake_quant"))
        with torch.no_grad():
            logits[name, "transformers_fake"] = hf(torch.from_numpy(TOKS)).logits.float().numpy()
        for fmt in ("compressed_tensors", "fake_quant"):
            logits[name, fmt] = np.asarray(load_model(str(d / fmt))(jnp.asarray(TOKS)))
    for fmt, index in (("fake_quant", "model"), ("packed", "params")):
        assert len(set(json.loads((outs["sharded"] / fmt / f"{index}.safetensors.index.json").read_text())
                       ["weight_map"].values())) >= 3, fmt
    assert read_weight_formats(str(outs["sharded"] / "packed")) == result.formats()
    with packed_kernels(model, result):
        save_lrmq(model, str(tmp_path / "orbax"), weight_formats=result.formats())
    leaves = [jax.tree.leaves(nnx.state(load_model(str(d)))) for d in
              (outs["one"] / "packed", outs["sharded"] / "packed", tmp_path / "orbax")]
    assert len(leaves[0]) == len(leaves[1]) == len(leaves[2]) > 0
    for a, b, c in zip(*leaves):
        assert a.dtype == b.dtype == c.dtype and np.array_equal(a, b) and np.array_equal(a, c)
    for kind in ("transformers", "transformers_fake", "compressed_tensors", "fake_quant"):
        np.testing.assert_array_equal(logits["sharded", kind], logits["one", kind])


def test_a_failure_mid_stream_leaves_nothing(awq_runs, tmp_path):
    model = awq_runs["model"]
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="4-bit only"):
        with StreamedExport(str(out), model.cfg, ["autoawq"]) as export:
            stream_model(model, awq_runs["result"], export)
            bad = dict(awq_runs["result"].packed)
            export.write_layer(type("L", (), {"index": 0, "params": {}, "g_idx": {},
                                              "packed": {"q_proj": _replace_bits(bad["layers.0.attn.q_proj"])}})())
    assert os.listdir(tmp_path) == []


def test_an_export_missing_or_repeating_a_tensor_is_refused(awq_runs, tmp_path):
    """finish() refuses an output some tensor of the model never reached (a layer the driver skipped); a tensor
    written twice is refused when it comes; either way nothing is left behind."""
    from lrmq.checkpoint.hf import flat_params

    model, result = awq_runs["model"], awq_runs["result"]
    others = {n: np.asarray(v.get_value()) for n, v in flat_params(model).items() if not n.startswith("layers.")}
    with pytest.raises(ExportError, match=r"tensors of the model were never written \(layers\.0\."):
        with StreamedExport(str(tmp_path / "out"), model.cfg, ["compressed_tensors", "fake_quant"]) as export:
            export.write_other(others)
            export.finish(result)
    with pytest.raises(ExportError, match="embed.embedding: written twice"):
        with StreamedExport(str(tmp_path / "out"), model.cfg, ["fake_quant"]) as export:
            export.write_other(others)
            export.write_other(others)
    assert os.listdir(tmp_path) == []


def _replace_bits(qw):
    import dataclasses

    return dataclasses.replace(qw, bits=3)


def test_host_memory_does_not_grow_with_the_model(tmp_path):
    """AWQ streamed over a 64-layer float32 checkpoint (~200 MB of weights): the peak host memory grows by less
    than a third of the weights over the RSS before the run (one layer is ~3 MB; its programs compiled by a warm-up
    run on a 1-layer checkpoint of the same shapes)."""
    res = run_with_devices("scripts/ptq_rss.py", str(tmp_path), "64", n_devices=1)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["weights_bytes"] > 200e6
    assert r["peak_growth"] < r["weights_bytes"] / 3, r


def test_flag_form_streams_out_and_out2(awq_runs, tmp_path, capsys):
    """`lrmq.quantize --method awq --format compressed_tensors --export-hf-fake OUT2`: both written layer by layer;
    OUT2's fake-quant weights are OUT's codes dequantized (lrmq reads both to the same logits within bf16 scale
    rounding)."""
    from lrmq import quantize

    out, out2 = tmp_path / "ct", tmp_path / "fake"
    calib = awq_runs["root"] / "calib.txt"
    assert quantize.main(["--checkpoint", "tiny", "--method", "awq", "--group-size", "32", "--calibration", str(calib),
                          "--format", "compressed_tensors", "--out", str(out), "--export-hf-fake", str(out2),
                          "--devices", "1"]) == 0
    err = capsys.readouterr().err
    assert "quantized 14 linears to int4 asym g32 f32-scale (awq)" in err and str(out2) in err, err
    a, b = (np.asarray(load_model(str(d))(jnp.asarray(TOKS))) for d in (out, out2))
    np.testing.assert_allclose(a, b, atol=0.05)
    assert quantize.main(["--checkpoint", "tiny", "--method", "rtn", "--devices", "2", "--out", str(tmp_path / "x")]) == 2
    assert "--devices is for the calibrated layer-by-layer methods" in capsys.readouterr().err


def test_shard_writer_holds_one_tensor_and_writes_save_files_bytes(tmp_path):
    """ShardWriter streams each tensor to disk as it comes; a shard is byte for byte what safetensors' save_file
    writes for the same tensors (every dtype lrmq writes, a 0-d array, a transposed view), and a split one reads back."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from lrmq.checkpoint.shards import ShardWriter

    rng = np.random.default_rng(0)
    dtypes = [np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.uint8, np.int8, np.int64, np.bool_]
    tensors = {f"t{rng.integers(1000)}_{i}": np.asarray(np.asarray(rng.standard_normal(
        tuple(rng.integers(0, 5, rng.integers(0, 3)))) * 10).astype(dtypes[i % len(dtypes)])) for i in range(24)}
    tensors["transposed"] = rng.standard_normal((3, 4)).astype(np.float32).T
    save_file({k: np.ascontiguousarray(v) if v.ndim else v for k, v in tensors.items()}, str(tmp_path / "ref"),
              metadata={"format": "pt"})
    for name, limit in (("one", 10**9), ("split", 40)):
        os.mkdir(tmp_path / name)
        w = ShardWriter(str(tmp_path / name), limit)
        for k, v in tensors.items():
            w.add(k, v)
        files = w.close()
        assert not [f for f in os.listdir(tmp_path / name) if f.startswith(".")]  # no data / part files left
        if name == "one":
            assert (tmp_path / "one" / "model.safetensors").read_bytes() == (tmp_path / "ref").read_bytes()
        else:
            got = {}
            for f in files[:-1]:
                got.update(load_file(str(tmp_path / name / f)))
            assert got.keys() == tensors.keys() and len(files) > 3
            assert all(np.array_equal(got[k], tensors[k]) and got[k].dtype == tensors[k].dtype for k in tensors)
