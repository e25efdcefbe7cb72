"""The Sampler: the tokenizer side of a GRPO step (prompts in, completions scored, advantages out), the generation
engines, the fp8 KV calibration, the held-out evaluation, and the sampler's mesh.

It takes `WeightVersion`s (`sync`: the weights arrive in the engine's decode layout, relaid once per version) and
returns `Rollout`s stamped with the version they were sampled from. Its `EngineConfig` is built once, whole (the
decode attention and the KV pool's budget included), when the sampler is made.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from lrmq.data.prompts import format_prompt
from lrmq.generation.engine import (Engine, EngineConfig, GenerationResult, bucket_length, left_pad, pool_info,
                                    sequence_keys)
from lrmq.generation.sampling import SamplingConfig
from lrmq.rl.advantages import compute_advantages
from lrmq.rl.batch import build_batch, mask_rows, replay_experts, truncate_left, truncated_rows
from lrmq.rl.config import TrainConfig
from lrmq.rl.kv_scales import KVCalibration
from lrmq.rl.messages import Rollout, WeightVersion
from lrmq.rl.rewards import score_completions, weighted_rewards
from lrmq.sharding import batch_divisor

log = logging.getLogger("lrmq.train")
GIB = 1024 ** 3


def reward_stats(rewards: np.ndarray, parts: dict, info: dict, group_size: int) -> dict[str, float]:
    """A rollout's reward/* statistics: the training reward, each reward function's mean, the main reward's
    accuracy, format rate and timeouts, and the share of groups whose rewards are all equal (no signal)."""
    grouped = rewards.reshape(-1, group_size)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        **{f"reward/{k}": float(v.mean()) for k, v in parts.items()},
        "reward/accuracy": float(np.mean(info["correct"])),
        "reward/format_rate": float(np.mean(info["formatted"])),
        "reward/frac_zero_std": float(np.mean(grouped.max(1) == grouped.min(1))),
        "reward/timeouts": float(info.get("timeouts", 0)),
    }


class Sampler:
    """`policy_graphdef`: the float policy's (evaluation); `rollout_graphdef`: what rollouts sample from (the packed
    copy's with rollout.quant, else the same); `engine`: the rollout engine's whole config; `eval_rows`: held-out
    problems; `suite_eval`: run.eval_suite's evaluator or None."""

    def __init__(self, cfg: TrainConfig, tokenizer, *, policy_graphdef, rollout_graphdef, model_cfg, mesh,
                 engine: EngineConfig, eval_rows=(), suite_eval=None):
        self.cfg, self.tokenizer, self.mesh, self.model_cfg = cfg, tokenizer, mesh, model_cfg
        self.eval_rows, self.suite_eval = list(eval_rows), suite_eval
        make = lambda graphdef: Engine(None, eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id, graphdef=graphdef,
                                       model_cfg=model_cfg, config=engine, mesh=mesh)
        self.engine = make(policy_graphdef)  # the float policy's: evaluation (and rollouts without rollout.quant)
        self.rollout_engine = self.engine if rollout_graphdef is policy_graphdef else make(rollout_graphdef)
        self.kv_calibration = KVCalibration(cfg.rollout.kv_scale_refresh)

    def shardings(self, states):
        """Where a WeightVersion's states go: the rollout engine's decode layout on the sampler's mesh (a sync relays
        the weights there once per version; the programs then relay nothing per call)."""
        return self.rollout_engine.decode_shardings(states)

    # ------------------------------------------------------------------ compile
    def samplings(self) -> dict[str, SamplingConfig]:
        """The rollout's sampling, and greedy when held-out evaluation decodes greedily too."""
        r = self.cfg.rollout
        out = {"sampled": SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)}
        if self.cfg.run.eval_greedy and self.cfg.run.eval_size:
            out["greedy"] = SamplingConfig(greedy=True)
        return out

    def warmup(self, version: WeightVersion, eval_states=None) -> None:
        """Compile the engines' programs (every row bucket's prefill and decode, per sampling) on `version` (and the
        float policy's `eval_states` when it has its own engine and there is an evaluation)."""
        r = self.cfg.rollout
        t0 = time.perf_counter()
        sizes = dict(n_requests=r.prompts_per_step * r.group_size, prompt_len=r.max_prompt_len, max_new=r.max_new_tokens)
        samplings = self.samplings()
        with jax.set_mesh(self.mesh):
            if self.rollout_engine is not self.engine:  # the copy's engine samples the rollouts; the policy's evaluates
                self.rollout_engine.warmup(version.states, sampling=samplings["sampled"], **sizes)
                if not (self.cfg.run.eval_size or self.cfg.run.eval_suite):
                    samplings = {}
            states = version.states if self.rollout_engine is self.engine else self.engine.prepare(eval_states,
                                                                                                   copy=False)
            for sampling in samplings.values():
                self.engine.warmup(states, sampling=sampling, **sizes)
        log.info("compiled the rollout engine's programs in %.1f s", time.perf_counter() - t0)

    def log_pool(self, hbm: int, reserved: int, what: str) -> None:
        r = self.cfg.rollout
        info = pool_info(self.rollout_engine.config, self.model_cfg, self.mesh, r.prompts_per_step * r.group_size,
                         r.max_prompt_len, r.max_new_tokens)
        log.info("KV pool: %d pages of %d tokens (worst case %d), %.2f GiB per device (%.0f%% of %.2f GiB less "
                 "%s %.2f GiB)", info["pages"], r.page_size, info["worst_case_pages"],
                 info["bytes_per_device"] / GIB, 100 * r.kv_memory_fraction, hbm / GIB, what, reserved / GIB)

    # ------------------------------------------------------------------ rollout
    def encode_prompts(self, problems: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        ids, truncated = [], 0
        for p in problems:
            t = self.tokenizer.encode(format_prompt(self.cfg.data.template, p, self.tokenizer))
            truncated += len(t) > self.cfg.rollout.max_prompt_len
            ids.append(truncate_left(t, self.cfg.rollout.max_prompt_len))
        # Prompt columns: a power-of-two bucket of the longest prompt (as TRL pads to the batch's longest), so
        # prefill and cache skip the budget nobody uses; update_padding=max keeps max_prompt_len (one shape).
        width = self.cfg.rollout.max_prompt_len
        if self.cfg.rollout.update_padding != "max":
            width = min(bucket_length(max(map(len, ids))), width)
        tokens, mask = left_pad(ids, width, self.tokenizer.pad_id)
        return tokens, mask, truncated

    def calibration_prompts(self, batch: dict[str, list]) -> list[list[int]]:
        """The token ids of a batch's prompts (rollout.quant_scales=awq calibrates on the first batch's)."""
        tokens, mask, _ = self.encode_prompts([str(p) for p in batch["problem"]])
        return [row[m > 0].tolist() for row, m in zip(tokens, mask)]

    def generate(self, engine: Engine, states, tokens, mask, key, sampling: SamplingConfig,
                 kv_scales=None) -> GenerationResult:
        """Complete every (left-padded) prompt row; sequence i samples with `fold_in(key, i)`, so results depend
        neither on rollout.generation_batch nor on the devices."""
        prompts = [row[m > 0].tolist() for row, m in zip(tokens, mask)]
        with jax.set_mesh(self.mesh):
            return engine.generate(states, prompts, max_new_tokens=self.cfg.rollout.max_new_tokens, sampling=sampling,
                                   keys=sequence_keys(key, len(prompts)),
                                   prompt_capacity=self.cfg.rollout.max_prompt_len, kv_scales=kv_scales)

    def rollout(self, batch: dict[str, list], key, index: int, weights: WeightVersion,
                sync_stats: dict[str, float] | None = None) -> Rollout:
        """Sample group_size completions of each prompt of `batch` (data batch `index`) from `weights`, score them
        and compute their advantages; `sync_stats` (rollout/sync_*: the version's first rollout) join its stats."""
        g, version = self.cfg.rollout.group_size, weights.version
        problems = [p for p in batch["problem"] for _ in range(g)]
        answers = [str(x) for x in batch["answer"] for _ in range(g)]
        tokens, mask, truncated = self.encode_prompts(problems)
        t0 = time.perf_counter()
        kv_scales = self.kv_calibration.for_rollout(version)
        out = self.generate(self.rollout_engine, weights.states, tokens, mask, key, self.samplings()["sampled"],
                            kv_scales)
        t_gen = time.perf_counter() - t0
        kv_stats = self.kv_calibration.after_rollout(kv_scales, out, version)
        texts = [self.tokenizer.decode(out.tokens[i, : out.lengths[i]].tolist()) for i in range(len(problems))]
        rewards, parts, info = self.score(texts, answers, out.lengths)
        ro = self._rollout(tokens, mask, out, texts, answers, rewards, parts, info, index, version)
        ro.prompts = {"problem": list(batch["problem"]), "answer": [str(x) for x in batch["answer"]]}
        ro.stats.update({"prompt/truncated": float(truncated),
                         "perf/rollout_tokens_per_s": float(out.lengths.sum() / max(t_gen, 1e-9)),
                         "perf/rollout_s": t_gen, "rollout/weight_bytes": float(weights.nbytes),
                         **(sync_stats or {}), **kv_stats})
        return ro

    def _rollout(self, tokens, mask, out: GenerationResult, texts, answers, rewards, parts, info, index: int,
                 version: int) -> Rollout:
        """Advantages, the training batch, the completion records and the reward / completion statistics."""
        a, g = self.cfg.algo, self.cfg.rollout.group_size
        comp, lengths = out.tokens, out.lengths
        adv = np.asarray(compute_advantages(a.advantage, rewards, g, eps=a.adv_eps, std_ddof=a.std_ddof,
                                            scale=a.scale_rewards))
        rb = build_batch(tokens, mask, comp, lengths, out.logprobs, adv, rewards)
        if out.experts is not None:  # a MoE rollout: the experts the update replays (routing_replay) or compares
            rb = dataclasses.replace(rb, experts=replay_experts(mask, lengths, comp.shape[1], out.experts))
        cut = truncated_rows(comp, lengths, self.tokenizer.eos_ids)
        if a.mask_truncated_completions:
            rb = mask_rows(rb, cut)
        completions = [
            {"prompt": self.tokenizer.decode([int(t) for t, m in zip(tokens[i], mask[i]) if m]),
             "completion": texts[i], "answer": answers[i], "reward": float(rewards[i]),
             "rewards": {k: float(v[i]) for k, v in parts.items()}, "advantage": float(adv[i]),
             "tokens": int(lengths[i]), "truncated": bool(cut[i])}
            for i in range(len(texts))]
        stats = {**reward_stats(rewards, parts, info, g), "completion/length_mean": float(lengths.mean()),
                 "completion/truncated_rate": float(np.mean(cut))}
        failed = bool(info.get("failed")) or int(info.get("timeouts", 0)) >= len(texts)
        return Rollout(rb, stats, completions, failed, index=index, version=version)

    def score(self, texts: list[str], answers: list[str], lengths) -> tuple[np.ndarray, dict, dict]:
        """(training reward [N], {reward name: its unweighted values}, the main reward's info)."""
        return weighted_rewards(self.cfg.algo, texts, answers, lengths, self.cfg.rollout.max_new_tokens,
                                score_fn=score_completions)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, states, limit: int | None = None) -> dict[str, float]:
        """Held-out accuracy of the float policy `states` (on the sampler's mesh), greedy and sampled at the
        rollout temperature (what GRPO optimizes); run.eval_suite's benchmarks too."""
        rows = self.eval_rows[: (limit or self.cfg.run.eval_size)]
        if not rows:
            return {}
        div = batch_divisor(self.mesh)
        rows = rows[: max(div, len(rows) // div * div)]
        tokens, mask, _ = self.encode_prompts([r["problem"] for r in rows])
        answers = [str(r["answer"]) for r in rows]
        with jax.set_mesh(self.mesh):
            prepared = self.engine.prepare(states, copy=False)
        out: dict[str, float] = {}
        for name, sampling in sorted(self.samplings().items()):
            gen = self.generate(self.engine, prepared, tokens, mask, jax.random.key(self.cfg.run.seed + 7919), sampling)
            texts = [self.tokenizer.decode(gen.tokens[i, : gen.lengths[i]].tolist()) for i in range(len(rows))]
            rewards, info = score_completions(texts, answers, self.cfg.algo.reward,
                                              timeout_s=self.cfg.algo.reward_timeout_s)
            out[f"eval/{name}_accuracy"] = float(np.mean(info["correct"]))
            out[f"eval/{name}_reward"] = float(rewards.mean())
            out[f"eval/{name}_format_rate"] = float(np.mean(info["formatted"]))
        out["eval/accuracy"] = out["eval/sampled_accuracy"]
        if self.suite_eval is not None:
            out.update(self.suite_eval(prepared, self.tokenizer, self.engine, self.model_cfg.max_position_embeddings,
                                       self.cfg.algo.reward_timeout_s))
        return out
