"""Prompt datasets from local files, and prompt templates (problem text -> model input string).

`load_prompt_dataset` always returns a `datasets.Dataset` with exactly two string columns,
`problem` and `answer`, whatever the source field names were.
"""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from lrmq.data.text import label, read_records
from lrmq.paths import FileFormatError, is_url, kind_of, local_copy
from lrmq.registry import Registry

if TYPE_CHECKING:
    import datasets

    from lrmq.tokenizer import Tokenizer

# Suffix -> `datasets` builder name for single files.
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def _datasets():
    # Never touch the network: local files only (set before `datasets` reads its config at import).
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    return datasets


def _extract_last_boxed(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched; `\\boxed 5` also works."""
    for tag in ("\\boxed", "\\fbox"):  # \fbox only when no \boxed parses
        start = text.rfind(tag)
        while start != -1:
            content = _boxed_content(text, start + len(tag))
            if content is not None:
                return content
            start = text.rfind(tag, 0, start)
    return None


def _boxed_content(text: str, i: int) -> Optional[str]:
    if text.startswith(" ", i):  # "\boxed 5": up to the next space or `$`
        rest = text[i + 1 :]
        end = min([p for p in (rest.find(" "), rest.find("$")) if p != -1], default=len(rest))
        return rest[:end] or None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced


def _first_line(e: BaseException) -> str:
    """The innermost cause's first line (datasets wraps the parser's error in DatasetGenerationError)."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _why_unreadable(files: Sequence[str], option: Optional[str]) -> None:
    """Raise the precise one-line error (file, line, what) for JSON / JSON Lines files `datasets` refused."""
    for f in files:
        if os.path.splitext(f)[1].lower() in (".jsonl", ".json"):
            for at, rec in read_records(f, option):
                if not isinstance(rec, dict):
                    raise FileFormatError(f"{label(f, option)} {at}: expected a JSON object (one problem), found "
                                          f"a {kind_of(rec)}")


def _load_one(path: str, split: str, cache_dir: Optional[str], option: Optional[str] = None) -> "datasets.Dataset":
    ds_lib = _datasets()
    where = label(path, option)
    if is_url(path):  # a bucket file or directory of files: read from a per-process local copy
        path = local_copy(path, "prompt dataset", where)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{where}: prompt dataset not found" if option else f"prompt dataset not found: {path}")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_info.json")) or os.path.exists(os.path.join(path, "dataset_dict.json")):
            try:
                obj = ds_lib.load_from_disk(path)  # a save_to_disk() directory
            except Exception as e:  # a damaged save_to_disk directory: arrow, json and file errors
                raise ValueError(f"{where}: cannot load the saved dataset ({_first_line(e)})") from None
            if isinstance(obj, ds_lib.DatasetDict):
                if split not in obj:
                    raise KeyError(f"{path}: no split {split!r}; available: {sorted(obj)}")
                obj = obj[split]
            return obj
        files = sorted(f for f in glob.glob(os.path.join(path, "*")) if os.path.splitext(f)[1] in _FORMATS)
        kinds = {_FORMATS[os.path.splitext(f)[1]] for f in files}
        if len(kinds) != 1:
            raise ValueError(f"{where}: expected data files of one format {sorted(set(_FORMATS))}, found {sorted(kinds) or 'none'}")
        fmt = kinds.pop()
    else:
        ext = os.path.splitext(path)[1].lower()
        if ext not in _FORMATS:
            raise ValueError(f"{where}: unsupported file type {ext!r}; use one of {sorted(_FORMATS)} or a save_to_disk dir")
        fmt, files = _FORMATS[ext], [path]
    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"prompt dataset {where} is empty")
    try:
        return ds_lib.load_dataset(fmt, data_files={split: files}, split=split, cache_dir=cache_dir)
    except Exception as e:  # datasets raises many types (DatasetGenerationError wraps the parser's error)
        if isinstance(e, StopIteration) or "corresponds to no data" in str(e):
            raise ValueError(f"prompt dataset {where} is empty") from None
        _why_unreadable(files, option)  # JSON: the file, line and problem
        raise ValueError(f"{where}: could not load as {fmt} ({_first_line(e)})") from None


def load_prompt_dataset(
    path_or_paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    problem_field: str = "problem",
    answer_field: str = "answer",
    solution_field: Optional[str] = "solution",
    split: str = "train",
    cache_dir: Optional[str] = None,
    option: Optional[str] = None,
) -> "datasets.Dataset":
    """Local jsonl/json/parquet/csv/arrow files or save_to_disk dirs -> Dataset[problem, answer] (str).

    When `answer_field` is not a column, the answer is the last `\\boxed{}` of `solution_field`.
    Several paths are concatenated in order. `option`: the key or flag the paths came from
    (`data.train_files`), named in the errors with the file (and, for JSON, the line).
    """
    ds_lib = _datasets()
    paths = [path_or_paths] if isinstance(path_or_paths, (str, os.PathLike)) else list(path_or_paths)
    if not paths:
        raise ValueError("load_prompt_dataset: no paths given")
    parts = []
    for p in map(os.fspath, paths):
        ds = _load_one(p, split, cache_dir, option)
        where = label(p, option)
        if len(ds) == 0:
            raise ValueError(f"prompt dataset {where} is empty")
        cols = list(ds.column_names)
        if problem_field not in cols:
            raise KeyError(f"{where}: missing problem field {problem_field!r}; available columns: {cols}")
        if answer_field in cols:
            answers = [None if a is None else str(a) for a in ds[answer_field]]
            source = answer_field
        elif solution_field is not None and solution_field in cols:
            answers = [None if s is None else _extract_last_boxed(str(s)) for s in ds[solution_field]]
            source = f"\\boxed{{}} in {solution_field!r}"
        else:
            raise KeyError(
                f"{where}: missing answer field {answer_field!r} (and no solution field {solution_field!r} to "
                f"extract a \\boxed{{}} answer from); available columns: {cols}"
            )
        bad = [i for i, a in enumerate(answers) if a is None]
        if bad:
            raise ValueError(f"{where}: {len(bad)} row(s) have no answer from {source}, first at row {bad[0]}")
        problems = ds[problem_field]
        bad = [i for i, q in enumerate(problems) if not isinstance(q, str) or not q]
        if bad:
            raise ValueError(f"{where}: {len(bad)} row(s) have an empty or non-string {problem_field!r}, first at row {bad[0]}")
        parts.append(ds_lib.Dataset.from_dict({"problem": problems, "answer": answers}))
    return parts[0] if len(parts) == 1 else ds_lib.concatenate_datasets(parts)


# ----------------------------------------------------------------------------- templates

PromptTemplate = Callable[[str, Optional["Tokenizer"]], str]
PROMPT_TEMPLATES: Registry[PromptTemplate] = Registry("prompt template")

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

QWEN_MATH_TEMPLATE = (
    "<|im_start|>system\n" + BOXED_INSTRUCTION + "<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"
)

# The synthetic-arithmetic prompt. The tiny model is trained on
#     ARITH_TEMPLATE.format(problem=p) + " " + solution + <eos>
# e.g. "Compute 12+7*3-5. Answer: 7*3=21. 12+21=33. 33-5=28. \boxed{28}".
ARITH_TEMPLATE = "{problem} Answer:"


@PROMPT_TEMPLATES.register("raw")
def raw_template(problem: str, tokenizer: Optional["Tokenizer"] = None) -> str:
    return problem


@PROMPT_TEMPLATES.register("qwen_math")
def qwen_math_template(problem: str, tokenizer: Optional["Tokenizer"] = None) -> str:
    # str.replace, not format: problems contain literal braces (LaTeX).
    return QWEN_MATH_TEMPLATE.replace("{problem}", problem)


@PROMPT_TEMPLATES.register("chat")
def chat_template(problem: str, tokenizer: Optional["Tokenizer"] = None) -> str:
    if tokenizer is None:
        raise ValueError("prompt template 'chat' needs a tokenizer (it renders the model's own chat template)")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{problem}\n{BOXED_INSTRUCTION}"}], add_generation_prompt=True
    )


@PROMPT_TEMPLATES.register("arith")
def arith_template(problem: str, tokenizer: Optional["Tokenizer"] = None) -> str:
    return ARITH_TEMPLATE.replace("{problem}", problem)


def format_prompt(template: str, problem: str, tokenizer: Optional["Tokenizer"] = None) -> str:
    """`PROMPT_TEMPLATES.get(template)(problem, tokenizer)`."""
    return PROMPT_TEMPLATES.get(template)(problem, tokenizer)
