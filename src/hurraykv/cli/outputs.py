"""Where a command's output goes (``compact``, ``pull``, ``inspect --map``): a file
written atomically, or standard output, with the summary line moved out of its way."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from .inputs import CannotRead

STDOUT = "-"


def check_writable(path: str) -> None:
    parent = Path(path).parent
    if not parent.is_dir():
        raise CannotRead(f"cannot write {path}: the directory {parent} does not exist")


def check_output(path: str) -> None:
    """Before the work: ``path`` can be written; ``-`` (standard output) must not be a
    terminal, which a binary .hrry file would garble."""
    if path != STDOUT:
        check_writable(path)
    elif sys.stdout.isatty():
        raise CannotRead("refusing to write a binary .hrry file to a terminal: redirect "
                         "standard output (> FILE) or pipe it, or name a file instead of -")


def human(path: str) -> TextIO:
    """Where the summary line goes: stderr when the .hrry file goes to standard output."""
    return sys.stderr if path == STDOUT else sys.stdout


def write_output(path: str, write: Callable[[str], Any]) -> None:
    """``write(file)`` writes the .hrry file: to ``path``, or for ``-`` to a temporary
    file (``$TMPDIR``; the format ends in an index, written last) copied to standard
    output, then removed."""
    if path != STDOUT:
        write(path)
        return
    out = sys.stdout.buffer
    with tempfile.TemporaryDirectory(prefix="hurraykv-") as tmp:
        name = os.path.join(tmp, "out.hrry")
        write(name)
        with open(name, "rb") as f:
            shutil.copyfileobj(f, out, 1 << 20)
    out.flush()
