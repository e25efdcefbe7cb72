"""The streamed, sharded PTQ pass against the one it replaced, and its peak host memory (CPU).

Two sections, one JSON (``--out``, with the machine and the date):

* ``speed``: AWQ and GPTQ (W4 g128) on a ~100M Qwen3-shaped model (``benchmarks/quantize.py``'s
  ``AWQ_GPTQ_CFG``), 1 device, run by today's code and by the code before the streamed driver
  (``--before``, default commit b8c8e07, extracted with ``git archive`` into a temporary directory), each
  contender in a fresh child process, interleaved over ``--rounds`` rounds. Reported: each run's wall time of the
  whole quantization (compiles included) and the median ratio today / before.
* ``rss``: ``python -m lrmq.quantize --config`` (AWQ W4 g128, compressed_tensors, streamed from the checkpoint)
  on a synthetic bf16 HF checkpoint several times larger than the memory the pass is meant to use, in a child
  process; reported: the checkpoint's bytes, the child's peak RSS (``ru_maxrss``) and their ratio, and the same
  child's RSS right after its imports (the Python + JAX floor).

    python benchmarks/ptq_stream.py --out docs/figures/ptq_stream.json
    python benchmarks/ptq_stream.py --quick          # seconds: 2 layers, 1 round, a small checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.common import machine_info, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SPEED_CHILD = r"""
import json, sys, time
import numpy as np
from flax import nnx
from lrmq.model.config import ModelConfig, RopeConfig
from lrmq.model.decoder import Decoder
from lrmq.ptq.awq import AWQOptions, awq_quantize_model
from lrmq.ptq.gptq_model import GPTQOptions, gptq_quantize_model
method, layers, n_blocks, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
c = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=layers, num_heads=12, num_kv_heads=4,
         head_dim=64)
cfg = ModelConfig(family="qwen3", qk_norm="head", layer_types=("full_attention",) * layers,
                  rope={"full_attention": RopeConfig(theta=1e6)}, **c)
toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (n_blocks, block))
model = Decoder(cfg, nnx.Rngs(0))
t0 = time.perf_counter()
if method == "awq":
    r = awq_quantize_model(model, toks, AWQOptions(bits=4, group_size=128), progress=False)
else:
    r = gptq_quantize_model(model, toks, GPTQOptions(bits=4, group_size=128), progress=False)
total = time.perf_counter() - t0
print(json.dumps({"total_s": total, "seconds_per_layer": [float(x) for x in r.info["seconds_per_layer"]]}))
"""


def _child_env(root: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
    env.pop("XLA_FLAGS", None)
    return env


def before_tree(commit: str, dest: str) -> str:
    """The package tree at ``commit`` (lrmq/ and pallas_kernels/) under ``dest``."""
    arch = subprocess.run(["git", "-C", REPO, "archive", commit, "lrmq", "pallas_kernels"], check=True,
                          capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=arch, check=True)
    return dest


def bench_speed(before: str, rounds: int, layers: int, n_blocks: int, block: int) -> dict:
    out = {"config": {"layers": layers, "hidden": 768, "intermediate": 2048, "calibration": [n_blocks, block],
                      "bits": 4, "group_size": 128, "devices": 1}, "runs": []}
    with tempfile.TemporaryDirectory() as d:
        trees = {"before": before_tree(before, d), "today": REPO}
        for r in range(rounds):
            for method in ("awq", "gptq"):
                for name, root in trees.items():
                    res = subprocess.run([sys.executable, "-c", SPEED_CHILD, method, str(layers), str(n_blocks),
                                          str(block)], env=_child_env(root), cwd=d, capture_output=True, text=True)
                    if res.returncode:
                        raise RuntimeError(f"{name} {method}: {res.stderr[-2000:]}")
                    row = dict(json.loads(res.stdout.strip().splitlines()[-1]), round=r, method=method, code=name)
                    out["runs"].append(row)
                    print(f"[speed] round {r} {method} {name}: {row['total_s']:.2f} s", flush=True)
    for method in ("awq", "gptq"):
        t = {n: [x["total_s"] for x in out["runs"] if x["method"] == method and x["code"] == n]
             for n in ("before", "today")}
        out[method] = {"before_s": float(np.median(t["before"])), "today_s": float(np.median(t["today"])),
                       "ratio_today_over_before": float(np.median(t["today"]) / np.median(t["before"]))}
    out["before_commit"] = before
    return out


RSS_CHILD = r"""
import json, os, resource, sys
from lrmq.ptq.pipeline import run_quantize
from lrmq.ptq.config import load_quantize_config
import jax
jax.devices()
floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cfg = load_quantize_config(None, sys.argv[1:])
run_quantize(cfg)
print(json.dumps({"floor_rss_bytes": floor, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def write_checkpoint(path: str, layers: int, hidden: int, inter: int, vocab: int = 32000) -> int:
    """A synthetic bf16 Qwen3-shaped HF checkpoint, one safetensors file per layer with an index; returns its bytes."""
    import ml_dtypes
    from safetensors.numpy import save_file

    nq, nkv, hd = hidden // 64, max(1, hidden // 256), 64
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)
    bf = lambda *s: (rng.standard_normal(s, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)  # noqa: E731
    weight_map, total = {}, 0

    def put(name_tensors: dict, fname: str):
        nonlocal total
        save_file(name_tensors, os.path.join(path, fname), metadata={"format": "pt"})
        for k, v in name_tensors.items():
            weight_map[k] = fname
            total += v.nbytes

    put({"model.embed_tokens.weight": bf(vocab, hidden), "model.norm.weight": np.ones(hidden, ml_dtypes.bfloat16),
         "lm_head.weight": bf(vocab, hidden)}, "other.safetensors")
    for i in range(layers):
        p = f"model.layers.{i}."
        put({p + "self_attn.q_proj.weight": bf(nq * hd, hidden), p + "self_attn.k_proj.weight": bf(nkv * hd, hidden),
             p + "self_attn.v_proj.weight": bf(nkv * hd, hidden), p + "self_attn.o_proj.weight": bf(hidden, nq * hd),
             p + "self_attn.q_norm.weight": np.ones(hd, ml_dtypes.bfloat16),
             p + "self_attn.k_norm.weight": np.ones(hd, ml_dtypes.bfloat16),
             p + "mlp.gate_proj.weight": bf(inter, hidden), p + "mlp.up_proj.weight": bf(inter, hidden),
             p + "mlp.down_proj.weight": bf(hidden, inter),
             p + "input_layernorm.weight": np.ones(hidden, ml_dtypes.bfloat16),
             p + "post_attention_layernorm.weight": np.ones(hidden, ml_dtypes.bfloat16)}, f"layer{i:03d}.safetensors")
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    cfg = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=vocab, hidden_size=hidden,
               intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=nq, num_key_value_heads=nkv,
               head_dim=hd, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096, hidden_act="silu",
               tie_word_embeddings=False, torch_dtype="bfloat16")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return total


def bench_rss(layers: int, hidden: int, inter: int, n_blocks: int, block: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "model")
        weights = write_checkpoint(ckpt, layers, hidden, inter)
        calib = os.path.join(d, "calib.txt")
        with open(calib, "w") as f:  # token ids are what matters, not the text: documents of digits
            rng = np.random.default_rng(1)
            f.write("\n".join(" ".join(map(str, rng.integers(0, 10 ** 6, 4 * block))) for _ in range(n_blocks * 2)))
        tok = os.path.join(REPO, "lrmq", "assets", "tiny")
        args = [f"model={ckpt}", f"tokenizer={tok}", "method=awq", "bits=4", "group_size=128",
                f"calibration.path={calib}", f"calibration.block_size={block}", f"calibration.max_blocks={n_blocks}",
                "calibration.max_doc_tokens=1000000",
                "calibration.batch_size=2", "awq.n_grid=4", "outputs.formats=[compressed_tensors]",
                f"outputs.dir={os.path.join(d, 'out')}", "progress=false"]
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-c", RSS_CHILD, *args], env=_child_env(REPO), capture_output=True,
                             text=True)
        wall = time.perf_counter() - t0
        if res.returncode:
            raise RuntimeError(res.stderr[-3000:])
        r = json.loads(res.stdout.strip().splitlines()[-1])
        out_bytes = sum(os.path.getsize(os.path.join(root, f)) for root, _, fs in os.walk(os.path.join(d, "out"))
                        for f in fs)
    r.update(weights_bytes=weights, layers=layers, hidden=hidden, intermediate=inter, calibration=[n_blocks, block],
             wall_s=wall, output_bytes=out_bytes, weights_over_peak_rss=weights / r["peak_rss_bytes"],
             peak_over_floor_bytes=r["peak_rss_bytes"] - r["floor_rss_bytes"])
    print(f"[rss] weights {weights / 2**30:.2f} GiB, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB "
          f"(floor {r['floor_rss_bytes'] / 2**30:.2f} GiB), {wall:.0f} s", flush=True)
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--before", default="b8c8e07")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sections", default="speed,rss")
    ap.add_argument("--layers", type=int, default=128, help="rss: layers of the synthetic checkpoint")
    ap.add_argument("--update", action="store_true", help="keep the other sections of an existing --out JSON")
    a = ap.parse_args(argv)
    payload = {"benchmark": "ptq_stream", "argv": argv if argv is not None else sys.argv[1:],
               "machine": machine_info(), "date": time.strftime("%Y-%m-%d")}
    sections = a.sections.split(",")
    if "speed" in sections:
        payload["speed"] = bench_speed(a.before, 1 if a.quick else a.rounds, 2 if a.quick else 4, 8 if a.quick else 16,
                                       128 if a.quick else 256)
    if "rss" in sections:
        payload["rss"] = (bench_rss(4, 256, 1024, 4, 64) if a.quick else bench_rss(a.layers, 1024, 4096, 8, 128))
    if a.update and a.out and os.path.exists(a.out):  # read at the end: another section's run may have written it
        with open(a.out) as f:
            old = json.load(f)
        for k in ("speed", "rss"):
            if k not in sections and k in old:
                payload[k] = dict(old[k], argv=old[k].get("argv", old.get("argv")))
    for k in sections:
        payload[k]["argv"] = payload["argv"]
    write_json(a.out, payload)
    print(json.dumps({k: v for k, v in payload.items() if k in ("speed", "rss")}, default=str)[:2000])


if __name__ == "__main__":
    main()
