"""HF <-> lrmq conversion: bit-exact round trips, sharded safetensors, packed weights, clean failures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

from lrmq.checkpoint.hf import CheckpointError, save_hf_model
from lrmq.checkpoint.load import load_model
from lrmq.checkpoint.orbax_io import is_lrmq_checkpoint, load_lrmq, save_lrmq
from lrmq.convert import convert, main

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raw_tensors(ckpt_dir: str) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, raw bytes), read from the safetensors headers (no framework casts)."""
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    files = (sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index)
             else ["model.safetensors"])
    out = {}
    for fname in files:
        with open(os.path.join(ckpt_dir, fname), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            data = f.read()
        for name, info in header.items():
            if name != "__metadata__":
                a, b = info["data_offsets"]
                out[name] = (info["dtype"], info["shape"], data[a:b])
    return out


def read_config(d: str) -> dict:
    with open(os.path.join(d, "config.json")) as f:
        return json.load(f)


def torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


TOKENS = np.random.RandomState(0).randint(0, 128, (2, 10))


@pytest.mark.parametrize("variant,dtype", [("qwen3", "float32"), ("llama_linear", "float32"),
                                           ("qwen2", "bfloat16"), ("olmo3", "bfloat16"), ("qwen3_moe", "bfloat16")])
def test_round_trip_is_bit_exact(variant, dtype, hf_checkpoint, tmp_path):
    import transformers

    src, _ = hf_checkpoint(variant, dtype)
    mid, back = str(tmp_path / "lrmq"), str(tmp_path / "hf")
    convert(src, mid, to="lrmq")
    assert is_lrmq_checkpoint(mid)
    assert read_config(mid)["lrmq"]["param_dtype"] == dtype
    convert(mid, back, to="hf")

    original, exported = raw_tensors(src), raw_tensors(back)
    assert sorted(exported) == sorted(original)
    for name in original:
        assert exported[name] == original[name], name  # dtype, shape and every byte
    assert read_config(back) == read_config(src)
    assert os.path.exists(os.path.join(back, "generation_config.json"))  # tokenizer-side files travel

    # transformers picks the load dtype itself: compare against the original directory loaded the same way.
    load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    np.testing.assert_array_equal(torch_logits(load(back), TOKENS), torch_logits(load(src), TOKENS))


def test_cli_autodetects_source_and_copies_tokenizer_files(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("qwen2")
    with_tok = str(tmp_path / "src")
    shutil.copytree(src, with_tok)
    with open(os.path.join(with_tok, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 256}, f)
    dst = str(tmp_path / "out")
    r = subprocess.run([sys.executable, "-m", "lrmq.convert", "--to", "lrmq", "--dtype", "bfloat16", with_tok, dst],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert is_lrmq_checkpoint(dst)
    assert read_config(dst)["dtype"] == "bfloat16"  # config.json describes the stored weights
    assert os.path.exists(os.path.join(dst, "tokenizer_config.json"))
    model = load_model(dst)
    assert model.embed.embedding.get_value().dtype == jnp.bfloat16


def test_sharded_hf_checkpoints_load(hf_checkpoint, tmp_path):
    import transformers

    src, hf_model = hf_checkpoint("llama_linear")
    ref = np.asarray(load_model(src)(jnp.asarray(TOKENS)))

    by_torch = str(tmp_path / "torch_sharded")
    hf_model.save_pretrained(by_torch, max_shard_size="60KB")
    by_lrmq = str(tmp_path / "lrmq_sharded")
    save_hf_model(load_model(src), by_lrmq, max_shard_bytes=60_000)
    for d in (by_torch, by_lrmq):
        index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
        assert len(set(index["weight_map"].values())) >= 2
        assert not os.path.exists(os.path.join(d, "model.safetensors"))
        np.testing.assert_array_equal(np.asarray(load_model(d)(jnp.asarray(TOKENS))), ref)
    # our sharded export is a valid transformers checkpoint too, with the same bytes
    assert raw_tensors(by_lrmq) == raw_tensors(src)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(by_lrmq, attn_implementation="eager").eval()
    np.testing.assert_array_equal(torch_logits(reloaded, TOKENS), torch_logits(hf_model, TOKENS))


def test_load_lrmq_param_dtype_override(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("qwen3")
    dst = str(tmp_path / "l")
    save_lrmq(load_model(src), dst)
    model = load_lrmq(dst, param_dtype="bfloat16", dtype="bfloat16")
    assert model.cfg.param_dtype == "bfloat16" and model.cfg.dtype == "bfloat16"
    assert model.layers[0].attn.q_proj.kernel.get_value().dtype == jnp.bfloat16
    ref = load_model(src).layers[0].attn.q_proj.kernel.get_value()
    np.testing.assert_array_equal(np.asarray(model.layers[0].attn.q_proj.kernel.get_value()),
                                  np.asarray(ref.astype(jnp.bfloat16)))


# ------------------------------------------------------------------------------------------ failures
def _corrupt(kind: str, d: str) -> str:
    """Damage the checkpoint in `d`; return a string the error message must contain."""
    st = os.path.join(d, "model.safetensors")
    if kind == "truncated":
        size = os.path.getsize(st)
        with open(st, "r+b") as f:
            f.truncate(size - 1000)
        return "model.safetensors: file is truncated"
    if kind == "missing_tensor":
        tensors = load_file(st)
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, st, metadata={"format": "pt"})
        return "model.layers.1.mlp.up_proj.weight"
    if kind == "wrong_shape":
        tensors = load_file(st)
        tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
        save_file(tensors, st, metadata={"format": "pt"})
        return "model.layers.0.self_attn.k_proj.weight"
    if kind == "unknown_model_type":
        cfg = read_config(d)
        cfg["model_type"] = "gpt_neox"
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        return "model_type 'gpt_neox'"
    raise AssertionError(kind)


def _assert_no_output(out_parent: str, dst: str):
    assert not os.path.exists(dst)
    assert [n for n in os.listdir(out_parent) if n.startswith(".")] == []  # no leftover temp dirs


@pytest.mark.parametrize("kind,to", [("truncated", "lrmq"), ("missing_tensor", "hf"), ("wrong_shape", "lrmq"),
                                     ("unknown_model_type", "hf")])
def test_conversion_errors_name_the_problem_and_leave_nothing(kind, to, hf_checkpoint, tmp_path, capsys):
    src = str(tmp_path / "src")
    shutil.copytree(hf_checkpoint("qwen2")[0], src)
    needle = _corrupt(kind, src)
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    dst = str(out_parent / "dst")
    assert main(["--from", "hf", "--to", to, src, dst]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lrmq.convert: error: ") and needle in err, err
    assert "Traceback" not in err
    _assert_no_output(str(out_parent), dst)


def test_cli_subprocess_error_exit_code(hf_checkpoint, tmp_path):
    src = str(tmp_path / "src")
    shutil.copytree(hf_checkpoint("qwen2")[0], src)
    needle = _corrupt("truncated", src)
    dst = str(tmp_path / "out" / "dst")
    r = subprocess.run([sys.executable, "-m", "lrmq.convert", "--to", "lrmq", src, dst], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert not os.path.exists(dst)


def test_cli_refuses_existing_output_and_non_checkpoints(hf_checkpoint, tmp_path, capsys):
    src, _ = hf_checkpoint("qwen2")
    dst = tmp_path / "exists"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    assert main(["--to", "lrmq", src, str(dst)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert os.listdir(dst) == ["keep.txt"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--to", "hf", str(empty), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "not a model checkpoint" in err
    assert main(["--to", "hf", str(tmp_path / "nope"), str(tmp_path / "o")]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["--from", "lrmq", "--to", "hf", src, str(tmp_path / "o")]) == 2
    assert "--from lrmq" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")

    assert main(["--to", "lrmq", "--overwrite", src, str(dst)]) == 0
    assert is_lrmq_checkpoint(str(dst)) and not os.path.exists(dst / "keep.txt")


def test_failed_lrmq_restore_is_a_checkpoint_error(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("qwen2")
    dst = str(tmp_path / "l")
    save_lrmq(load_model(src), dst)
    state_file = os.path.join(dst, "lrmq_state.json")
    state = json.load(open(state_file))
    state["variables"]["layers.1.mlp.down_proj.kernel"]["array"][0] = [96, 32]
    json.dump(state, open(state_file, "w"))
    with pytest.raises(CheckpointError, match="layers.1.mlp.down_proj.kernel"):
        load_lrmq(dst)


# ------------------------------------------------------------------------------------------ packed weights
def test_quantized_kernels_round_trip(hf_checkpoint, tmp_path):
    from lrmq.quant.formats import quantize_weight
    from lrmq.quant.qkernel import QuantizedKernel

    src, _ = hf_checkpoint("qwen3")
    model = load_model(src)
    packed = {
        "layers.0.attn.q_proj": dict(fmt="int", bits=4, group_size=32),
        "layers.0.mlp.down_proj": dict(fmt="int", bits=3, group_size=32, symmetric=True),
        "layers.1.mlp.up_proj": dict(fmt="nf4", bits=4),
    }
    for path, kw in packed.items():
        lin = model
        for k in path.split("."):
            lin = lin[int(k)] if k.isdigit() else getattr(lin, k)
        old = lin.kernel
        lin.kernel = QuantizedKernel(quantize_weight(old.get_value(), **kw),
                                     **{"logical_axes": old.get_metadata()["logical_axes"]})
    dst = str(tmp_path / "q")
    save_lrmq(model, dst)
    restored = load_lrmq(dst)

    def flat(m):
        return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(m))}

    a, b = flat(model), flat(restored)
    assert sorted(a) == sorted(b)
    for path, var in a.items():
        assert type(b[path]) is type(var), path
        va, vb = var.get_value(), b[path].get_value()
        if isinstance(var, QuantizedKernel):
            assert vb.static() == va.static(), path
            assert b[path].get_metadata()["logical_axes"] == var.get_metadata()["logical_axes"]
        assert jax.tree.structure(va) == jax.tree.structure(vb), path
        for x, y in zip(jax.tree.leaves(va), jax.tree.leaves(vb)):
            assert x.dtype == y.dtype and x.shape == y.shape, path
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=path)

    # float HF export would silently drop packed weights: it must refuse instead, leaving nothing behind.
    with pytest.raises(CheckpointError, match="layers.0.attn.q_proj.kernel"):
        save_hf_model(restored, str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")


def test_docs_name_map_table_is_current():
    from lrmq.checkpoint.hf_names import NAME_MAP

    doc = open(os.path.join(REPO_ROOT, "docs", "checkpoints.md")).read()
    for hf, ours, tr in NAME_MAP:
        assert f"| `{hf}` | `{ours}` | {'transpose' if tr == 'T' else 'copy'} |" in doc, (hf, ours)
