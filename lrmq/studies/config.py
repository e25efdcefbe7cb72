"""`StudyConfig`: the typed config of `python -m lrmq.study` (YAML `--config configs/study/NAME.yaml` plus
dotted `key=value` overrides; unknown keys are errors, every field described: `--help-config`).

A study is a matrix of arms run over seeds. An arm is one recipe:

* ``base``: the study's starting checkpoint, evaluated as is (paper 1's "no RL" floor);
* ``train``: ``python -m lrmq.train`` with the study's train config plus the arm's overrides (GRPO,
  Dr.GRPO, QAT-in-RL, QLoRA), then the final policy is evaluated;
* ``ptq``: ``python -m lrmq.quantize`` of another arm's model (same seed), then evaluated.

Arms come from the paper presets (``paper1`` / ``paper2`` sections, expanded by `lrmq.studies.matrix`) and
from the explicit ``arms`` list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lrmq.configlib import ConfigError, load_config, opt
from lrmq.ptq.importance import MAPPINGS
from lrmq.ptq.methods import PTQ_METHODS

ARM_KINDS = ("base", "train", "ptq")


@dataclass
class ArmSpec:
    name: str = opt("", "unique arm name (letters, digits, '_', '-', '.'): its directory under runs/")
    kind: Literal["base", "train", "ptq"] = opt("train", "base (evaluate the starting checkpoint), train "
                                                         "(lrmq.train) or ptq (lrmq.quantize of the source arm)")
    group: str = opt("", "family shown in tables and plots (e.g. GRPO, PTQ, QAT, QLoRA); empty = kind")
    train: list[str] = opt(help="train: dotted overrides on top of the study's train config", factory=list)
    source: str = opt("", "ptq: the arm whose model (same seed) is quantized")
    method: str = opt("", "ptq: the PTQ method", names=PTQ_METHODS, empty_ok=True)
    bits: int = opt(4, "ptq: weight bits, 2-8 (docs/ptq.md lists the widths each method and format takes)", ge=2, le=8)
    group_size: int = opt(128, "ptq: input rows per group (-1 = per output channel; 0 = per tensor, rtn / int8; "
                               "nf4: the block size)", ge=1, also=(-1, 0))
    quantize: list[str] = opt(help="ptq: further dotted overrides of the QuantizeConfig (e.g. "
                                   "quantlrm.mapping=inverted_u)", factory=list)
    before: Literal["run", "pseudo_ft"] = opt("run", "ptq quantlrm: the 'before' weights: run (the source "
                                                     "run's initial_policy) or pseudo_ft (a short SFT of the "
                                                     "policy on its own correct rollouts; the policy itself is "
                                                     "quantized)")
    baseline: str = opt("", "the arm this one is compared against in results.md (empty: a ptq arm's source)")
    compare: dict[str, str] = opt(help="train arms trained quantized (QAT): the PTQ arms the QAT-vs-PTQ table pairs "
                                       "this arm with, label -> arm (paper1 sets 'same format': RTN of the FP policy "
                                       "in this arm's weight format, and 'paper 1 pairing'); empty: every PTQ arm "
                                       "of the baseline's policy at the same bits", factory=dict)
    nominal_bits: float = opt(0.0, "bits per weight shown on the accuracy-vs-bits plot (0 = from the recipe)", ge=0)

    def validate(self):
        if not self.name or not all(c.isalnum() or c in "_-." for c in self.name):
            raise ValueError(f"arm name {self.name!r}: use letters, digits, '_', '-' or '.'")
        if self.kind == "ptq" and (not self.source or not self.method):
            raise ValueError(f"arm {self.name}: kind ptq needs source (an arm) and method")
        if self.kind != "ptq" and (self.method or self.source or self.quantize):
            raise ValueError(f"arm {self.name}: source/method/quantize are for kind ptq")
        if self.kind != "train" and self.train:
            raise ValueError(f"arm {self.name}: train overrides are for kind train")


@dataclass
class TrainSection:
    config: str = opt("configs/tiny_demo.yaml", "the train config every train arm starts from "
                                                "(lrmq.train --config)")
    overrides: list[str] = opt(help="dotted overrides applied to every train arm (before the arm's own)",
                               factory=list)


@dataclass
class QuantizeSection:
    config: str = opt("", "a lrmq.quantize config every ptq arm starts from (empty = defaults)")
    overrides: list[str] = opt(help="dotted overrides applied to every ptq arm (before the arm's own)",
                               factory=list)
    calibration: str = opt("", "calibration file for awq/gptq/quantlrm (empty = the study writes synthetic "
                                "arithmetic problems, data/train.jsonl, with lrmq.data.synthetic)")
    calibration_size: int = opt(512, "problems written when the study writes its calibration file", ge=1)
    pseudo_ft_steps: int = opt(20, "steps of the pseudo-fine-tuning SFT (before: pseudo_ft)", ge=1)


@dataclass
class EvalSection:
    kind: Literal["heldout", "suite"] = opt("heldout", "heldout: accuracy on the train config's held-out "
                                                       "problems (synthetic split or data.eval_files; "
                                                       "lrmq.studies.heldout); suite: python -m lrmq.evaluate")
    size: int = opt(256, "heldout: problems evaluated (the first N of the held-out split)", ge=1)
    samples: int = opt(1, "heldout: sampled completions per problem (accuracy = their mean)", ge=1)
    greedy: bool = opt(True, "heldout: also score greedy decoding (greedy_accuracy)")
    metric: str = opt("sampled_accuracy", "the number tables and plots use: heldout: sampled_accuracy | "
                                          "greedy_accuracy | sampled_reward; suite: headline")
    config: str = opt("configs/eval/paper1.yaml", "suite: the lrmq.evaluate config")
    overrides: list[str] = opt(help="suite: dotted overrides of the lrmq.evaluate config", factory=list)

    def validate(self):
        ok = ("sampled_accuracy", "greedy_accuracy", "sampled_reward", "greedy_reward") if self.kind == "heldout" \
            else ("headline",)
        if self.metric not in ok:
            raise ValueError(f"eval.metric {self.metric!r} for eval.kind {self.kind}: one of {list(ok)}")
        if self.kind == "heldout" and self.metric.startswith("greedy") and not self.greedy:
            raise ValueError("eval.metric is greedy but eval.greedy is false")


@dataclass
class Paper1Matrix:
    enabled: bool = opt(False, "add paper 1's matrix (quantization-aware RL vs full-precision RL + PTQ / QLoRA)")
    algorithms: dict[str, list[str]] = opt(
        help="RL algorithms: name -> train overrides; each gets the full set of arms",
        factory=lambda: {"grpo": ["algo.advantage=grpo", "algo.loss_aggregation=sequence-mean-token-mean"],
                         "drgrpo": ["algo.advantage=drgrpo", "algo.loss_aggregation=drgrpo-constant"]})
    ptq_methods: list[str] = opt(help="PTQ of each full-precision policy (nf4 runs at 4 bits only, int8 at 8)",
                                 factory=lambda: ["rtn", "nf4", "int8", "awq", "gptq", "quantlrm"],
                                 names=PTQ_METHODS)
    bits: list[int] = opt(help="weight bits of the int PTQ methods", factory=lambda: [4, 3], ge=3, le=8)
    group_size: int = opt(128, "PTQ group size (g128 as the papers; the tiny model's K are 128 and 384)",
                          ge=1, also=(-1,))
    qat_schemes: list[str] = opt(help="QAT-in-RL schemes (quant.qat_scheme)",
                                 factory=lambda: ["paper_int8", "int8", "int4"],
                                 names=("paper_int8", "int8", "int4", "int4_asym", "int8_asym", "w8a8"),
                                 kind="QAT scheme")
    qat_overrides: list[str] = opt(help="train overrides of the QAT arms", factory=list)
    qat_group_size: dict[str, int] = opt(help="quant.qat_group_size of a scheme's QAT arms, scheme -> input rows per "
                                              "group (a scheme not named: the train config's; 0 = per output "
                                              "channel)", factory=dict)
    same_format_ptq: bool = opt(True, "pair each QAT arm with RTN of the FP policy in exactly its weight format "
                                      "(lrmq.quant.qat.qat_weight_format; an arm of ptq_methods in that format is "
                                      "reused, else an rtn arm is added): the QAT-vs-PTQ table's matched pairs")
    paper_pairs: dict[str, str] = opt(help="paper 1's own pairings, a labelled row of the QAT-vs-PTQ table: QAT scheme "
                                           "-> the PTQ arm of the same algorithm, without the 'ALG-ptq-' prefix",
                                      factory=lambda: {"paper_int8": "awq-w4"})
    qlora_bases: list[str] = opt(help="QLoRA base formats (quant.base_format)", factory=lambda: ["nf4", "int4"],
                                 names=("nf4", "int4"), kind="QLoRA base format")
    qlora_overrides: list[str] = opt(help="train overrides of the QLoRA arms (paper 1: lr 1e-4 vs 1e-6)",
                                     factory=list)
    base: bool = opt(True, "add the base model without RL (the floor)")

    def validate(self):
        for what, keys in (("qat_group_size", self.qat_group_size), ("paper_pairs", self.paper_pairs)):
            unknown = [k for k in keys if k not in self.qat_schemes]
            if unknown:
                raise ValueError(f"paper1.{what}: {unknown} not in paper1.qat_schemes {self.qat_schemes}")
        bad = {k: v for k, v in self.qat_group_size.items() if v < 0}
        if bad:
            raise ValueError(f"paper1.qat_group_size: {bad}: 0 (per output channel) or a positive group size")


@dataclass
class Paper2Matrix:
    enabled: bool = opt(False, "add paper 2's matrix (QuantLRM vs AWQ / GPTQ / RTN on the RL policy)")
    algorithm: str = opt("grpo", "the RL run whose policy is quantized: a paper1 algorithm name (its train "
                                 "arm is shared when paper1 is enabled) or 'grpo'")
    algorithm_overrides: list[str] = opt(help="train overrides of that run when paper1 does not define it",
                                         factory=lambda: ["algo.advantage=grpo"])
    methods: list[str] = opt(help="PTQ methods compared", factory=lambda: ["quantlrm", "awq", "gptq", "rtn"],
                             names=PTQ_METHODS)
    bits: list[int] = opt(help="weight bits", factory=lambda: [3, 4], ge=3, le=8)
    group_size: int = opt(128, "group size", ge=1, also=(-1,))
    mappings: list[str] = opt(help="importance-mapping ablation of quantlrm at ablation_bits (u_shape is the "
                                   "main arm)", factory=lambda: ["inverted_u", "increasing", "decreasing",
                                                                 "constant"], names=MAPPINGS)
    ablation_bits: int = opt(3, "bits of the mapping ablation and pseudo-fine-tuning arms", ge=3, le=8)
    pseudo_ft: bool = opt(True, "add quantlrm with pseudo-fine-tuning 'before' weights (no pre-RL checkpoint)")


@dataclass
class StudyConfig:
    name: str = opt("study", "study name (titles of results.md and plots)")
    out_dir: str = opt("studies/study", "the study directory: runs/ARM/seedS/, results.json, results.md, "
                                        "plots/; rerunning resumes")
    seeds: list[int] = opt(help="seeds: each arm runs once per seed (run.seed, eval sampling)",
                           factory=lambda: [0, 1, 2])
    parallel: int = opt(1, "arm jobs run at once (separate processes)", ge=1)
    threads: int = opt(0, "threads per job of OpenMP, MKL, OpenBLAS and numba (environment; XLA keeps its own; "
                          "0 = leave the defaults)", ge=0)
    only: list[str] = opt(help="run only these arms (and the arms they depend on); empty = all", factory=list)
    timeout_s: float = opt(0.0, "per command time limit in seconds (0 = none)", ge=0)
    train: TrainSection = opt(help="the train recipe the train arms start from", factory=TrainSection)
    quantize: QuantizeSection = opt(help="the PTQ recipe the ptq arms start from", factory=QuantizeSection)
    eval: EvalSection = opt(help="how every arm is evaluated", factory=EvalSection)
    paper1: Paper1Matrix = opt(help="paper 1's matrix preset", factory=Paper1Matrix)
    paper2: Paper2Matrix = opt(help="paper 2's matrix preset", factory=Paper2Matrix)
    arms: list[ArmSpec] = opt(help="explicit arms (added after the presets; a preset arm of the same name is "
                                   "replaced)", factory=list)
    plots: bool = opt(True, "write plots/ (matplotlib)")

    def validate(self):
        if not self.seeds:
            raise ValueError("seeds is empty")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds repeat: {self.seeds}")


def load_study_config(path: str | None, overrides=()) -> StudyConfig:
    return load_config(StudyConfig, path, list(overrides))


__all__ = ["ARM_KINDS", "ArmSpec", "ConfigError", "EvalSection", "Paper1Matrix", "Paper2Matrix",
           "QuantizeSection", "StudyConfig", "TrainSection", "load_study_config"]
