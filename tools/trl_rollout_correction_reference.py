"""TRL's own rollout/learner mismatch correction (`vllm_importance_sampling_correction`) on the fixed batch of
tools/trl_reference.py: the reference tests/test_rollout_correction.py holds lrmq's algo.rollout_correction to.
Runs in a venv with trl 1.16 (pip install -e '.[bench]', or a side venv with trl==1.16.0 torch==2.13.0
transformers==5.24.0), not in lrmq's: it imports no JAX.

    python tools/trl_rollout_correction_reference.py --out tests/fixtures/trl_rollout_correction_reference.json

For every case (correction mode x cap x loss type x on-/off-policy old log-probs, with the KL term and GSPO in
some) it computes TRL's importance-sampling weight by running the block of TRL's own
`GRPOTrainer._generate_and_score_completions` source that computes it (extracted and executed as is, so a change
in TRL shows up here), from the learner's old log-probs and given sampler log-probs, then calls
`GRPOTrainer._compute_loss` with that weight (use_vllm and the correction switched on) and records the loss, the
weight and the gradient as tools/trl_reference.py does.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import platform
import sys
import tempfile
import textwrap

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_reference import SMALL, TINY, direction, fixed_batch  # noqa: E402

# (name, loss_type, importance_sampling_level, beta, use_bias_correction_kl, eps_low, eps_high,
#  mode, clip_max, clip_min, old: "learner" (first update: old == the learner's forward) or "stale" (mu > 1),
#  sampler noise scale)
CASES = [
    ("token_truncate_grpo", "grpo", "token", 0.0, False, 0.2, 0.2, "token_truncate", 1.5, None, "learner", 0.5),
    ("token_mask_bnpo_two_sided", "bnpo", "token", 0.0, False, 0.2, 0.2, "token_mask", 1.5, 1 / 1.5, "stale", 0.5),
    ("sequence_truncate_dapo", "dapo", "token", 0.0, False, 0.2, 0.28, "sequence_truncate", 1.5, 0.8, "stale", 0.3),
    ("sequence_mask_grpo_kl", "grpo", "token", 0.04, True, 0.2, 0.2, "sequence_mask", 3.0, None, "stale", 0.5),
    ("sequence_mask_dr_grpo_default", "dr_grpo", "token", 0.0, False, 0.2, 0.2, "sequence_mask", 3.0, None, "learner",
     0.5),
    ("token_truncate_gspo", "grpo", "sequence", 0.0, False, 3e-4, 4e-4, "token_truncate", 1.5, None, "stale", 0.5),
]
MARKER = "if self.use_vllm and self.vllm_importance_sampling_correction:"


def trl_is_block() -> str:
    """The source of TRL's importance-sampling-weight block (the first `if use_vllm and correction:` in
    `_generate_and_score_completions`), dedented: run with `exec` on our tensors."""
    from trl import GRPOTrainer

    lines = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == MARKER)
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    block = textwrap.dedent("\n".join(lines[start:end]))
    assert "vllm_importance_sampling_ratio" in block and "sampling_per_token_logps" in block, block
    return block


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(TINY, "tokenizer.json"))
    tok.pad_token = tok.pad_token or tok.convert_ids_to_tokens(0)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    batch = fixed_batch(model.config.vocab_size)
    n = len(batch["completion_ids"][0])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(output_dir=tmp, per_device_train_batch_size=6, num_generations=6, max_completion_length=n,
                         temperature=1.0, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                         logging_steps=1)
        trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **k: [0.0] * len(completions)], args=cfg,
                              train_dataset=Dataset.from_dict({"prompt": ["x"] * 6}), processing_class=tok)
    model.eval()
    block = trl_is_block()
    t = {k: torch.tensor(v) for k, v in batch.items()}
    sampler_noise = np.random.default_rng(1).normal(0, 1, t["old_noise"].shape).astype(np.float32)
    directions = {k: torch.tensor(direction(k, tuple(p.shape))) for k, p in model.named_parameters()}
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([t["prompt_ids"], t["completion_ids"]], 1),
            torch.cat([t["prompt_mask"], t["completion_mask"]], 1), n)

    cases = {}
    for name, loss_type, level, beta, bias_corr, eps_low, eps_high, mode, cmax, cmin, old_kind, scale in CASES:
        trainer.loss_type, trainer.importance_sampling_level, trainer.beta = loss_type, level, beta
        trainer.args.use_bias_correction_kl = bias_corr
        trainer.epsilon_low, trainer.epsilon_high = eps_low, eps_high
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
        trainer.vllm_importance_sampling_mode = mode
        trainer.vllm_importance_sampling_clip_max, trainer.vllm_importance_sampling_clip_min = cmax, cmin
        cmask = t["completion_mask"]
        if old_kind == "learner":
            old = logps * cmask
        else:
            old = (logps + t["old_noise"] * (0.002 if level == "sequence" else 1.0)) * cmask
        sampler = (old + torch.tensor(sampler_noise) * scale) * cmask
        ns = {"self": trainer, "old_per_token_logps": old, "sampling_per_token_logps": sampler,
              "completion_mask": cmask, "tool_mask": None, "torch": torch, "math": math}
        exec(block, ns)
        weight = ns["vllm_importance_sampling_ratio"]
        inputs = {"prompt_ids": t["prompt_ids"], "prompt_mask": t["prompt_mask"],
                  "completion_ids": t["completion_ids"], "completion_mask": cmask,
                  "advantages": t["advantages"], "num_items_in_batch": cmask.sum(),
                  "importance_sampling_ratio": weight, "sampling_per_token_logps": sampler}
        if old_kind == "stale":  # TRL's first-update old log-probs are its own forward: pass them only when stale
            inputs["old_per_token_logps"] = old
        if beta:
            inputs["ref_per_token_logps"] = (logps + t["ref_noise"]) * cmask
        trainer._metrics["eval"].clear()
        model.zero_grad()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        cases[name] = {
            "loss_type": loss_type, "importance_sampling_level": level, "beta": beta,
            "use_bias_correction_kl": bias_corr, "epsilon_low": eps_low, "epsilon_high": eps_high,
            "temperature": 1.0, "mode": mode, "clip_max": cmax, "clip_min": cmin, "old": old_kind,
            "old_per_token_logps": old.tolist(), "sampling_per_token_logps": sampler.tolist(),
            "ref_per_token_logps": inputs["ref_per_token_logps"].tolist() if beta else None,
            "importance_sampling_ratio": weight.tolist(),
            "loss": float(loss.detach()),
            "metrics": {k: float(v[-1]) for k, v in trainer._metrics["eval"].items() if v},
            "grad_norm": {k: float(g.norm()) for k, g in grads.items()},
            "grad_projection": {k: float((g * directions[k]).sum()) for k, g in grads.items()},
            "grad_small": {k: grads[k].tolist() for k in SMALL},
        }
        w = weight[cmask.bool()] if weight.shape[-1] != 1 else weight
        print(f"{name:32s} loss {float(loss.detach()):+.6f}  weight min {float(w.min()):.3f} max {float(w.max()):.3f}"
              f"  zero {float((w == 0).float().mean()):.2f}")

    out = {"what": "TRL GRPOTrainer vLLM importance-sampling correction + _compute_loss on the fixed batch of "
                   "tools/trl_reference.py (tools/trl_rollout_correction_reference.py)",
           "date": datetime.date.today().isoformat(), "machine": platform.platform(),
           "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
           "trl_block": block, "batch": {k: v.tolist() for k, v in batch.items()}, "cases": cases}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
