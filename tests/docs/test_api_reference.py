"""``docs/api.md`` is what ``docs/apiref.py`` builds from the code's docstrings today, so
the API reference cannot drift from the code; and the generator covers the public API."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import hurraykv

ROOT = Path(__file__).resolve().parents[2]


def generator():
    spec = importlib.util.spec_from_file_location("apiref", ROOT / "docs" / "apiref.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_api_md_is_generated_from_the_docstrings():
    built = generator().build()
    on_disk = (ROOT / "docs" / "api.md").read_text()
    if built != on_disk:
        diff = "".join(list(difflib.unified_diff(
            on_disk.splitlines(True), built.splitlines(True), "docs/api.md (committed)",
            "docs/api.md (from the code)", n=1))[:60])
        raise AssertionError("docs/api.md no longer matches the docstrings: regenerate it "
                             "with `.venv/bin/python docs/apiref.py` and commit it\n" + diff)


def test_the_generator_is_deterministic():
    apiref = generator()
    assert apiref.build() == apiref.build()


def test_every_top_level_name_and_public_module_is_documented():
    text = (ROOT / "docs" / "api.md").read_text()
    for name in hurraykv.__all__:
        assert f"### `hurraykv.{name}`" in text, name
    for module, _ in generator().MODULES:
        assert f"## `{module}`" in text, module
    # a method and a property of the main classes, with their docstrings' first lines
    assert "- `save_snapshot" not in text  # functions are entries, not methods
    assert "- `gather(self, s: int" in text and "- `shared_pages` (property)" in text
    assert "- `iter_pull(self" in text and "- `lookup_prefix(self" in text
