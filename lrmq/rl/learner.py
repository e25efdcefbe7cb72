"""The Learner: the policy's trainable weights, their optimizer state, the compiled updates (`UpdatePrograms`), the
KL reference and the learner's mesh. It takes `Rollout` batches and returns metrics; it publishes `WeightVersion`s
for a sampler (`publish`): the policy's weights, or with rollout.quant a packed copy quantized here, on the
learner's mesh, so that only the packed bytes (and the arrays the copy shares) move.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
from flax import nnx

from lrmq.checkpoint.hf import save_hf_model
from lrmq.checkpoint.load import resolve_checkpoint
from lrmq.configlib import ConfigError
from lrmq.ptq.qat_export import export_qat_policy
from lrmq.quant.training import export_float_model, trainable_filter
from lrmq.rl.batch import RolloutBatch, UpdateBatch, bucketed_batch, packed_batch, padded_batch
from lrmq.rl.config import TrainConfig
from lrmq.rl.messages import WeightVersion, tree_bytes
from lrmq.rl.placement import transfer
from lrmq.rl.precompile import UpdatePrograms, packed_chooser, replay_shape
from lrmq.rl.rollout_copy import RolloutCopy, RolloutQuant, awq_rollout_scales, calibration_blocks
from lrmq.rl.step import init_opt_state, make_optimizer, micro_batch_count, rollout_quant_warning
from lrmq.sharding import batch_divisor, batch_sharding

log = logging.getLogger("lrmq.train")


class Learner:
    """`model`: the policy, built on `mesh`. `version` counts the updates applied (a resumed learner: its step)."""

    def __init__(self, cfg: TrainConfig, model, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.model_cfg = model.cfg
        self.graphdef, self.trainable, self.rest = nnx.split(model, trainable_filter(cfg.quant.mode), ...)
        self.tx, self.schedule = make_optimizer(cfg)
        with jax.set_mesh(mesh):
            self.opt_state = init_opt_state(self.tx, self.trainable, mesh)
        shardings = tuple(jax.tree.map(lambda x: x.sharding, tree) for tree in (self.trainable, self.opt_state))
        self.updates = UpdatePrograms(self.graphdef, cfg, self.tx, shardings, mesh,
                                      replay=replay_shape(cfg, model.cfg))
        self._choose_packed = packed_chooser(self.updates.shapes) if cfg.rollout.update_padding == "pack" else None
        self.ref_trainable = self._reference_params() if cfg.algo.beta != 0.0 else None
        if (warning := rollout_quant_warning(cfg)) is not None:  # a quantized or stale sampler, uncorrected
            log.warning(warning)
        self.copy = self._rollout_copy()
        self.version = 0
        self.quantized_at: int | None = None  # the version the packed copy was quantized from

    def _reference_params(self):
        """The frozen KL reference: a copy of the initial policy, or for QLoRA the base without adapters."""
        if self.cfg.quant.mode == "qlora":
            return jax.tree.map(jnp.zeros_like, self.trainable)  # zero adapters = the frozen base, no copy
        return jax.tree.map(jnp.copy, self.trainable)

    def _rollout_copy(self) -> RolloutCopy | None:
        """rollout.quant: the packed copy's quantizer, on the learner's mesh."""
        r = self.cfg.rollout
        if not self.cfg.quantized_rollout:
            return None
        spec = RolloutQuant(r.quant, group_size=r.quant_group_size, targets=self.cfg.quant.targets,
                            merge_lora=r.lora == "merged")
        try:
            return RolloutCopy(self.graphdef, self.trainable, self.rest, spec, awq_scales=r.quant_scales == "awq",
                               mesh=self.mesh)
        except ValueError as e:
            raise ConfigError(str(e)) from e

    def states(self):
        return (self.trainable, self.rest)

    # ------------------------------------------------------------------ what a sampler reads
    @property
    def rollout_graphdef(self):
        """The graphdef of what rollouts sample from: the packed copy's, or the policy's."""
        return self.graphdef if self.copy is None else self.copy.graphdef

    def rollout_abstract(self):
        """The rollout weights' pytree (arrays or ShapeDtypeStructs), before any publish."""
        if self.copy is None:
            return self.states()
        return self.copy.abstract_states(self.trainable, self.rest)

    def needs_calibration(self) -> bool:
        """rollout.quant_scales=awq before its scales were searched (on the first batch's prompts)."""
        return self.copy is not None and self.cfg.rollout.quant_scales == "awq" and self.copy.scales is None

    def calibrate(self, prompts: list[list[int]]) -> dict[str, float]:
        """The AWQ scale search of rollout.quant_scales=awq, once, on `prompts`; the next publish re-quantizes."""
        t0 = time.perf_counter()
        with jax.set_mesh(self.mesh):
            self.copy.scales = awq_rollout_scales(self.graphdef, self.trainable, self.rest,
                                                  calibration_blocks(prompts), self.copy.spec)
        self.quantized_at = None
        dt = time.perf_counter() - t0
        log.info("rollout.quant_scales=awq: scales searched on the first batch's prompts in %.1f s", dt)
        return {"perf/awq_search_s": dt}

    def _quantize(self) -> dict[str, float]:
        """Re-quantize the packed copy when rollout.quant_refresh updates passed since it was (or it never was)."""
        if self.quantized_at is not None and self.version - self.quantized_at < self.cfg.rollout.quant_refresh:
            return {}
        self.quantized_at = self.version
        return {"perf/requantize_s": self.copy.refresh(self.trainable, self.rest)}

    def publish(self, shardings=None, *, copy: bool = True) -> tuple[WeightVersion, dict[str, float]]:
        """The current weights for a sampler: the policy's, or the packed copy (re-quantized here when due), moved
        to `shardings` (the sampler's decode layout: `Engine.decode_shardings`; None = as they are). `copy`: fresh
        buffers (the update donates the learner's), needed unless the sampler is done with them before the next
        update. Returns the version and its rollout/sync_* and perf/requantize_s metrics."""
        stats = {} if self.copy is None else self._quantize()
        states = self.states() if self.copy is None else self.copy.states(self.trainable, self.rest)
        t0 = time.perf_counter()
        if shardings is not None:
            states = transfer(states, shardings, copy=copy)
        elif copy:
            states = jax.tree.map(jnp.copy, states)
        jax.block_until_ready(states)
        nbytes = tree_bytes(states)
        stats.update({"rollout/sync_s": time.perf_counter() - t0, "rollout/sync_bytes": float(nbytes)})
        return WeightVersion(states, version=self.version, packed=self.copy is not None, nbytes=nbytes), stats

    # ------------------------------------------------------------------ updates
    def compile(self, progress: bool = False) -> dict[str, int]:
        """Compile the update for every shape it can have (`UpdatePrograms.compile`); {program: per-device bytes}
        of the largest shape."""
        return self.updates.compile(self.trainable, self.rest, self.opt_state, self.ref_trainable, progress=progress)

    def update_batch(self, rb: RolloutBatch) -> UpdateBatch:
        """The host update batch in the layout rollout.update_padding asks for."""
        r = self.cfg.rollout
        if r.update_padding == "pack":
            return packed_batch(rb, n_micro=micro_batch_count(self.cfg, rb.num_sequences),
                                groups=batch_divisor(self.mesh), choose_shape=self._choose_packed,
                                width=r.max_prompt_len + r.max_new_tokens)
        return bucketed_batch(rb) if r.update_padding == "bucket" else padded_batch(rb)

    def update(self, rb: RolloutBatch) -> dict[str, float]:
        """The algo.num_iterations optimizer updates of one rollout batch (the version advances by one); returns
        train/* and perf/* metrics."""
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
        self.version += 1
        metrics["perf/train_tokens_per_s"] = host.token_count() * self.cfg.algo.num_iterations / max(dt, 1e-9)
        metrics["perf/update_s"] = dt
        metrics["perf/update_width"] = float(host.tokens.shape[1])
        metrics["perf/update_rows"] = float(host.tokens.shape[0])  # packed: rows of several sequences
        return metrics

    def skip(self) -> None:
        """A batch not trained on (its reward failed): the weights stay, the version advances (versions count the
        batches the learner took, so the sampler's schedule never waits for an update that will not come)."""
        self.version += 1

    def _run_updates(self, batch: UpdateBatch, ref_logp) -> dict[str, float]:
        """One compiled update per entry of `old_logprob_sources`; the metrics of the last, with the sampler/learner
        mismatch of the first (the learner before any update of this batch)."""
        metrics, mismatch = {}, None
        for old_from in self.updates.sources:
            step = self.updates.step(old_from, batch, ref_logp)
            self.trainable, self.opt_state, metrics = step(self.trainable, self.rest, self.opt_state, batch, ref_logp)
            if mismatch is None:  # sampler vs learner (routing included) before any update of this batch
                mismatch = {k: v for k, v in metrics.items() if k.startswith("mismatch/") or k == "moe/route_mismatch"}
            if old_from == "own":  # on-policy: its log-probs are pi_old of the later updates
                old = jax.device_put(metrics.pop("logp") * batch.completion_mask, batch_sharding(self.mesh, 2))
                batch = batch.replace(old_logp=old)
        metrics.update(mismatch or {})
        return {f"train/{k}": float(v) for k, v in jax.device_get(metrics).items()}

    # ------------------------------------------------------------------ checkpoints and exports
    def checkpoint_tree(self) -> dict:
        return {"trainable": self.trainable, "rest": self.rest, "opt": self.opt_state}

    def restore(self, tree: dict, version: int) -> None:
        self.trainable, self.rest, self.opt_state = tree["trainable"], tree["rest"], tree["opt"]
        self.version = version
        self.quantized_at = None

    def export_policy(self, out_dir: str) -> None:
        """HF export of the current policy. Every process must call it: sharded parameters are gathered tensor by
        tensor (collectives), and process 0 writes."""
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
