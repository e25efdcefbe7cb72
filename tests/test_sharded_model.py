"""Sharded load on 8 forced CPU devices (in a subprocess: the pytest process has one device)."""

from __future__ import annotations


def test_sharded_load_matches_unsharded(hf_checkpoint, multi_device_run, tmp_path):
    # qwen3: tied embeddings (vocab-sharded lm head) + per-head qk-norm; olmo3: post-norm, full qk-norm,
    # sliding window. Two variants keep the 8-device compiles affordable.
    dirs = [hf_checkpoint(v)[0] for v in ("qwen3", "olmo3")]
    r = multi_device_run("sharded_check.py", str(tmp_path), *dirs)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-5000:]}"
    assert r.stdout.strip().splitlines()[-1].startswith("OK")
