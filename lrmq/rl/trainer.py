"""The GRPO / Dr.GRPO training loop: rollouts -> rewards -> advantages -> jitted updates.

Multi-host: every process iterates the same global prompt batch; generation and the update run
sharded over the global mesh; completions are gathered so each host scores all of them (rewards are
cheap next to generation) and then places its own shards of the train batch.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrmq import compile_cache, paths
from lrmq.checkpoint.hf import save_hf_model
from lrmq.checkpoint.load import check_checkpoint, resolve_checkpoint
from lrmq.configlib import ConfigError, check_data_parallel_batch, save_config
from lrmq.data.pipeline import PromptPipeline
from lrmq.data.prompts import format_prompt
from lrmq.generation.engine import Engine, GenerationResult, bucket_length, left_pad, pool_info, sequence_keys
from lrmq.generation.paged import KVScales, pool_budget
from lrmq.generation.sampling import SamplingConfig
from lrmq.model.config import check_position_limit
from lrmq.ptq.qat_export import QUANTIZED_POLICY, export_qat_policy
from lrmq.quant.training import export_float_model, trainable_filter
from lrmq.rl.advantages import compute_advantages
from lrmq.rl.batch import (RolloutBatch, UpdateBatch, build_batch, bucketed_batch, mask_rows, packed_batch,
                           padded_batch, truncate_left, truncated_rows)
from lrmq.rl.config import TrainConfig
from lrmq.rl.evaluation import SuiteEval
from lrmq.rl.kv_scales import KVCalibration
from lrmq.rl.precompile import GIB, UpdatePrograms, check_budget, hbm_bytes, packed_chooser
from lrmq.rl.rewards import score_completions, weighted_rewards
from lrmq.rl.rollout_copy import RolloutCopy, RolloutQuant, awq_rollout_scales, calibration_blocks
from lrmq.rl.run_lock import RunDirLock
from lrmq.rl.run_checks import config_diff, first_non_finite
from lrmq.rl.run_state import NullWriter, RunCheckpointer, RunLogs, completion_markdown, progress_bar
from lrmq.rl.setup import build_model, load_datasets
from lrmq.rl.step import init_opt_state, make_optimizer, micro_batch_count, rollout_quant_warning
from lrmq.sharding import MeshConfig, batch_divisor, batch_sharding, make_mesh
from lrmq.tensorboard import summary_writer
from lrmq.tokenizer import Tokenizer

log = logging.getLogger("lrmq.train")


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


class TrainingStopped(RuntimeError):
    """Training cannot go on (a non-finite metric, rewards that keep failing); the message says why and what
    was kept."""


@dataclass
class Rollout:
    """What one rollout produced: the batch to train on, its statistics (reward/*, completion/*, prompt/*, perf/*,
    rollout/*), one record per completion (completions.jsonl) and whether the reward failed on every comparison
    (the batch is then not trained on)."""

    batch: RolloutBatch
    stats: dict[str, float]
    completions: list[dict]
    reward_failed: bool


# ----------------------------------------------------------------------------- the trainer


class GRPOTrainer:
    def __init__(self, cfg: TrainConfig, *, writer_factory=None, preflight_programs=None):
        """`preflight_programs(cfg, graphdef, state, mesh) -> {name: per-device bytes}`: more programs the
        memory preflight compiles and checks with the update (lrmq.train passes `lrmq.aot.rollout_memory`)."""
        self.cfg = cfg
        self.preflight_programs = preflight_programs
        compile_cache.enable(cfg.run.compile_cache)
        self.run_dir = paths.resolve(cfg.run.out_dir)  # local: absolute path; or a URL (gs://...)
        created = not paths.is_url(self.run_dir) and not os.path.exists(self.run_dir)
        paths.ensure_dir(self.run_dir)
        # one training per run dir (process 0 holds it for the whole multi-process run)
        self.lock = RunDirLock(self.run_dir)
        if jax.process_index() == 0:
            self.lock.acquire()
        try:
            self.mesh = make_mesh(MeshConfig(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor))
            self._check_mesh()
            self._init_policy()
            self._init_updates()
            self._init_engines()
            self._init_run(writer_factory)
        except BaseException:  # a refused start (bad input, an interrupt): no lock of a dead process is left,
            self.lock.release()  # nor the run dir this start made while nothing was written into it
            if created and os.path.isdir(self.run_dir) and not os.listdir(self.run_dir):
                os.rmdir(self.run_dir)
            raise

    # ------------------------------------------------------------------ setup helpers
    def _init_policy(self):
        """The tokenizer, the datasets, the policy split into trainable / rest, and its optimizer."""
        cfg = self.cfg
        ckpt = check_checkpoint(cfg.model.checkpoint, "model.checkpoint")  # not reported as a missing tokenizer
        self.tokenizer = Tokenizer.from_dir(ckpt)
        self.train_rows, self.eval_rows = load_datasets(cfg)
        with jax.set_mesh(self.mesh):
            model = build_model(cfg, self.mesh)
        self.model_cfg = model.cfg
        check_position_limit(model.cfg, cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens,
                             "rollout.max_prompt_len + rollout.max_new_tokens")
        self.graphdef, self.trainable, self.rest = nnx.split(model, trainable_filter(cfg.quant.mode), ...)
        self.tx, self.schedule = make_optimizer(cfg)
        with jax.set_mesh(self.mesh):
            self.opt_state = init_opt_state(self.tx, self.trainable, self.mesh)

    def _init_updates(self):
        """The update's programs (`UpdatePrograms`: compiled before the first rollout for every shape an update can
        have, fixed by the config) and the frozen KL reference (algo.beta != 0)."""
        cfg = self.cfg
        shardings = tuple(jax.tree.map(lambda x: x.sharding, tree) for tree in (self.trainable, self.opt_state))
        self.updates = UpdatePrograms(self.graphdef, cfg, self.tx, shardings, self.mesh)
        self._choose_packed = packed_chooser(self.updates.shapes) if cfg.rollout.update_padding == "pack" else None
        self.ref_trainable = self._reference_params() if cfg.algo.beta != 0.0 else None

    def _init_engines(self):
        """The generation engine of the policy and, with rollout.quant, the one of its packed rollout copy."""
        cfg = self.cfg
        self.engine = Engine(None, eos_ids=self.tokenizer.eos_ids, pad_id=self.tokenizer.pad_id, graphdef=self.graphdef,
                             model_cfg=self.model_cfg, config=cfg.rollout.engine_config(), mesh=self.mesh,
                             impl=cfg.rollout.decode_attention)
        # rollout.quant: rollouts sample from a packed copy of the policy (its own engine); held-out evaluation,
        # checkpoints and exports stay with the float policy (`self.engine`)
        self.rollout_copy = self._make_rollout_copy()
        self.rollout_engine = self.engine if self.rollout_copy is None else Engine(
            None, eos_ids=self.tokenizer.eos_ids, pad_id=self.tokenizer.pad_id, graphdef=self.rollout_copy.graphdef,
            model_cfg=self.model_cfg, config=cfg.rollout.engine_config(), mesh=self.mesh,
            impl=cfg.rollout.decode_attention)
        self._steps_since_refresh = 0
        self.kv_calibration = KVCalibration(cfg.rollout.kv_scale_refresh)  # rollout.kv_scale_refresh

    def _init_run(self, writer_factory):
        """Evaluation suite, prompt pipeline, checkpoints, step counters and logs."""
        cfg = self.cfg
        # run.eval_suite's items are loaded now: missing benchmark data fails before any compute
        self.suite_eval = SuiteEval(cfg.run) if cfg.run.eval_suite else None
        self.pipeline = PromptPipeline(self.train_rows, batch_size=cfg.rollout.prompts_per_step, seed=cfg.run.seed,
                                       process_index=0, process_count=1)
        self.ckpt = RunCheckpointer(paths.join(self.run_dir, "checkpoints"), keep=cfg.run.keep_checkpoints)
        self.step = 0
        self.failed_reward_batches = 0  # consecutive
        self._stop_signal = None
        # Logs are written by process 0 only (metrics are global); other processes creating the same
        # TensorBoard dir raced in tensorboardX's exists-then-makedirs and crashed one process at start-up.
        # For a URL run dir they are written locally and mirrored up (RunLogs).
        self.logs = RunLogs(self.run_dir, enabled=jax.process_index() == 0)
        self.writer = (writer_factory or summary_writer)(self.logs.tb_dir) if self.logs.enabled else NullWriter()
        self.metrics_path = self.logs.metrics_path  # local; the run dir's own copy for a local run dir

    def _check_mesh(self):
        check_data_parallel_batch(self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size,
                                  self.cfg.optim.micro_batch_size, batch_divisor(self.mesh),
                                  f"mesh {dict(self.mesh.shape)}")

    def _reference_params(self):
        """The frozen KL reference: a copy of the initial policy, or for QLoRA the base without adapters."""
        if self.cfg.quant.mode == "qlora":
            return jax.tree.map(jnp.zeros_like, self.trainable)  # zero adapters = the frozen base, no copy
        return jax.tree.map(jnp.copy, self.trainable)

    def states(self):
        return (self.trainable, self.rest)

    # ------------------------------------------------------------------ the quantized rollout copy
    def _make_rollout_copy(self) -> RolloutCopy | None:
        r = self.cfg.rollout
        if not self.cfg.quantized_rollout:
            return None
        if (warning := rollout_quant_warning(self.cfg)) is not None:
            log.warning(warning)
        spec = RolloutQuant(r.quant, group_size=r.quant_group_size, targets=self.cfg.quant.targets,
                            merge_lora=r.lora == "merged")
        try:
            return RolloutCopy(self.graphdef, self.trainable, self.rest, spec, awq_scales=r.quant_scales == "awq",
                               mesh=self.mesh)
        except ValueError as e:
            raise ConfigError(str(e)) from e

    def rollout_states(self):
        """What rollouts sample from: the packed copy (rollout.quant) or the learner itself."""
        if self.rollout_copy is None:
            return self.states()
        return self.rollout_copy.states(self.trainable, self.rest)

    def refresh_rollout_copy(self, prompts: list[list[int]] | None = None) -> dict[str, float]:
        """Re-quantize the rollout copy when rollout.quant_refresh updates have passed since the last time (or it
        has none yet); with rollout.quant_scales=awq the scales are searched first, once, on `prompts`."""
        c, r = self.rollout_copy, self.cfg.rollout
        if c is None:
            return {}
        out = {}
        if r.quant_scales == "awq" and c.scales is None and prompts is not None:
            t0 = time.perf_counter()
            with jax.set_mesh(self.mesh):
                c.scales = awq_rollout_scales(self.graphdef, self.trainable, self.rest, calibration_blocks(prompts),
                                              c.spec)
            c.packed = None  # the RTN copy of the warm-up: re-quantize with the scales now
            out["perf/awq_search_s"] = time.perf_counter() - t0
            log.info("rollout.quant_scales=awq: scales searched on the first batch's prompts in %.1f s",
                     out["perf/awq_search_s"])
        if c.packed is None or self._steps_since_refresh >= r.quant_refresh:
            out["perf/requantize_s"] = c.refresh(self.trainable, self.rest)
            self._steps_since_refresh = 0
        return out

    # ------------------------------------------------------------------ rollout
    def _encode_prompts(self, problems: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
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

    def _generate(self, tokens, mask, key, sampling: SamplingConfig, max_new: int, *, rollout: bool = False,
                  kv_scales: KVScales | None = None) -> GenerationResult:
        """Complete every (left-padded) prompt row through the engine (`rollout`: the rollout engine, on the
        quantized copy when rollout.quant is set); sequence i samples with `fold_in(key, i)`, so results depend
        neither on rollout.generation_batch nor on the devices. kv_scales: the fp8 KV scales to write under
        (None: the call calibrates its own)."""
        prompts = [row[m > 0].tolist() for row, m in zip(tokens, mask)]
        engine, states = (self.rollout_engine, self.rollout_states()) if rollout else (self.engine, self.states())
        with jax.set_mesh(self.mesh):
            out = engine.generate(states, prompts, max_new_tokens=max_new, sampling=sampling,
                                  keys=sequence_keys(key, len(prompts)), prompt_capacity=self.cfg.rollout.max_prompt_len,
                                  kv_scales=kv_scales)
        return out

    def rollout(self, batch: dict[str, list], key) -> Rollout:
        """Sample group_size completions of each prompt of `batch`, score them and compute their advantages."""
        r, a = self.cfg.rollout, self.cfg.algo
        g = r.group_size
        problems = [p for p in batch["problem"] for _ in range(g)]
        answers = [str(x) for x in batch["answer"] for _ in range(g)]
        tokens, mask, truncated = self._encode_prompts(problems)
        copy_stats = self.refresh_rollout_copy([row[m > 0].tolist() for row, m in zip(tokens[::g], mask[::g])])
        t0 = time.perf_counter()
        sampling = SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        kv_scales = self.kv_calibration.for_rollout()
        out = self._generate(tokens, mask, key, sampling, r.max_new_tokens, rollout=True, kv_scales=kv_scales)
        comp, logp, lengths = out.tokens, out.logprobs, out.lengths
        t_gen = time.perf_counter() - t0
        kv_stats = self.kv_calibration.after_rollout(kv_scales, out)
        texts = [self.tokenizer.decode(comp[i, : lengths[i]].tolist()) for i in range(len(problems))]
        rewards, parts, info = self.score(texts, answers, lengths)
        adv = np.asarray(compute_advantages(a.advantage, rewards, g, eps=a.adv_eps,
                                            std_ddof=a.std_ddof, scale=a.scale_rewards))
        rb = build_batch(tokens, mask, comp, lengths, logp, adv, rewards)
        cut = truncated_rows(comp, lengths, self.tokenizer.eos_ids)
        if a.mask_truncated_completions:
            rb = mask_rows(rb, cut)
        completions = [
            {"prompt": self.tokenizer.decode([int(t) for t, m in zip(tokens[i], mask[i]) if m]),
             "completion": texts[i], "answer": answers[i], "reward": float(rewards[i]),
             "rewards": {k: float(v[i]) for k, v in parts.items()}, "advantage": float(adv[i]),
             "tokens": int(lengths[i]), "truncated": bool(cut[i])}
            for i in range(len(texts))]
        stats = {
            **reward_stats(rewards, parts, info, g),
            "completion/length_mean": float(lengths.mean()),
            "completion/truncated_rate": float(np.mean(cut)),
            "prompt/truncated": float(truncated),
            "perf/rollout_tokens_per_s": float(lengths.sum() / max(t_gen, 1e-9)),
            "perf/rollout_s": t_gen,
            "rollout/weight_bytes": float(self._rollout_weight_bytes()),
            **copy_stats,
            **kv_stats,
        }
        failed = bool(info.get("failed")) or int(info.get("timeouts", 0)) >= len(texts)
        return Rollout(rb, stats, completions, failed)

    def _rollout_weight_bytes(self) -> int:
        """Bytes of the weights the rollout reads (the packed copy and the policy arrays it shares, or the policy)."""
        if self.rollout_copy is not None:
            return sum(self.rollout_copy.weight_bytes(self.trainable, self.rest).values())
        return sum(int(np.prod(a.shape, dtype=np.int64)) * a.dtype.itemsize for a in jax.tree.leaves(self.states()))

    def score(self, texts: list[str], answers: list[str], lengths) -> tuple[np.ndarray, dict, dict]:
        """(training reward [N], {reward name: its unweighted values}, the main reward's info)."""
        return weighted_rewards(self.cfg.algo, texts, answers, lengths, self.cfg.rollout.max_new_tokens,
                                score_fn=score_completions)

    # ------------------------------------------------------------------ update
    def update_batch(self, rb: RolloutBatch) -> UpdateBatch:
        """The host update batch in the layout rollout.update_padding asks for."""
        r = self.cfg.rollout
        if r.update_padding == "pack":
            return packed_batch(rb, n_micro=micro_batch_count(self.cfg, rb.num_sequences),
                                groups=batch_divisor(self.mesh), choose_shape=self._choose_packed,
                                width=r.max_prompt_len + r.max_new_tokens)
        return bucketed_batch(rb) if r.update_padding == "bucket" else padded_batch(rb)

    def update(self, rb: RolloutBatch) -> dict[str, float]:
        """The algo.num_iterations optimizer updates of one rollout batch; returns train/* and perf/* metrics."""
        host = self.update_batch(rb)
        with jax.set_mesh(self.mesh):
            batch = jax.tree.map(lambda v: jax.device_put(v, batch_sharding(self.mesh, v.ndim)), host)
            ref_logp = None
            if self.cfg.algo.beta != 0.0:
                ref_logp = self.updates.reference(batch)(self.ref_trainable, self.rest, batch)
                ref_logp = jax.device_put(ref_logp, batch_sharding(self.mesh, 2))
            t0 = time.perf_counter()
            metrics = self._run_updates(batch, ref_logp)
        dt = time.perf_counter() - t0
        metrics["perf/train_tokens_per_s"] = host.token_count() * self.cfg.algo.num_iterations / max(dt, 1e-9)
        metrics["perf/update_s"] = dt
        self._steps_since_refresh += 1
        self.kv_calibration.after_update()
        metrics["perf/update_width"] = float(host.tokens.shape[1])
        metrics["perf/update_rows"] = float(host.tokens.shape[0])  # packed: rows of several sequences
        return metrics

    def _run_updates(self, batch: UpdateBatch, ref_logp) -> dict[str, float]:
        """One compiled update per entry of `old_logprob_sources`; the metrics of the last, with the sampler/learner
        mismatch of the first (the learner before any update of this batch)."""
        metrics, mismatch = {}, None
        for old_from in self.updates.sources:
            step = self.updates.step(old_from, batch, ref_logp)
            self.trainable, self.opt_state, metrics = step(self.trainable, self.rest, self.opt_state, batch, ref_logp)
            if mismatch is None:
                mismatch = {k: v for k, v in metrics.items() if k.startswith("mismatch/")}
            if old_from == "own":  # on-policy: its log-probs are pi_old of the later updates
                old = jax.device_put(metrics.pop("logp") * batch.completion_mask, batch_sharding(self.mesh, 2))
                batch = batch.replace(old_logp=old)
        metrics.update(mismatch or {})
        return {f"train/{k}": float(v) for k, v in jax.device_get(metrics).items()}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, limit: int | None = None) -> dict[str, float]:
        """Held-out accuracy, greedy and sampled at the rollout temperature (what GRPO optimizes)."""
        rows = self.eval_rows[: (limit or self.cfg.run.eval_size)]
        if not rows:
            return {}
        div = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        rows = rows[: max(div, len(rows) // div * div)]
        tokens, mask, _ = self._encode_prompts([r["problem"] for r in rows])
        answers = [str(r["answer"]) for r in rows]
        r = self.cfg.rollout
        out: dict[str, float] = {}
        for name, sampling in sorted(self._samplings().items()):
            gen = self._generate(tokens, mask, jax.random.key(self.cfg.run.seed + 7919), sampling, r.max_new_tokens)
            comp, lengths = gen.tokens, gen.lengths
            texts = [self.tokenizer.decode(comp[i, : lengths[i]].tolist()) for i in range(len(rows))]
            rewards, info = score_completions(texts, answers, self.cfg.algo.reward,
                                              timeout_s=self.cfg.algo.reward_timeout_s)
            out[f"eval/{name}_accuracy"] = float(np.mean(info["correct"]))
            out[f"eval/{name}_reward"] = float(rewards.mean())
            out[f"eval/{name}_format_rate"] = float(np.mean(info["formatted"]))
        out["eval/accuracy"] = out["eval/sampled_accuracy"]
        if self.suite_eval is not None:
            out.update(self.suite_eval(self.states(), self.tokenizer, self.engine,
                                       self.model_cfg.max_position_embeddings, self.cfg.algo.reward_timeout_s))
        return out

    # ------------------------------------------------------------------ ahead-of-time compiles and pre-flight
    def compile_updates(self) -> dict[str, int]:
        """Compile the update for every shape an update can have (and the reference log-probs when algo.beta != 0)
        now, before the first rollout (`UpdatePrograms.compile`); `update` runs those programs, and later steps
        compile no update. Returns {program name: per-device bytes} of the largest shape."""
        return self.updates.compile(self.trainable, self.rest, self.opt_state, self.ref_trainable,
                                    progress=self.cfg.run.progress)

    def _samplings(self) -> dict[str, SamplingConfig]:
        """The rollout's sampling, and greedy when held-out evaluation decodes greedily too."""
        r = self.cfg.rollout
        out = {"sampled": SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)}
        if self.cfg.run.eval_greedy and self.cfg.run.eval_size:
            out["greedy"] = SamplingConfig(greedy=True)
        return out

    def compile_rollouts(self) -> None:
        """Compile the generation engine's programs (every row bucket's prefill and decode, per sampling) before
        the first rollout (`Engine.warmup`): later rollouts and evaluations compile nothing."""
        r = self.cfg.rollout
        t0 = time.perf_counter()
        sizes = dict(n_requests=r.prompts_per_step * r.group_size, prompt_len=r.max_prompt_len, max_new=r.max_new_tokens)
        samplings = self._samplings()
        with jax.set_mesh(self.mesh):
            if self.rollout_copy is not None:  # the copy's engine samples the rollouts; the policy's evaluates
                self.refresh_rollout_copy()
                self.rollout_engine.warmup(self.rollout_states(), sampling=samplings["sampled"], **sizes)
                if not (self.cfg.run.eval_size or self.cfg.run.eval_suite):
                    samplings = {}
            for sampling in samplings.values():
                self.engine.warmup(self.states(), sampling=sampling, **sizes)
        log.info("compiled the rollout engine's programs in %.1f s", time.perf_counter() - t0)

    def size_kv_pool(self, update_bytes: int) -> None:
        """rollout.kv_pages = 0: cap the engines' KV pool to rollout.kv_memory_fraction of the device's memory
        (run.hbm_limit_gib when set) less the update's per-device total `update_bytes` (weights, optimizer state,
        its peak), as vLLM's gpu_memory_utilization; the worst case is the cap and preemption covers the rest. No
        cap where the device's memory is unknown (CPU without run.hbm_limit_gib)."""
        r = self.cfg.rollout
        if r.kv_pages:
            return
        hbm = self.cfg.run.hbm_limit_gib * GIB if self.cfg.run.hbm_limit_gib else hbm_bytes(self.mesh.devices.flat[0])
        budget = pool_budget(hbm, update_bytes, r.kv_memory_fraction)
        for engine in {id(e): e for e in (self.engine, self.rollout_engine)}.values():
            engine.limit_pool(budget)
        if budget:
            info = pool_info(self.rollout_engine.config, self.model_cfg, self.mesh, r.prompts_per_step * r.group_size,
                             r.max_prompt_len, r.max_new_tokens)
            log.info("KV pool: %d pages of %d tokens (worst case %d), %.2f GiB per device (%.0f%% of %.2f GiB less "
                     "the update's %.2f GiB)", info["pages"], r.page_size, info["worst_case_pages"],
                     info["bytes_per_device"] / GIB, 100 * r.kv_memory_fraction, hbm / GIB, update_bytes / GIB)

    def preflight(self) -> dict | None:
        """Compile every update shape (`compile_updates`); on accelerators (run.preflight) also compile
        `preflight_programs` (the rollout) and raise (naming sizes) when any needs more memory per device than it
        has, before any slice time goes into rollouts."""
        mem = self.compile_updates()
        r = self.cfg.run
        on_accel = self.mesh.devices.flat[0].platform != "cpu"
        check = r.preflight == "on" or (r.preflight == "auto" and on_accel)
        mem = {"train_step": mem["train_step"]}
        if check:  # an update past the budget is refused before any rollout program is compiled
            check_budget(mem, self.mesh.devices.flat[0], r.hbm_limit_gib, log=log.info)
        self.size_kv_pool(mem["train_step"])
        self.compile_rollouts()
        if not check:
            return None
        if self.preflight_programs is not None:
            engine = self.rollout_engine.config
            if self.rollout_copy is None:
                mem.update(self.preflight_programs(self.cfg, self.graphdef, self.states(), self.mesh, engine))
            else:
                mem.update(self.preflight_programs(self.cfg, self.rollout_copy.graphdef,
                                                   self.rollout_copy.states(self.trainable, self.rest), self.mesh,
                                                   engine))
        check_budget(mem, self.mesh.devices.flat[0], r.hbm_limit_gib, log=log.info)
        return mem

    # ------------------------------------------------------------------ checkpoints
    def save(self):
        # (the packed shape of a batch depends on the batch alone, so a resumed run matches an uninterrupted one)
        self.ckpt.save(self.step, {"trainable": self.trainable, "rest": self.rest, "opt": self.opt_state},
                       {"step": self.step, "data": self.pipeline.get_state()})
        self.logs.sync(force=True)  # URL run dir: the logs there are never behind the newest checkpoint

    def maybe_restore(self) -> bool:
        latest = self.ckpt.latest_step()
        if latest is None:
            return False
        with jax.set_mesh(self.mesh):
            tree, meta = self.ckpt.restore(latest, {"trainable": self.trainable, "rest": self.rest,
                                                    "opt": self.opt_state})
        self.trainable, self.rest, self.opt_state = tree["trainable"], tree["rest"], tree["opt"]
        self.pipeline.set_state(meta["data"])
        self.step = int(meta["step"])
        self.logs.truncate_after(self.step)
        log.info("resumed from step %d (%s)", self.step, self.ckpt.directory)
        return True

    def export_policy(self, out_dir: str):
        """HF export of the current policy. Every process must call it: sharded parameters are gathered
        tensor by tensor (collectives), and process 0 writes."""
        model = nnx.merge(self.graphdef, self.trainable, self.rest)
        if self.cfg.quant.mode != "none":
            model = export_float_model(model)
        save_hf_model(model, out_dir, tokenizer_from=resolve_checkpoint(self.cfg.model.checkpoint), overwrite=True)

    def export_quantized_policy(self, out_dir: str) -> str | None:
        """QAT runs: the policy as it was trained to run, its weights quantized by the scheme's own quantizer
        (`lrmq.ptq.qat_export`: packed for lrmq's kernels and compressed-tensors), beside the float final_policy.
        Returns the directory, or None where the scheme or the run has none (logged)."""
        q = self.cfg.quant
        if q.qat_scheme == "w8a8":
            log.warning("quant.qat_scheme=w8a8 quantizes activations at run time: no quantized export is written "
                        "(final_policy holds the float master weights)")
            return None
        if jax.process_count() > 1:
            log.warning("%s is not written by a multi-process run (the exporters write from one host); "
                        "final_policy holds the float master weights", out_dir)
            return None
        model = nnx.merge(self.graphdef, self.trainable, self.rest)
        return export_qat_policy(model, out_dir, scheme=q.qat_scheme, group_size=q.qat_group_size,
                                 tokenizer_from=resolve_checkpoint(self.cfg.model.checkpoint))

    # ------------------------------------------------------------------ loop
    def _on_signal(self, signum, frame):
        self._stop_signal = signum
        log.warning("signal %d received: finishing this step, saving a checkpoint, then exiting", signum)

    def log_completions(self, step: int, records: list[dict]):
        """All of a step's completions to completions.jsonl, the first run.log_completions to TensorBoard."""
        if jax.process_index() != 0 or not records:
            return
        if self.cfg.run.completions_jsonl:
            self.logs.append_completions([{"step": step, **r} for r in records])
        shown = records[: self.cfg.run.log_completions]
        if shown:
            self.writer.add_text("completions", "\n\n---\n\n".join(completion_markdown(r) for r in shown), step)

    def log_metrics(self, step: int, metrics: dict[str, float]):
        if jax.process_index() != 0:  # every process holds the same (global) metrics
            return
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # before the append: its sync also copies tb/ up for a URL run dir
        self.logs.append({"step": step, **metrics})

    def train(self, stop_after: int | None = None) -> dict[str, float]:
        """Train to run.steps (or `stop_after` more steps, or a signal) from the newest checkpoint; returns the
        last step's metrics (with the final evaluation's)."""
        cfg = self.cfg
        try:
            self._start()
        except BaseException:  # a refused resume, a preflight that does not fit, an interrupt: no lock is left
            self.lock.release()
            raise
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        bar = progress_bar(cfg.run.steps, self.step, enabled=cfg.run.progress)
        last: dict[str, float] = {}
        base_key = jax.random.key(cfg.run.seed)
        ran = 0
        try:
            while self.step < cfg.run.steps:
                last = self._run_step(jax.random.fold_in(base_key, self.step))
                ran += 1
                bar.update(1)
                bar.set_postfix(reward=f"{last['reward/mean']:.3f}", acc=f"{last['reward/accuracy']:.2f}",
                                len=f"{last['completion/length_mean']:.0f}", kl=f"{last.get('train/kl', 0):.3g}")
                if self.step % cfg.run.save_every == 0 or self.step == cfg.run.steps:
                    self.save()
                if self._stop_signal is not None or (stop_after and ran >= stop_after):
                    if self.step % cfg.run.save_every and self.step != cfg.run.steps:
                        self.save()
                    self.ckpt.wait()
                    return last
            bar.close()  # the final evaluation's and the exports' messages (w8a8: no quantized export) on their own lines
            return self._finish(last)
        finally:
            bar.close()
            for s, h in old.items():
                signal.signal(s, h)
            self.writer.flush()
            self.logs.sync(force=True)
            self.lock.release()

    def _start(self) -> None:
        """Resume from the newest checkpoint (or start: the initial export and evaluation), write config.yaml and
        compile every program (`preflight`)."""
        try:
            resumed = self.maybe_restore()
        except Exception as e:  # the checkpoints describe another model / optimizer: keep their config.yaml
            raise ConfigError(f"cannot resume from {self.ckpt.directory}: its checkpoints do not fit this config"
                              f"{config_diff(self.run_dir, self.cfg)} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                              "config.yaml was left as it was: rerun with that config, or use another "
                              "run.out_dir") from e
        if jax.process_index() == 0:  # one writer: object stores throttle concurrent writes to one object
            save_config(self.cfg, paths.join(self.run_dir, "config.yaml"))
        self.preflight()
        if not resumed:
            if self.cfg.run.export_hf:  # every process: the export gathers the sharded parameters
                self.export_policy(paths.join(self.run_dir, "initial_policy"))  # W_before for QuantLRM
            self.logs.reset()
            ev = self.evaluate()
            if ev:
                self.log_metrics(0, ev)

    def _run_step(self, key) -> dict[str, float]:
        """One step: a rollout, its updates (none when the reward failed), the logs; returns the step's metrics."""
        cfg = self.cfg
        t0 = time.perf_counter()
        ro = self.rollout(next(self.pipeline), key)
        self._check_reward(ro)
        m = {} if ro.reward_failed else self.update(ro.batch)  # never train on a batch the reward never scored
        self._check_finite(self.step + 1, m, ro.batch)
        self.step += 1
        m.update(ro.stats)
        m["optim/lr"] = float(self.schedule(max(self.step - 1, 0) * cfg.algo.num_iterations))
        m["perf/step_s"] = time.perf_counter() - t0
        if cfg.run.eval_every and self.step % cfg.run.eval_every == 0 and self.step < cfg.run.steps:
            m.update(self.evaluate())
        self.log_metrics(self.step, m)
        self.log_completions(self.step, ro.completions)
        return m

    def _check_reward(self, ro: Rollout) -> None:
        """Count consecutive failed reward batches; at algo.max_failed_reward_batches save and stop."""
        self.failed_reward_batches = self.failed_reward_batches + 1 if ro.reward_failed else 0
        limit = self.cfg.algo.max_failed_reward_batches
        if ro.reward_failed and limit and self.failed_reward_batches >= limit:
            self.save()
            self.ckpt.wait()
            raise TrainingStopped(
                f"step {self.step + 1}: {self.failed_reward_batches} consecutive reward batches in which every "
                f"comparison failed or timed out (algo.max_failed_reward_batches={limit}); checkpoint of step "
                f"{self.step} saved. Raise algo.reward_timeout_s / algo.reward_budget_s, or check the reward")

    def _finish(self, last: dict[str, float]) -> dict[str, float]:
        """After the last step: the final evaluation (added to `last`) and the exports."""
        self.ckpt.wait()
        final = self.evaluate()
        if final:
            self.log_metrics(self.step, final)
            last.update(final)
        if self.cfg.run.export_hf:
            self.export_policy(paths.join(self.run_dir, "final_policy"))
            if self.cfg.quant.mode == "qat":
                self.export_quantized_policy(paths.join(self.run_dir, QUANTIZED_POLICY))
        return last

    def _check_finite(self, step: int, metrics: dict[str, float], rb: RolloutBatch) -> None:
        """Stop before a non-finite update can be logged as fine or saved over a good checkpoint."""
        bad = first_non_finite(metrics, rb.behaviour_logp)
        if bad:
            latest = self.ckpt.latest_step()
            raise TrainingStopped(
                f"step {step}: non-finite {bad} ({metrics.get(bad, 'nan')}); the update was not saved"
                + (f", the checkpoint of step {latest} is intact" if latest is not None else "")
                + ". Lower optim.lr or check the model and data")
