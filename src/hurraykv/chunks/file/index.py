"""The chunk aliases of a ``file://`` directory: lines ``KEY NAME`` appended to
``DIR/aliases.log``, one append per segment (every chunk key of the segment), read
incrementally by every process that shares the directory.  A line a crash cut short, or
anything else that is not an alias line, is a miss.  Once dead lines (of segments no
longer stored) outnumber live ones, the log is rewritten with the live ones, under the
directory's exclusive lock, so that no append is in flight and none is lost; the other
processes notice the new log and read it again."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ...io.atomic import append_lines, write_pieces
from ..keys import ALIAS_LINE
from .tenants import LogTail

LOG = "aliases.log"


class AliasIndex:
    """Chunk key -> segment name, as the log says."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOG
        self.aliases: dict[str, str] = {}
        self._log = LogTail(self.path)

    def refresh(self) -> None:
        """Take in the lines other processes appended since the last look.  A log that
        shrank or was replaced (an operator's clean-up) is read again from its start,
        forgetting what the old one said."""
        restart, lines = self._log.read()
        if restart:
            self.aliases.clear()
        for line in lines:
            m = ALIAS_LINE.fullmatch(line)
            if m is not None:
                self.aliases[m[1].decode("ascii")] = m[2].decode("ascii")

    def append(self, keys: Sequence[str], name: str) -> None:
        """Record ``keys`` as aliases of segment ``name`` (under the shared lock: a
        compaction never replaces the log under an append)."""
        lines = "".join(f"{key} {name}\n" for key in keys).encode("ascii")
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            append_lines(fd, lines, "aliases")  # whole, after ending a cut line
        finally:
            os.close(fd)

    def learn(self, keys: Sequence[str], name: str) -> None:
        """This process's own append, known without reading the log back."""
        self.aliases.update((key, name) for key in keys)

    def compact(self, live: set[str], slack: int) -> None:
        """Rewrite the log with the aliases of the segments ``live``, once its lines pass
        twice those by ``slack`` (under the exclusive lock)."""
        self.refresh()
        keep = [(key, name) for key, name in self.aliases.items() if name in live]
        if self._log.lines <= 2 * len(keep) + slack:
            return
        text = "".join(f"{key} {name}\n" for key, name in keep).encode("ascii")
        write_pieces(self.path, [text], len(text))
        self.refresh()
