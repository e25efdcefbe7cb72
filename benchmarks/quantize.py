"""PTQ benchmarks on synthetic checkpoints with real model shapes (CPU).

Sections (each a function taking the written checkpoint pair and returning a dict of figures):
* ``importance``: the QuantLRM importance pass (global exact median + per-channel importance over
  q/o/gate/down) versus the floor of merely reading both checkpoints once; reports wall time, ratio
  and the pass's peak RSS (measured in a fresh child process).
More sections (e.g. ``--awq-gptq`` layer timings) are added to ``SECTIONS`` and get their own flag.

    python benchmarks/quantize.py --quick          # 2 layers of Qwen3-0.6B shapes, seconds
    python benchmarks/quantize.py                  # Qwen3-0.6B and Qwen2.5-1.5B shapes, 28 layers
    python benchmarks/quantize.py --awq-gptq --layers 4 --out docs/figures/awq_gptq_time.json

Both forms take ``--out FILE`` to write their figures, with the machine and date, as JSON.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (layers, hidden, intermediate, q heads, kv heads, head dim)
SHAPES = {
    "qwen3-0.6b": (28, 1024, 3072, 16, 8, 128),
    "qwen2.5-1.5b": (28, 1536, 8960, 12, 2, 128),
}


def layer_shapes(hidden, inter, nq, nkv, hd) -> dict[str, tuple[int, int]]:
    """HF/torch ``[out, in]`` shapes of one decoder layer's projections."""
    return {
        "self_attn.q_proj": (nq * hd, hidden),
        "self_attn.k_proj": (nkv * hd, hidden),
        "self_attn.v_proj": (nkv * hd, hidden),
        "self_attn.o_proj": (hidden, nq * hd),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def _bf16(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16)


def write_pair(root: str, model: str, layers: int, seed: int = 0) -> tuple[str, str]:
    """bf16 safetensors base / fine-tuned checkpoints, one file per layer; ~25% of entries unchanged."""
    from safetensors.numpy import save_file

    n_layers, hidden, inter, nq, nkv, hd = SHAPES[model]
    shapes = layer_shapes(hidden, inter, nq, nkv, hd)
    dirs = [os.path.join(root, model, k) for k in ("base", "ft")]
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(min(layers, n_layers)):
        base, ft = {}, {}
        for p, shape in shapes.items():
            b = rng.standard_normal(shape, dtype=np.float32) * 0.02
            delta = rng.standard_normal(shape, dtype=np.float32) * 2e-4
            delta[rng.random(shape, dtype=np.float32) < 0.25] = 0
            name = f"model.layers.{i}.{p}.weight"
            base[name], ft[name] = _bf16(b), _bf16(b + delta)
        for d, t in zip(dirs, (base, ft)):
            save_file(t, os.path.join(d, f"layer{i:03d}.safetensors"))
    return dirs[0], dirs[1]


def _files(d):
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))


def read_floor(base_dir: str, ft_dir: str) -> float:
    """Seconds to load every tensor of both checkpoints once (the importance pass's lower bound):
    ``safetensors.safe_open(...).get_tensor`` of each tensor (a copy out of the page cache / disk)."""
    import ml_dtypes  # noqa: F401
    from safetensors import safe_open

    t0 = time.perf_counter()
    total = 0
    for d in (base_dir, ft_dir):
        for path in _files(d):
            with safe_open(path, "np") as f:
                for k in f.keys():
                    total += int(f.get_tensor(k).view(np.uint16)[-1, -1])  # touch
    return time.perf_counter() - t0


def drop_page_cache(*dirs: str) -> None:
    """Evict the checkpoint files from the page cache (POSIX_FADV_DONTNEED; clean pages, no root
    needed) so the next read comes from the disk."""
    for d in dirs:
        for path in _files(d):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def checkpoint_pairs(base_dir: str, ft_dir: str):
    """Callable for ``importance_for_model``: lazy (name, w_ft, w_base) in lrmq ``[K, N]`` orientation,
    zero-copy views of the mapped files (as ``lrmq.ptq.quantlrm.TensorSource`` reads HF checkpoints)."""
    from lrmq.checkpoint.safetensors_mmap import MappedSafetensors

    def gen():
        for pb, pf in zip(_files(base_dir), _files(ft_dir)):
            fb, ff = MappedSafetensors(pb), MappedSafetensors(pf)
            for k in fb.keys():
                name = k.removesuffix(".weight")
                yield name, (lambda ff=ff, k=k: ff[k].T), (lambda fb=fb, k=k: fb[k].T)

    return gen


def _importance_child(base_dir, ft_dir, q):
    from lrmq.ptq import fused
    from lrmq.ptq.importance import global_stats, importance_for_model

    t_init = time.perf_counter()
    fused.warm_up()  # numba's per-process start-up (cached machine code), reported separately
    init_s = time.perf_counter() - t_init
    pairs = checkpoint_pairs(base_dir, ft_dir)
    info = {}
    t0 = time.perf_counter()
    stats = global_stats(pairs, info=info)
    t1 = time.perf_counter()
    res = importance_for_model(pairs, stats=stats)
    t2 = time.perf_counter()
    q.put({"init_s": init_s, "stats_s": t1 - t0, "importance_s": t2 - t1, "total_s": t2 - t0,
           "stats_reads": info["reads"], "n_matrices": len(res), "positives": stats.count, "median": stats.median,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def _run_child(base_dir: str, ft_dir: str) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_importance_child, args=(base_dir, ft_dir, q))
    p.start()
    while True:
        try:
            out = q.get(timeout=1.0)
            break
        except Exception:  # queue.Empty: keep waiting unless the child died
            if not p.is_alive():
                raise RuntimeError(f"importance child exited with code {p.exitcode}") from None
    p.join()
    return out


def bench_importance(base_dir: str, ft_dir: str) -> dict:
    """Warm (page cache) and cold (evicted first: from disk) runs of the pass, each against the
    matching floor.  The pass runs in a fresh process (numba start-up reported as ``init_s``)."""
    out = {}
    read_floor(base_dir, ft_dir)  # warm the page cache so both figures see the same storage state
    warm_floor = min(read_floor(base_dir, ft_dir) for _ in range(2))
    warm = _run_child(base_dir, ft_dir)
    out.update({f"warm_{k}": v for k, v in warm.items()})
    out["warm_read_floor_s"] = warm_floor
    out["warm_ratio"] = warm["total_s"] / warm_floor
    drop_page_cache(base_dir, ft_dir)
    cold_floor = read_floor(base_dir, ft_dir)
    drop_page_cache(base_dir, ft_dir)
    cold = _run_child(base_dir, ft_dir)
    out.update({f"cold_{k}": cold[k] for k in ("stats_s", "importance_s", "total_s")})
    out["cold_read_floor_s"] = cold_floor
    out["cold_ratio"] = cold["total_s"] / cold_floor
    return out


SECTIONS = {"importance": bench_importance}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 layers of Qwen3-0.6B shapes")
    ap.add_argument("--models", nargs="*", default=list(SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument("--dir", default=None, help="where to write the synthetic checkpoints (temp dir)")
    ap.add_argument("--out", default=None, help="write the figures as JSON")
    a = ap.parse_args(argv)
    info, results = _machine(), []
    models = ["qwen3-0.6b"] if a.quick else a.models
    layers = a.layers or (2 if a.quick else None)
    with tempfile.TemporaryDirectory(dir=a.dir) as root:
        for model in models:
            n = layers or SHAPES[model][0]
            t0 = time.perf_counter()
            base_dir, ft_dir = write_pair(root, model, n)
            size = sum(os.path.getsize(f) for d in (base_dir, ft_dir) for f in _files(d)) / 2**20
            print(f"[{model}] {n} layers, both checkpoints {size:.0f} MiB bf16 "
                  f"(written in {time.perf_counter() - t0:.1f}s)", flush=True)
            for sec in a.sections:
                r = SECTIONS[sec](base_dir, ft_dir)
                print(f"[{model}] {sec}: " + ", ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
                results.append({"model": model, "layers": n, "ckpt_mib": size, "section": sec, **r})
    _write(a.out, {"benchmark": "quantize", "argv": argv if argv is not None else sys.argv[1:], "machine": info,
                   "results": results})


def _machine() -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import machine_info, source_commit

    info = machine_info(None)
    info["lrmq_commit"] = source_commit()
    return info


def _write(path, payload) -> None:
    from common import write_json

    payload["machine"]["loadavg_at_end"] = os.getloadavg()
    write_json(path, payload)


# ----------------------------------------------------------------------------- --awq-gptq (model-level PTQ)

# ~100M Qwen3-shaped model: hidden 768, 12 layers, 12 heads, 4 kv heads, head_dim 64, intermediate 2048
AWQ_GPTQ_CFG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
                    num_kv_heads=4, head_dim=64)


def bench_awq_gptq(layers: int | None = None, n_blocks: int = 16, block: int = 512, bits: int = 4,
                   group_size: int = 128) -> dict:
    """Seconds per decoder layer of AWQ (llm-awq: 20-point grid x 4 groups + clip) and GPTQ
    (true-sequential, blocksize 128) on random weights of the ~100M Qwen3-shaped config, with
    ``n_blocks`` x ``block`` calibration tokens. The first layer includes compilation; the steady
    figure is the median of the remaining layers."""
    from flax import nnx

    from lrmq.model.config import ModelConfig, RopeConfig
    from lrmq.model.decoder import Decoder
    from lrmq.ptq.awq import AWQOptions, awq_quantize_model
    from lrmq.ptq.gptq_model import GPTQOptions, gptq_quantize_model

    c = dict(AWQ_GPTQ_CFG)
    if layers:
        c["num_layers"] = layers
    cfg = ModelConfig(family="qwen3", qk_norm="head", layer_types=("full_attention",) * c["num_layers"],
                      rope={"full_attention": RopeConfig(theta=1e6)}, **c)
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (n_blocks, block))
    out = {"layers": cfg.num_layers, "params_M": cfg.num_params() / 1e6, "calib_tokens": n_blocks * block}
    for name, run in (("awq", lambda m: awq_quantize_model(m, toks, AWQOptions(bits=bits, group_size=group_size),
                                                           progress=False)),
                      ("gptq", lambda m: gptq_quantize_model(m, toks, GPTQOptions(bits=bits, group_size=group_size),
                                                             progress=False))):
        model = Decoder(cfg, nnx.Rngs(0))
        t0 = time.perf_counter()
        r = run(model)
        total = time.perf_counter() - t0
        per = r.info["seconds_per_layer"]
        out[f"{name}_total_s"] = total
        out[f"{name}_first_layer_s"] = per[0]
        out[f"{name}_s_per_layer"] = float(np.median(per[1:])) if len(per) > 1 else per[0]
        out[f"{name}_seconds_per_layer"] = [float(x) for x in per]
    return out


def main_awq_gptq(argv) -> None:
    ap = argparse.ArgumentParser(description="AWQ / GPTQ seconds per layer on the ~100M Qwen3-shaped config")
    ap.add_argument("--awq-gptq", action="store_true")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--n-blocks", type=int, default=16)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the figures as JSON")
    a = ap.parse_args(argv)
    info = _machine()
    r = bench_awq_gptq(a.layers, a.n_blocks, a.block, a.bits)
    print("[awq-gptq] " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
          flush=True)
    _write(a.out, {"benchmark": "quantize --awq-gptq", "argv": argv, "machine": info, "bits": a.bits,
                   "group_size": 128, "results": r})


if __name__ == "__main__" and "--awq-gptq" in sys.argv:
    main_awq_gptq(sys.argv[1:])
    sys.exit(0)


if __name__ == "__main__":
    main()
