"""Which tenant stored each segment of a ``file://`` directory: ``DIR/tenants.log``, for
``max_bytes_per_tenant`` (``file_capacity.py``).

A tenant is what a request's ``cache_salt`` names (the connector passes a 64-bit BLAKE2b
digest of it, never the salt); requests without one are the tenant ``""``, whose
segments have no line.  Under a quota a writer appends ``NAME TENANT`` when its segment
is admitted, under the exclusive lock, before the segment is in place (no scan counts it
as another tenant's); without one, beside its alias lines under the shared lock (so a
quota set later knows the tenants).  A scan under a quota, and an eviction's alias
compaction, read the new lines and, once dead lines outnumber live ones, rewrite the log
with the segments still stored.  A line a crash cut short, or anything else that is not
a line of this form, is ignored: that segment counts as the tenant ``""``'s.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ...io.atomic import append_lines, write_pieces
from ..keys import KEY

LOG = "tenants.log"
TENANT = re.compile(r"[0-9a-f]{1,32}")
LINE = re.compile(rb"(" + KEY + rb"-[0-9]{1,9}) ([0-9a-f]{1,32})")
SLACK = 4096  # dead lines beyond the live ones before a rewrite


class LogTail:
    """The lines appended to a log since the last look (``DIR/aliases.log``,
    ``DIR/tenants.log``): ``read()`` gives whether the log was replaced or shrank since
    (read again from its start: the caller forgets what the old one said) and the new
    whole lines (a line still being written waits for the next look).  A log that is
    missing, or a link planted there, is an empty one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines = 0  # lines of the current log read so far, whatever they hold
        self._read_upto, self._id = 0, None

    def read(self) -> tuple[bool, list[bytes]]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            restart = self._id is not None or self._read_upto > 0
            self._read_upto, self._id, self.lines = 0, None, 0
            return restart, []
        try:
            st = os.fstat(fd)
            restart = (st.st_dev, st.st_ino) != self._id or st.st_size < self._read_upto
            if restart:
                self._read_upto, self._id, self.lines = 0, (st.st_dev, st.st_ino), 0
            data = os.pread(fd, st.st_size - self._read_upto, self._read_upto) \
                if st.st_size > self._read_upto else b""
        finally:
            os.close(fd)
        whole = data.rfind(b"\n") + 1
        self._read_upto += whole
        lines = data[:whole].split(b"\n")[:-1] if whole else []
        self.lines += len(lines)
        return restart, lines


class TenantLog:
    def __init__(self, directory: Path) -> None:
        self.path = directory / LOG
        self._owners: dict[str, str] = {}
        self._tail = LogTail(self.path)

    def append(self, name: str, tenant: str) -> None:
        """Record that ``tenant`` stored segment ``name`` (under the directory's lock:
        exclusive at admission under a quota, shared beside the alias log without)."""
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            append_lines(fd, f"{name} {tenant}\n".encode("ascii"), "tenants")
        finally:
            os.close(fd)

    def owners(self, live: set[str]) -> dict[str, str]:
        """Segment name -> tenant of the segments ``live`` (under the exclusive lock); the
        log is rewritten when it holds many lines of segments gone."""
        self._refresh()
        out = {n: t for n, t in self._owners.items() if n in live}
        if self._tail.lines > 2 * len(out) + SLACK:
            text = "".join(f"{n} {t}\n" for n, t in out.items()).encode("ascii")
            write_pieces(self.path, [text], len(text))
            self._refresh()
        return out

    def _refresh(self) -> None:
        restart, lines = self._tail.read()
        if restart:
            self._owners.clear()
        for line in lines:
            m = LINE.fullmatch(line)
            if m is not None:
                self._owners[m[1].decode("ascii")] = m[2].decode("ascii")


__all__ = ["LOG", "TENANT", "LogTail", "TenantLog"]
