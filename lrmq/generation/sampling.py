"""Token sampling: greedy, temperature, top-k, top-p (nucleus), as pure functions of logits."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class SamplingConfig:
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and math.isfinite(self.top_p)):  # NaN passes every comparison
            raise ValueError(f"temperature and top_p must be finite numbers (got {self.temperature}, {self.top_p})")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (got {self.temperature}); use greedy=True for argmax")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k})")


def scaled_logprobs(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """log-softmax of temperature-scaled logits in float32: the policy log-probs GRPO trains against."""
    t = 1.0 if cfg.greedy else cfg.temperature
    return jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)


def sample(key: jax.Array, logits: jax.Array, cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] -> (tokens [B], log-probs of those tokens under `scaled_logprobs`)."""
    logp = scaled_logprobs(logits, cfg)
    if cfg.greedy:
        tok = jnp.argmax(logp, axis=-1)
    else:
        masked = logp
        if cfg.top_k:
            kth = jax.lax.top_k(masked, cfg.top_k)[0][:, -1:]
            masked = jnp.where(masked < kth, -jnp.inf, masked)
        if cfg.top_p < 1.0:
            masked = _top_p_mask(masked, cfg.top_p)
        tok = jax.random.categorical(key, masked, axis=-1)
    return tok.astype(jnp.int32), jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def _top_p_mask(logp: jax.Array, top_p: float) -> jax.Array:
    """Keep the smallest set of tokens whose probability mass reaches top_p (the top token always stays)."""
    sorted_logp = jnp.sort(logp, axis=-1)[:, ::-1]
    probs = jnp.exp(sorted_logp - jax.nn.logsumexp(sorted_logp, axis=-1, keepdims=True))
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < top_p
    # threshold = smallest kept log-prob per row
    thresh = jnp.min(jnp.where(keep_sorted, sorted_logp, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logp < thresh, -jnp.inf, logp)
