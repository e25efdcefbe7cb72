"""rollout.kv_scale_refresh: which fp8 KV-cache scales a rollout's engine call writes under.

With rollout.kv_cache fp8_e4m3 / fp8_e5m2 the engine keeps one scale per layer and KV head for K and for V
(`lrmq.generation.kv_pool.QuantPool`). By default (refresh 0) each `Engine.generate` calibrates its own on its first
prefill, from the prompts of that call. With refresh k > 0 the trainer keeps the scales a calibrating rollout
returned (`GenerationResult.kv_scales`) and passes them to the following rollouts (`Engine.generate(kv_scales=)`),
so they stay the same between refreshes, and lets the next rollout calibrate anew once k policy updates have
passed since (counted in policy versions: the version a rollout samples from minus the calibration's) (k = 1 recalibrates every step as 0 does, FP8-RL's per-step recalibration, but reuses the scales
after a step without an update, a failed reward batch). The scales are not checkpointed: a resumed run
recalibrates at its first rollout.
"""

from __future__ import annotations

from dataclasses import dataclass

from lrmq.generation.engine import GenerationResult
from lrmq.generation.kv_pool import KVScales


@dataclass
class KVCalibration:
    """The kept scales (`refresh` = rollout.kv_scale_refresh; see the module docstring) and the policy version they
    were calibrated under. `for_rollout(version)` -> the engine call -> `after_rollout(..., version)`: the updates
    since the calibration are the versions between, so the sampler needs nothing from the learner but the version
    number it samples from."""

    refresh: int
    scales: KVScales | None = None
    version: int = 0  # the policy version `scales` were calibrated under

    def for_rollout(self, version: int) -> KVScales | None:
        """The scales the next rollout (sampling from `version`) writes under; None: it calibrates its own (refresh
        0: always; refresh k: the first rollout, and the first after k updates)."""
        if not self.refresh or self.scales is None or version - self.version >= self.refresh:
            return None
        return self.scales

    def after_rollout(self, given: KVScales | None, result: GenerationResult, version: int) -> dict[str, float]:
        """Keep the scales a calibrating rollout (`given` None) returned; its rollout/kv_* statistics:
        kv_saturated (K / V entries clipped at the format's max: kept scales that the policy's keys outgrew show
        there) and, with refresh k > 0, kv_calibrated (1: this rollout calibrated, 0: it reused the kept scales)."""
        stats = {}
        if "kv_saturated" in result.stats:
            stats["rollout/kv_saturated"] = float(result.stats["kv_saturated"])
        if self.refresh:
            if given is None:
                self.scales, self.version = result.kv_scales, version
            stats["rollout/kv_calibrated"] = float(given is None)
        return stats
