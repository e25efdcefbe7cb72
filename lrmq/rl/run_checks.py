"""The checks that stop a run instead of letting it write nonsense: non-finite updates and rollouts, and
which config keys a resumed run changed."""

from __future__ import annotations

import numpy as np

from lrmq import paths
from lrmq.configlib import load_config, to_plain
from lrmq.rl.config import TrainConfig


def first_non_finite(metrics: dict[str, float], behaviour_logp: np.ndarray) -> str | None:
    """The first non-finite train/* metric of an update, or "rollout log-probs" when the sampler's are not
    finite; None when everything is."""
    bad = [k for k, v in metrics.items() if k.startswith("train/") and not np.isfinite(v)]
    if bad:
        return bad[0]
    return None if np.all(np.isfinite(behaviour_logp)) else "rollout log-probs"


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v) and k != "extra_rewards":
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def config_diff(run_dir: str, cfg: TrainConfig) -> str:
    """': the saved config.yaml differs in a, b, c' (the keys outside run.* whose values differ from the run
    dir's config.yaml), or '' (same, or no readable config.yaml)."""
    try:
        saved = to_plain(load_config(TrainConfig, paths.join(run_dir, "config.yaml")))
    except Exception:
        return ""
    a, b = dict(_flat(saved)), dict(_flat(to_plain(cfg)))
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not k.startswith("run.")]
    return f": the saved config.yaml differs in {', '.join(keys[:8])}" if keys else ""
