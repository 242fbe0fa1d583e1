"""The package's structure as docs/architecture.md states it: no import circle between
its modules, and no module reaching into another's private names (the checkers in
``tests/support/structure.py``, tested here on planted faults)."""

from __future__ import annotations

import textwrap

from tests.support.structure import SRC, circles, imports, private_reaches


def test_no_import_circle_in_the_package():
    assert circles(imports(SRC)) == []


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
