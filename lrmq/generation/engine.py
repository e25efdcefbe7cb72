"""Batched generation: one jitted prefill + `lax.while_loop` decode over a preallocated KV cache.

Prompts are left-padded to a length bucket (powers of two), so a run compiles once per
(batch, bucket, max_new_tokens) and never per step. Every sequence stops at its own EOS or at
`max_new_tokens`. Returns generated ids, the log-probability of each sampled token (temperature
applied, before top-k/top-p truncation: the quantity GRPO's importance ratio uses) and lengths
(the EOS token is counted and kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrmq.generation.sampling import SamplingConfig, sample
from lrmq.model.decoder import Decoder, KVCache, positions_from_mask
from lrmq.sharding import batch_divisor, batch_sharding


@dataclass
class GenerationResult:
    tokens: np.ndarray  # [B, max_new_tokens] int32, pad after the end
    logprobs: np.ndarray  # [B, max_new_tokens] float32, 0 after the end
    lengths: np.ndarray  # [B] int32, generated tokens including EOS


def bucket_length(n: int, minimum: int = 16) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), np.int32)
    for i, p in enumerate(prompts):
        if len(p) > length:
            raise ValueError(f"prompt {i} has {len(p)} tokens, more than the {length} allowed")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        tokens[i, length - len(p):] = p
        mask[i, length - len(p):] = 1
    return tokens, mask


def _generate_fn(graphdef, state, tokens, mask, key, *, max_new: int, cfg: SamplingConfig, eos: tuple[int, ...],
                 pad_id: int):
    states = state if isinstance(state, tuple) else (state,)  # (trainable, rest) splits merge too
    model: Decoder = nnx.merge(graphdef, *states)
    b, p = tokens.shape
    cache = KVCache.create(model.cfg, b, p + max_new)
    positions = positions_from_mask(mask)
    # Prefill: only the last position's logits are needed (prompts are left-padded, so it is each row's last
    # real token); projecting all P positions onto the vocabulary would cost ~P decode steps of lm_head.
    h, cache = model.hidden(tokens, positions, cache, index=0)
    logits = model.logits(h[:, -1:])
    next_pos = jnp.max(positions, axis=-1) + 1
    eos_arr = jnp.asarray(eos, jnp.int32)

    out_tok = jnp.full((b, max_new), pad_id, jnp.int32)
    out_lp = jnp.zeros((b, max_new), jnp.float32)
    state0 = (0, logits[:, -1], cache, next_pos, jnp.zeros((b,), bool), out_tok, out_lp, jnp.zeros((b,), jnp.int32))

    def cond(s):
        step, _, _, _, done, *_ = s
        return (step < max_new) & ~jnp.all(done)

    def body(s):
        step, last_logits, cache, pos, done, out_tok, out_lp, lengths = s
        tok, lp = sample(jax.random.fold_in(key, step), last_logits, cfg)
        tok = jnp.where(done, pad_id, tok)
        lp = jnp.where(done, 0.0, lp)
        out_tok = out_tok.at[:, step].set(tok)
        out_lp = out_lp.at[:, step].set(lp)
        lengths = lengths + (~done).astype(jnp.int32)
        done = done | jnp.isin(tok, eos_arr)
        logits, cache = model(tok[:, None], pos[:, None], cache, index=p + step)
        return step + 1, logits[:, -1], cache, pos + 1, done, out_tok, out_lp, lengths

    _, _, _, _, _, out_tok, out_lp, lengths = jax.lax.while_loop(cond, body, state0)
    return out_tok, out_lp, lengths


class Generator:
    """Holds the compiled generate function for a model; reuse it across calls (rollouts)."""

    def __init__(self, model: Decoder, *, eos_ids: Sequence[int], pad_id: int, mesh=None, min_bucket: int = 16,
                 graphdef=None):
        if not eos_ids:
            raise ValueError("eos_ids is empty: generation needs at least one stop token")
        # graphdef: pass the one from an `nnx.split(model, filter, ...)` to generate from split states
        self.graphdef = graphdef if graphdef is not None else nnx.split(model)[0]
        self.eos = tuple(int(e) for e in eos_ids)
        self.pad_id = int(pad_id)
        self.mesh = mesh
        self.min_bucket = min_bucket
        self._fns: dict = {}

    def _fn(self, max_new: int, cfg: SamplingConfig):
        k = (max_new, cfg)
        if k not in self._fns:
            self._fns[k] = jax.jit(partial(_generate_fn, self.graphdef, max_new=max_new, cfg=cfg, eos=self.eos,
                                           pad_id=self.pad_id))
        return self._fns[k]

    def generate_padded(self, state, tokens, mask, key, *, max_new_tokens: int, sampling: SamplingConfig):
        """Device-level call on already left-padded arrays (used by the GRPO rollout)."""
        return self._fn(max_new_tokens, sampling)(state, tokens, mask, key)

    def generate(self, model_or_state, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 sampling: SamplingConfig = SamplingConfig(), seed: int | jax.Array = 0,
                 prompt_bucket: int | None = None) -> GenerationResult:
        state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
        n = len(prompts)
        p = prompt_bucket or bucket_length(max(len(x) for x in prompts), self.min_bucket)
        tokens, mask = left_pad(prompts, p, self.pad_id)
        if self.mesh is not None:  # batch must divide the data axes; pad with copies of the first prompt

            div = batch_divisor(self.mesh)
            extra = (-n) % div
            if extra:
                tokens = np.concatenate([tokens, np.repeat(tokens[:1], extra, 0)])
                mask = np.concatenate([mask, np.repeat(mask[:1], extra, 0)])
            sh = batch_sharding(self.mesh)
            tokens, mask = jax.device_put(tokens, sh), jax.device_put(mask, sh)
        key = jax.random.key(seed) if isinstance(seed, int) else seed
        out_tok, out_lp, lengths = self.generate_padded(state, jnp.asarray(tokens), jnp.asarray(mask), key,
                                                        max_new_tokens=max_new_tokens, sampling=sampling)
        return GenerationResult(np.asarray(out_tok)[:n], np.asarray(out_lp)[:n], np.asarray(lengths)[:n])


def generate(model: Decoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_ids: Sequence[int],
             pad_id: int, sampling: SamplingConfig = SamplingConfig(), seed: int = 0, mesh=None) -> GenerationResult:
    """One-shot convenience wrapper around Generator."""
    return Generator(model, eos_ids=eos_ids, pad_id=pad_id, mesh=mesh).generate(
        model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed)


def generation_chunk(generation_batch: int, n: int, divisor: int) -> int:
    """Rows per generate call: generation_batch (0 = all n), a multiple of the data-parallel divisor that
    divides n, so every chunk has the same shape (one compile)."""
    if not generation_batch or generation_batch >= n:
        return n
    size = max(divisor, generation_batch // divisor * divisor)
    while n % size:
        size -= divisor
    return max(size, divisor)
