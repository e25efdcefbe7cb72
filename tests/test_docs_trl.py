"""docs/grpo.md's "Coming from TRL" table stays honest: every lrmq key it names is an option of TrainConfig,
every row names a key or says "not offered", and every GRPOConfig field a GRPO user sets has a row."""

from __future__ import annotations

import pathlib
import re

from lrmq.config_help import iter_options
from lrmq.rl.config import TrainConfig

GRPO_MD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "grpo.md"
SECTIONS = ("model", "data", "rollout", "algo", "optim", "quant", "mesh", "run")
# the GRPOConfig / TrainingArguments fields a GRPO user sets (issue 37)
TRL_FIELDS = [
    "num_generations", "max_completion_length", "learning_rate", "lr_scheduler_type", "save_steps", "logging_steps",
    "report_to", "use_vllm", "warmup_ratio", "gradient_accumulation_steps", "per_device_train_batch_size", "beta",
    "epsilon", "epsilon_high", "delta", "loss_type", "scale_rewards", "importance_sampling_level",
    "mask_truncated_completions", "top_entropy_quantile", "num_iterations", "steps_per_generation", "temperature",
    "top_p", "top_k", "repetition_penalty", "max_prompt_length", "sync_ref_model", "reward_weights",
    "vllm_importance_sampling_correction", "_mode", "_cap", "seed", "bf16", "gradient_checkpointing",
    "use_bias_correction_kl", "warmup_steps", "max_grad_norm",
]


def trl_rows() -> list[tuple[str, str, str]]:
    text = GRPO_MD.read_text(encoding="utf-8")
    start = text.index("## Coming from TRL")
    end = text.index("\n## ", start + 1)
    rows = []
    for line in text[start:end].splitlines():  # the first table of the section
        if line.startswith("|"):
            if not line.startswith("|---"):
                cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
                assert len(cells) == 3, line
                rows.append(tuple(cells))
        elif rows:
            break
    assert rows[0][0].startswith("TRL"), rows[0]
    return rows[1:]


def test_every_lrmq_key_in_the_trl_table_exists():
    known = {key for key, _, _ in iter_options(TrainConfig)}
    missing, keyless = [], []
    for trl, lrmq, notes in trl_rows():
        keys = [k for k in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", lrmq + " " + notes) if k.split(".")[0] in SECTIONS]
        missing += [f"{trl}: {k}" for k in keys if k not in known]
        if not re.findall(r"`([a-z_]+\.[a-z_]+)`", lrmq) and "not offered" not in lrmq and "every step" not in lrmq \
                and "TensorBoard" not in lrmq:
            keyless.append(trl)
    assert not missing, f"keys in docs/grpo.md's TRL table that TrainConfig does not have: {missing}"
    assert not keyless, f"rows naming neither an lrmq key nor 'not offered': {keyless}"


def test_every_grpo_field_has_a_row():
    firsts = " ".join(trl for trl, _, _ in trl_rows())
    absent = [f for f in TRL_FIELDS if f"`{f}`" not in firsts]
    assert not absent, f"GRPOConfig fields without a row in docs/grpo.md's TRL table: {absent}"
