"""The server's disk tier: objects persisted as .hrry files under ``--persist DIR``,
LRU under ``--persist-budget``, served from the file after a restart.  ``PersistedTier``
is the part of ``KeyStore`` that holds it (a base class sharing the store's state: the
memory tier's ``_objects``, whose ``path`` an eviction from disk clears, and the
``evictions`` counts); ``hrry_size`` is a file's size before it is written.

The disk tier is changed from two threads: files are written in worker threads (a PUT's
commit), read and deleted on the event loop.  Its index (``_files``, in
least-recently-used order, ``_sizes``, ``_data``, ``_mapped``) is therefore only touched under
``_disk``, a lock held for bookkeeping and unlinks, never while a file is written.  A file
leaves the index before it is unlinked, under the lock, so a reader either opens the whole
file or does not find it; a reader that opened it before keeps reading it (an unlinked
file lives as long as a descriptor does).  Keys evicted from disk for good are left in
``_gone`` for the store to drop their aliases on the event loop.

A persisted object is served by reading its file a frame at a time (``FileBytes``), not
from a mapping: a file cut underneath a mapping is SIGBUS in whoever copies from it and
EFAULT in ``send()``, where a short read is ``UnreadableObject``, which the pull reports.

Recency survives a restart in the files' modification times: each write and each read
of a persisted object sets its file's mtime to a clock that only moves forward, and a
restart orders the files by mtime (ties by name).  The persist budget counts the files'
own sizes (``_sizes``); a key's size as ``hurraykv ls`` shows it is its data bytes
(``_data``: the tensors' buffers, as pushed), the same in memory, on disk and after a
restart (a file adds its header, index, metadata and alignment padding).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

from .. import units
from ..errors import ConfigError, HurrayError
from ..info import is_info
from ..io.atomic import remove_stale
from ..io.hrry import DEFAULT_ALIGNMENT, ENTRY, HEADER, TRAILER, HrryFile, write_hrry
from ..io.kvmeta import encode_kv
from ..io.snapshots import HEAD_NAME, snapshot_kv
from ..snapshot import is_kv_scales, is_seq_lens, member_name
from ..wire.descriptor import TensorDescriptor
from ..wire.layouts import BlockPaged
from .stored import FileBytes, ObjectFile, PersistFull, StoredObject, UnreadableObject

log = logging.getLogger("hurraykv.server")


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def hrry_size(tensors: list[tuple[str, TensorDescriptor, Any]], kv: dict[str, Any],
              alignment: int = DEFAULT_ALIGNMENT) -> int:
    """The size of the file ``write_hrry(path, tensors, kv)`` writes, known before a byte
    is written so the persist budget is settled first (the writer's layout: descriptors
    8-aligned, each buffer aligned, padding after a tensor's last buffer, KV, index and
    trailer; ``test_persist_budget.py`` checks it against real files)."""
    pos = HEADER.size
    for _, desc, _ in tensors:
        pos = _align(pos, 8) + len(desc.encode())
        if desc.buffers:
            for h in desc.buffers:
                pos = _align(pos, alignment) + h.byte_size
            pos = _align(pos, alignment)
    if kv:
        pos = _align(pos, 8) + len(encode_kv(kv))
    pos = _align(pos, 8) + 8
    pos += sum(2 + len(name.encode("utf-8")) + ENTRY.size for name, _, _ in tensors)
    return pos + TRAILER.size


class PersistedTier:
    """The .hrry files of a ``KeyStore``: index, budget, recency, writes and loads."""

    persist: Path | None
    backing: Any  # a hurraykv.store.PageStore, or None
    evictions: Counter[str]
    _objects: OrderedDict[str, StoredObject]

    def _init_disk(self, persist: str | os.PathLike | None, persist_budget: int | None
                   ) -> None:
        """The tier's state, read from the directory (created if missing)."""
        self.persist = Path(persist) if persist else None
        self.persist_budget = persist_budget
        # Guarded by _disk (see the module's docstring): persisted files in
        # least-recently-used order, their sizes, and those already opened, whose index is
        # parsed and validated once, not per pull (their bytes stay in the page cache,
        # outside the memory budget).
        self._disk = threading.RLock()
        self._files: OrderedDict[str, Path] = OrderedDict()
        self._sizes: dict[str, int] = {}  # key -> its file's size (the persist budget's)
        self._data: dict[str, int] = {}  # key -> its data bytes (what listings show)
        self._mapped: dict[str, StoredObject] = {}
        self.persisted_bytes = 0
        self.persist_reserved = 0  # bytes of files being written
        self._writing: Counter[str] = Counter()  # keys whose files are being written
        self._clock = 0  # the last mtime given (ns): recency order across restarts
        self._gone: list[str] = []  # evicted from disk in a worker: aliases checked later
        if self.persist:
            _usable_directory(self.persist)
            self._scan()

    def _scan(self) -> None:
        """Index the persisted objects, least recently used first (by mtime, then name),
        with their files' sizes; temporary files that a killed server left behind
        (``.NAME.XXXXXXXX.tmp``, its own writer's names, unless a live writer holds one
        locked) are removed.  Files that do not read as a persisted object are skipped
        and not counted against the persist budget (they are not the server's)."""
        assert self.persist is not None
        stale = remove_stale(self.persist, None, min_age=0)
        if stale:
            log.info("removed %d stale temporary file(s) from %s", len(stale), self.persist)
        found = []
        data_of: dict[Path, int] = {}
        for path in self.persist.glob("*.hrry"):
            try:
                st = path.stat()
                f = HrryFile.open(path)
                key = f.kv.get("hurraykv.key")
                data = sum(h.byte_size for n in f.names for h in f.descriptor(n).buffers)
            except (HurrayError, OSError) as e:
                log.warning("skipping %s: %s", path, e)
                continue
            if isinstance(key, str):
                found.append((st.st_mtime_ns, path.name, key, path, st.st_size))
                data_of[path] = data
        for mtime, _, key, path, size in sorted(found):
            if key in self._files:  # the older of two files naming one key is unreachable
                log.warning("skipping %s: %s also holds key %r and is newer",
                            self._files[key], path, key)
                self.persisted_bytes -= self._sizes[key]
            self._files[key] = path
            self._files.move_to_end(key)
            self._sizes[key] = size
            self._data[key] = data_of[path]
            self.persisted_bytes += size
            self._clock = max(self._clock, mtime)
        log.info("persisted objects: %d in %s, %s", len(self._files), self.persist,
                 units.size(self.persisted_bytes))

    # -- the disk tier (callers hold _disk) -----------------------------------------------
    def pinned(self, key: str) -> bool:  # the key store's pins (RETAIN)
        return False

    def _tick(self) -> int:
        """A modification time after every one given before, this run or the last."""
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def _use(self, key: str) -> None:
        """``key``'s file is the most recently used: first in memory, then in its mtime
        (best effort: a file system that refuses it only loses order across restarts)."""
        self._files.move_to_end(key)
        t = self._tick()
        with contextlib.suppress(OSError):
            os.utime(self._files[key], ns=(t, t))

    def _evict_disk(self, key: str) -> None:
        """Take ``key``'s file out of the index, then unlink it: from then on nobody finds
        it, and whoever mapped it already keeps reading valid pages."""
        path = self._files.pop(key)
        size = self._sizes.pop(key, 0)
        self._data.pop(key, None)
        self.persisted_bytes -= size
        self._mapped.pop(key, None)
        obj = self._objects.get(key)
        if obj is not None and obj.path == path:
            obj.path = None  # still served from memory, no longer durable there
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("evicted %r from disk but cannot remove %s: %s", key, path, e)
        self.evictions["disk"] += 1
        log.info("evicted %r from disk (%s)%s", key, units.size(size),
                 "; still in memory" if obj is not None else "")
        if obj is None:
            self._gone.append(key)

    def _evict_disk_down_to(self, room: int) -> None:
        """Evict least recently used files until the persisted bytes and the files being
        written fit in ``room``.  Never the file of a key being written: its path is about
        to be, or already is, the new file's, which unlinking it could remove."""
        for key in list(self._files):
            if self.persisted_bytes + self.persist_reserved <= room:
                return
            if not self._writing[key] and not self.pinned(key):
                self._evict_disk(key)

    def _reserve_disk(self, nbytes: int, key: str) -> None:
        """Room under the persist budget for a file of ``nbytes`` replacing ``key``'s,
        or ``PersistFull`` (decided before anything is evicted)."""
        with self._disk:
            budget = self.persist_budget
            if budget is not None:
                # what cannot leave meanwhile: files being written and the old files of
                # the keys they replace (this key's goes as its new file is renamed)
                pinned = sum(self._sizes.get(k, 0) for k in self._sizes if k != key and (
                    self._writing[k] or self.pinned(k)))
                if pinned + self.persist_reserved + nbytes > budget:
                    raise PersistFull(nbytes, budget, pinned + self.persist_reserved)
                self._evict_disk_down_to(budget - nbytes + self._sizes.get(key, 0))
            self.persist_reserved += nbytes
            self._writing[key] += 1

    def _done_writing(self, key: str, reserved: int) -> None:
        self.persist_reserved -= reserved
        self._writing[key] -= 1
        if not self._writing[key]:
            del self._writing[key]

    def _add_file(self, key: str, path: Path, reserved: int, nbytes: int) -> None:
        """Index the file just written for ``key`` (``nbytes`` of data): its reservation
        becomes its size."""
        with self._disk:
            self._done_writing(key, reserved)
            try:
                size = path.stat().st_size
            except OSError as e:  # a DELETE of the key while it was written
                log.info("%s is gone before it was indexed: %s", path, e)
                self._forget_file(key)
                return
            if size != reserved:
                log.warning("%s: %d bytes where %d were expected", path, size, reserved)
            self.persisted_bytes += size - self._sizes.get(key, 0)
            self._sizes[key] = size
            self._data[key] = nbytes
            self._files[key] = path
            self._use(key)
            if self.persist_budget is not None:  # only if the expected size was short
                self._evict_disk_down_to(self.persist_budget)

    def _forget_file(self, key: str) -> None:
        """A file removed behind the server's back: out of the index and the accounts."""
        self._files.pop(key, None)
        self.persisted_bytes -= self._sizes.pop(key, 0)
        self._data.pop(key, None)
        self._mapped.pop(key, None)

    # -- loads and writes ----------------------------------------------------------------
    def _path(self, key: str) -> Path:
        assert self.persist is not None
        return self.persist / (hashlib.sha256(key.encode("utf-8")).hexdigest()[:40] + ".hrry")

    def _from_disk(self, key: str) -> StoredObject | None:
        """``key``'s persisted object, its file opened and its index validated on first
        use, its bytes read from the file as they are sent; None when it has no file,
        ``UnreadableObject`` when the file cannot be opened or read as the object."""
        with self._disk:
            obj = self._mapped.get(key)
            if obj is not None:
                self._use(key)
                return obj
            path = self._files.get(key)
            if path is not None:
                try:
                    file = ObjectFile(path)
                except FileNotFoundError:
                    log.warning("%s (key %r) was removed from %s by someone else", path.name,
                                key, self.persist)
                    self._forget_file(key)
                    return None
                except OSError as e:
                    raise UnreadableObject(f"cannot open {path.name}: {e.strerror or e}",
                                           path, field="file", value=path.name,
                                           rule="a persisted file the server can open"
                                           ) from None
                try:  # the file's name only: messages may reach a tenant
                    f = HrryFile.index(file.fd, path.name)
                except HurrayError as e:
                    file.close()
                    raise UnreadableObject.of(e, path) from None
                items = [(f.descriptor(n), [FileBytes(file, off, size)
                                            for off, size in f.spans(n)]) for n in f.names]
                obj = StoredObject(items, sum(h.byte_size for d, _ in items
                                              for h in d.buffers), path)
                self._mapped[key] = obj
                self._use(key)
                return obj
        return None

    def drop_opened(self, obj: StoredObject) -> None:
        """Forget ``obj``, an object served from its file, which a pull found damaged:
        the next pull opens the file afresh and is refused before any byte is sent."""
        with self._disk:
            for key, opened in list(self._mapped.items()):
                if opened is obj:
                    del self._mapped[key]

    def persist_object(self, key: str, obj: StoredObject, snap: Any) -> Path | None:
        """Write the object's .hrry file (atomic) and its pages to the backing store;
        runs in a worker thread, before the PUT is acknowledged.  The file's room under
        the persist budget is settled first: ``PersistFull`` before anything is written,
        least recently used files evicted otherwise."""
        if self.persist is None:
            if self.backing is not None and snap is not None:
                self.backing.put(key, snap)
                obj.backed = True
            return None
        tensors, kv = file_contents(key, obj, snap)
        reserved = hrry_size(tensors, kv)
        self._reserve_disk(reserved, key)
        added = False
        try:
            if self.backing is not None and snap is not None:
                self.backing.put(key, snap)
                obj.backed = True
            path = write_hrry(self._path(key), tensors, kv)
            self._add_file(key, path, reserved, obj.nbytes)
            added = True
        finally:
            if not added:
                with self._disk:
                    self._done_writing(key, reserved)
        return path


def file_contents(key: str, obj: StoredObject, snap: Any
                  ) -> tuple[list[tuple[str, TensorDescriptor, Any]], dict[str, Any]]:
    """The named tensors and KV metadata of ``key``'s .hrry file, in the object's order
    (``snap``: the object's snapshot, None for one tensor)."""
    if snap is not None:
        tensors = [(HEAD_NAME, obj.items[0][0], [])]
        used: set[str] = set()
        for i, (d, b) in enumerate(obj.items[1:]):
            name = _name(d, i)
            name = name if name not in used else f"extra.{i}"
            used.add(name)
            tensors.append((name, d, b))
        kv = snapshot_kv(snap)
    else:
        tensors = [("tensor", *obj.items[0])]
        kv = {}
    kv["hurraykv.key"] = key
    return tensors, kv


def _usable_directory(path: Path) -> None:
    """``--persist DIR`` made if missing, and one the server can list and write in:
    ``ConfigError`` naming the option, the path and why not (at start, not at the first
    push)."""
    def refuse(why: str) -> ConfigError:
        return ConfigError(f"--persist {path}: {why}", field="persist", value=str(path),
                           rule="a directory the server can create, read and write")

    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise refuse("not a directory") from None
    except OSError as e:
        raise refuse(f"cannot create it: {e.strerror or e}") from None
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise refuse("cannot write in it: Permission denied")


def _name(desc: TensorDescriptor, i: int) -> str:
    layout = desc.layout
    if isinstance(layout, BlockPaged):
        return member_name(layout.layer_index, layout.kv_role_name)
    if is_info(desc):
        return "info"
    if is_seq_lens(desc):
        return "seq_lens"
    if is_kv_scales(desc):
        return "kv_scales"
    return f"extra.{i}"
