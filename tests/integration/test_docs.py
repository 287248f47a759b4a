"""The docs resolve in a clone: every section of docs/methods.md that code, configs or docs cite has its heading, and
every relative link in README.md and docs/*.md points to an existing file (and, for a Markdown file, heading)."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
METHODS = ROOT / "docs" / "methods.md"
SCANNED = (".py", ".yaml", ".md")
SKIPPED_DIRS = {"__pycache__", "runs", "data_cache", "outputs", "multirun", "mlruns"}

# "methods.md" then one or more section references: §3, §3.1, §3–4, "§2, §5", "§5 and §9".
CITATION = re.compile(r"methods\.md\s?((?:(?:\s|,|and|or)*§\s?\d+(?:\.\d+)?(?:\s?[–-]\s?\d+)?)+)")
SECTION = re.compile(r"§\s?(\d+(?:\.\d+)?)(?:\s?[–-]\s?(\d+))?")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def sections_cited(text: str) -> set[str]:
    """The sections a text cites as methods.md §N (a range §3–4 cites 3 and 4)."""
    found = set()
    for citation in CITATION.finditer(text):
        for first, last in SECTION.findall(citation.group(1)):
            if last:
                found.update(str(n) for n in range(int(first), int(last) + 1))
            else:
                found.add(first)
    return found


def repository_files(suffixes: tuple[str, ...]):
    """The checkout's files with these suffixes, tool caches, virtualenvs and run outputs aside."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        for name in files:
            if name.endswith(suffixes):
                yield Path(folder) / name


def headings(text: str) -> list[str]:
    """Markdown headings outside fenced code, without their #s."""
    return [m.group(2) for line in FENCE.sub("", text).splitlines() if (m := HEADING.match(line))]


def section_numbers(text: str) -> set[str]:
    """Sections a methods page defines: "## 3. Title" → "3", "### 3.1 Title" → "3.1"."""
    return {m.group(1) for h in headings(text) if (m := re.match(r"(\d+(?:\.\d+)*)\.?\s", h))}


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces → hyphens, repeats numbered -1, -2, …"""
    seen: dict[str, int] = {}
    out = set()
    for h in headings(text):
        slug = re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


@functools.cache
def file_anchors(path: Path) -> set[str]:
    """``anchors`` of a Markdown file, read once."""
    return anchors(path.read_text(encoding="utf-8"))


def broken_links(path: Path) -> list[str]:
    """Relative links of a Markdown file whose file, or heading in a Markdown target, does not exist."""
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, …
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        shown = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
        if not dest.exists():
            broken.append(f"{target} (no file {shown})")
        elif anchor and dest.suffix == ".md" and anchor not in file_anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {shown})")
    return broken


@pytest.mark.parametrize(
    ("text", "sections"),
    [
        ("(methods.md §8): FMLM+ PR", {"8"}),
        ("trained by self-distillation (methods.md §3–4).", {"3", "4"}),
        ("shared draws (methods.md §2, §5).", {"2", "5"}),
        ("which methods.md §5 and §9 prescribe", {"5", "9"}),
        ("see methods.md§6.2 for", {"6.2"}),
        ("the methods' pitfall list, §7 of something else", set()),
    ],
)
def test_citations_are_parsed(text, sections):
    assert sections_cited(text) == sections


def test_every_cited_section_has_a_heading():
    cited: dict[str, list[str]] = {}
    for path in repository_files(SCANNED):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "methods.md" not in text or path == Path(__file__).resolve():  # this file's examples are not citations
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for section in sections_cited(line):
                cited.setdefault(section, []).append(f"{path.relative_to(ROOT)}:{number}")
    assert len(cited) >= 5, f"found only the citations {cited}: is the scan or the pattern broken?"
    defined = section_numbers(METHODS.read_text(encoding="utf-8"))
    missing = {s: where[:3] for s, where in sorted(cited.items()) if s not in defined}
    assert not missing, f"docs/methods.md has no heading for the cited sections {missing}; it defines {sorted(defined)}"


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))])
def test_relative_links_resolve(doc):
    broken = broken_links(ROOT / doc)
    assert not broken, f"{doc} links to what does not exist: {broken}"


def test_broken_links_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n## 2. A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](docs/other.md) [ok](docs/other.md#2-a-section) [ok](#here) ![ok](docs) [web](https://x.org/none.md)\n"
        "## Here\n[gone](docs/gone.md) [bad anchor](docs/other.md#3-b) [bad local](#there)\n"
        "`[in code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        f"docs/gone.md (no file {tmp_path / 'docs' / 'gone.md'})",
        f"docs/other.md#3-b (no heading #3-b in {tmp_path / 'docs' / 'other.md'})",
        f"#there (no heading #there in {page})",
    ]


def test_anchors_follow_github():
    text = (
        "# Top\n## 1. Shared backbone: DiT, per-token\n## FMLM+ training\n## FMLM+ training\n```\n# not a heading\n```"
    )
    assert anchors(text) == {"top", "1-shared-backbone-dit-per-token", "fmlm-training", "fmlm-training-1"}
