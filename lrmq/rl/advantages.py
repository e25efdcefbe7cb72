"""Group-relative advantage estimators, registered by name.

Every estimator has the signature

    fn(rewards [B*G] float, group_size G, *, eps=1e-4, std_ddof=1, scale="group") -> advantages [B*G] float32

where the G samples of one prompt are contiguous (rows ``g*G .. g*G+G-1``), computed on the host in
NumPy (the rewards come from Python reward functions; the jitted step consumes the result). Estimators that do not
use ``eps`` / ``std_ddof`` / ``scale`` accept and ignore them, so callers can pass one config to any of them.

A group whose rewards are all equal carries no learning signal and gets advantage exactly 0 from
every estimator: float32 arithmetic alone does not give that (the mean of eight 0.1 rewards is one ulp
off 0.1, the std ~1e-8, so ``(r - mean) / (std + eps)`` came out -7.45e-5 with eps 1e-4 and ~-0.9 with
eps 0). See docs/grpo.md ("Algorithm") for the formulas, the ddof and the scale choices.
"""

from __future__ import annotations

import numpy as np

from lrmq.registry import Registry

ADVANTAGES = Registry("advantage estimator")

# TRL's GRPOTrainer adds 1e-4 to the group std; paper 1 trained with TRL.
DEFAULT_EPS = 1e-4
# TRL uses torch.Tensor.std() (unbiased, ddof=1); Tunix also uses ddof=1, MaxText's older trainer ddof=0.
DEFAULT_STD_DDOF = 1
# What the grpo estimator divides by: the group's std (GRPO, TRL's default), the whole batch's std
# (TRL scale_rewards="batch", as in Dr.GRPO's follow-ups), or nothing (= the drgrpo estimator).
SCALES = ("group", "batch", "none")


def _grouped(rewards, group_size: int):
    r = np.asarray(rewards, np.float32)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B*G], got shape {r.shape}")
    if group_size < 1 or r.shape[0] % group_size:
        raise ValueError(f"{r.shape[0]} rewards do not split into groups of {group_size}")
    return r.reshape(-1, group_size)


def _zero_constant_groups(adv, r):
    """Exactly 0 for every member of a group whose rewards are all equal."""
    constant = (r.max(axis=1, keepdims=True) == r.min(axis=1, keepdims=True))
    return np.where(constant, np.float32(0), adv).astype(np.float32).reshape(-1)


def _std(x, ddof: int, axis=None):
    n = x.size if axis is None else x.shape[axis]
    if ddof >= n:  # an unbiased std of one sample is 0/0; 0 keeps A finite (A is 0 there anyway)
        return np.zeros((1, 1) if axis is None else (x.shape[0], 1), np.float32)
    return np.std(x, axis=axis, keepdims=True, ddof=ddof)


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards, group_size: int, *, eps: float = DEFAULT_EPS, std_ddof: int = DEFAULT_STD_DDOF,
                    scale: str = "group"):
    """(r - mean_G) / (std + eps), std over the group (scale="group"), the whole batch ("batch"), or 1 ("none")."""
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}: expected one of {SCALES}")
    r = _grouped(rewards, group_size)
    dev = r - r.mean(axis=1, keepdims=True)
    if scale == "none":
        return _zero_constant_groups(dev, r)
    std = _std(r, std_ddof, axis=1) if scale == "group" else _std(r.reshape(-1), std_ddof)
    denom = std + eps
    # denom == 0 only when eps == 0 and the std is 0, where dev is 0 too: 0/0 -> 0, not NaN.
    adv = np.where(denom > 0, dev / np.where(denom > 0, denom, 1.0), 0.0)
    return _zero_constant_groups(adv, r)


@ADVANTAGES.register("drgrpo")
def drgrpo_advantages(rewards, group_size: int, *, eps: float = DEFAULT_EPS, std_ddof: int = DEFAULT_STD_DDOF,
                      scale: str = "group"):
    """r - mean_G: Dr.GRPO drops the std division (it up-weights near-uniform groups)."""
    del eps, std_ddof, scale
    r = _grouped(rewards, group_size)
    return _zero_constant_groups(r - r.mean(axis=1, keepdims=True), r)


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards, group_size: int, *, eps: float = DEFAULT_EPS, std_ddof: int = DEFAULT_STD_DDOF,
                    scale: str = "group"):
    """r_i - mean_{j != i} r_j (leave-one-out baseline; unbiased). Equals G/(G-1) * (r - mean_G)."""
    del eps, std_ddof, scale
    r = _grouped(rewards, group_size)
    if group_size < 2:
        return np.zeros(r.size, np.float32)
    loo_mean = (r.sum(axis=1, keepdims=True) - r) / (group_size - 1)
    return _zero_constant_groups(r - loo_mean, r)


def compute_advantages(name: str, rewards, group_size: int, **kwargs):
    """Look up estimator ``name`` and apply it."""
    return ADVANTAGES.get(name)(rewards, group_size, **kwargs)
