"""Taking segments out of a ``file://`` directory.  A segment is evicted by renaming it
to ``.evict.NAME.XXXXXXXX`` and then removing that name: a reader that opened it keeps
reading valid bytes (the inode lives until closed), a reader that comes later finds no
file (a miss), and no reader ever sees part of one.  A renamed file that is not the one
the scan listed is put back: an engine never removes a segment it did not choose.  The
removals (an unlink frees the file's pages and blocks: most of what an eviction costs)
run on a thread of their own, off the saving thread and outside the lock."""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...io.atomic import STALE_SECONDS

SUFFIX = ".hrry"
TRASH = ".evict."


@dataclass(frozen=True)
class Entry:
    name: str  # the segment's name, without SUFFIX
    nbytes: int
    used_ns: int  # modification time: last written or loaded
    inode: int


def take(directory: Path, entry: Entry) -> Path | None:
    """Rename segment ``entry`` out of the store (no reader finds it from now on); the
    name to remove it by, or None when it was not the file the scan listed."""
    path = directory / f"{entry.name}{SUFFIX}"
    trash = directory / f"{TRASH}{entry.name}.{secrets.token_hex(4)}"
    try:
        os.rename(path, trash)
    except OSError:  # gone already (another engine's eviction, an operator)
        return None
    chosen = False
    try:
        st = os.stat(trash, follow_symlinks=False)
        if (st.st_ino, st.st_mtime_ns) != (entry.inode, entry.used_ns):
            # stored again or loaded since the scan (an inode number alone may be
            # reused): not the segment chosen, put it back
            with contextlib.suppress(FileExistsError):
                os.link(trash, path)
            return None
        chosen = True
        return trash
    finally:
        if not chosen:
            with contextlib.suppress(OSError):
                os.unlink(trash)


def discard(trash: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(trash)


def evict(directory: Path, entry: Entry) -> bool:
    """Remove segment ``entry`` now if it is still the file the scan listed."""
    trash = take(directory, entry)
    if trash is not None:
        discard(trash)
    return trash is not None


def remove_later(trash: list[Path]) -> None:
    """Remove segments already out of the store on the remover thread."""
    if trash:
        _REMOVER.remove(trash, discard)


def settle() -> None:
    """Wait until the segments this process evicted are removed from the disk."""
    _REMOVER.settle()


def remove_stale_trash(directory: Path) -> list[str]:
    """The ``.evict.*`` names a crashed evictor left, once stale, removed; their names."""
    removed = []
    before = time.time() - STALE_SECONDS
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(TRASH) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_mtime < before:
                        os.unlink(entry.path)
                        removed.append(entry.name)
    return removed


class _Remover:
    """The thread that removes this process's evicted files: an unlink frees the file's
    pages and blocks, 0.15-0.7 ms for 4 MiB on ext4, which was most of what a capacity
    added to a save.  Not a daemon, so the interpreter waits for the files queued when
    it exits; it ends once idle for ``IDLE`` seconds (so it never holds an exit up) and
    starts again with the next eviction.  A child forked meanwhile starts its own."""

    IDLE = 0.2

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[tuple[Path, Callable[[Path], None]]] = []
        self._running = False  # a thread serves the queue
        self._busy = 0  # files taken off the queue, not yet removed

    def remove(self, paths: list[Path], discard: Callable[[Path], None]) -> None:
        with self._cond:
            self._queue += [(p, discard) for p in paths]
            if self._running:
                self._cond.notify()
                return
            worker = threading.Thread(target=self._serve, name="hurraykv-evict")
            try:
                worker.start()
            except RuntimeError:  # at interpreter exit, or out of threads: done here
                work, self._queue = self._queue, []
            else:
                self._running = True
                return
        for path, discard in work:
            discard(path)

    def _serve(self) -> None:
        with self._cond:
            while True:
                if not self._queue and not self._cond.wait_for(lambda: self._queue,
                                                               self.IDLE):
                    self._running = False
                    self._cond.notify_all()
                    return
                work, self._queue = self._queue, []
                self._busy = len(work)
                self._cond.release()
                try:
                    for path, discard in work:
                        discard(path)
                finally:
                    self._cond.acquire()
                    self._busy = 0
                    self._cond.notify_all()

    def settle(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and not self._busy)


_REMOVER = _Remover()
