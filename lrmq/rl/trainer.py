"""The GRPO / Dr.GRPO training loop: a `Sampler` (rollouts: generation, rewards, advantages) and a `Learner` (the
updates), each on its mesh (rollout.placement), with nothing between them but `WeightVersion`s one way and
`Rollout`s the other (`lrmq.rl.messages`). `GRPOTrainer` is the thin loop: it takes each batch's rollout from the
`RolloutStream` (`lrmq.rl.loop`: inline, or a thread running up to rollout.max_staleness versions ahead), has the
learner update on it, publishes the new version, and keeps the run: checkpoints (with the pending rollouts),
logs, evaluation, exports, signals.

Multi-host: every process iterates the same global prompt batch; generation and the update run sharded over the
global meshes; completions are gathered so each host scores all of them (rewards are cheap next to generation) and
then places its own shards of the train batch.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import jax

from lrmq import compile_cache, paths
from lrmq.checkpoint.load import check_checkpoint
from lrmq.configlib import ConfigError, check_data_parallel_batch, save_config
from lrmq.data.pipeline import PromptPipeline
from lrmq.generation.kv_pool import pool_budget
from lrmq.model.config import check_position_limit
from lrmq.ptq.qat_export import QUANTIZED_POLICY
from lrmq.rl.config import TrainConfig
from lrmq.rl.evaluation import SuiteEval
from lrmq.rl.learner import Learner
from lrmq.rl.loop import RolloutStream, Schedule
from lrmq.rl.messages import Rollout, WeightVersion
from lrmq.rl.pending import pending_from_meta, pending_to_meta
from lrmq.rl.placement import describe, is_split, placement_meshes, transfer
from lrmq.rl.precompile import GIB, check_budget, hbm_bytes
from lrmq.rl.run_checks import config_diff, first_non_finite
from lrmq.rl.run_lock import RunDirLock
from lrmq.rl.run_state import NullWriter, RunCheckpointer, RunLogs, completion_markdown, progress_bar
from lrmq.rl.sampler import Sampler
from lrmq.rl.setup import build_model, load_datasets
from lrmq.sharding import batch_divisor, bytes_per_device
from lrmq.tensorboard import summary_writer
from lrmq.tokenizer import Tokenizer

log = logging.getLogger("lrmq.train")

__all__ = ["GRPOTrainer", "NullWriter", "Rollout", "TrainingStopped"]


class TrainingStopped(RuntimeError):
    """Training cannot go on (a non-finite metric, rewards that keep failing); the message says why and what
    was kept."""


class GRPOTrainer:
    def __init__(self, cfg: TrainConfig, *, writer_factory=None, preflight_programs=None):
        """`preflight_programs(cfg, graphdef, state, mesh, engine) -> {name: per-device bytes}`: more programs the
        memory preflight compiles and checks with the update (lrmq.train passes `lrmq.aot.rollout_memory`)."""
        self.cfg = cfg
        self.preflight_programs = preflight_programs
        compile_cache.enable(cfg.run.compile_cache)
        self.run_dir = paths.resolve(cfg.run.out_dir)  # local: absolute path; or a URL (gs://...)
        created = not paths.is_url(self.run_dir) and not os.path.exists(self.run_dir)
        paths.ensure_dir(self.run_dir)
        self.lock = RunDirLock(self.run_dir)  # one training per run dir (process 0 holds it for the whole run)
        if jax.process_index() == 0:
            self.lock.acquire()
        try:
            self.mesh, self.sampler_mesh = placement_meshes(cfg)
            self._check_mesh()
            self._init_policy()
            self._init_run(writer_factory)
        except BaseException:  # a refused start (bad input, an interrupt): no lock of a dead process is left,
            self.lock.release()  # nor the run dir this start made while nothing was written into it
            if created and os.path.isdir(self.run_dir) and not os.listdir(self.run_dir):
                os.rmdir(self.run_dir)
            raise

    # ------------------------------------------------------------------ setup
    def _check_mesh(self):
        r = self.cfg.rollout
        check_data_parallel_batch(r.prompts_per_step * r.group_size, self.cfg.optim.micro_batch_size,
                                  batch_divisor(self.mesh), f"mesh {dict(self.mesh.shape)}")
        if is_split(self.mesh, self.sampler_mesh):
            log.info("rollout.placement=%s", describe(self.mesh, self.sampler_mesh))

    def _init_policy(self):
        """The tokenizer, the datasets and the learner (the policy, its optimizer and its compiled updates)."""
        cfg = self.cfg
        ckpt = check_checkpoint(cfg.model.checkpoint, "model.checkpoint")  # not reported as a missing tokenizer
        self.tokenizer = Tokenizer.from_dir(ckpt)
        self.train_rows, self.eval_rows = load_datasets(cfg)
        with jax.set_mesh(self.mesh):
            model = build_model(cfg, self.mesh)
        cfg.check_model(model.cfg)
        check_position_limit(model.cfg, cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens,
                             "rollout.max_prompt_len + rollout.max_new_tokens")
        self.learner = Learner(cfg, model, self.mesh)
        self._sampler: Sampler | None = None  # made by the preflight: its KV pool is sized after the update's

    def _init_run(self, writer_factory):
        """Evaluation suite, prompt pipeline, checkpoints, step counters and logs."""
        cfg = self.cfg
        # run.eval_suite's items are loaded now: missing benchmark data fails before any compute
        self.suite_eval = SuiteEval(cfg.run) if cfg.run.eval_suite else None
        self.pipeline = PromptPipeline(self.train_rows, batch_size=cfg.rollout.prompts_per_step, seed=cfg.run.seed,
                                       process_index=0, process_count=1)
        self.ckpt = RunCheckpointer(paths.join(self.run_dir, "checkpoints"), keep=cfg.run.keep_checkpoints)
        self.schedule = Schedule(cfg.rollout.max_staleness, cfg.rollout.sync_every, cfg.rollout.min_ess)
        self.step = 0
        self.failed_reward_batches = 0  # consecutive
        self.dropped_stale = 0  # sequences, since the last logged step
        self._pending: list[Rollout] = []
        self._stop_signal = None
        # Logs are written by process 0 only (metrics are global); other processes creating the same
        # TensorBoard dir raced in tensorboardX's exists-then-makedirs and crashed one process at start-up.
        # For a URL run dir they are written locally and mirrored up (RunLogs).
        self.logs = RunLogs(self.run_dir, enabled=jax.process_index() == 0)
        self.writer = (writer_factory or summary_writer)(self.logs.tb_dir) if self.logs.enabled else NullWriter()
        self.metrics_path = self.logs.metrics_path  # local; the run dir's own copy for a local run dir

    def _make_sampler(self, update_bytes: int) -> Sampler:
        """The sampler with its engines' whole config: with rollout.kv_pages = 0 the KV pool is capped to
        rollout.kv_memory_fraction of the device's memory (run.hbm_limit_gib when set) less what else lives on the
        sampler's devices: the update (colocated) or the sampler's own weights (split), as vLLM's
        gpu_memory_utilization; no cap where the device's memory is unknown (CPU without run.hbm_limit_gib)."""
        r, lr = self.cfg.rollout, self.learner
        device = self.sampler_mesh.devices.flat[0]
        hbm = self.cfg.run.hbm_limit_gib * GIB if self.cfg.run.hbm_limit_gib else hbm_bytes(device)
        split = is_split(self.mesh, self.sampler_mesh)
        budget, reserved = 0, update_bytes
        moe = bool(lr.model_cfg.num_experts)  # the rollouts record each token's experts
        make = lambda engine: Sampler(self.cfg, self.tokenizer, policy_graphdef=lr.graphdef,
                                      rollout_graphdef=lr.rollout_graphdef, model_cfg=lr.model_cfg,
                                      mesh=self.sampler_mesh, engine=engine, eval_rows=self.eval_rows,
                                      suite_eval=self.suite_eval)
        if not r.kv_pages:
            if split:  # the sampler's own weights in its decode layout
                probe = make(r.engine_config(moe=moe))
                abstract = lr.rollout_abstract()
                reserved = bytes_per_device(jax.tree.map(
                    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                    probe.shardings(abstract)))
            budget = pool_budget(hbm, reserved, r.kv_memory_fraction)
        sampler = make(r.engine_config(budget, moe=moe))
        if budget:
            sampler.log_pool(hbm, reserved, "the sampler's weights" if split else "the update's")
        return sampler

    @property
    def sampler(self) -> Sampler:
        """The sampler; made by the preflight with its KV pool sized to what the update leaves, or on first use
        before one (tests, benchmarks: an uncapped pool)."""
        if self._sampler is None:
            self._sampler = self._make_sampler(0)
        return self._sampler

    # ------------------------------------------------------------------ weights between the roles
    def publish(self) -> tuple[WeightVersion, dict[str, float]]:
        """The learner's current weights as a WeightVersion in the sampler's decode layout. Fresh buffers unless
        the loop is synchronous on one mesh (the rollout is done with them before the next update donates them)."""
        copy = is_split(self.mesh, self.sampler_mesh) or self.cfg.rollout.max_staleness > 0
        shardings = self.sampler.shardings(self.learner.rollout_abstract())
        with jax.set_mesh(self.mesh):
            return self.learner.publish(shardings, copy=copy)

    def rollout(self, batch: dict[str, list], key, index: int | None = None) -> Rollout:
        """One rollout of `batch` from the learner's current weights outside the loop (tests, benchmarks; the
        loop's own come from its RolloutStream)."""
        version, stats = self.publish()
        return self.sampler.rollout(batch, key, self.step if index is None else index, version, stats)

    def eval_states(self):
        """The float policy for evaluation, on the sampler's mesh."""
        states = self.learner.states()
        if not is_split(self.mesh, self.sampler_mesh):
            return states
        return transfer(states, self.sampler.engine.decode_shardings(states))

    # ------------------------------------------------------------------ ahead-of-time compiles and pre-flight
    def compile_updates(self) -> dict[str, int]:
        """Compile the update for every shape it can have (and the reference log-probs when algo.beta != 0) before
        the first rollout; {program name: per-device bytes} of the largest shape."""
        return self.learner.compile(progress=self.cfg.run.progress)

    def preflight(self) -> dict | None:
        """Compile every update shape; make the sampler (its KV pool sized to what the update leaves) and compile its
        programs; on accelerators (run.preflight) also compile `preflight_programs` (the rollout) and raise (naming
        sizes) when any needs more memory per device than it has, before any slice time goes into rollouts."""
        mem = {"train_step": self.compile_updates()["train_step"]}
        r = self.cfg.run
        on_accel = self.mesh.devices.flat[0].platform != "cpu"
        check = r.preflight == "on" or (r.preflight == "auto" and on_accel)
        if check:  # an update past the budget is refused before any rollout program is compiled
            check_budget(mem, self.mesh.devices.flat[0], r.hbm_limit_gib, log=log.info)
        self._sampler = self._make_sampler(mem["train_step"])
        version, stats = self.publish()
        self.sampler.warmup(version, self.eval_states())
        self._first_version = (version, {k: v for k, v in stats.items() if k.startswith("rollout/")})
        if not check:
            return None
        if self.preflight_programs is not None:
            mem.update(self.preflight_programs(self.cfg, self.learner.rollout_graphdef, version.states,
                                               self.sampler_mesh, self.sampler.rollout_engine.config))
        check_budget(mem, self.sampler_mesh.devices.flat[0], r.hbm_limit_gib, log=log.info)
        return mem

    # ------------------------------------------------------------------ checkpoints
    def save(self, pending: list[Rollout] = ()):
        """A checkpoint of the learner, the data order and the rollouts sampled ahead (`pending`)."""
        meta = {"step": self.step, "data": self.pipeline.get_state(), "version": self.learner.version,
                "pending": pending_to_meta(pending)}
        self.ckpt.save(self.step, self.learner.checkpoint_tree(), meta)
        self.logs.sync(force=True)  # URL run dir: the logs there are never behind the newest checkpoint

    def maybe_restore(self) -> bool:
        latest = self.ckpt.latest_step()
        if latest is None:
            return False
        with jax.set_mesh(self.mesh):
            tree, meta = self.ckpt.restore(latest, self.learner.checkpoint_tree())
        self.step = int(meta["step"])
        self.learner.restore(tree, int(meta.get("version", self.step)))
        self.pipeline.set_state(meta["data"])
        self._pending = pending_from_meta(meta.get("pending", []))
        self.logs.truncate_after(self.step)
        log.info("resumed from step %d (%s)%s", self.step, self.ckpt.directory,
                 f", {len(self._pending)} rollout(s) sampled ahead" if self._pending else "")
        return True

    def export_policy(self, out_dir: str):
        self.learner.export_policy(out_dir)

    def export_quantized_policy(self, out_dir: str) -> str | None:
        return self.learner.export_quantized_policy(out_dir)

    # ------------------------------------------------------------------ logs
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

    def evaluate(self, limit: int | None = None) -> dict[str, float]:
        """Held-out accuracy of the current policy, greedy and sampled at the rollout temperature."""
        return self.sampler.evaluate(self.eval_states(), limit)

    # ------------------------------------------------------------------ the loop
    def train(self, stop_after: int | None = None) -> dict[str, float]:
        """Train to run.steps (or `stop_after` more steps, or a signal) from the newest checkpoint; returns the
        last step's metrics (with the final evaluation's)."""
        try:
            self._start()
        except BaseException:  # a refused resume, a preflight that does not fit, an interrupt: no lock is left
            self.lock.release()
            raise
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        bar = progress_bar(self.cfg.run.steps, self.step, enabled=self.cfg.run.progress)
        stream = self._open_stream()
        try:
            last = self._loop(stream, bar, stop_after)
            if self.step == self.cfg.run.steps:
                bar.close()  # the final evaluation's and the exports' messages on their own lines
                return self._finish(last)
            return last
        finally:
            stream.close()
            bar.close()
            for s, h in old.items():
                signal.signal(s, h)
            self.writer.flush()
            self.logs.sync(force=True)
            self.lock.release()

    def _open_stream(self) -> RolloutStream:
        """The rollouts of the remaining steps, the pending ones restored first (a stale one is dropped, counted
        and sampled anew from its prompts); the current version published."""
        key = jax.random.key(self.cfg.run.seed)
        stale = [r for r in self._pending if self.schedule.stale(r)]
        self.dropped_stale += sum(r.batch.num_sequences for r in stale)
        batches = {r.index: r.prompts for r in stale}
        self._sync_stats: dict[int, dict] = {}

        def produce(index: int, version: WeightVersion) -> Rollout:
            batch = batches.pop(index) if index in batches else next(self.pipeline)
            return self.sampler.rollout(batch, jax.random.fold_in(key, index), index, version,
                                        self._sync_stats.pop(version.version, None))

        stream = RolloutStream(produce, self.schedule, start=self.step, end=self.cfg.run.steps,
                               threaded=self.cfg.rollout.max_staleness > 0,
                               pending=[r for r in self._pending if not self.schedule.stale(r)], floor=self.learner.version)
        self._pending = []
        version, stats = self._first_version
        if self.learner.needs_calibration():  # rollout.quant_scales=awq: on the first batch's prompts, then re-pack
            first = batches.setdefault(self.step, next(self.pipeline))
            stats = self.learner.calibrate(self.sampler.calibration_prompts(first))
            version, more = self.publish()
            stats.update(more)
        if self.schedule.publishes(self.learner.version):
            self._publish(stream, version, stats)
        return stream

    def _publish(self, stream: RolloutStream, version: WeightVersion, stats: dict[str, float]) -> None:
        self._sync_stats[version.version] = stats
        stream.publish(version)

    def _loop(self, stream: RolloutStream, bar, stop_after: int | None) -> dict[str, float]:
        ran, last = 0, {}
        while self.step < self.cfg.run.steps:
            last = self._run_step(stream)
            ran += 1
            bar.update(1)
            bar.set_postfix(reward=f"{last['reward/mean']:.3f}", acc=f"{last['reward/accuracy']:.2f}",
                            len=f"{last['completion/length_mean']:.0f}", kl=f"{last.get('train/kl', 0):.3g}")
            stopping = self._stop_signal is not None or bool(stop_after and ran >= stop_after)
            if self.step % self.cfg.run.save_every == 0 or self.step == self.cfg.run.steps or stopping:
                self.save(stream.drain())
            if self.step < self.cfg.run.steps:
                self._publish_next(stream)
            if stopping:
                self.ckpt.wait()
                return last
        self.ckpt.wait()
        return last

    def _publish_next(self, stream: RolloutStream) -> None:
        """After an update: its version to the stream when the schedule publishes it (the ESS always, for min_ess)."""
        if self.schedule.publishes(self.learner.version):
            self._publish(stream, *self.publish())

    def _run_step(self, stream: RolloutStream) -> dict[str, float]:
        """One step: its rollout (waiting for it when the sampler is behind), its updates (none when the reward
        failed), the logs; returns the step's metrics."""
        cfg = self.cfg
        t0 = time.perf_counter()
        ro = stream.take(self.step)
        wait = time.perf_counter() - t0
        self._check_reward(ro)
        if ro.reward_failed:  # never train on a batch the reward never scored
            m = {}
            self.learner.skip()
        else:
            m = self.learner.update(ro.batch)
        self._check_finite(self.step + 1, m, ro.batch)
        if "train/mismatch/chi2_token" in m:
            stream.record_ess(self.learner.version, m.setdefault("rollout/ess", ess(m)))
        self.step += 1
        m.update(ro.stats)
        m.update({"rollout/version_lag": float(self.schedule.lag(ro)), "rollout/version": float(ro.version),
                  "rollout/dropped_stale": float(self.dropped_stale), "perf/rollout_wait_s": wait})
        self.dropped_stale = 0
        m["optim/lr"] = float(self.learner.schedule(max(self.step - 1, 0) * cfg.algo.num_iterations))
        m["perf/step_s"] = time.perf_counter() - t0
        if cfg.run.eval_every and self.step % cfg.run.eval_every == 0 and self.step < cfg.run.steps:
            m.update(self.evaluate())
        self.log_metrics(self.step, m)
        self.log_completions(self.step, ro.completions)
        return m

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

    def _check_finite(self, step: int, metrics: dict[str, float], rb) -> None:
        """Stop before a non-finite update can be logged as fine or saved over a good checkpoint."""
        bad = first_non_finite(metrics, rb.behaviour_logp)
        if bad:
            latest = self.ckpt.latest_step()
            raise TrainingStopped(
                f"step {step}: non-finite {bad} ({metrics.get(bad, 'nan')}); the update was not saved"
                + (f", the checkpoint of step {latest} is intact" if latest is not None else "")
                + ". Lower optim.lr or check the model and data")


def ess(metrics: dict[str, float]) -> float:
    """The effective sample size of the update's importance weights w = pi_learner / pi_sampler, as a fraction of
    the tokens: (E w)^2 / E w^2 = 1 / (1 + chi2) with chi2 = E w^2 - 1 (train/mismatch/chi2_token)."""
    return float(1.0 / (1.0 + max(metrics["train/mismatch/chi2_token"], 0.0)))
