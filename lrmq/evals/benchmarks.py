r"""The benchmark table, the suites and their prompts, and loading a benchmark's items.

A benchmark names its source (Hugging Face dataset id, config, split, field names), its prompt
(`EVAL_PROMPTS`), its answer extractor and its scorer (`lrmq.evals.scorers`). A suite is a list of
benchmarks plus the decoding protocol of the paper it comes from.

Items come from a local file first, ``DATA_DIR/<benchmark>.jsonl`` (or ``.json``, ``.parquet``, or a
``DATA_DIR/<benchmark>/`` directory of such files) with the Hugging Face dataset's own field names, and
from ``datasets.load_dataset(hf_id, config, split=split)`` otherwise, unless offline
(``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1``). When neither is there the error names the dataset and
the files looked for.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from lrmq.data.prompts import arith_template, qwen_math_template
from lrmq.data.text import read_records
from lrmq.paths import FileFormatError, kind_of
from lrmq.registry import Registry

DATA_DIR_ENV = "LRMQ_EVAL_DATA"
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "lrmq", "evals")
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


class EvalDataError(ValueError):
    """A benchmark's data cannot be found or read; the message is one line naming dataset and files."""


def default_data_dir() -> str:
    return os.path.expanduser(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR)


# ----------------------------------------------------------------------------- prompts
# fn(row, bench) -> the model's input string. QuantLRM's prompts are copied from its inference_vllm.py
# (psunlpgroup/QuantLRM): raw strings ending in "<think>\n", no chat template.

PromptFn = Callable[[dict, "Benchmark"], str]
EVAL_PROMPTS: Registry[PromptFn] = Registry("eval prompt")

THINK = "<think>\n"


@EVAL_PROMPTS.register("qwen_math")
def _qwen_math(row: dict, b: "Benchmark") -> str:
    """Paper 1's `--qwen-math` chat prompt (system: reason step by step, answer in \\boxed{})."""
    return qwen_math_template(str(row[b.problem_field]))


@EVAL_PROMPTS.register("raw")
def _raw(row: dict, b: "Benchmark") -> str:
    return str(row[b.problem_field])


@EVAL_PROMPTS.register("arith")
def _arith(row: dict, b: "Benchmark") -> str:
    """The shipped tiny model's training format ("{problem} Answer:"): exercises the suites end to end."""
    return arith_template(str(row[b.problem_field]))


@EVAL_PROMPTS.register("quantlrm_aime")
def _quantlrm_aime(row: dict, b: "Benchmark") -> str:
    return str(row[b.problem_field]) + "\n" + THINK


@EVAL_PROMPTS.register("quantlrm_folio")
def _quantlrm_folio(row: dict, b: "Benchmark") -> str:
    return ("Use logical deductions to determine whether the provided conclusion is true, false, or uncertain "
            "based on premise. Consider all relevant information to reach a logical conclusion.\n\n*******\n"
            "Premise: " + str(row["premises"]) + "\n*******\n\n*******\nConclusion: " + str(row["conclusion"])
            + "\n*******" + THINK)


@EVAL_PROMPTS.register("quantlrm_temporal")
def _quantlrm_temporal(row: dict, b: "Benchmark") -> str:
    return ("Use the timeline provided and answer step by step. Finally give the index (the letter) of the actual "
            "correct answer.\n" + str(row[b.problem_field]) + "\n" + THINK)


@EVAL_PROMPTS.register("quantlrm_gpqa")
def _quantlrm_gpqa(row: dict, b: "Benchmark") -> str:
    return ("Answer the question by giving the index (the letter) of the actual correct answer.\n"
            + str(row[b.problem_field]) + "\n" + THINK)


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    hf_id: str
    split: str
    problem_field: str
    answer_field: str
    prompt: str  # EVAL_PROMPTS
    extractor: str  # scorers.EXTRACTORS
    scorer: str  # scorers.SCORERS
    hf_config: Optional[str] = None
    size: int = 0  # rows of the full split (documentation; a different count only warns)
    extra_fields: tuple[str, ...] = ()  # further fields the prompt reads


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in [
    # Paper 1 (understand-r1-zero's evaluation_suite: aime, amc, math, minerva, olympiad_bench)
    Benchmark("aime24", "AIME 2024", "HuggingFaceH4/aime_2024", "train", "problem", "answer",
              "qwen_math", "last_boxed", "paper_reward", size=30),
    Benchmark("amc", "AMC", "AI-MO/aimo-validation-amc", "train", "problem", "answer",
              "qwen_math", "last_boxed", "paper_reward", size=83),
    Benchmark("math500", "MATH-500", "HuggingFaceH4/MATH-500", "test", "problem", "answer",
              "qwen_math", "last_boxed", "paper_reward", size=500),
    Benchmark("minerva", "Minerva Math", "math-ai/minervamath", "test", "question", "answer",
              "qwen_math", "last_boxed", "paper_reward", size=272),
    Benchmark("olympiadbench", "OlympiadBench", "Hothan/OlympiadBench", "train", "question", "final_answer",
              "qwen_math", "last_boxed", "paper_reward", hf_config="OE_TO_maths_en_COMP", size=675),
    # QuantLRM (inference_vllm.py)
    Benchmark("aime120", "AIME-120 (2022-2025)", "ChuGyouk/AIME-22-25", "train", "problem", "answer",
              "quantlrm_aime", "final_boxed", "math_equiv", size=120),
    Benchmark("folio", "FOLIO", "yale-nlp/FOLIO", "validation", "premises", "label",
              "quantlrm_folio", "true_false_uncertain", "label_match", size=203, extra_fields=("conclusion",)),
    Benchmark("temporal_sequences", "BBH temporal_sequences", "lukaemon/bbh", "test", "input", "target",
              "quantlrm_temporal", "option_letter", "label_match", hf_config="temporal_sequences", size=250),
    Benchmark("gpqa_diamond", "GPQA-Diamond", "fingertap/GPQA-Diamond", "test", "question", "answer",
              "quantlrm_gpqa", "option_letter", "label_match", size=198),
]}


@dataclass(frozen=True)
class Suite:
    name: str
    benchmarks: tuple[str, ...]
    generation: dict  # GenerationSection defaults of the paper's protocol
    headline: str  # "pooled" (mean over all problems) or "average" (mean of benchmark means)
    headline_metric: str  # the key the paper reports
    description: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)


SUITES: dict[str, Suite] = {s.name: s for s in [
    Suite("paper1", ("aime24", "amc", "math500", "minerva", "olympiadbench"),
          {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 512, "samples": 1, "greedy": False},
          "pooled", "reward",
          "Paper 1: mean reward {0, 0.1, 1.1} pooled over the problems of five math benchmarks"),
    Suite("quantlrm", ("aime120", "folio", "temporal_sequences", "gpqa_diamond"),
          {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "max_new_tokens": 32768, "samples": 1, "greedy": False},
          "average", "accuracy",
          "QuantLRM: accuracy on four reasoning benchmarks and their unweighted average"),
]}


def suite_of_benchmark(name: str) -> Suite:
    for s in SUITES.values():
        if name in s.benchmarks:
            return s
    raise KeyError(name)


def resolve_suite(name: str) -> tuple[Suite, list[str]]:
    """A suite name, a benchmark name, or comma-separated benchmark names -> (protocol suite, benchmarks).
    Single benchmarks run under the protocol of the suite they belong to."""
    if name in SUITES:
        return SUITES[name], list(SUITES[name].benchmarks)
    names = [n.strip() for n in name.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if not names or unknown:
        raise KeyError(f"unknown suite or benchmark {name!r}; suites: {sorted(SUITES)}, "
                       f"benchmarks: {sorted(BENCHMARKS)}")
    suites = {suite_of_benchmark(n).name for n in names}
    if len(suites) > 1:
        raise KeyError(f"{name!r} mixes benchmarks of suites {sorted(suites)} (different protocols); run them "
                       "separately")
    return SUITES[suites.pop()], names


# ----------------------------------------------------------------------------- items


@dataclass(frozen=True)
class Item:
    benchmark: str
    id: str
    prompt: str
    answer: str


def answer_text(v: Any) -> Optional[str]:
    """A gold answer as a string: 142.0 -> "142", ["3"] -> "3", ["1", "2"] -> "1, 2"."""
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, (list, tuple)):
        parts = [answer_text(x) for x in v]
        return ", ".join(p for p in parts if p is not None) if parts else None
    return str(v).strip()


def local_candidates(data_dir: str, name: str) -> list[str]:
    return [os.path.join(data_dir, name + s) for s in LOCAL_SUFFIXES] + [os.path.join(data_dir, name) + os.sep]


def _read_local(path: str) -> list[dict]:
    """The rows of a local benchmark file (lrmq.data.text: .jsonl, .json as a list, columns or BIG-Bench's
    {"examples": [...]}, .parquet); a bad file is one line naming it and the line or record."""
    if not path.endswith(LOCAL_SUFFIXES):
        raise EvalDataError(f"{path}: unsupported file type (use {', '.join(LOCAL_SUFFIXES)})")
    try:
        records = read_records(path)
    except FileFormatError as e:
        raise EvalDataError(str(e)) from None
    for at, r in records:
        if not isinstance(r, dict):
            raise EvalDataError(f"{path} {at}: expected a JSON object (one benchmark item), found a {kind_of(r)}")
    return [r for _, r in records]


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def load_rows(b: Benchmark, data_dir: str) -> tuple[list[dict], str]:
    """(rows, where they came from)."""
    for path in local_candidates(data_dir, b.name):
        if path.endswith(os.sep):
            if os.path.isdir(path):
                files = sorted(f for f in glob.glob(os.path.join(path, "*")) if f.endswith(LOCAL_SUFFIXES))
                if not files:
                    raise EvalDataError(f"benchmark {b.name!r}: {path} holds no {'/'.join(LOCAL_SUFFIXES)} files")
                return [r for f in files for r in _read_local(f)], path
        elif os.path.isfile(path):
            return _read_local(path), path
    src = b.hf_id + (f" ({b.hf_config})" if b.hf_config else "") + f" split {b.split!r}"
    looked = os.path.join(data_dir, b.name + "{" + ",".join(LOCAL_SUFFIXES) + "}")
    if _offline():
        raise EvalDataError(f"benchmark {b.name!r}: dataset {src} is not available: no local file {looked} (or "
                            f"directory {os.path.join(data_dir, b.name)}/) and Hugging Face is offline "
                            "(HF_DATASETS_OFFLINE / HF_HUB_OFFLINE)")
    try:
        import datasets

        ds = datasets.load_dataset(b.hf_id, b.hf_config, split=b.split)
        return [dict(r) for r in ds], f"hf:{b.hf_id}"
    except Exception as e:  # noqa: BLE001  (network, auth, missing config: one line for all)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EvalDataError(f"benchmark {b.name!r}: dataset {src} is not available: no local file {looked}, and "
                            f"loading it from Hugging Face failed: {msg}") from None


def load_items(b: Benchmark, data_dir: str, limit: int = 0, prompt: str = "") -> list[Item]:
    """The benchmark's first `limit` items (all when 0), prompts rendered with the benchmark's prompt (or
    `prompt`, an `EVAL_PROMPTS` name)."""
    rows, where = load_rows(b, data_dir)
    if not rows:
        raise EvalDataError(f"benchmark {b.name!r}: {where} has no rows")
    need = (b.problem_field, b.answer_field, *b.extra_fields)
    missing = [f for f in need if f not in rows[0]]
    if missing:
        raise EvalDataError(f"benchmark {b.name!r}: {where} has no field(s) {missing}; it has {sorted(rows[0])} "
                            f"(the schema of {b.hf_id})")
    rows = rows[:limit] if limit else rows
    render = EVAL_PROMPTS.get(prompt or b.prompt)
    out = []
    for i, r in enumerate(rows):
        a = answer_text(r[b.answer_field])
        if a is None or a == "":
            raise EvalDataError(f"benchmark {b.name!r}: {where} row {i} has no answer in {b.answer_field!r}")
        out.append(Item(b.name, str(i), render(r, b), a))
    return out
