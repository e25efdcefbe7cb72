"""The fingerprint of a short synchronous GRPO run on the tiny model: what `tests/test_rl_roles.py` compares the
Sampler / Learner loop (placement colocated, max_staleness 0) with. `python tests/sync_golden.py` records it into
tests/data/sync_golden.json from the code checked out (it was recorded from the GRPOTrainer of 6576fb1, before
the Sampler / Learner split)."""

from __future__ import annotations

import hashlib
import json
import os
import sys

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sync_golden.json")
STEPS = 2


def golden_config(out_dir: str, **sections):
    from conftest import tiny_train_config

    run = {"steps": STEPS, "save_every": STEPS, "eval_size": 0, **sections.pop("run", {})}
    return tiny_train_config(out_dir, run=run, **sections)


def fingerprint(run_dir: str) -> dict:
    """Per step: the sha256 of its completions (text, reward, advantage, token count, in order) and its train/* and
    reward/* metrics."""
    with open(os.path.join(run_dir, "completions.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    out = {}
    for step in range(1, STEPS + 1):
        recs = [[r["completion"], r["reward"], r["advantage"], r["tokens"]] for r in records if r["step"] == step]
        m = [x for x in metrics if x["step"] == step][-1]
        out[str(step)] = {"completions_sha256": hashlib.sha256(json.dumps(recs).encode()).hexdigest(),
                          "metrics": {k: v for k, v in m.items() if k.split("/")[0] in ("train", "reward")}}
    return out


if __name__ == "__main__":  # record
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import conftest  # noqa: F401  (the suite's XLA flags, before JAX starts)
    from lrmq.rl.trainer import GRPOTrainer

    with tempfile.TemporaryDirectory() as d:
        GRPOTrainer(golden_config(d)).train()
        fp = fingerprint(d)
    with open(GOLDEN, "w") as f:
        json.dump(fp, f, indent=1, sort_keys=True)
    print(json.dumps(fp, indent=1)[:2000])
