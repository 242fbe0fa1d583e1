"""The server's aliases (floor 4): alias -> target keys, what LINK records (H61, H62).

Held in memory as two maps (alias -> target, target -> its aliases), so dropping a
target's aliases costs what it drops; ``nbytes`` is what the table holds (the key strings
and the entries), which the server counts against ``--memory-budget``.

With ``--persist`` they also live in ``DIR/aliases.jsonl``, one JSON line per change:
``["alias","target"]`` links, ``["alias",null]`` removes.  An append writes whole lines
(after a newline, should the file not end with one) and is fsynced before the LINK is
acknowledged.  The file is read line by line: a line longer than ``MAX_LINE`` or not of
that shape (checked by a regular expression before any JSON is decoded, so no nesting can
reach the decoder), or cut by a crash, is skipped and counted, never fatal.  After loading,
and whenever the file holds more than twice what is live, it is rewritten (atomically) with
the live aliases only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

from ..io.atomic import write_bytes

log = logging.getLogger("hurraykv.server")

# an internal key: a 32-hex tenant, NUL, then 4096 UTF-8 bytes, each at most 6 JSON chars
MAX_LINE = 2 * (40 + 6 * 4096) + 16
_STRING = r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"'
_LINE = re.compile(rf"\[\s*({_STRING})\s*,\s*({_STRING}|null)\s*\]\s*\Z")
ENTRY_BYTES = 200  # two dict entries and a set slot, beside the two strings
COMPACT_SLACK = 1 << 20


def cost(alias: str, target: str) -> int:
    """Bytes one alias holds in memory."""
    return sys.getsizeof(alias) + sys.getsizeof(target) + ENTRY_BYTES


def _line(alias: str, target: str | None) -> bytes:
    return (json.dumps([alias, target], separators=(",", ":")) + "\n").encode("utf-8")


class AliasTable:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._target: dict[str, str] = {}
        self._aliases: dict[str, set[str]] = {}
        self.nbytes = 0
        self._file_bytes = 0
        self._live_bytes = 0  # of the file, what the live aliases' lines take
        if path is not None:
            self._load()

    # -- reading ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._target)

    def target(self, alias: str) -> str | None:
        return self._target.get(alias)

    def aliases_of(self, target: str) -> set[str]:
        return self._aliases.get(target, set())

    def items(self) -> list[tuple[str, str]]:
        return sorted(self._target.items())

    def added_bytes(self, pairs: list[tuple[str, str]]) -> int:
        """Bytes ``link(pairs)`` would add (less what replaced aliases free)."""
        new: dict[str, str] = dict(pairs)
        return sum(cost(a, t) - (cost(a, self._target[a]) if a in self._target else 0)
                   for a, t in new.items())

    # -- changing --------------------------------------------------------------------
    def link(self, pairs: list[tuple[str, str]]) -> None:
        """Record the aliases (persisted, fsynced, before this returns)."""
        if not pairs:
            return
        self._append(b"".join(_line(a, t) for a, t in pairs))
        for alias, target in pairs:
            self._set(alias, target)
        self._maybe_compact()

    def remove(self, aliases: list[str]) -> list[str]:
        """Remove those of ``aliases`` that exist; returns them."""
        gone = [a for a in dict.fromkeys(aliases) if a in self._target]
        if gone:
            self._append(b"".join(_line(a, None) for a in gone))
            for alias in gone:
                self._unset(alias)
            self._maybe_compact()
        return gone

    def drop_target(self, target: str) -> list[str]:
        """Remove every alias of ``target`` (it is gone); returns them."""
        return self.remove(sorted(self._aliases.get(target, ())))

    def _set(self, alias: str, target: str) -> None:
        if alias in self._target:
            self._unset(alias)
        self._target[alias] = target
        self._aliases.setdefault(target, set()).add(alias)
        self.nbytes += cost(alias, target)
        self._live_bytes += len(_line(alias, target))

    def _unset(self, alias: str) -> None:
        target = self._target.pop(alias)
        mine = self._aliases[target]
        mine.discard(alias)
        if not mine:
            del self._aliases[target]
        self.nbytes -= cost(alias, target)
        self._live_bytes -= len(_line(alias, target))

    # -- the file --------------------------------------------------------------------
    def _append(self, data: bytes) -> None:
        if self.path is None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND
                     | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # a line cut by a crash must not glue onto this one
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            self._file_bytes = size + len(data)
        finally:
            os.close(fd)

    def _maybe_compact(self) -> None:
        if self.path is not None and self._file_bytes > 2 * self._live_bytes + COMPACT_SLACK:
            self.compact()

    def compact(self) -> None:
        """Rewrite the file with the live aliases only (atomically)."""
        assert self.path is not None
        data = b"".join(_line(a, t) for a, t in self._target.items())
        write_bytes(self.path, data)  # temporary, fsync, rename, fsync of the directory
        self._file_bytes = self._live_bytes = len(data)

    def _load(self) -> None:
        assert self.path is not None
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - read line by line below
        except FileNotFoundError:
            return
        skipped = lines = read = 0
        with f:
            while True:
                raw = f.readline(MAX_LINE + 1)
                if not raw:
                    break
                read += len(raw)
                lines += 1
                if not raw.endswith(b"\n"):
                    skipped += 1
                    if len(raw) > MAX_LINE:  # too long: skip to its end, in bounded reads
                        while raw and not raw.endswith(b"\n"):
                            raw = f.readline(MAX_LINE + 1)
                            read += len(raw)
                    continue  # else the last line, cut short by a crash
                parsed = _parse(raw)
                if parsed is None:
                    skipped += 1
                    continue
                alias, target = parsed
                if target is None:
                    if alias in self._target:
                        self._unset(alias)
                else:
                    self._set(alias, target)
        self._file_bytes = read
        if skipped:  # rewritten without them: a cut line never meets the next append
            log.warning("%s: skipped %d of %d lines that are not whole alias records",
                        self.path, skipped, lines)
            self.compact()
        else:
            self._maybe_compact()
        log.info("aliases: %d in %s", len(self._target), self.path)


def _parse(raw: bytes) -> tuple[str, str | None] | None:
    """``(alias, target or None)`` of one line, or None when it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    m = _LINE.match(text)
    if m is None:
        return None
    try:
        alias = json.loads(m.group(1))
        target = None if m.group(2) == "null" else json.loads(m.group(2))
    except ValueError:
        return None
    return alias, target
