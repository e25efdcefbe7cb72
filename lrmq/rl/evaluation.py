"""`run.eval_suite`: an lrmq.evaluate suite run on the policy being trained, a few items per benchmark (paper 1
scored 3 per split every 10 steps), with the suite's decoding protocol and the trainer's rollout engine."""

from __future__ import annotations

import os

from lrmq.configlib import ConfigError
from lrmq.evals.benchmarks import BENCHMARKS, default_data_dir, load_items, resolve_suite
from lrmq.evals.config import GenerationSection
from lrmq.evals.runner import run_suite
from lrmq.rl.config import RunSection


class SuiteEval:
    def __init__(self, run: RunSection):
        """Load the suite's items now (an unknown suite is a ConfigError, missing data an EvalDataError)."""
        try:
            self.suite, names = resolve_suite(run.eval_suite)
        except KeyError as e:
            raise ConfigError(f"run.eval_suite: {e.args[0]}") from None
        data_dir = os.path.expanduser(run.eval_data_dir) if run.eval_data_dir else default_data_dir()
        self.items = [it for name in names for it in load_items(BENCHMARKS[name], data_dir, limit=run.eval_suite_limit)]

    def __call__(self, states, tokenizer, engine, max_positions: int, timeout_s: float) -> dict[str, float]:
        """eval/SUITE/BENCHMARK/{accuracy,reward} and the suite's headline, on the policy `states`."""
        gen = GenerationSection(**self.suite.generation)
        gen.batch_size = max(1, min(len(self.items), 32))
        res = run_suite(states, tokenizer, self.items, gen, suite=self.suite, engine=engine,
                        max_positions=max_positions, timeout_s=timeout_s)
        name = self.suite.name
        out = {f"eval/{name}/{b}/{k}": float(v[k]) for b, v in res["benchmarks"].items()
               for k in ("accuracy", "reward") if k in v}
        h = res.get("headline")
        if h:
            out[f"eval/{name}/{h['how']}_{h['metric']}"] = float(h["value"])
        return out
