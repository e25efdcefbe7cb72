"""A study's rollouts table (issue 36's KV-cache arms): what `lrmq.studies.runner` keeps of a train run's
metrics (the mismatch averaged over all steps, the CPU speed over the steps after the first, which compiles),
the rollout's KV bytes per cached token computed from the run's config, the table's cells, and the KV-cache
study configs' arms. No training: each test is a fraction of a second."""

from __future__ import annotations

import json
import os

import pytest

from conftest import REPO_ROOT
from lrmq.checkpoint.load import read_model_config
from lrmq.configlib import dump_config, load_config
from lrmq.rl.config import TrainConfig
from lrmq.studies.config import load_study_config
from lrmq.studies.matrix import expand
from lrmq.studies.report import markdown
from lrmq.studies.runner import last_metrics, rollout_kv_bytes_per_token


def test_speed_is_averaged_after_the_first_step_and_the_mismatch_over_all(tmp_path):
    rows = [{"step": 0, "eval/sampled_accuracy": 0.2},  # the trainer's initial evaluation: no step timed
            {"step": 1, "perf/step_s": 30.0, "perf/rollout_s": 20.0, "perf/rollout_tokens_per_s": 10.0,
             "train/mismatch/kl_k3": 0.3, "reward/mean": 0.1},
            {"step": 2, "perf/step_s": 2.0, "perf/rollout_s": 1.0, "perf/rollout_tokens_per_s": 500.0,
             "train/mismatch/kl_k3": 0.1, "reward/mean": 0.2},
            {"step": 3, "perf/step_s": 4.0, "perf/rollout_s": 3.0, "perf/rollout_tokens_per_s": 300.0,
             "train/mismatch/kl_k3": 0.2, "reward/mean": 0.3}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = last_metrics(str(path))
    assert m["perf/step_s_avg"] == pytest.approx(3.0) and m["perf/rollout_s_avg"] == pytest.approx(2.0)
    assert m["perf/rollout_tokens_per_s_avg"] == pytest.approx(400.0)
    assert m["mismatch/kl_k3_avg"] == pytest.approx(0.2) and m["reward/mean_avg"] == pytest.approx(0.2)
    assert m["perf/step_s"] == 4.0  # the last value is kept as before


@pytest.mark.parametrize("kv_cache,itemsize,scales", [("auto", 4, 0), ("bf16", 2, 0), ("fp8_e4m3", 1, 0),
                                                      ("fp8_e5m2", 1, 0), ("int8", 1, 4)])
def test_rollout_kv_bytes_per_token(tmp_path, kv_cache, itemsize, scales):
    cfg = load_config(TrainConfig, os.path.join(REPO_ROOT, "configs", "tiny_demo.yaml"),
                      [f"rollout.kv_cache={kv_cache}"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    m = read_model_config(cfg.model.checkpoint, dtype=cfg.model.dtype)
    entries = m.num_layers * 2 * m.num_kv_heads  # K and V of every layer and KV head
    # the tiny model computes in f32 (auto: 4 bytes); int8 adds a float32 scale per token, head and K / V
    assert rollout_kv_bytes_per_token(str(path)) == entries * (m.head_dim * itemsize + scales)


def test_rollouts_table_has_kv_bytes_and_speed():
    def arm(name, kl, kv, rollout_s, tok_s, step_s):
        metrics = {"train/mismatch/kl_k1_avg": {"mean": kl, "std": 0.0, "n": 3},
                   "train/mismatch/kl_k3_avg": {"mean": kl, "std": 0.0, "n": 3},
                   "train/reward/mean_avg": {"mean": 0.4, "std": 0.01, "n": 3},
                   "train/rollout/weight_bytes": {"mean": 2.0**20, "std": 0.0, "n": 3},
                   "train/rollout/kv_bytes_per_token": {"mean": kv, "std": 0.0, "n": 3},
                   "train/perf/rollout_s_avg": {"mean": rollout_s, "std": 0.1, "n": 3},
                   "train/perf/rollout_tokens_per_s_avg": {"mean": tok_s, "std": 10.0, "n": 3},
                   "train/perf/step_s_avg": {"mean": step_s, "std": 0.2, "n": 3},
                   "sampled_accuracy": {"mean": 0.3, "std": 0.01, "n": 3}}
        return {"name": name, "group": "g", "nominal_bits": 32, "mean": 0.3, "std": 0.01, "n": 3, "metrics": metrics,
                "memory": {}, "vs_baseline": None, "vs_baseline_paired": None}

    res = {"study": "kv", "metric": "sampled_accuracy", "seeds": [0, 1, 2], "written": "now",
           "eval": {"kind": "heldout", "size": 256, "samples": 1},
           "arms": [arm("fp", 0.0, 1024.0, 0.5, 3000.0, 1.0), arm("fp8-tis", 0.0012, 256.0, 0.75, 2100.0, 1.25)]}
    md = markdown(res)
    head = next(line for line in md.splitlines() if line.startswith("| arm | reward over training"))
    assert head.endswith("| rollout weight MiB | KV bytes / token | rollout s | rollout tokens/s | step s |")
    row = [line for line in md.splitlines() if line.startswith("| fp8-tis |")][-1]  # the main table's is first
    assert row == "| fp8-tis | 0.400 ± 0.010 | 0.00120 ± 0.00000 | 0.00120 ± 0.00000 | - | 1.000 | 256 | " \
                  "0.75 ± 0.10 | 2100 ± 10 | 1.25 ± 0.20 |"


# each arm's rollout settings: (rollout.kv_cache, algo.rollout_correction, rollout.quant)
KV_ARMS = {"fp": ("auto", "auto", "none"), "fp8-tis": ("fp8_e4m3", "token_truncate", "none"),
           "fp8-none": ("fp8_e4m3", "none", "none"), "int8-tis": ("int8", "token_truncate", "none"),
           "int8-none": ("int8", "none", "none"), "w4-fp8-tis": ("fp8_e4m3", "token_truncate", "int4"),
           "w4-fp8-none": ("fp8_e4m3", "none", "int4")}


@pytest.mark.parametrize("name,n_arms", [("kv_cache.yaml", 7), ("kv_cache_small.yaml", 6)])
def test_kv_cache_study_arms(name, n_arms):
    study = load_study_config(os.path.join(REPO_ROOT, "configs", "study", name))
    arms = {a.name: a for a in expand(study)}
    assert len(arms) == n_arms and list(study.seeds) == [0, 1, 2] and study.parallel == 1
    assert all(a.baseline == "fp" for n, a in arms.items() if n != "fp")
    for a in arms.values():  # every arm's overrides make a valid train config of the recipe
        cfg = load_config(TrainConfig, os.path.join(REPO_ROOT, study.train.config), [*study.train.overrides, *a.train])
        assert (cfg.rollout.kv_cache, cfg.algo.rollout_correction, cfg.rollout.quant) == KV_ARMS[a.name]
        assert cfg.run.steps == 30 and cfg.optim.lr == pytest.approx(1e-4)
