"""The README and docs/ are right for someone who has only the clone: every relative link
points at a file (or heading) inside the repository that exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# Markdown inline links and images, reference definitions, and HTML href/src.
LINK_PATTERNS = (
    re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"),
    re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE),
    re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']"""),
)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def doc_files() -> list[Path]:
    """The repository's Markdown a reader meets: README.md, docs/, the chart's README."""
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    files = [REPO_ROOT / p for p in listed
             if p == "README.md" or p.startswith(("docs/", "charts/"))]
    return sorted(f for f in files if f.exists())


def links(text: str) -> list[str]:
    prose = CODE_SPAN.sub("", FENCE.sub("", text))  # code is not a link
    return [m.group(1) for pattern in LINK_PATTERNS for m in pattern.finditer(prose)]


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, n = slug, 1
        while anchor in anchors:
            anchor, n = f"{slug}-{n}", n + 1
        anchors.add(anchor)
    return anchors


def broken_links(doc: Path, text: str | None = None) -> list[str]:
    """What is wrong with the links of `doc` (its `text`, read from it unless given)."""
    problems = []
    for link in links(doc.read_text(encoding="utf-8") if text is None else text):
        if EXTERNAL.match(link):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.is_relative_to(REPO_ROOT):
            problems.append(f"{link}: outside the repository")
        elif not path.exists():
            problems.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
            problems.append(f"{link}: no heading #{anchor} in {path.relative_to(REPO_ROOT)}")
    return problems


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_links_point_at_files_in_the_repository(doc: Path) -> None:
    assert broken_links(doc) == []


def test_no_doc_sends_readers_outside_the_clone() -> None:
    for doc in doc_files():
        text = doc.read_text(encoding="utf-8")
        assert "../shared" not in text and "shared/ARCHITECTURE" not in text, doc


def test_the_checker_catches_what_it_is_for() -> None:
    text = ("[a](../../outside.md) [b](missing.md) [c](architecture.md#no-such-heading) "
            "[d](architecture.md#errors) [e](https://example.com/x) `[f](code.md)`\n"
            "[ref]: ../README.md#set-up-two-commands\n")
    assert links(text) == [
        "../../outside.md", "missing.md", "architecture.md#no-such-heading",
        "architecture.md#errors", "https://example.com/x", "../README.md#set-up-two-commands"]
    # As if it were a file in docs/ (never written).
    problems = broken_links(REPO_ROOT / "docs" / "probe.md", text)
    assert [p.split(": ")[0] for p in problems] == [
        "../../outside.md", "missing.md", "architecture.md#no-such-heading"]
