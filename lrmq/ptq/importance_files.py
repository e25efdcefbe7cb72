"""The output files of QuantLRM's importance pass: the vectors (``importance.npz``) and a figure
of the |dW| distribution with the mapping and the per-channel importance (``importance.png``)."""

from __future__ import annotations

import os
import tempfile
from typing import Mapping

import numpy as np

from lrmq.ptq.importance import MAPPINGS
from lrmq.ptq.median import Stats


def save_importance_npz(path: str, importances: Mapping[str, np.ndarray]) -> None:
    """Write ``{name: vector}`` to ``path`` (.npz) atomically: temp file in the same dir, then rename."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".npz.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{k: np.asarray(v) for k, v in importances.items()})
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def plot_importance(
    path_png: str,
    dw_sample: np.ndarray,
    stats: Stats,
    importances: Mapping[str, np.ndarray],
    mapping: str = "u_shape",
    *,
    R: float = 10.0,
    max_curves: int = 4,
) -> None:
    """Two panels: histogram of positive |dW| (log x) with the mapping overlaid; importance per channel."""
    import matplotlib


    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.asarray(dw_sample, np.float32).ravel()
    x = x[x > 0]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.5))
    lo, hi = max(stats.min, 1e-12), stats.max
    bins = np.geomspace(lo, hi, 80) if hi > lo else 10
    if x.size:
        ax0.hist(x, bins=bins, color="tab:gray", alpha=0.7)
    ax0.set_xscale("log")
    ax0.set_xlabel("|dW| (positive)")
    ax0.set_ylabel("count (sample)")
    ax0.axvline(stats.median, color="tab:red", ls="--", lw=1, label=f"median {stats.median:.3g}")
    axq = ax0.twinx()
    grid = np.geomspace(lo, hi, 400).astype(np.float32) if hi > lo else np.array([lo], np.float32)
    axq.plot(grid, MAPPINGS.get(mapping)(grid, stats, R), color="tab:blue", label=f"q ({mapping})")
    axq.set_ylabel("q(|dW|)")
    axq.set_ylim(0, R * 1.05)
    ax0.legend(loc="upper left")
    axq.legend(loc="upper right")
    ax0.set_title(f"|dW|: n={stats.count}, min={stats.min:.3g}, max={stats.max:.3g}")
    for name in list(importances)[:max_curves]:
        ax1.plot(np.asarray(importances[name]), lw=0.8, label=name)
    ax1.set_xlabel("input channel")
    ax1.set_ylabel("importance")
    ax1.set_yscale("log")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path_png, dpi=100)
    plt.close(fig)
