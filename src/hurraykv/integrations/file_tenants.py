"""Which tenant stored each segment of a ``file://`` directory: ``DIR/tenants.log``, for
``max_bytes_per_tenant`` (``file_capacity.py``).

A tenant is what a request's ``cache_salt`` names (the connector passes a 64-bit BLAKE2b
digest of it, never the salt); requests without one are the tenant ``""``, whose
segments have no line.  A writer appends ``NAME TENANT`` after its segment is admitted,
under the directory's shared lock (as the alias log); a scan, under the exclusive lock,
reads the new lines and, once dead lines outnumber live ones, rewrites the log with the
segments still stored.  A line a crash cut short, or anything else that is not a line of
this form, is ignored: that segment counts as the tenant ``""``'s.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..io.atomic import append_lines, write_pieces
from .chunks import KEY

LOG = "tenants.log"
TENANT = re.compile(r"[0-9a-f]{1,32}")
LINE = re.compile(rb"(" + KEY + rb"-[0-9]{1,9}) ([0-9a-f]{1,32})")
SLACK = 4096  # dead lines beyond the live ones before a rewrite


class TenantLog:
    def __init__(self, directory: Path) -> None:
        self.path = directory / LOG
        self._owners: dict[str, str] = {}
        self._read_upto, self._id, self._lines = 0, None, 0

    def append(self, name: str, tenant: str) -> None:
        """Record that ``tenant`` stored segment ``name`` (under the shared lock)."""
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
        if self._lines > 2 * len(out) + SLACK:
            text = "".join(f"{n} {t}\n" for n, t in out.items()).encode("ascii")
            write_pieces(self.path, [text], len(text))
            self._refresh()
        return out

    def _refresh(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            self._owners.clear()
            self._read_upto, self._id, self._lines = 0, None, 0
            return
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self._id or st.st_size < self._read_upto:
                self._owners.clear()
                self._read_upto, self._id, self._lines = 0, (st.st_dev, st.st_ino), 0
            data = os.pread(fd, st.st_size - self._read_upto, self._read_upto) \
                if st.st_size > self._read_upto else b""
        finally:
            os.close(fd)
        whole = data.rfind(b"\n") + 1
        for line in data[:whole].split(b"\n"):
            m = LINE.fullmatch(line)
            if m is not None:
                self._owners[m[1].decode("ascii")] = m[2].decode("ascii")
                self._lines += 1
        self._read_upto += whole


__all__ = ["LOG", "TENANT", "TenantLog"]
