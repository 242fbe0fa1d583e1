"""Room held in a ``file://`` directory for segments being written.  A segment of a known
size is admitted before it is written, so the directory stays within its budget: its room
is held by a reservation file, ``.reserve.NAME.BYTES.XXXXXXXX``, created under the
exclusive lock and ``flock``-ed by its writer until the segment is in place.  A scan
counts the finished segments and the live reservations; a reservation that nobody holds
locked (its writer was killed: the kernel dropped the lock) is removed, uncounted, by the
next scan.  A released reservation's file is kept, still locked, as the process's spare
and renamed into its next reservation: creating a file cost 50 us of the 85 us a capacity
added to a save."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from ...errors import HurrayError
from .eviction import Entry

RESERVE = ".reserve."
RESERVATION = re.compile(r"\.reserve\..+\.([0-9]{1,20})\.[0-9a-f]{8}\Z", re.DOTALL)
SPARE = ".reserve-spare."
SPARE_NAME = re.compile(r"\.reserve-spare\.[0-9a-f]{8}\Z")


class Reservation:
    """Room held for a segment being written (``Capacity.admit``), and the segments
    evicted to make it."""

    def __init__(self, path: str | None, fd: int | None, evicted: list[Entry],
                 spare: Callable[[str, int], None] | None = None) -> None:
        self.path, self._fd, self.evicted = path, fd, evicted
        self._spare = spare  # takes the released file and its descriptor, to reuse them

    def release(self) -> None:
        """Give the room back; call it once the segment is in place (it then counts for
        itself), under the shared lock: a scan (exclusive) that began before the rename
        may have listed the directory without the segment, and must find the reservation
        instead.  A second call does nothing."""
        fd, self._fd = self._fd, None
        if fd is None or self.path is None:
            return
        if self._spare is not None:
            self._spare(self.path, fd)
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(fd)


class Reservations:
    """The reservations of one process in directory ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._at = str(directory) + os.sep  # paths as strings: a Path costs 3 us to join
        # a released reservation's file, still locked: (path, fd, the pid that holds it)
        self.spare: tuple[str, int, int] | None = None
        self._spare_lock = threading.Lock()

    def reserve(self, nbytes: int, keep: str, written: bool, evicted: list[Entry]
                 ) -> Reservation:
        """A reservation file for a segment not yet written, locked until released: a
        scan by another writer counts it, and once its writer dies (the kernel drops the
        lock) the next scan reclaims it.  Created under the exclusive lock, so no scan
        sees it before it is locked."""
        if written:  # already in the directory: scans list the segment itself
            return Reservation(None, None, evicted)
        spare = self.take_spare()
        for _ in range(100):
            path = f"{self._at}{RESERVE}{keep}.{nbytes}.{secrets.token_hex(4)}"
            if spare is not None:
                try:
                    os.link(spare[0], path)  # never over an existing name
                except FileExistsError:
                    continue
                except OSError:  # removed by hand, ...: a new file instead
                    os.close(spare[1])
                    spare = None
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(spare[0])
                    return Reservation(path, spare[1], evicted, self.keep_spare)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o666)
            except FileExistsError:
                continue  # taken, or a planted file or link
            except OSError as e:
                raise HurrayError(f"cannot reserve room for segment {keep} in {self.dir}: "
                                  f"{e.strerror}", field="reservation", value=str(path),
                                  rule="a writable store directory") from None
            # a file system without flock: scans cannot tell it is live and count it
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return Reservation(path, fd, evicted, self.keep_spare)
        if spare is not None:
            os.close(spare[1])
        raise HurrayError(f"no free reservation name for segment {keep} in {self.dir}",
                          field="reservation", value=keep,
                          rule="a free .reserve.NAME.BYTES.XXXXXXXX name")

    def take_spare(self) -> tuple[str, int, int] | None:
        with self._spare_lock:
            spare, self.spare = self.spare, None
        if spare is not None and spare[2] != os.getpid():  # the parent's, before a fork
            os.close(spare[1])
            return None
        return spare

    def keep_spare(self, path: str, fd: int) -> None:
        """Release reservation ``path`` (under the shared lock) by renaming its file to
        ``.reserve-spare.XXXXXXXX``, locked still, for this process's next reservation
        to take by renaming it again: creating a file cost 50 us of the 85 us a capacity
        added to a save.  A spare counts 0 bytes; one whose process died is removed by
        the next scan, as a dead reservation is.  One spare a process: others go."""
        spare: str | None = f"{self._at}{SPARE}{secrets.token_hex(4)}"
        try:
            os.link(path, spare)  # never over an existing name
        except OSError:
            spare = None
        with contextlib.suppress(OSError):
            os.unlink(path)
        if spare is not None:
            with self._spare_lock:
                if self.spare is None:
                    self.spare = (spare, fd, os.getpid())
                    return
            with contextlib.suppress(OSError):
                os.unlink(spare)
        os.close(fd)

    def live_bytes(self, reservations: list[tuple[str, int]]) -> int:
        """The bytes of the live reservations (under the exclusive lock); those whose
        writer died are removed."""
        total = 0
        for name, nbytes in reservations:
            path = self.dir / name
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                continue
            except OSError:  # another user's: cannot tell, so never under-count
                total += nbytes
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue  # not a reservation (a planted FIFO, ...): left alone
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    total += nbytes  # its writer holds it
                    continue
                except OSError:  # no flock here: cannot tell, so never under-count
                    total += nbytes
                    continue
                # nobody holds it (a writer killed before releasing it), and no writer
                # can take it: new ones are created under the exclusive lock held here
                with contextlib.suppress(OSError):
                    os.unlink(path)
            finally:
                os.close(fd)
        return total

    def close(self) -> None:
        """Remove the spare reservation file."""
        spare = self.take_spare()
        if spare is not None:
            with contextlib.suppress(OSError):
                os.unlink(spare[0])
            os.close(spare[1])
