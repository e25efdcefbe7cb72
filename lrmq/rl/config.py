"""The GRPO run config: typed dataclasses, loaded from YAML with dotted overrides (lrmq.configlib).

Every field is an `opt` with its description (`python -m lrmq.train --help-config`); fields that name a
registry entry carry the registry, so a typo fails when the config is read, with every other error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from lrmq.configlib import ConfigError, check_data_parallel_batch, opt
from lrmq.data.prompts import PROMPT_TEMPLATES
from lrmq.generation.engine import EngineConfig
from lrmq.generation.attention import DECODE_ATTENTION
from lrmq.generation.kv_format import KEPT_SCALE_FORMATS, KVFormat
from lrmq.generation.scheduler import check_kv_pages
from lrmq.model.presets import PRESETS
from lrmq.rl.advantages import ADVANTAGES
from lrmq.rl.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, LossConfig
from lrmq.rl.rewards import REWARDS


# rollout.decode_attention: "auto" and the engine's decode attention names (attention.DECODE_ATTENTION), not restated
DecodeAttention = Literal[("auto", *DECODE_ATTENTION)]


@dataclass
class ModelSection:
    checkpoint: str = opt("tiny", 'the policy to train: an HF or lrmq checkpoint directory; "tiny" = the shipped '
                                  "embedded model")
    dtype: Literal["float32", "bfloat16"] = opt("float32", "compute dtype of rollouts and the train step")
    param_dtype: Literal["float32", "bfloat16"] = opt("float32", "dtype of the parameters (the master weights the "
                                                                 "optimizer updates)")
    shapes: str = opt("", "architecture preset (e.g. qwen3-8b) that --compile-only uses when the checkpoint is "
                          "not on this machine", names=PRESETS, kind="architecture preset", empty_ok=True)
    remat: Literal["none", "full", "dots"] = opt("none", "rematerialisation of each decoder layer in the train "
                                                         "step: none, full (recompute the layer in the backward "
                                                         "pass), dots (keep matmul outputs, recompute the rest)")
    scan_layers: bool = opt(False, "train step: run the decoder layers as one lax.scan over their stacked "
                                   "weights (one layer body in the program: deep models compile many times "
                                   "faster, for a transient copy of the layer weights); rollouts stay unrolled")
    logits_chunk: int = opt(256, "completion positions per chunk when projecting onto the vocabulary for "
                                 "log-probs (0 = all at once); bounds the live f32 [micro-batch, chunk, vocab] logits", ge=0)


@dataclass
class DataSection:
    train_files: list[str] = opt(help="training prompt datasets (jsonl/json/parquet/csv/arrow files or "
                                      "save_to_disk dirs, concatenated); empty = synthetic arithmetic", factory=list)
    eval_files: list[str] = opt(help="held-out prompt datasets for evaluation (same formats; empty = no "
                                     "evaluation); synthetic data brings its own held-out split", factory=list)
    problem_field: str = opt("problem", "dataset column holding the problem text")
    answer_field: str = opt("answer", "dataset column holding the reference answer")
    solution_field: str = opt("solution", "column whose last \\boxed{} is the answer when answer_field is not "
                                          "a column")
    template: str = opt("arith", "prompt template that renders each problem (chat = the model's chat template)",
                        names=PROMPT_TEMPLATES)
    synthetic_train_size: int = opt(4000, "synthetic arithmetic (no train_files): training problems", ge=1)
    synthetic_eval_size: int = opt(128, "synthetic arithmetic: held-out problems, drawn first and excluded "
                                        "from training", ge=0)
    synthetic_seed: int = opt(1234, "synthetic arithmetic: seed of the problem generator")
    max_train_examples: int = opt(0, "use only the first N training examples (0 = all; paper 1 takes the "
                                     "first 10k)", ge=0)


@dataclass
class RolloutSection:
    group_size: int = opt(8, "G: completions sampled per prompt (the group of group-relative advantages)", ge=1)
    prompts_per_step: int = opt(8, "prompts per training step; a step's batch is prompts_per_step x "
                                   "group_size sequences", ge=1)
    max_prompt_len: int = opt(64, "prompt length in tokens; longer prompts keep their last max_prompt_len tokens", ge=1)
    max_new_tokens: int = opt(64, "completion tokens generated at most per sequence (also max_len of the "
                                  "drgrpo-constant aggregation)", ge=1)
    temperature: float = opt(1.0, "sampling temperature of rollouts and sampled evaluation; the update's "
                                  "log-probs use the same temperature", gt=0, lt=float("inf"))
    top_p: float = opt(1.0, "nucleus sampling: sample from the smallest set of tokens with this probability "
                            "mass (1 = off)", gt=0, le=1)
    top_k: int = opt(0, "sample among the k most likely tokens (0 = off)", ge=0)
    update_padding: Literal["pack", "bucket", "max"] = opt(
        "pack", "layout of the update batch, every shape of it compiled before the first rollout: pack (each "
                "sequence's real tokens only, several sequences per row of max_prompt_len + max_new_tokens "
                "columns with attention kept within each; rows and completion slots rounded up to one of "
                "rollout.update_shapes shapes), bucket (prompt and completion parts padded to the next power of "
                "two of the batch's longest, at least 16: one compile per pair) or max (max_prompt_len + "
                "max_new_tokens: one compile)")
    update_shapes: int = opt(5, "update_padding=pack: packed update shapes, all compiled before the first rollout: "
                                "from the worst case (one sequence per row, every completion at full length) down "
                                "in steps of sqrt(2); a batch uses the smallest that holds it (1 = always the "
                                "worst case: one compile, the most padding)", ge=1)
    generation_batch: int = opt(0, "decode slots of the rollout engine: sequences decoded at once, the next "
                                   "waiting one taking a slot as soon as a sequence stops (0 = all prompts x "
                                   "group of a step)", ge=0)
    page_size: int = opt(16, "tokens per page of the rollout engine's paged KV cache", ge=1)
    kv_pages: int = opt(0, "pages of the rollout engine's KV pool (0 = what fits: rollout.kv_memory_fraction of the "
                           "device's memory less the update's per-device total (weights, optimizer state and its "
                           "peak), at most the worst case (every slot at full length: nothing preempted); the worst "
                           "case where the device's memory is unknown (CPU). Fewer pages hold less memory and "
                           "recompute a preempted sequence later)", ge=0)
    kv_memory_fraction: float = opt(0.9, "rollout.kv_pages=0 on an accelerator (or a --compile-only TPU topology): "
                                         "the share of each device's memory the update and the KV pool may take "
                                         "together, as vLLM's gpu_memory_utilization", gt=0, le=1)
    sync_steps: int = opt(64, "decode steps per device call of the rollout engine at most (it returns early "
                              "when a sequence stops while others wait)", ge=1)

    quant: Literal["none", "int8", "int4", "nf4"] = opt(
        "none", "weights the rollouts sample from: none (the learner's own forward: float, the QAT fake-quant "
                "forward under quant.mode=qat, the packed base + adapters under qlora) or a packed copy of the "
                "policy's projections, re-quantized on device after updates: int8 / int4 (RTN, groups of "
                "rollout.quant_group_size rows) or nf4 (bitsandbytes, block 64). The float policy trains, saves "
                "and exports; the sampler's log-probs come back with the tokens for algo.rollout_correction "
                "(docs/grpo.md, 'Quantized rollouts')")
    quant_group_size: int = opt(128, "rollout.quant int8 / int4: input rows per scale group (-1 = one scale per "
                                     "output channel)", ge=1, also=(-1,))
    quant_refresh: int = opt(1, "rollout.quant: re-quantize the rollout copy every k updates (1 = after every "
                                "update; a resumed run re-quantizes at once)", ge=1)
    quant_scales: Literal["rtn", "awq"] = opt(
        "rtn", "rollout.quant int8 / int4: plain round-to-nearest, or AWQ scales searched once on the first rollout "
               "batch (prompts and completions) and folded into the float weights before every re-quantization")
    kv_cache: Literal["auto", "bf16", "fp8_e4m3", "fp8_e5m2", "int8"] = opt(
        "auto", "format of the rollout engine's KV cache pages: auto (the model's dtype), bf16, or quantized with "
                "float32 scales: fp8_e4m3 / fp8_e5m2 (per layer and KV head, calibrated on each call's first "
                "prefill) or int8 (per token and KV head). Quantized, the sampler's attention differs from the "
                "learner's: algo.rollout_correction=auto turns the correction on (docs/generation.md, 'Quantized "
                "KV cache')")
    kv_scale_refresh: int = opt(
        0, "rollout.kv_cache fp8_e4m3 / fp8_e5m2: 0 = calibrate the per-layer / KV-head scales on each rollout's "
           "first prefill (its prompts' keys and values); k > 0 = keep one calibration across rollouts and "
           "recalibrate only once k updates have passed (stable scales between refreshes; a resumed run "
           "recalibrates at once; later keys beyond a kept scale's range clip: rollout/kv_saturated counts them). "
           "int8 has a scale per token (nothing to keep), so k > 0 is refused for it as for auto / bf16", ge=0)
    decode_attention: DecodeAttention = opt(
        "auto", "decode attention of the rollout and evaluation engines: auto (the compile target's kernel: "
                "JAX's ragged paged attention on TPU, Triton on GPU, where it takes the shapes; else xla), or "
                "xla / tpu / gpu given explicitly. xla runs fp8 KV pages at 1 KV head per TPU chip, which auto "
                "refuses (docs/generation.md, 'Quantized KV cache'; docs/tpu.md)")
    lora: Literal["unmerged", "merged"] = opt(
        "unmerged", "quant.mode=qlora: rollouts run the packed base and the adapters as the learner does "
                    "(unmerged; rollout.quant must be none: the base is packed already), or merge the adapters into "
                    "the dequantized base and quantize that in rollout.quant's format (merged)")
    placement: Literal["colocated", "split"] = opt(
        "colocated", "where rollouts run: colocated (the sampler and the learner share every chip, one after the "
                     "other) or split (the sampler gets mesh.rollout_fraction of each host's local chips, the learner "
                     "the rest; weights move to the sampler after each sync; docs/grpo.md 'Sampler and Learner')")
    max_staleness: int = opt(0, "k: the sampler runs at most k policy versions ahead of the learner: step j's rollout "
                                "is sampled from version max(0, j-1-k) (0 = on-policy, generate then update). Rollouts "
                                "staler than k when their update comes are dropped (rollout/dropped_stale)", ge=0)
    sync_every: int = opt(1, "the learner sends its weights to the sampler after every N updates (a version the "
                             "sampler can use); needs N - 1 <= rollout.max_staleness", ge=1)
    min_ess: float = opt(0.0, "with rollout.max_staleness > 0: when the last update's effective sample size of the "
                              "importance weights (rollout/ess = 1 / (1 + chi2), as a fraction of the tokens) falls "
                              "below this, the next rollout waits for the newest version (on-policy) instead of "
                              "running ahead (0 = never)", ge=0.0, le=1.0)

    routing_replay: bool = opt(False, "mixture-of-experts models: the rollout engine records the experts every token "
                                      "ran (uint8 ids per sparse layer) and the update's forward runs those experts "
                                      "instead of its own top-k (rollout routing replay): the router's softmax is "
                                      "gathered at the replayed ids, so its gradients still reach the gates of the "
                                      "chosen experts. Refused for a dense model (docs/moe.md, 'RL on MoE')")

    def engine_config(self, pool_bytes: int = 0, *, moe: bool = False) -> EngineConfig:
        """The rollout engine, whole: `pool_bytes` is the KV pool's budget per device when kv_pages is 0
        (`kv_pool.pool_budget`; 0 = the worst case). `moe`: a mixture-of-experts policy, whose rollouts record the
        experts every token ran (replayed with routing_replay, else compared by ``moe/route_mismatch``)."""
        return EngineConfig(slots=self.generation_batch or self.prompts_per_step * self.group_size,
                            page_size=self.page_size, pages=self.kv_pages, sync_steps=self.sync_steps,
                            kv_cache=self.kv_cache, attention=self.decode_attention, pool_bytes=int(pool_bytes),
                            record_experts=self.routing_replay or moe)


@dataclass
class AlgoSection:
    advantage: str = opt("grpo", "advantage estimator: grpo (reward minus group mean, over group std + "
                                 "adv_eps), drgrpo (minus group mean only), rloo (leave-one-out mean)",
                         names=ADVANTAGES)
    scale_rewards: Literal["group", "batch", "none"] = opt(
        "group", "grpo advantages: divide by the std of the group (GRPO, TRL's default), of the whole batch "
                 "(TRL scale_rewards=batch), or by nothing (none: as the drgrpo estimator)")
    std_ddof: int = opt(1, "grpo advantages: delta degrees of freedom of the group std: 1 = unbiased (TRL's "
                           "torch.std, paper 1), 0 = population std (MaxText)", ge=0)
    adv_eps: float = opt(1e-4, "grpo advantages: added to the group std in the denominator", ge=0, lt=float("inf"))
    loss_aggregation: str = opt("sequence-mean-token-mean", "how token losses become the loss: "
                                "sequence-mean-token-mean (GRPO), token-mean (DAPO), drgrpo-constant (Dr.GRPO: "
                                "sum / (sequences x rollout.max_new_tokens))", names=AGGREGATIONS)
    policy_loss: str = opt("grpo", "per-token policy loss (grpo = ppo-clip: the clipped importance-ratio "
                                   "objective)", names=POLICY_LOSSES)
    importance_sampling: Literal["token", "sequence"] = opt(
        "token", "importance ratio per token (GRPO/PPO) or per sequence, the length-normalised sequence "
                 "log-ratio (GSPO; TRL importance_sampling_level=sequence)")
    eps_low: float = opt(0.2, "the importance ratio is clipped below at 1 - eps_low", ge=0)
    eps_high: float = opt(0.2, "the importance ratio is clipped above at 1 + eps_high", ge=0)
    num_iterations: int = opt(1, "mu: optimizer updates per rollout batch (each over the whole batch)", ge=1)
    old_logprobs: Literal["rollout", "recompute"] = opt(
        "rollout", "old log-probs of the importance ratio: rollout (the sampler's, as Tunix's default) or "
                   "recompute (one extra forward with the pre-update policy: the ratio starts at exactly 1, as TRL)")
    beta: float = opt(0.0, "KL penalty coefficient against the initial policy; 0 creates no reference model at "
                           "all (paper 1)")
    kl_estimator: str = opt("k3", "estimator of the KL penalty (used when beta != 0)", names=KL_ESTIMATORS)
    kl_bias_correction: bool = opt(False, "multiply the KL term by the (differentiable) importance ratio, as TRL's "
                                          "use_bias_correction_kl (TRL's default); off = the GRPO paper's k3 term")
    rollout_correction: Literal["auto", "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                                "geometric_truncate", "geometric_mask"] = opt(
        "auto", "rollout/learner mismatch correction: each token's policy loss times w ~ pi_learner_old / pi_sampler "
                "(stop-gradient), truncated to [rollout_correction_min, rollout_correction_cap] (*_truncate) or zero "
                "outside it (*_mask), per token (token_*), per sequence on the product of its token ratios "
                "(sequence_*, TRL's) or on their geometric mean (geometric_*). auto = none while the rollout samples "
                "with the learner's own weights, TRL's default sequence_mask when it samples a different (quantized) "
                "copy; none = off. On, the ratio's denominator is the learner's old log-probs (first update "
                "on-policy, as TRL), whatever algo.old_logprobs says; docs/grpo.md")
    rollout_correction_cap: float = opt(3.0, "C_max of algo.rollout_correction (TRL vllm_importance_sampling_clip_max)",
                                        gt=0, lt=float("inf"))
    rollout_correction_min: float = opt(0.0, "C_min of algo.rollout_correction (0 = no lower bound, TRL's default "
                                             "vllm_importance_sampling_clip_min=None; 1 / cap = ms-swift/verl's "
                                             "two-sided mask)", ge=0, lt=float("inf"))
    mask_truncated_completions: bool = opt(False, "completions cut at rollout.max_new_tokens (no EOS) get no loss "
                                                  "(TRL mask_truncated_completions); they still count in the "
                                                  "reward statistics")
    router_aux_coef: float = opt(0.0, "mixture-of-experts models: weight of the Switch / Qwen3-MoE load-balancing "
                                      "loss (transformers' load_balancing_loss_func over every sparse layer and "
                                      "every real prompt and completion token of a micro-batch) added to the "
                                      "policy loss; 0 = off, as most RL recipes (Qwen's pre-training value, "
                                      "config.json's router_aux_loss_coef, is 0.001). Refused for a dense model",
                                 ge=0, lt=float("inf"))
    reward: str = opt("boxed_math", "reward function: boxed_math (1 correct + 0.1 for a \\boxed answer; "
                                    "math-verify), boxed_exact (same values, exact match only)", names=REWARDS)
    reward_timeout_s: float = opt(1.0, "time limit in seconds of one math-verify comparison (boxed_math)", gt=0, lt=float("inf"))
    reward_budget_s: float = opt(30.0, "wall-time budget of one batch's math-verify comparisons (0 = none); "
                                       "comparisons not decided in time score 0 and count in reward/timeouts",
                                 ge=0)
    max_failed_reward_batches: int = opt(3, "stop after this many consecutive reward batches in which every "
                                            "comparison failed or timed out (0 = never); such a batch is not "
                                            "trained on", ge=0)
    reward_weight: float = opt(1.0, "weight of `reward` in the training reward")
    extra_rewards: dict[str, float] = opt(
        help="more reward functions and their weights, summed with reward_weight x reward into the training "
             "reward, each logged as reward/NAME (e.g. {format: 0.5, overlong_penalty: 1.0})", factory=dict)

    def validate(self):
        if self.num_iterations < 1:
            raise ConfigError("algo.num_iterations must be >= 1")
        if self.rollout_correction_min >= self.rollout_correction_cap:
            raise ConfigError(f"algo.rollout_correction_min={self.rollout_correction_min} must be below "
                              f"algo.rollout_correction_cap={self.rollout_correction_cap}")
        for name in self.extra_rewards:
            if name not in REWARDS:
                raise ConfigError(f"algo.extra_rewards: unknown reward {name!r}; known: {', '.join(REWARDS.names())}")


    def resolved_rollout_correction(self, quantized_rollout: bool = False) -> str:
        """The correction the step applies: `auto` is TRL's default (sequence_mask, as TRL with vLLM) when the
        rollout samples a different copy of the weights or through a quantized KV cache (`sampler_differs`), else
        none (the sampler is the learner)."""
        if self.rollout_correction == "auto":
            return "sequence_mask" if quantized_rollout else "none"
        return self.rollout_correction


@dataclass
class OptimSection:
    lr: float = opt(1e-6, "peak learning rate (AdamW)", gt=0, lt=float("inf"))
    schedule: Literal["linear", "constant", "cosine"] = opt("linear", "learning rate after warmup: linear or "
                                                                      "cosine decay to 0 at the last update, "
                                                                      "or constant")
    warmup_steps: int = opt(1, "optimizer updates of linear warmup from 0 to lr", ge=0)
    warmup_ratio: float = opt(0.0, "warmup as a fraction of all optimizer updates (run.steps x algo.num_iterations), "
                                   "rounded up, as TRL's warmup_ratio; the warmup is the larger of this and "
                                   "warmup_steps", ge=0, le=1)
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay", ge=0, lt=float("inf"))
    b1: float = opt(0.9, "AdamW beta1", ge=0, lt=1)
    b2: float = opt(0.999, "AdamW beta2", ge=0, lt=1)
    eps: float = opt(1e-8, "AdamW epsilon", ge=0, lt=float("inf"))
    max_grad_norm: float = opt(1.0, "clip gradients to this global norm (0 = no clipping)", ge=0, lt=float("inf"))
    micro_batch_size: int = opt(0, "sequences per micro-batch for gradient accumulation (0 = the whole batch); "
                                   "the update equals the whole-batch one", ge=0)

    def warmup_updates(self, total: int) -> int:
        """Optimizer updates of warmup out of `total`: max(warmup_steps, ceil(warmup_ratio x total)), at most
        `total` (TRL/HF: ceil(warmup_ratio x max_steps) when warmup_steps is 0)."""
        return min(max(self.warmup_steps, math.ceil(self.warmup_ratio * total)), total)


@dataclass
class QuantSection:
    mode: Literal["none", "qat", "qlora"] = opt("none", "quantization while training: none, qat (fake-quantized "
                                                        "forward, straight-through gradients to float weights), "
                                                        "qlora (frozen packed base + LoRA adapters)")
    qat_scheme: Literal["paper_int8", "int8", "int4", "int4_asym", "int8_asym", "w8a8"] = opt(
        "paper_int8", "QAT scheme: paper_int8 (per-tensor int8, scale frozen at load), int8 / int4 (AQT "
                      "weight-only, symmetric), int4_asym / int8_asym (min-max with a zero point per group: "
                      "lrmq.quantize --method rtn's format), w8a8 (AQT int8 weights and activations)")
    qat_group_size: int = opt(0, "QAT (all but paper_int8): input rows per weight scale group (0 = per output "
                                 "channel)", ge=0)
    qat_stochastic_rounding: bool = opt(False, "QAT (AQT schemes): quantize the backward pass's incoming "
                                               "gradients to int8 with stochastic rounding")
    targets: str = opt(r".*\.(q|k|v|o|gate|up|down)_proj$", "regex over module paths of the Linears that QAT "
                                                             "quantizes or QLoRA packs and adapts (lm_head excluded)")
    base_format: Literal["nf4", "int4"] = opt("nf4", "QLoRA: packed format of the frozen base weights")
    base_group_size: int = opt(64, "QLoRA int4 base: input rows per scale group", ge=1)
    lora_rank: int = opt(8, "QLoRA: rank r of each adapter", ge=1)
    lora_alpha: float = opt(16.0, "QLoRA: adapter output scale alpha / r", gt=0, lt=float("inf"))
    lora_dropout: float = opt(0.05, "QLoRA: dropout on the adapter input in the update (not in rollouts)", ge=0, lt=1)


@dataclass
class MeshSection:
    data: int = opt(1, "data-parallel mesh axis: batch split, parameters replicated (-1 = all remaining devices)", ge=1, also=(-1,))
    fsdp: int = opt(-1, "FSDP mesh axis: batch split and parameters sharded (-1 = all remaining devices)", ge=1, also=(-1,))
    tensor: int = opt(1, "tensor-parallel mesh axis: heads, MLP and vocabulary dimensions sharded", ge=1)
    expert: int = opt(1, "expert-parallel mesh axis (a mixture of experts): each chip holds num_experts / expert of "
                         "the experts and the batch is split over it too, tokens sent to their experts' chips by "
                         "all-to-all (docs/moe.md, 'Expert parallelism'); 1 = none. With rollout.placement=split it "
                         "applies to the learner's mesh only", ge=1)
    topology: str = opt("", "the hardware the recipe is written for, as a TPU topology (e.g. v5p:2x4x4): "
                            "--compile-only compiles for it when no --topology is given")
    rollout_fraction: float = opt(0.5, "rollout.placement=split: the share of each host's local chips given to the "
                                       "sampler (its first ones); the learner's mesh (data x fsdp x tensor above) "
                                       "takes the rest", gt=0.0, lt=1.0)
    rollout_data: int = opt(-1, "rollout.placement=split: the sampler mesh's data axis (decode slots split; -1 = all "
                                "remaining sampler chips)", ge=1, also=(-1,))
    rollout_fsdp: int = opt(0, "rollout.placement=split: the sampler mesh's fsdp axis (the KV heads and weights split "
                               "over it; -1 = all remaining sampler chips; 0 = the largest split of the model's KV heads "
                               "the KV format runs at: >= 2 heads per chip for fp8 pages on TPU, else >= 1; printed)",
                            ge=0, also=(-1,))
    rollout_tensor: int = opt(1, "rollout.placement=split: the sampler mesh's tensor axis", ge=1)


@dataclass
class RunSection:
    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "log_every": "it never did anything; every step's metrics go to TensorBoard and metrics.jsonl"}

    out_dir: str = opt("runs/default", "run directory (local or gs:// URL): config.yaml, checkpoints, logs, HF "
                                       "exports; rerunning resumes from it")
    steps: int = opt(100, "training steps (each: one rollout batch, num_iterations updates)", ge=1)
    seed: int = opt(0, "seed of prompt order, sampling and quantization/adapter initialisation")
    save_every: int = opt(50, "save a checkpoint every N steps (and after the last)", ge=1)
    keep_checkpoints: int = opt(2, "checkpoints kept in the run directory (older ones are deleted)", ge=1)
    eval_every: int = opt(0, "evaluate on held-out problems every N steps (0 = only before and after training)", ge=0)
    eval_size: int = opt(128, "held-out problems per evaluation", ge=0)
    eval_suite: str = opt("", "also run this lrmq.evaluate suite (paper1, quantlrm) or comma-separated benchmarks at "
                              "every evaluation, eval_suite_limit items per benchmark (empty = held-out split only)",
                          empty_ok=True)
    eval_suite_limit: int = opt(3, "items per benchmark of eval_suite at each evaluation (paper 1: 3 per split "
                                   "every 10 steps; 0 = all)", ge=0)
    eval_data_dir: str = opt("", "local benchmark files of eval_suite (empty = $LRMQ_EVAL_DATA or "
                                 "~/.cache/lrmq/evals; see docs/evaluate.md)", empty_ok=True)
    eval_greedy: bool = opt(True, "also evaluate greedy decoding (eval/accuracy is sampled at the rollout "
                                  "temperature)")
    log_completions: int = opt(2, "sampled completions per step shown in TensorBoard's text tab (every completion "
                                  "goes to completions.jsonl)", ge=0)
    completions_jsonl: bool = opt(True, "write every sampled completion (prompt, completion, reward parts, "
                                        "advantage) to completions.jsonl in the run dir")
    compile_cache: str = opt("auto", "JAX persistent compilation cache dir, so a rerun of the same config skips "
                                     "compiling: auto = $LRMQ_COMPILE_CACHE or ~/.cache/lrmq/jax; off = none",
                             empty_ok=True)
    export_hf: bool = opt(True, "write HF exports of the policy before (initial_policy/) and after "
                                "(final_policy/) training, e.g. for QuantLRM")
    preflight: Literal["auto", "on", "off"] = opt(
        "auto", "compile the update and the rollout before the first step and refuse to start when either needs "
                "more memory per device than it has: auto = on accelerators only")
    hbm_limit_gib: float = opt(0.0, "per-device memory the preflight check allows; 0 = the device's own limit", ge=0, lt=float("inf"))
    progress: bool = opt(True, "show a progress bar")


@dataclass
class TrainConfig:
    model: ModelSection = opt(help="the policy model", factory=ModelSection)
    data: DataSection = opt(help="prompt datasets and the prompt template", factory=DataSection)
    rollout: RolloutSection = opt(help="sampling of the completions of each step", factory=RolloutSection)
    algo: AlgoSection = opt(help="advantages, policy loss, KL penalty and reward", factory=AlgoSection)
    optim: OptimSection = opt(help="AdamW, learning-rate schedule, gradient accumulation", factory=OptimSection)
    quant: QuantSection = opt(help="quantization-aware training (QAT) or QLoRA", factory=QuantSection)
    mesh: MeshSection = opt(help="device mesh (data x fsdp x tensor [x expert])", factory=MeshSection)
    run: RunSection = opt(help="run directory, length, checkpoints, evaluation", factory=RunSection)

    def validate(self):
        r, o = self.rollout, self.optim
        seqs = r.prompts_per_step * r.group_size
        if r.group_size < 2 and self.algo.advantage in ("grpo", "rloo"):
            raise ConfigError(f"rollout.group_size={r.group_size}: group-relative advantages need >= 2 samples")
        if o.micro_batch_size and seqs % o.micro_batch_size:
            raise ConfigError(f"optim.micro_batch_size={o.micro_batch_size} does not divide the "
                              f"{seqs} sequences per step (prompts_per_step x group_size)")
        if self.mesh.data > 0 and self.mesh.fsdp > 0:
            check_data_parallel_batch(seqs, o.micro_batch_size, self.mesh.data * self.mesh.fsdp * self.mesh.expert,
                                      "mesh.data x mesh.fsdp" + (" x mesh.expert" if self.mesh.expert > 1 else ""))
        if self.run.steps < 1:
            raise ConfigError("run.steps must be >= 1")
        try:  # a set pool too small for one rollout sequence: refused here, not by the scheduler mid-rollout
            check_kv_pages(r.kv_pages, "rollout.kv_pages", prompt_tokens=r.max_prompt_len, max_new=r.max_new_tokens,
                           page_size=r.page_size, sync_steps=r.sync_steps, prompt_note=" (rollout.max_prompt_len)")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self._check_rollout_quant()
        self._check_async()

    def _check_async(self):
        r = self.rollout
        if r.sync_every - 1 > r.max_staleness:
            raise ConfigError(f"rollout.sync_every={r.sync_every} with rollout.max_staleness={r.max_staleness}: the "
                              f"sampler would sample from versions up to {r.sync_every - 1} updates old, past the "
                              f"bound; set rollout.max_staleness >= {r.sync_every - 1} or lower rollout.sync_every")
        if r.min_ess and not r.max_staleness:
            raise ConfigError(f"rollout.min_ess={r.min_ess} makes a running-ahead sampler wait; with "
                              "rollout.max_staleness=0 it never runs ahead: set rollout.max_staleness >= 1 or "
                              "rollout.min_ess=0")

    def _check_rollout_quant(self):
        r, mode = self.rollout, self.quant.mode
        if r.lora == "merged" and mode != "qlora":
            raise ConfigError(f"rollout.lora=merged: there are no adapters to merge under quant.mode={mode} "
                              "(it applies to quant.mode=qlora)")
        if mode == "qlora" and r.lora == "unmerged" and r.quant != "none":
            raise ConfigError(f"rollout.quant={r.quant} with quant.mode=qlora: the base is packed already "
                              f"({self.quant.base_format}) and the adapters are unmerged; set rollout.lora=merged "
                              "to merge the adapters and quantize the result, or rollout.quant=none")
        if r.lora == "merged" and r.quant == "none":
            raise ConfigError("rollout.lora=merged needs a rollout.quant format (int8, int4, nf4) to quantize the "
                              "merged weights into; rollout.lora=unmerged samples from the learner itself")
        if r.kv_scale_refresh and r.kv_cache not in KEPT_SCALE_FORMATS:
            why = ("int8 scales each token by its own absmax as it is written: there is no calibration to keep"
                   if r.kv_cache == "int8" else f"rollout.kv_cache={r.kv_cache} has no scales")
            raise ConfigError(f"rollout.kv_scale_refresh={r.kv_scale_refresh} keeps fp8 KV scales across rollouts; "
                              f"{why}. Set rollout.kv_cache to {' or '.join(KEPT_SCALE_FORMATS)}, or "
                              "rollout.kv_scale_refresh=0")
        if r.quant_scales == "awq" and r.quant not in ("int8", "int4"):
            raise ConfigError(f"rollout.quant_scales=awq needs rollout.quant int8 or int4 (got {r.quant})")

    @property
    def quantized_rollout(self) -> bool:
        """Whether rollouts sample from a packed copy instead of the learner itself."""
        return self.rollout.quant != "none"

    @property
    def sampler_differs(self) -> bool:
        """Whether the sampler's log-probs come from a different policy or forward than the learner's at the update's
        start: a packed rollout copy (rollout.quant), a quantized KV cache (rollout.kv_cache fp8 / int8) or a stale
        version (rollout.max_staleness > 0). algo.rollout_correction=auto turns the correction on then (the
        decoupled objective: docs/grpo.md)."""
        return self.quantized_rollout or KVFormat(self.rollout.kv_cache).quantized or self.rollout.max_staleness > 0

    def loss_config(self) -> LossConfig:
        """The loss part of algo.* as `grpo_loss` takes it: rollout.max_new_tokens is the Dr.GRPO constant and
        algo.rollout_correction's `auto` is resolved (`AlgoSection.resolved_rollout_correction`)."""
        a = self.algo
        return LossConfig(policy_loss=a.policy_loss, eps_low=a.eps_low, eps_high=a.eps_high,
                          importance_level=a.importance_sampling, aggregation=a.loss_aggregation,
                          max_len=self.rollout.max_new_tokens, beta=a.beta, kl_estimator=a.kl_estimator,
                          kl_bias_correction=a.kl_bias_correction,
                          rollout_correction=a.resolved_rollout_correction(self.sampler_differs),
                          rollout_correction_cap=a.rollout_correction_cap,
                          rollout_correction_min=a.rollout_correction_min, router_aux_coef=a.router_aux_coef)

    def check_model(self, model_cfg) -> None:
        """Refuse the mixture-of-experts options for a dense model (`ModelConfig.num_experts == 0`): they would do
        nothing; routing replay of more experts than its uint8 ids hold; and AWQ rollout scales on a mixture of
        experts (AWQ's scale groups are the dense MLP's)."""
        if model_cfg.num_experts:
            if self.rollout.routing_replay and model_cfg.num_experts >= 255:
                raise ConfigError(f"rollout.routing_replay: {model_cfg.num_experts} experts do not fit the replayed "
                                  "uint8 ids (at most 254)")
            if self.rollout.quant != "none" and self.rollout.quant_scales == "awq":
                raise ConfigError(f"rollout.quant_scales=awq: model.checkpoint={self.model.checkpoint!r} is a "
                                  "mixture-of-experts model and the rollout copy's AWQ scale search covers dense MLPs "
                                  "only; use rollout.quant_scales=rtn")
            return
        for key, value, off in (("algo.router_aux_coef", self.algo.router_aux_coef, 0.0),
                                ("rollout.routing_replay", self.rollout.routing_replay, False)):
            if value != off:
                raise ConfigError(f"{key}={value}: model.checkpoint={self.model.checkpoint!r} is a dense model (no "
                                  f"experts, no router); it applies to mixture-of-experts models (Qwen3-MoE)")
