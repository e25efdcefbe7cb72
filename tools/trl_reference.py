"""TRL's own GRPO loss on a fixed batch of the shipped tiny model: the reference tests/test_trl_parity.py holds
lrmq to. Runs in a venv with trl (pip install -e '.[bench]'), not in lrmq's: it imports no JAX.

    python tools/trl_reference.py --out tests/fixtures/trl_grpo_reference.json

For every case (loss type x importance level x KL with and without TRL's bias correction x clip range x
temperature) it calls `GRPOTrainer._compute_loss` on one fixed batch (left-padded prompts, right-padded
completions, off-policy old log-probs so the ratio is not 1 and some tokens clip) and records the loss,
TRL's logged metrics, and the gradient: per-tensor L2 norms, the full gradient of two small tensors,
and each tensor's gradient projected on a fixed random direction (a scalar that any gradient error moves).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import zlib

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "lrmq", "assets", "tiny")

# (name, TRL loss_type, importance_sampling_level, beta, use_bias_correction_kl, epsilon_low, epsilon_high, temperature)
CASES = [
    ("grpo", "grpo", "token", 0.0, False, 0.2, 0.2, 1.0),
    ("grpo_kl", "grpo", "token", 0.04, False, 0.2, 0.2, 1.0),
    ("grpo_kl_bias_corrected", "grpo", "token", 0.04, True, 0.2, 0.28, 1.0),
    ("bnpo", "bnpo", "token", 0.0, False, 0.2, 0.2, 0.7),
    ("dapo_clip_higher", "dapo", "token", 0.0, False, 0.2, 0.28, 1.0),
    ("dr_grpo", "dr_grpo", "token", 0.0, False, 0.2, 0.2, 1.0),
    ("gspo", "grpo", "sequence", 0.0, False, 3e-4, 4e-4, 1.0),
    ("gspo_kl_bias_corrected", "grpo", "sequence", 0.04, True, 3e-4, 4e-4, 1.0),
]
SMALL = ("model.norm.weight", "model.layers.0.self_attn.q_norm.weight")


def direction(name: str, shape: tuple) -> np.ndarray:
    """The fixed random direction a tensor's gradient is projected on (seeded by its HF name)."""
    return np.random.default_rng(zlib.crc32(name.encode())).standard_normal(shape).astype(np.float32)


def fixed_batch(vocab: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    b, p, n = 6, 7, 9
    prompt_len = np.array([7, 5, 3, 6, 7, 4])
    comp_len = np.array([9, 4, 1, 7, 9, 2])
    prompt_ids = rng.integers(1, vocab, (b, p))
    prompt_mask = (np.arange(p)[None, :] >= (p - prompt_len)[:, None]).astype(np.int64)  # left padding
    prompt_ids = np.where(prompt_mask > 0, prompt_ids, 0)
    completion_ids = rng.integers(1, vocab, (b, n))
    completion_mask = (np.arange(n)[None, :] < comp_len[:, None]).astype(np.int64)
    completion_ids = np.where(completion_mask > 0, completion_ids, 0)
    advantages = np.array([1.2, -0.7, 0.4, -1.5, 0.0, 0.9], np.float32)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages,
            "old_noise": rng.normal(0, 0.25, (b, n)).astype(np.float32),
            "ref_noise": rng.normal(0, 0.3, (b, n)).astype(np.float32)}


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
    trainers = {}

    def trainer_at(temperature: float):
        """A GRPOTrainer on a fresh copy of the model: TRL bakes the temperature into the model's fused LM head
        when the trainer is built, so each temperature gets its own."""
        if temperature not in trainers:
            model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
            with tempfile.TemporaryDirectory() as tmp:
                cfg = GRPOConfig(output_dir=tmp, per_device_train_batch_size=6, num_generations=6,
                                 max_completion_length=n, temperature=temperature, report_to=[], use_cpu=True,
                                 bf16=False, gradient_checkpointing=False, logging_steps=1)
                trainers[temperature] = GRPOTrainer(
                    model=model, reward_funcs=[lambda completions, **k: [0.0] * len(completions)], args=cfg,
                    train_dataset=Dataset.from_dict({"prompt": ["x"] * 6}), processing_class=tok)
            model.eval()  # TRL's "eval" mode: no gradient-accumulation normaliser; dropout is 0 anyway
        return trainers[temperature]

    vocab = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).config.vocab_size
    batch = fixed_batch(vocab)
    t = {k: torch.tensor(v) for k, v in batch.items()}
    n = batch["completion_ids"].shape[1]

    cases = {}
    for name, loss_type, level, beta, bias_corr, eps_low, eps_high, temperature in CASES:
        trainer = trainer_at(temperature)
        model = trainer.model
        directions = {k: torch.tensor(direction(k, tuple(p.shape))) for k, p in model.named_parameters()}
        trainer.loss_type, trainer.importance_sampling_level, trainer.beta = loss_type, level, beta
        trainer.args.use_bias_correction_kl = bias_corr
        trainer.epsilon_low, trainer.epsilon_high = eps_low, eps_high
        with torch.no_grad():  # the policy's own log-probs at this temperature, to build old/ref around
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                model, torch.cat([t["prompt_ids"], t["completion_ids"]], 1),
                torch.cat([t["prompt_mask"], t["completion_mask"]], 1), n)
        old = (logps + t["old_noise"] * (0.002 if level == "sequence" else 1.0)) * t["completion_mask"]
        inputs = {"prompt_ids": t["prompt_ids"], "prompt_mask": t["prompt_mask"],
                  "completion_ids": t["completion_ids"], "completion_mask": t["completion_mask"],
                  "advantages": t["advantages"], "old_per_token_logps": old,
                  "num_items_in_batch": t["completion_mask"].sum()}
        if beta:
            inputs["ref_per_token_logps"] = (logps + t["ref_noise"]) * t["completion_mask"]
        trainer._metrics["eval"].clear()
        model.zero_grad()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        cases[name] = {
            "loss_type": loss_type, "importance_sampling_level": level, "beta": beta, "use_bias_correction_kl": bias_corr,
            "epsilon_low": eps_low, "epsilon_high": eps_high, "temperature": temperature,
            "old_per_token_logps": old.tolist(),
            "ref_per_token_logps": inputs["ref_per_token_logps"].tolist() if beta else None,
            "loss": float(loss.detach()),
            "metrics": {k: float(v[-1]) for k, v in trainer._metrics["eval"].items() if v},
            "grad_norm": {k: float(g.norm()) for k, g in grads.items()},
            "grad_projection": {k: float((g * directions[k]).sum()) for k, g in grads.items()},
            "grad_small": {k: grads[k].tolist() for k in SMALL},
        }
        print(f"{name:24s} loss {float(loss.detach()):+.6f}")

    out = {"what": "TRL GRPOTrainer._compute_loss on a fixed batch of lrmq/assets/tiny (tools/trl_reference.py)",
           "date": datetime.date.today().isoformat(), "machine": platform.platform(),
           "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
           "batch": {k: v.tolist() for k, v in batch.items()},
           "cases": cases}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
