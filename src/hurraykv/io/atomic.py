"""Temporary files for atomic writes (floor 3): every file hurraykv replaces atomically
(``.hrry`` files, the server's persisted objects and alias list, ``inspect --map``
pictures) is written to a temporary file beside it, then renamed over it.

* Names: ``.NAME.XXXXXXXX.tmp`` (8 random hex digits) in the target's directory.
* Creation: ``O_CREAT | O_EXCL | O_NOFOLLOW`` (never through a planted file or symbolic
  link: a name that exists is skipped for another), mode 0666 less the umask, as ``open``
  would create the target itself.
* While it is written, and until it is renamed, the writer holds an exclusive ``flock``
  on it.  A writer killed by SIGKILL cannot remove its temporary file, but the kernel
  drops its lock: a later write of the same target removes that target's temporary files
  that nobody holds locked and that have not been written to for ``STALE_SECONDS``
  (``remove_stale``), so a crash leaves its leftover only until the next write of that
  target.  A live writer's file is locked, and one created an instant ago (not yet
  locked) is too young to be taken.  A directory is listed for this at most once per
  ``STALE_SECONDS`` per process, so a directory of many files (a chunk store) costs one
  listing per interval, not one per write.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import ContainerError

TEMP_SUFFIX = ".tmp"
STALE_SECONDS = 5.0  # unlocked and untouched this long: a dead writer's
_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
          | getattr(os, "O_CLOEXEC", 0))


def temp_pattern(name: str | None = None) -> re.Pattern[str]:
    """The temporary names of target ``name`` (of any target when None)."""
    stem = re.escape(name) if name is not None else r".+"
    return re.compile(rf"\.{stem}\.[0-9a-f]{{8}}{re.escape(TEMP_SUFFIX)}\Z", re.DOTALL)


_ANY_TEMP = temp_pattern()
_HEX = frozenset("0123456789abcdef")


def is_temp_of(entry: str, name: str) -> bool:
    """``temp_pattern(name).match(entry)`` without compiling a pattern per target: every
    put names a new segment, so re's cache never held it (issue 47: the largest item of a
    save's own work)."""
    head = f".{name}."
    return (len(entry) == len(head) + 8 + len(TEMP_SUFFIX) and entry.startswith(head)
            and entry.endswith(TEMP_SUFFIX)
            and _HEX.issuperset(entry[len(head):-len(TEMP_SUFFIX)]))


def _directory(path: Path) -> Path:
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ContainerError(f"cannot write {path}: the directory {parent} does not exist",
                             field="path", value=str(path), rule="an existing directory")
    return parent


def create_temp(path: str | os.PathLike) -> tuple[int, str]:
    """``(fd, name)`` of a new temporary file for ``path``, locked by this process until
    ``fd`` is closed; stale temporaries of the same target are removed first."""
    path = Path(path)
    parent = _directory(path)
    remove_stale(parent, path.name)
    for _ in range(100):
        tmp = parent / f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        try:
            fd = os.open(tmp, _FLAGS, 0o666)
        except FileExistsError:
            continue  # taken, or a planted file or link: never written through
        except OSError as e:
            raise ContainerError(f"cannot write {path}: {e.strerror}", field="path",
                                 value=str(path), rule="a writable directory") from None
        # a file system without flock: the age rule alone protects it
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd, str(tmp)
    raise ContainerError(f"no free temporary name beside {path}", field="path",
                         value=str(path))


_LISTED: dict[str, tuple[float, list[str]]] = {}  # directory -> (when, temporary names)


def _temporaries(directory: Path, fresh: bool) -> list[str]:
    """The temporary-looking names in ``directory``.  A directory is listed at most once
    per STALE_SECONDS (unless ``fresh``): a name created since is too young to be taken
    anyway, so a directory of many files costs one listing per interval, not per write."""
    key = str(directory)
    now = time.monotonic()
    cached = _LISTED.get(key)
    if cached is not None and not fresh and now - cached[0] < STALE_SECONDS:
        return cached[1]
    try:
        names = list(filter(_ANY_TEMP.match, os.listdir(directory)))  # C-level filter
    except OSError:
        names = []
    _LISTED[key] = (now, names)
    return names


def remove_stale(directory: str | os.PathLike, name: str | None = None,
                 min_age: float = STALE_SECONDS, fresh: bool = False) -> list[str]:
    """Remove the temporary files of target ``name`` (of every target when None) in
    ``directory`` that no writer holds locked and that were last written at least
    ``min_age`` seconds ago; returns the names removed.  ``fresh``: list the directory
    now (a start-up repair), not from the listing of the last few seconds."""
    directory = Path(directory)
    candidates = _temporaries(directory, fresh=fresh or min_age < STALE_SECONDS)
    if name is not None:
        candidates = [c for c in candidates if is_temp_of(c, name)]
    removed = []
    before = time.time() - min_age
    for entry in candidates:
        if _remove_if_stale(directory / entry, before):
            removed.append(entry)
    if removed:
        cached = _LISTED.get(str(directory))
        if cached is not None:
            _LISTED[str(directory)] = (cached[0], [n for n in cached[1] if n not in removed])
    return removed


def _remove_if_stale(path: Path, before: float) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False  # gone, not ours to open, or a symbolic link: left alone
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mtime > before:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live writer holds it
        except OSError:
            pass
        # still the same file under that name (not renamed into place meanwhile)?
        with contextlib.suppress(OSError):
            now = os.stat(path, follow_symlinks=False)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)
                return True
        return False
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, pieces: Sequence[Any], what: str) -> None:
    """Write every byte of ``pieces`` to ``fd`` in gathered writes (``IOV_MAX`` buffers a
    call).  Empty pieces are dropped first, since ``writev`` of nothing returns 0; a write
    that then makes no progress raises instead of being retried forever."""
    views = [v for v in (memoryview(p).cast("B") for p in pieces) if v.nbytes]
    limit = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
    first = 0
    while first < len(views):
        n = os.writev(fd, views[first:first + limit])
        if n <= 0:
            left = sum(v.nbytes for v in views[first:])
            raise ContainerError(f"cannot write {what}: the system wrote 0 of {left} bytes",
                                 field="path", value=what, rule="every write makes progress")
        while n:
            if n >= views[first].nbytes:
                n -= views[first].nbytes
                first += 1
            else:
                views[first], n = views[first][n:], 0


def append_lines(fd: int, lines: bytes, what: str) -> tuple[int, int]:
    """Append whole ``lines`` to ``fd`` (opened ``O_APPEND``) in one write, so appends of
    other writers never interleave with it.  A line an earlier append left cut (a crash, a
    full disk) is ended first, so it never swallows the first of these.  A short write
    (a full disk) raises rather than leave a cut record behind a success.  Returns the
    file's size before and the bytes written (the caller may cut a failed append back)."""
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        lines = b"\n" + lines
    written = os.write(fd, lines)
    if written != len(lines):
        # not retried: a second write could interleave with another writer's append
        raise ContainerError(f"{what}: the file took {written} of {len(lines)} bytes of an "
                             "append (no space left on its file system, or a size limit)",
                             field=what, value=written, rule="an append is written whole")
    return size, written


def write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> Path:
    """Replace ``path`` with ``data`` atomically (temporary file, fsync, rename)."""
    return write_pieces(path, [data], len(data), fsync=fsync)


class Replacement:
    """A temporary file that ``commit`` renames over its target (``replacement``)."""

    def __init__(self, path: Path, fsync: bool) -> None:
        self.path, self.fsync = path, fsync
        self.fd, self.tmp = create_temp(path)
        self.committed = False

    def commit(self) -> None:
        """fsync (when asked) and rename over the target: from now on it is the file."""
        if self.fsync:
            os.fsync(self.fd)
        os.replace(self.tmp, self.path)  # still locked: nobody takes it for a dead writer's
        self.committed = True


@contextlib.contextmanager
def replacement(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[Replacement]:
    """A temporary file beside ``path`` to write (``.fd``), renamed over ``path`` by
    ``commit()``; removed if the block ends without it, or with an exception.  The
    directory is fsynced after a commit when ``fsync``.  A caller may commit under a lock
    of its own, having written the bulk before taking it (the alias log's compaction)."""
    out = Replacement(Path(path), fsync)
    try:
        yield out
    finally:
        if not out.committed:
            with contextlib.suppress(OSError):
                os.unlink(out.tmp)
        os.close(out.fd)
    if out.committed and fsync:
        fsync_dir(out.path.parent)


def write_pieces(path: str | os.PathLike, pieces: Sequence[Any], size: int, *,
                 fsync: bool = False) -> Path:
    """Replace ``path`` with ``pieces`` back to back, atomically (temporary file, an
    fsync of it and its directory when ``fsync``, rename), in as few gathered writes as
    the system allows (a .hrry file whose layout is already known: ``chunks.file.store``)."""
    path = Path(path)
    views = [memoryview(p).cast("B") for p in pieces]
    with replacement(path, fsync=fsync) as out:
        if sum(v.nbytes for v in views) != size:
            raise ContainerError(f"{path}: pieces of {sum(v.nbytes for v in views)} bytes "
                                 f"for a file of {size}", field="size", value=size)
        write_all(out.fd, views, str(path))
        out.commit()
    return path
