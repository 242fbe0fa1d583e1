"""``make demo`` as a newcomer meets it: ``python -m hurraykv.demo`` leaves ``demo.hrry`` in
the current directory and prints the ``hurraykv`` commands to try on it, and each of them
succeeds on that file (run here through ``hurraykv.cli.main``, in the same process)."""

from __future__ import annotations

import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

import hurraykv as hk
from hurraykv.cli import main as hurraykv
from hurraykv.io import checksums

ROOT = Path(__file__).resolve().parents[2]


def test_make_demo_runs_the_module():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: .*\n\t\$\(PY\) -m hurraykv\.demo$", makefile, re.M)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """``python -m hurraykv.demo`` in an empty directory (in-process: runpy runs the module
    as ``__main__``, as ``-m`` does); its output and the directory."""
    import contextlib
    import io
    import os

    where = tmp_path_factory.mktemp("demo")
    before, out = Path.cwd(), io.StringIO()
    sys.modules.pop("hurraykv.demo", None)  # as -m finds it: not imported yet
    os.chdir(where)
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            runpy.run_module("hurraykv.demo", run_name="__main__", alter_sys=True)
    finally:
        os.chdir(before)
    return done.value.code, out.getvalue(), where


def test_the_demo_passes_and_leaves_demo_hrry(demo_run):
    code, out, where = demo_run
    assert code == 0, out
    assert out.count("bitwise identical") == 2 and "demo OK" in out
    assert sorted(p.name for p in where.iterdir()) == ["demo.hrry"]  # nothing else left
    snap = hk.load_snapshot(where / "demo.hrry")
    assert snap.model == "tiny-llama-demo" and snap.num_seqs == 4
    assert checksums.KEY in snap.metadata  # save_snapshot's default: one per page


def tried(out: str) -> list[list[str]]:
    """The command lines the demo prints after its 'Try:'."""
    tail = out.split("Try:", 1)[1]
    lines = [shlex.split(line) for line in tail.splitlines() if line.strip()]
    # the command as this environment runs it: its name on PATH, else its path
    assert all(Path(words[0]).name == "hurraykv" and (
        words[0] == "hurraykv" or Path(words[0]).exists()) for words in lines), lines
    return [words[1:] for words in lines]


def test_every_command_the_demo_suggests_succeeds(demo_run, monkeypatch, capsys):
    _, out, where = demo_run
    commands = tried(out)
    assert [c[0] for c in commands] == ["inspect", "inspect", "validate", "inspect"]
    assert ["inspect", "--map", "demo.svg", "demo.hrry"] in commands
    monkeypatch.chdir(where)
    for argv in commands:
        assert hurraykv(argv) == 0, (argv, capsys.readouterr())
        shown = capsys.readouterr().out
        if argv[0] == "inspect":
            assert "demo.hrry" in shown and "tiny-llama-demo" in shown, shown
    assert (where / "demo.svg").read_text().startswith("<svg")
