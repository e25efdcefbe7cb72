"""Every `from lrmq... import ...` the docs quote (README.md and docs/*.md, in code blocks or inline code) imports:
the module exists and has each name. Import only: nothing is compiled or run."""

from __future__ import annotations

import ast
import importlib
import re

import pytest

from test_docs_links import PAGES, ROOT

_FROM = re.compile(r"from\s+lrmq(?:\.[\w.]+)?\s+import\s+")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def quoted_imports(text: str) -> list[tuple[int, str]]:
    """(line number, statement) of each `from lrmq... import ...` in a fenced block or an inline code span; a
    parenthesized import is read to its closing parenthesis, a `\\` continuation to its end."""
    lines, out, fenced = text.splitlines(), [], False
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        spans = [line] if fenced else [m.group(2) for m in _CODE_SPAN.finditer(line)]
        for span in spans:
            m = _FROM.search(span)
            if not m:
                continue
            stmt, j = span[m.start():].strip().lstrip(">").strip(), i
            while fenced and ("(" in stmt and ")" not in stmt or stmt.endswith("\\")) and j + 1 < len(lines):
                j += 1
                stmt = stmt.rstrip("\\") + " " + lines[j].strip()
            stmt = stmt.split(";")[0].split("  #")[0].strip().rstrip("\"'").strip()  # python -c "from ..."
            out.append((i + 1, stmt))
    return out


def check_import(stmt: str) -> str | None:
    """None when `stmt` imports, else what is wrong (one line)."""
    try:
        node = ast.parse(stmt).body[0]
    except SyntaxError as e:
        return f"not a Python import: {e.msg}"
    try:
        mod = importlib.import_module(node.module)
    except ImportError as e:
        return f"ImportError: {e}"
    missing = []
    for alias in node.names:
        if not hasattr(mod, alias.name):
            try:  # a submodule: `from lrmq.quant import qweight`
                importlib.import_module(f"{node.module}.{alias.name}")
            except ImportError:
                missing.append(alias.name)
    return f"{node.module} has no {missing}" if missing else None


ALL = [(p, n, s) for p in PAGES for n, s in quoted_imports(p.read_text(encoding="utf-8"))]


def test_the_docs_quote_imports():  # the test below checks something: the docs' own examples are found
    found = {(p.name, s) for p, _, s in ALL}
    assert ("quantization.md", "from lrmq.quant.formats import quantize_weight, dequantize") in found, sorted(found)
    assert ("checkpoints.md", "from lrmq.checkpoint.load import load_model") in found
    assert check_import("from lrmq.quant.qweight import quantize_weight") == \
        "lrmq.quant.qweight has no ['quantize_weight']"


@pytest.mark.parametrize("page,line,stmt", ALL, ids=[f"{p.name}:{n}" for p, n, _ in ALL])
def test_every_quoted_lrmq_import_imports(page, line, stmt):
    err = check_import(stmt)
    assert err is None, f"{page.relative_to(ROOT)}:{line}: `{stmt}`: {err}"
