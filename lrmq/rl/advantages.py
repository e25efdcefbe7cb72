"""Group-relative advantage estimators, registered by name.

Every estimator has the signature

    fn(rewards [B*G] float, group_size G, *, eps=1e-4, std_ddof=1) -> advantages [B*G] float32

where the G samples of one prompt are contiguous (rows ``g*G .. g*G+G-1``). Estimators that do not
use ``eps`` / ``std_ddof`` accept and ignore them, so callers can pass one config to any of them.
See docs/grpo.md ("Algorithm") for the formulas and the ddof choice.
"""

from __future__ import annotations

import jax.numpy as jnp

from lrmq.registry import Registry

ADVANTAGES = Registry("advantage estimator")

# TRL's GRPOTrainer adds 1e-4 to the group std; paper 1 trained with TRL.
DEFAULT_EPS = 1e-4
# TRL uses torch.Tensor.std() (unbiased, ddof=1); Tunix also uses ddof=1, MaxText's older trainer ddof=0.
DEFAULT_STD_DDOF = 1


def _grouped(rewards, group_size: int):
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B*G], got shape {r.shape}")
    if group_size < 1 or r.shape[0] % group_size:
        raise ValueError(f"{r.shape[0]} rewards do not split into groups of {group_size}")
    return r.reshape(-1, group_size)


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards, group_size: int, *, eps: float = DEFAULT_EPS, std_ddof: int = DEFAULT_STD_DDOF):
    """(r - mean_G) / (std_G + eps)."""
    r = _grouped(rewards, group_size)
    if std_ddof >= group_size:
        # An unbiased std of a 1-sample group is 0/0; fall back to 0 so A = 0 rather than NaN.
        std = jnp.zeros((r.shape[0], 1), jnp.float32)
    else:
        std = jnp.std(r, axis=1, keepdims=True, ddof=std_ddof)
    dev = r - r.mean(axis=1, keepdims=True)
    denom = std + eps
    # A constant group has dev == 0; with eps == 0 that would be 0/0, and its advantage is 0 anyway.
    return jnp.where(denom > 0, dev / jnp.where(denom > 0, denom, 1.0), 0.0).reshape(-1)


@ADVANTAGES.register("drgrpo")
def drgrpo_advantages(rewards, group_size: int, *, eps: float = DEFAULT_EPS, std_ddof: int = DEFAULT_STD_DDOF):
    """r - mean_G: Dr.GRPO drops the std division (it up-weights near-uniform groups)."""
    del eps, std_ddof
    r = _grouped(rewards, group_size)
    return (r - r.mean(axis=1, keepdims=True)).reshape(-1)


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards, group_size: int, *, eps: float = DEFAULT_EPS, std_ddof: int = DEFAULT_STD_DDOF):
    """r_i - mean_{j != i} r_j (leave-one-out baseline; unbiased). Equals G/(G-1) * (r - mean_G)."""
    del eps, std_ddof
    r = _grouped(rewards, group_size)
    if group_size < 2:
        return jnp.zeros(r.size, jnp.float32)
    loo_mean = (r.sum(axis=1, keepdims=True) - r) / (group_size - 1)
    return (r - loo_mean).reshape(-1)


def compute_advantages(name: str, rewards, group_size: int, **kwargs):
    """Look up estimator ``name`` and apply it."""
    return ADVANTAGES.get(name)(rewards, group_size, **kwargs)
