"""Streamed PTQ of a checkpoint several times larger than the host memory the pass may grow by.

Run by tests/test_ptq_stream.py in a fresh interpreter: write a synthetic float32 Qwen3-shaped HF checkpoint of
``layers`` layers, warm the PTQ programs up on a 1-layer checkpoint of the same shapes (compiles are not the pass's
memory), reset the peak RSS (VmHWM, /proc/self/clear_refs), run ``lrmq.ptq.pipeline.run_quantize`` (AWQ W4 g64,
compressed_tensors, small shards) on the big one and print the peak growth over the RSS before it, with the
checkpoint's bytes, as one JSON line.
"""

import json
import os
import sys

import numpy as np

from lrmq.ptq.config import load_quantize_config
from lrmq.ptq.pipeline import run_quantize


def vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def write_checkpoint(path: str, layers: int, hidden: int = 256, inter: int = 768, vocab: int = 512) -> int:
    from safetensors.numpy import save_file

    nq, nkv, hd = 4, 2, 64
    os.makedirs(path)
    rng = np.random.default_rng(0)
    w = lambda *s: rng.standard_normal(s, dtype=np.float32) * 0.05  # noqa: E731
    weight_map, total = {}, 0

    def put(tensors: dict, fname: str):
        nonlocal total
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        total += sum(v.nbytes for v in tensors.values())

    put({"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float32)},
        "other.safetensors")
    for i in range(layers):
        p = f"model.layers.{i}."
        put({p + "self_attn.q_proj.weight": w(nq * hd, hidden), p + "self_attn.k_proj.weight": w(nkv * hd, hidden),
             p + "self_attn.v_proj.weight": w(nkv * hd, hidden), p + "self_attn.o_proj.weight": w(hidden, nq * hd),
             p + "self_attn.q_norm.weight": np.ones(hd, np.float32), p + "self_attn.k_norm.weight": np.ones(hd, np.float32),
             p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
             p + "mlp.down_proj.weight": w(hidden, inter), p + "input_layernorm.weight": np.ones(hidden, np.float32),
             p + "post_attention_layernorm.weight": np.ones(hidden, np.float32)}, f"layer{i:03d}.safetensors")
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    cfg = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=vocab, hidden_size=hidden,
               intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=nq, num_key_value_heads=nkv,
               head_dim=hd, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512, hidden_act="silu",
               tie_word_embeddings=True, torch_dtype="float32")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return total


def quantize(model: str, out: str, calib: str, tok: str) -> None:
    run_quantize(load_quantize_config(None, [
        f"model={model}", f"tokenizer={tok}", "method=awq", "bits=4", "group_size=64", f"calibration.path={calib}",
        "calibration.block_size=16", "calibration.max_blocks=2", "calibration.batch_size=2", "awq.n_grid=2",
        "outputs.formats=[compressed_tensors]", "outputs.max_shard_bytes=2000000", f"outputs.dir={out}",
        "progress=false"]))


def main(root: str, layers: int) -> None:
    tok = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "lrmq",
                       "assets", "tiny")
    calib = os.path.join(root, "calib.txt")
    with open(calib, "w") as f:
        f.write("\n".join(f"{i} plus {i} is {2 * i}. " * 8 for i in range(16)))
    write_checkpoint(os.path.join(root, "warm"), 1)
    weights = write_checkpoint(os.path.join(root, "big"), layers)
    quantize(os.path.join(root, "warm"), os.path.join(root, "warm_out"), calib, tok)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = vm("VmRSS")
    quantize(os.path.join(root, "big"), os.path.join(root, "big_out"), calib, tok)
    print(json.dumps({"weights_bytes": weights, "rss_before": before, "peak_growth": vm("VmHWM") - before}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
