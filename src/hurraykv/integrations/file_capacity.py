"""A byte budget over a directory of segments that several engines share (``file://``
``max_bytes``), least recently used evicted first.

*Use.*  A segment's modification time is its last use: written, or touched (``utime``)
by every load, in whichever engine.  Eviction removes the oldest first.

*Bookkeeping.*  The bytes stored are one shared record, ``DIR/.usage`` (the total and when
the directory was last scanned), read and written under the exclusive lock by every
writer, so every engine's writes count against the one budget.  A write that keeps the
total under the budget costs the lock and the record; one that would pass it, or the
first after ``RESCAN_SECONDS`` since the last scan (an operator may have removed files, a
crashed writer may not have counted its own), scans the directory and, if the real sum
would pass the budget, evicts down to ``LOW_WATER`` of it (so the next writes do not each
evict one segment).  A segment of a known size is admitted before it is written, so the
directory stays within the budget; the first of a new structure (its size known once
written) is admitted after, passing the budget by that one file meanwhile.  What is not
counted: the alias log, ``quarantine/`` (the newest 16 damaged segments) and a writer's
temporary file.

*Several engines.*  A scan-and-evict holds an exclusive ``flock`` on ``DIR/.lock``, so two
evictors never work from the same listing; appends to the alias log hold it shared, so
a compaction of the log (under the exclusive lock) loses no line.  A lock not granted
within ``LOCK_SECONDS`` (another process holding it) is an error naming the file, not a
writer that waits forever.  A segment is evicted
by renaming it to ``.evict.NAME.XXXXXXXX`` and then removing that name: a reader that
opened it keeps reading valid bytes (the inode lives until closed), a reader that comes
later finds no file (a miss), and no reader ever sees part of one.  If the renamed file
is not the one the scan listed (another inode or modification time: an engine stored
the same name again, or loaded it, since), it is put back unless a newer one is already
there: an engine never removes a segment it did not choose.

*Crashes.*  A writer's temporary file and an evictor's ``.evict.*`` name left by a crash
are removed by the next start (``repair``), once older than ``io.atomic.STALE_SECONDS``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import HurrayError
from ..io.atomic import STALE_SECONDS, remove_stale, write_pieces

SUFFIX = ".hrry"
LOCK = ".lock"
USAGE = ".usage"
TRASH = ".evict."


@dataclass(frozen=True)
class Entry:
    name: str  # the segment's name, without SUFFIX
    nbytes: int
    used_ns: int  # modification time: last written or loaded
    inode: int


class Capacity:
    RESCAN_SECONDS = 60.0
    LOW_WATER = 0.9
    LOCK_SECONDS = 5.0

    def __init__(self, directory: Path, max_bytes: int | None) -> None:
        self.dir, self.max_bytes = directory, max_bytes
        self.evictions = 0  # segments this process evicted
        self.evicted_bytes = 0

    @contextlib.contextmanager
    def lock(self, exclusive: bool) -> Iterator[None]:
        """``flock`` on ``DIR/.lock``: exclusive to scan and evict or compact, shared to
        append.  Opened per use: flock belongs to an open file, and each use is its own
        (read-only: engines of other users share the file)."""
        path = self.dir / LOCK
        try:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o666)
        except OSError as e:  # a link planted there, a read-only directory, ...
            raise HurrayError(f"cannot open the lock {path}: {e.strerror}", field="lock",
                              value=str(path), rule="a lock file the engines share") from None
        try:
            deadline = time.monotonic() + self.LOCK_SECONDS
            mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
            while True:
                try:
                    fcntl.flock(fd, mode)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise HurrayError(
                            f"the lock {path} was held by another process for "
                            f"{self.LOCK_SECONDS:g} s (a stuck engine, or `flock` by hand)",
                            field="lock", value=str(path),
                            rule="the lock is held only while a store updates") from None
                    time.sleep(0.005)
            yield
        finally:
            os.close(fd)  # releases the lock

    def repair(self) -> list[str]:
        """Remove what a crashed writer or evictor left (once stale); the names removed."""
        removed = remove_stale(self.dir, fresh=True)
        before = time.time() - STALE_SECONDS
        with os.scandir(self.dir) as entries:
            for entry in entries:
                if entry.name.startswith(TRASH) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        if entry.stat(follow_symlinks=False).st_mtime < before:
                            os.unlink(entry.path)
                            removed.append(entry.name)
        return removed

    def scan(self) -> list[Entry]:
        """The segments in the directory, oldest use first."""
        out = []
        with os.scandir(self.dir) as entries:
            for entry in entries:
                if not entry.name.endswith(SUFFIX) or entry.name.startswith("."):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:  # removed meanwhile
                    continue
                if entry.is_file(follow_symlinks=False):
                    out.append(Entry(entry.name[:-len(SUFFIX)], st.st_size, st.st_mtime_ns,
                                     st.st_ino))
        out.sort(key=lambda e: e.used_ns)
        return out

    def check(self, nbytes: int, name: str) -> None:
        """Refuse a segment that the budget cannot hold even alone."""
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise HurrayError(f"segment {name} of {nbytes} bytes is larger than max_bytes "
                              f"{self.max_bytes}: not stored", field="max_bytes",
                              value=nbytes, rule="a segment fits in max_bytes")

    def admit(self, nbytes: int, keep: str, written: bool,
              then: Callable[[list[Entry]], None] | None = None) -> list[Entry]:
        """Account for segment ``keep`` of ``nbytes``, about to be written (or ``written``
        already, so a scan lists it), evicting the least recently used others when the
        directory would pass the budget; the entries evicted.  ``then(remaining)`` runs
        under the exclusive lock after an eviction (alias compaction)."""
        if self.max_bytes is None:
            return []
        evicted: list[Entry] = []
        with self.lock(exclusive=True):
            total, scanned = self._usage()
            if total + nbytes <= self.max_bytes and time.time() - scanned < \
                    self.RESCAN_SECONDS:
                self._record(total + nbytes, scanned)
                return []
            entries = self.scan()
            total = sum(e.nbytes for e in entries) + (0 if written else nbytes)
            if total > self.max_bytes:
                target = int(self.max_bytes * self.LOW_WATER)
                for entry in entries:
                    if total <= target:
                        break
                    if entry.name != keep and self._evict(entry):
                        total -= entry.nbytes
                        evicted.append(entry)
            self._record(total, time.time())
            if evicted and then is not None:
                gone = {e.name for e in evicted}
                then([e for e in entries if e.name not in gone])
        self.evictions += len(evicted)
        self.evicted_bytes += sum(e.nbytes for e in evicted)
        return evicted

    def _usage(self) -> tuple[int, float]:
        """The shared record: bytes stored and when the directory was last scanned (0: a
        scan is due: no record, or one that does not parse)."""
        try:
            fd = os.open(self.dir / USAGE, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                total, scanned = os.read(fd, 64).split()
            finally:
                os.close(fd)
            return max(0, int(total)), float(scanned)
        except (OSError, ValueError):
            return 0, 0.0

    def _record(self, total: int, scanned: float) -> None:
        text = f"{total} {scanned:.3f}\n".encode()
        with contextlib.suppress(OSError):  # unwritable: every admit scans instead
            write_pieces(self.dir / USAGE, [text], len(text))

    def _evict(self, entry: Entry) -> bool:
        path = self.dir / f"{entry.name}{SUFFIX}"
        trash = self.dir / f"{TRASH}{entry.name}.{secrets.token_hex(4)}"
        try:
            os.rename(path, trash)
        except OSError:  # gone already (another engine's eviction, an operator)
            return False
        try:
            st = os.stat(trash, follow_symlinks=False)
            if (st.st_ino, st.st_mtime_ns) != (entry.inode, entry.used_ns):
                # stored again or loaded since the scan (an inode number alone may be
                # reused): not the segment chosen, put it back
                with contextlib.suppress(FileExistsError):
                    os.link(trash, path)
                return False
            return True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(trash)

    @staticmethod
    def touch(fd: int) -> None:
        """A load is a use: the segment moves to the young end of the eviction order."""
        with contextlib.suppress(OSError):  # another user's file: its age stays
            os.utime(fd)


__all__ = ["Capacity", "Entry"]
