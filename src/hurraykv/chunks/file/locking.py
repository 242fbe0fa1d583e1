"""The directory's lock, ``DIR/.lock``: ``flock`` exclusive to scan and evict or to
compact the alias log, shared to append an alias.  Opened per use: ``flock`` belongs to an
open file, and each use is its own (read-only: engines of other users share the file).
A lock another process holds past the deadline is an error naming the file, never a
writer that waits forever."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

from ...errors import HurrayError

LOCK = ".lock"


@contextlib.contextmanager
def held(at: str, exclusive: bool, seconds: float, pause_first: float, pause_max: float
         ) -> Iterator[None]:
    """``DIR/.lock`` held (``at``: the directory and a separator), waited for at most
    ``seconds``, retried after ``pause_first`` doubling up to ``pause_max``."""
    path = at + LOCK
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
        deadline = time.monotonic() + seconds
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        pause = pause_first
        while True:
            try:
                fcntl.flock(fd, mode)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise HurrayError(
                        f"the lock {path} was held by another process for "
                        f"{seconds:g} s (a stuck engine, or `flock` by hand)",
                        field="lock", value=str(path),
                        rule="the lock is held only while a store updates") from None
                # another writer's admission or append holds it for tens of
                # microseconds: a fixed 5 ms nap made a contended save 5 ms slower
                time.sleep(pause)
                pause = min(2 * pause, pause_max)
        yield
    finally:
        os.close(fd)  # releases the lock
