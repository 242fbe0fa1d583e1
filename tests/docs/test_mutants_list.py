"""The mutation check's list (tests/mutants.py, `make mutants`) stays applicable: a mutant
whose original text moved would stop `make mutants` before it runs anything, and the
check is too slow for `make test`, so the main suite says it at once."""

from __future__ import annotations

import ast
from pathlib import Path

from tests import mutants
from tests.support.paths import ROOT


def _mutants():
    return mutants


def _defined(path: Path) -> set[str]:
    """``test_x`` and ``Class::test_x`` for every test function in ``path``."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(f"{node.name}::{f.name}" for f in node.body
                         if isinstance(f, ast.FunctionDef))
            names.add(node.name)
    return names


def _found(name: str, path: Path) -> bool:
    """``name`` in ``path``; a class's test may be inherited from a contract suite."""
    if name in _defined(path):
        return True
    cls, _, method = name.partition("::")
    return bool(method) and cls in _defined(path) and any(
        isinstance(node, ast.FunctionDef) and node.name == method
        for p in (ROOT / "src/hurraykv/testing").glob("*.py")
        for node in ast.walk(ast.parse(p.read_text())))


def test_every_mutants_original_text_is_found_once_in_its_file():
    m = _mutants()
    assert m.check(m.MUTANTS, ROOT / "src") == []


def test_every_mutants_tests_exist():
    missing = []
    for mutant in _mutants().MUTANTS:
        for node in mutant.tests:
            file, _, name = node.partition("::")
            path = ROOT / file
            if not path.is_file():
                missing.append(f"{mutant.name}: {file} is no file")
            elif name and not _found(name.split("[")[0], path):
                missing.append(f"{mutant.name}: {file} defines no {name}")
    assert missing == []


def test_the_check_finds_a_stale_mutant(tmp_path):
    m = _mutants()
    first = m.MUTANTS[0]
    (tmp_path / first.file).parent.mkdir(parents=True)
    (tmp_path / first.file).write_text("the code moved\n")
    assert [p.split(":")[0] for p in m.check([first], tmp_path)] == [first.name]
