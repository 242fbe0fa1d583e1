"""The package's structure as docs/architecture.md states it: no import circle between
its modules, no module over 500 lines without its reason, and no module reaching into
another's private names (the checkers in
``tests/support/structure.py``, tested here on planted faults)."""

from __future__ import annotations

import textwrap

from tests.support.structure import (
    SRC,
    circles,
    floor_violations,
    floors,
    imports,
    long_modules,
    private_reaches,
)

ROOT = SRC.parent


def listing() -> str:
    """The module listing of docs/architecture.md (its code block under the heading)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    after = text[text.index("## The modules, floor by floor"):]
    return after.split("```")[1]


# A module over this many lines is read by a newcomer only in parts: it is split where it
# has parts with names, unless it is one concept that reads top to bottom, listed below
# with the reason (issue 48).
LIMIT = 500
LONG = {
    "hurraykv/snapshot.py": "KVCacheSnapshot and the assembler that fills its member cache "
                            "are one concept; the assembler apart is an import circle, or "
                            "a package that changes KVCacheSnapshot.__module__",
    "hurraykv/chunks/s3.py": "S3Chunks, one store class: its objects, reads, writes, capacity "
                             "and retention, as the other stores' single modules read",
}


def test_no_module_is_over_500_lines_unless_listed_with_its_reason():
    found = long_modules(SRC, LIMIT)
    assert sorted(set(found) - set(LONG)) == [], (
        f"modules over {LIMIT} lines: {found}; split each where it has parts with names, "
        "or list it in LONG with the reason it is one concept")
    assert sorted(set(LONG) - set(found)) == []  # no stale entry excuses a future one


def test_the_length_checker_finds_a_planted_long_module(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * LIMIT)
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * (LIMIT + 1))
    assert long_modules(tmp_path, LIMIT) == {"pkg/long.py": LIMIT + 1}


def test_no_import_circle_in_the_package():
    assert circles(imports(SRC)) == []


def test_every_import_goes_down_the_floors_the_architecture_draws():
    drawn = floors(listing())
    assert drawn["wire"] == 0 and drawn["cli"] > drawn["integrations"]  # the listing read
    assert floor_violations(imports(SRC), drawn, SRC) == []


def test_no_module_uses_another_modules_private_names():
    assert private_reaches(SRC) == []


def test_the_checkers_find_a_planted_circle_and_reach(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text(textwrap.dedent("""\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from .c import Thing
        def f(x):
            return x._hidden
        """))
    (pkg / "c.py").write_text("def g():\n    from .a import b\n    return b._secret\n")
    (pkg / "d.py").write_text("from .c import _private\nclass K:\n    def m(self):\n"
                              "        return self._mine\n")
    assert circles(imports(tmp_path)) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert private_reaches(tmp_path) == ["pkg/b.py:5 x._hidden", "pkg/c.py:3 b._secret",
                                         "pkg/d.py:1 from .c import _private"]


def test_the_floor_checker_finds_a_planted_upward_and_sideways_import(tmp_path):
    pkg = tmp_path / "pkg"
    for d in ("low", "side", "high"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "tool.py").write_text("")
    (pkg / "stray.py").write_text("")
    (pkg / "low" / "a.py").write_text("from ..high import b\nfrom .. import tool\n")
    (pkg / "side" / "c.py").write_text("from ..low import a\n")
    (pkg / "high" / "b.py").write_text("from ..low import a\nfrom ..side import c\n")
    drawn = floors(textwrap.dedent("""\
        floor 2  high/                         the top
        floor 1  low/                          two packages
                   a.py                        a module of low
                 side/, tool.py                one more, and a module
        """))
    assert drawn == {"high": 2, "low": 1, "side": 1, "tool": 1}  # a.py is inside low/
    assert floor_violations(imports(tmp_path), drawn, tmp_path) == [
        "pkg.stray: in no floor of the listing",
        "pkg.low.a (floor 1) imports pkg.high.b (floor 2): upward",
        "pkg.side.c imports pkg.low.a: across floor 1, package to package"]
