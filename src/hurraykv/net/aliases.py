"""The server's aliases (floor 5): alias -> target keys, what LINK records (H61, H62).

Held in memory as two maps (alias -> target, target -> its aliases), so dropping a
target's aliases costs what it drops; ``nbytes`` is what the table holds (the key strings
and the entries), which the server counts against ``--memory-budget``; ``nbytes_by`` is
that by the tenant of the alias, which its ``--max-bytes-per-tenant`` quota holds.

With ``--persist`` they also live in ``DIR/aliases.jsonl``, one JSON line per change:
``["alias","target"]`` links, ``["alias",null]`` removes.  An append writes whole lines
(after a newline, should the file not end with one) and is fsynced before the LINK is
acknowledged.  The file is read line by line: a line longer than ``MAX_LINE`` or not of
that shape (checked by a regular expression before any JSON is decoded, so no nesting can
reach the decoder), or cut by a crash, is skipped and counted, never fatal.  After loading,
and whenever the file holds more than twice what is live, it is rewritten (atomically) with
the live aliases only.

That rewrite can take as long as the table is large, so it never runs on the thread that
changes the table (the server's event loop): the live aliases are copied there, then a
compaction thread writes and fsyncs them to a temporary file.  Appends go on meanwhile, to
the old file and to a tail kept for the new one; under the file lock the thread writes the
tail after the copy and renames the result into place, so no acknowledged LINK is lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from ..errors import ContainerError, HurrayError
from ..io.atomic import append_lines, replacement, write_all
from .tenants import tenant_of

log = logging.getLogger("hurraykv.server")

# an internal key: a 32-hex tenant, NUL, then 4096 UTF-8 bytes, each at most 6 JSON chars
MAX_LINE = 2 * (40 + 6 * 4096) + 16
_STRING = r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"'
_LINE = re.compile(rf"\[\s*({_STRING})\s*,\s*({_STRING}|null)\s*\]\s*\Z")
ENTRY_BYTES = 200  # two dict entries and a set slot, beside the two strings
COMPACT_SLACK = 1 << 20
COMPACT_RETRY_SECONDS = 30.0  # after a failed compaction (a full disk)


def cost(alias: str, target: str) -> int:
    """Bytes one alias holds in memory."""
    return sys.getsizeof(alias) + sys.getsizeof(target) + ENTRY_BYTES


def _line(alias: str, target: str | None) -> bytes:
    return (json.dumps([alias, target], separators=(",", ":")) + "\n").encode("utf-8")


class AliasLogError(HurrayError):
    """A change the alias log could not record (nothing was changed).  The message, for
    the server's log, names the file; ``why`` says what went wrong without it (a tenant
    is not told where the server persists)."""

    def __init__(self, path: Path, error: OSError | HurrayError) -> None:
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        super().__init__(f"cannot record aliases in {path}: {why}", field="aliases",
                         value=str(path), rule="a writable --persist directory")
        self.why = why


class AliasTable:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._target: dict[str, str] = {}
        self._aliases: dict[str, set[str]] = {}
        self.nbytes = 0
        self.nbytes_by: Counter[str] = Counter()  # by the alias's tenant ("" without)
        self._file_bytes = 0
        self._live_bytes = 0  # of the file, what the live aliases' lines take
        self._file_lock = threading.Lock()  # an append, or a compaction's final rename
        self._tail: list[bytes] | None = None  # appended since a compaction copied the table
        self._compactor: threading.Thread | None = None
        self.compactions_failed = 0
        self._retry_at = 0.0  # monotonic time before which a failed compaction waits
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
        """Remove every alias of ``target`` (it is gone: evicted, during another client's
        PUT); returns them.  A log that cannot record that (a full disk) leaves them and
        says so: they name nothing now, and an ``rm`` of the target removes them."""
        try:
            return self.remove(sorted(self._aliases.get(target, ())))
        except AliasLogError as e:
            log.warning("the aliases of an evicted object stay until its key is removed: %s",
                        e)
            return []

    def _set(self, alias: str, target: str) -> None:
        if alias in self._target:
            self._unset(alias)
        self._target[alias] = target
        self._aliases.setdefault(target, set()).add(alias)
        self.nbytes += cost(alias, target)
        self.nbytes_by[tenant_of(alias)] += cost(alias, target)
        self._live_bytes += len(_line(alias, target))

    def _unset(self, alias: str) -> None:
        target = self._target.pop(alias)
        mine = self._aliases[target]
        mine.discard(alias)
        if not mine:
            del self._aliases[target]
        self.nbytes -= cost(alias, target)
        tenant = tenant_of(alias)
        self.nbytes_by[tenant] -= cost(alias, target)
        if not self.nbytes_by[tenant]:
            del self.nbytes_by[tenant]
        self._live_bytes -= len(_line(alias, target))

    # -- the file --------------------------------------------------------------------
    def _append(self, data: bytes) -> None:
        """Append whole lines, fsynced, or change nothing: a write that fails midway (a
        full disk) is cut back off, so no partial change reappears after a restart."""
        if self.path is None:
            return
        with self._file_lock:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND
                             | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                             0o666)
            except OSError as e:
                raise AliasLogError(self.path, e) from None
            try:
                size = os.fstat(fd).st_size
                try:
                    _, written = append_lines(fd, data, "aliases")
                    os.fsync(fd)
                except (OSError, HurrayError) as e:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, size)
                    raise AliasLogError(self.path, e) from None
                self._file_bytes = size + written
                if self._tail is not None:
                    self._tail.append(data)
            finally:
                os.close(fd)

    def _maybe_compact(self) -> None:
        if (self.path is not None and self._compactor is None
                and time.monotonic() >= self._retry_at
                and self._file_bytes > 2 * self._live_bytes + COMPACT_SLACK):
            self._start_compaction()

    def _start_compaction(self) -> threading.Thread:
        items = list(self._target.items())  # here, where the table changes: a consistent copy
        with self._file_lock:
            self._tail = []
        thread = threading.Thread(target=self._compact_from, args=(items,), daemon=True,
                                  name="hurraykv-alias-compaction")
        self._compactor = thread
        thread.start()
        return thread

    def compact(self) -> None:
        """Rewrite the file with the live aliases only (atomically), and wait for it."""
        assert self.path is not None
        self.wait_compacted()
        self._start_compaction().join()

    def wait_compacted(self, timeout: float | None = None) -> None:
        """Wait for a compaction in progress (a clean shutdown; tests)."""
        thread = self._compactor
        if thread is not None:
            thread.join(timeout)

    def _compact_from(self, items: list[tuple[str, str]]) -> None:
        assert self.path is not None
        try:
            data = self._serialize(items)
            with replacement(self.path) as out:
                write_all(out.fd, [data], out.tmp)
                os.fsync(out.fd)  # the bulk, outside the lock: appends go on meanwhile
                with self._file_lock:
                    tail = b"".join(self._tail or ())
                    write_all(out.fd, [tail], out.tmp)
                    out.commit()
                    self._file_bytes = len(data) + len(tail)
                    self._tail = None
        except Exception as e:  # the old file is whole still: nothing lost, retried later
            self.compactions_failed += 1
            # not again at every change (each retry copies the table and fills what space
            # is left with a temporary): one try, and one warning, per interval
            self._retry_at = time.monotonic() + COMPACT_RETRY_SECONDS
            log.warning("%s: compaction failed, the file is kept as it is; next try in "
                        "%.0f s: %s", self.path, COMPACT_RETRY_SECONDS, e)
        finally:
            with self._file_lock:
                self._tail = None
            self._compactor = None

    @staticmethod
    def _serialize(items: list[tuple[str, str]]) -> bytes:
        return b"".join(_line(a, t) for a, t in items)

    def _load(self) -> None:
        assert self.path is not None
        try:  # never through a link (appends refuse one) nor blocking on a FIFO
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return
        except OSError as e:
            raise ContainerError(f"cannot read the alias log {self.path}: {e.strerror}",
                                 field="aliases", value=str(self.path),
                                 rule="a regular file, not a symbolic link") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ContainerError(f"the alias log {self.path} is not a regular file",
                                 field="aliases", value=str(self.path),
                                 rule="a regular file")
        f = os.fdopen(fd, "rb")
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
        # at start, before anyone appends: done here, not left running behind an owner
        # that may append at once (a rename afterwards would drop that append)
        if skipped or self._file_bytes > 2 * self._live_bytes + COMPACT_SLACK:
            self.compact()
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
