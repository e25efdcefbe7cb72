"""README.md and docs/*.md: every relative link names a file that exists and every #anchor a heading that
GitHub renders with that id; the README stays a front door (short lines, about 100 of them). No JAX."""

from __future__ import annotations

import functools
import pathlib
import re
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 110
README_MAX_CHARS = 120

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_LINK = re.compile(r"(?<!\\)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield i, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text (code spans and links as their text, emphasis
    markers '*' dropped), lower-cased, every character but letters, digits, '_', '-' and spaces removed,
    spaces turned into '-'."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading.strip())
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("*", "")  # emphasis markers (a literal '_' stays, as in rollout_copy)
    text = text.lower()
    out = []
    for ch in text:
        if ch in " -_" or ch.isalnum() or unicodedata.category(ch).startswith("M"):
            out.append("-" if ch == " " else ch)
    return "".join(out)


@functools.cache
def anchors(path: pathlib.Path) -> frozenset[str]:
    """Every anchor of a page: heading slugs (repeats get -1, -2, ... as on GitHub) and <a name/id>."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        out.update(_HTML_ID.findall(line))
        m = re.match(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(path: pathlib.Path):
    """(line number, target) of every link in the page's prose (code spans and fences excluded)."""
    for i, line in prose_lines(path.read_text(encoding="utf-8")):
        bare = _CODE_SPAN.sub("", line)
        for m in _INLINE_LINK.finditer(bare):
            yield i, m.group(1)
        m = _REF_DEF.match(bare)
        if m:
            yield i, m.group(1)


def broken_links(path: pathlib.Path) -> list[str]:
    bad = []
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        where = f"{path.relative_to(ROOT)}:{line}: {target}"
        if not dest.exists():
            bad.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    return bad


@pytest.mark.parametrize("heading,want", [
    ("Quantized rollouts (`rollout.quant`, `lrmq/rl/rollout_copy.py`)",
     "quantized-rollouts-rolloutquant-lrmqrlrollout_copypy"),
    ("At reasoning lengths: 1,024 new tokens, heavy-tailed completions (`--heavy-tail`)",
     "at-reasoning-lengths-1024-new-tokens-heavy-tailed-completions---heavy-tail"),
    ("Text inputs (`lrmq/data/text.py`)", "text-inputs-lrmqdatatextpy"),
    ("Will it fit? (`--compile-only`)", "will-it-fit---compile-only"),
    ("**Bold** and [a link](x.md)", "bold-and-a-link"),
])
def test_slug_follows_github(heading, want):
    assert slug(heading) == want


def test_repeated_headings_are_numbered(tmp_path):
    p = tmp_path / "a.md"
    p.write_text("# Results\n\n```\n# not a heading\n```\n## Results\n<a name=\"here\"></a>\n")
    assert anchors(p) == {"results", "results-1", "here"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    assert not broken_links(page), "\n".join(broken_links(page))


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    long = [f"README.md:{i}: {len(s)} characters" for i, s in enumerate(lines, 1) if len(s) > README_MAX_CHARS]
    assert not long, "\n".join(long)
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
