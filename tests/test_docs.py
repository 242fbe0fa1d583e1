"""The docs a user needs live in the repository: nothing points outside it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_no_reference_to_paths_outside_the_repository():
    for path in DOCS + sorted((ROOT / "src").rglob("*.py")):
        text = path.read_text()
        for bad in ("../shared", "shared/spec", "shared/design", "shared/engines",
                    "shared/conformance"):
            assert bad not in text, f"{path.relative_to(ROOT)} mentions {bad}"


def test_every_repository_path_the_docs_name_exists():
    named = set()
    for path in DOCS:
        named |= set(re.findall(r"`((?:docs|benchmarks|tests|engine_tests|src)/[\w./-]+)`",
                                path.read_text()))
    missing = [p for p in sorted(named) if not (ROOT / p.rstrip("/")).exists()
               and "*" not in p and "{" not in p]
    assert not missing, missing
