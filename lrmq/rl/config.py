"""The GRPO run config: typed dataclasses, loaded from YAML with dotted overrides (lrmq.configlib)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lrmq.configlib import ConfigError


@dataclass
class ModelSection:
    checkpoint: str = "tiny"  # HF or lrmq directory; "tiny" = the shipped embedded model
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype
    param_dtype: Literal["float32", "bfloat16"] = "float32"  # master weights
    # architecture preset (lrmq.model.presets, e.g. qwen3-8b) for --compile-only when the checkpoint is not here
    shapes: str = ""
    # rematerialisation of each decoder layer in the train step: none | full (recompute the layer in
    # the backward pass) | dots (save matmul outputs, recompute the rest)
    remat: Literal["none", "full", "dots"] = "none"
    # completion positions per chunk when projecting onto the vocabulary for log-probs (0 = all at once);
    # bounds the f32 [micro-batch, chunk, vocab] logits that are ever live
    logits_chunk: int = 256


@dataclass
class DataSection:
    train_files: list[str] = field(default_factory=list)  # empty: synthetic arithmetic
    eval_files: list[str] = field(default_factory=list)
    problem_field: str = "problem"
    answer_field: str = "answer"
    solution_field: str = "solution"
    template: str = "arith"  # raw | qwen_math | chat | arith
    synthetic_train_size: int = 4000
    synthetic_eval_size: int = 128
    synthetic_seed: int = 1234
    max_train_examples: int = 0  # 0 = all (paper 1 takes the first 10k)


@dataclass
class RolloutSection:
    group_size: int = 8  # G samples per prompt
    prompts_per_step: int = 8
    max_prompt_len: int = 64
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # sequences per generate call (0 = all prompts x group of a step at once); the KV cache scales with it
    generation_batch: int = 0


@dataclass
class AlgoSection:
    advantage: str = "grpo"  # grpo | drgrpo | rloo
    std_ddof: int = 1  # TRL's torch.std (unbiased), as paper 1; 0 = population std (MaxText)
    adv_eps: float = 1e-4
    loss_aggregation: str = "sequence-mean-token-mean"  # | token-mean | drgrpo-constant
    policy_loss: str = "grpo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    num_iterations: int = 1  # mu: inner updates per rollout batch
    # old log-probs of the importance ratio: "rollout" (the sampler's, as Tunix's default) or "recompute"
    # (one extra forward with the pre-update policy: the ratio starts at exactly 1, as TRL)
    old_logprobs: Literal["rollout", "recompute"] = "rollout"
    beta: float = 0.0  # KL coefficient; 0 creates no reference model at all (paper 1)
    kl_estimator: str = "k3"
    reward: str = "boxed_math"
    reward_timeout_s: float = 1.0

    def validate(self):
        from lrmq.rl.advantages import ADVANTAGES
        from lrmq.rl.losses import AGGREGATIONS, KL_ESTIMATORS
        from lrmq.rl.rewards import REWARDS

        for reg, name, key in ((ADVANTAGES, self.advantage, "advantage"),
                               (AGGREGATIONS, self.loss_aggregation, "loss_aggregation"),
                               (KL_ESTIMATORS, self.kl_estimator, "kl_estimator"), (REWARDS, self.reward, "reward")):
            if name not in reg:
                raise ConfigError(f"algo.{key}={name!r} is not registered; known: {reg.names()}")
        if self.num_iterations < 1:
            raise ConfigError("algo.num_iterations must be >= 1")


@dataclass
class OptimSection:
    lr: float = 1e-6
    schedule: Literal["linear", "constant", "cosine"] = "linear"
    warmup_steps: int = 1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    micro_batch_size: int = 0  # sequences per micro-batch for gradient accumulation; 0 = whole batch


@dataclass
class QuantSection:
    mode: Literal["none", "qat", "qlora"] = "none"
    # QAT (AQT dot_generals; gradients straight-through to float master weights)
    qat_scheme: Literal["paper_int8", "int8", "int4", "w8a8"] = "paper_int8"
    qat_group_size: int = 0  # 0 = per output channel
    qat_stochastic_rounding: bool = False
    targets: str = r".*\.(q|k|v|o|gate|up|down)_proj$"  # regex over module paths; lm_head excluded
    # QLoRA (frozen packed base + LoRA adapters)
    base_format: Literal["nf4", "int4"] = "nf4"
    base_group_size: int = 64
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05


@dataclass
class MeshSection:
    data: int = 1
    fsdp: int = -1  # -1: all remaining devices
    tensor: int = 1
    # the hardware the recipe is written for, as a TPU topology (e.g. v5p:2x4x4): --compile-only compiles
    # for it when no --topology is given
    topology: str = ""


@dataclass
class RunSection:
    out_dir: str = "runs/default"
    steps: int = 100
    seed: int = 0
    save_every: int = 50
    keep_checkpoints: int = 2
    eval_every: int = 0  # 0 = only before and after training
    eval_size: int = 128
    eval_greedy: bool = True  # also evaluate greedy decoding (eval/accuracy is sampled at the rollout temperature)
    log_every: int = 1
    export_hf: bool = True
    # compile the update and the rollout before the first step and refuse to start when either needs more
    # memory per device than it has: auto = on accelerators only
    preflight: Literal["auto", "on", "off"] = "auto"
    hbm_limit_gib: float = 0.0  # per-device memory the preflight check allows; 0 = the device's own limit
    progress: bool = True


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    optim: OptimSection = field(default_factory=OptimSection)
    quant: QuantSection = field(default_factory=QuantSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    run: RunSection = field(default_factory=RunSection)

    def validate(self):
        r, o = self.rollout, self.optim
        seqs = r.prompts_per_step * r.group_size
        if r.group_size < 2 and self.algo.advantage in ("grpo", "rloo"):
            raise ConfigError(f"rollout.group_size={r.group_size}: group-relative advantages need >= 2 samples")
        if o.micro_batch_size and seqs % o.micro_batch_size:
            raise ConfigError(f"optim.micro_batch_size={o.micro_batch_size} does not divide the "
                              f"{seqs} sequences per step (prompts_per_step x group_size)")
        if o.micro_batch_size and o.micro_batch_size % r.group_size and r.group_size % o.micro_batch_size:
            pass  # micro-batches may split groups: advantages are computed before splitting
        if self.mesh.data > 0 and self.mesh.fsdp > 0:
            div = self.mesh.data * self.mesh.fsdp
            mb = o.micro_batch_size or seqs
            if seqs % div or mb % div:
                raise ConfigError(f"batch of {seqs} sequences (micro-batch {mb}) is not divisible by the data axes "
                                  f"mesh.data x mesh.fsdp = {div}")
        if self.run.steps < 1:
            raise ConfigError("run.steps must be >= 1")
