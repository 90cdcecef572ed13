"""The docs name files that exist: every source path in the README and docs/ is in the tree.

A layout change that leaves a doc naming a moved or deleted module fails here. A path in
backticks counts when it is a tracked file, or the tail of one (docs abbreviate
`engine/core/scheduler.py` as `core/scheduler.py` inside an engine paragraph).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE_PATH = re.compile(r"`([\w./-]+\.(?:py|lua|cpp|h|proto|tpl))`")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True).stdout
    return out.split()


def _docs(tracked: list[str]) -> list[str]:
    return sorted(p for p in tracked if p == "README.md" or
                  (p.startswith("docs/") and p.endswith(".md")))


def missing_paths(text: str, tracked: list[str]) -> list[str]:
    """Backticked source paths in `text` that name no tracked file (nor a tracked tail)."""
    files = set(tracked)
    missing = []
    for path in SOURCE_PATH.findall(text):
        bare = path.removeprefix("./")
        if bare in files or any(f.endswith("/" + bare) for f in tracked):
            continue
        missing.append(path)
    return missing


def test_checker_catches_a_missing_path() -> None:
    tracked = ["engine/core/scheduler.py", "router/pipeline.py"]
    text = "`core/scheduler.py`, `router/pipeline.py`, `router/http_api.py`, `x.toml`"
    assert missing_paths(text, tracked) == ["router/http_api.py"]


@pytest.mark.parametrize("doc", _docs(_tracked()))
def test_doc_names_only_existing_files(doc: str) -> None:
    text = (REPO_ROOT / doc).read_text(encoding="utf-8")
    assert missing_paths(text, _tracked()) == [], f"{doc} names files that do not exist"
