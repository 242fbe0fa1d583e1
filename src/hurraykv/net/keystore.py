"""What the KV server stores: committed objects by key, LRU under a memory budget,
optionally persisted as .hrry files (LRU under a persist budget) that are served from an
mmap after a restart.

An object is a snapshot (a group head and its members) or one tensor, kept as the list
of ``(descriptor, buffers)`` the wire carries, in pre-order.  Objects are immutable once
committed: a reader holds a reference to the object it started with, so a PUT that
replaces a key never shows anyone a partial snapshot.

The disk tier (``--persist DIR``, bounded by ``--persist-budget``) is changed from two
threads: files are written in worker threads (a PUT's commit), read and deleted on the
event loop.  Its index (``_files``, in least-recently-used order, ``_sizes``, ``_mapped``)
is therefore only touched under ``_disk``, a lock held for bookkeeping and unlinks, never
while a file is written.  A file leaves the index before it is unlinked, under the lock,
so a reader either maps the whole file or does not find it; a reader that mapped it
before keeps valid pages (an unlinked file's pages live as long as a mapping does).

Recency survives a restart in the files' modification times: each write and each read
of a persisted object sets its file's mtime to a clock that only moves forward, and a
restart orders the files by mtime (ties by name).  Sizes are the files' own sizes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import units
from ..errors import HurrayError
from ..info import is_info
from ..io.atomic import remove_stale
from ..io.hrry import DEFAULT_ALIGNMENT, ENTRY, HEADER, TRAILER, HrryFile, write_hrry
from ..io.kvmeta import encode_kv
from ..io.snapshots import HEAD_NAME, snapshot_kv
from ..paged import BlockPagedTensor
from ..snapshot import KVCacheSnapshot, is_kv_scales, is_seq_lens, member_name
from ..wire.descriptor import TensorDescriptor
from ..wire.layouts import BlockPaged, Composite
from .aliases import AliasTable, cost
from .messages import ErrorCode
from .tenants import SEPARATOR

log = logging.getLogger("hurraykv.server")
ALIASES = "aliases.jsonl"
Items = list[tuple[TensorDescriptor, list[Any]]]


class StoreFull(HurrayError):
    """A PUT the memory budget cannot hold; answered with ERROR STORE_FULL."""

    def __init__(self, nbytes: int, budget: int, in_flight: int, kept: int, aliases: int = 0,
                 field: str = "total_data_bytes") -> None:
        self.nbytes, self.budget, self.in_flight, self.kept = nbytes, budget, in_flight, kept
        self.aliases = aliases
        super().__init__(self.needs(nbytes), field=field, value=nbytes, rule="--memory-budget")

    def needs(self, nbytes: int) -> str:
        """Why ``nbytes`` do not fit, in the budget's terms."""
        held = f" and {self.aliases} hold aliases" if self.aliases else ""
        return (f"needs {nbytes} bytes ({nbytes / (1 << 30):.3f} GiB) but the memory budget "
                f"is {self.budget} bytes ({self.budget / (1 << 30):.3f} GiB), of which "
                f"{self.in_flight} are reserved by other PUTs in flight and {self.kept} hold "
                f"the key's current value{held}")


class PersistFull(HurrayError):
    """An object whose .hrry file the persist budget cannot hold; answered with ERROR
    STORE_FULL (decided before anything is written or evicted)."""

    code = ErrorCode.STORE_FULL

    def __init__(self, nbytes: int, budget: int, in_flight: int) -> None:
        self.nbytes, self.budget, self.in_flight = nbytes, budget, in_flight
        others = (f", of which {in_flight} are reserved by other PUTs being written"
                  if in_flight else "")
        super().__init__(f"needs {nbytes} bytes ({nbytes / (1 << 30):.3f} GiB) for its "
                         f".hrry file (file_bytes) but --persist-budget is {budget} bytes "
                         f"({budget / (1 << 30):.3f} GiB){others}",
                         field="file_bytes", value=nbytes, rule="--persist-budget")


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


@dataclass
class StoredObject:
    items: Items
    nbytes: int
    path: Path | None = None
    backed: bool = False  # also in the backing store

    @property
    def durable(self) -> bool:
        """Evicting it from memory loses nothing: it is on disk or in the backing store."""
        return self.path is not None or self.backed


def object_from_items(items: Items, zero_unused: bool) -> tuple[StoredObject, Any]:
    """Validate received items and prepare them for storage.

    A group must be a KV snapshot; its block-paged members get their unused slots zeroed
    (the server owns these buffers).  Returns the object and, for snapshots, the
    KVCacheSnapshot used to persist it."""
    head = items[0][0]
    nbytes = sum(h.byte_size for d, _ in items for h in d.buffers)
    if isinstance(head.layout, Composite):
        snap = KVCacheSnapshot.from_members([(None, d, b) for d, b in items[1:]])
        if zero_unused and snap.seq_lens is not None:
            for key in snap.member_keys():
                snap.tensor(*key).zero_unused_slots()
        tensors = {(t.layer_index, t.kv_role): t for t in snap.tensors()}
        out: Items = [(head, [])]
        for desc, bufs in items[1:]:
            if isinstance(desc.layout, BlockPaged):
                t = tensors[(desc.layout.layer_index, desc.layout.kv_role_name)]
                bufs = list(t.buffers())
            out.append((desc, list(bufs)))
        return StoredObject(out, nbytes), snap
    desc, bufs = items[0]
    if isinstance(desc.layout, BlockPaged) and zero_unused:
        t = BlockPagedTensor.from_descriptor(desc, bufs)
        if t.seq_lens is not None:
            t.zero_unused_slots()
        bufs = list(t.buffers())
    return StoredObject([(desc, list(bufs))], nbytes), None


class KeyStore:
    """Committed objects by key, in memory under ``memory_budget`` (LRU), persisted
    and backed when configured.

    The budget bounds everything the server holds for data: committed objects in memory,
    the bytes of PUTs still arriving (reserved before their data is accepted) and the
    receive pool's idle buffers.  A reservation that does not fit first drops idle
    buffers, then evicts least recently used objects - never the current value of the
    key being replaced, which must survive a PUT that fails - and is refused otherwise."""

    def __init__(self, memory_budget: int | None = None, persist: str | os.PathLike | None = None,
                 zero_unused: bool = True, backing: Any = None, pool: Any = None,
                 persist_budget: int | None = None) -> None:
        if persist_budget is not None and not persist:
            raise HurrayError(f"persist_budget {persist_budget}: bounds the --persist "
                              "directory, and none is given", field="persist_budget",
                              value=persist_budget, rule="--persist-budget needs --persist")
        self.backing = backing  # a hurraykv.store.PageStore: snapshots beyond this machine
        self.memory_budget = memory_budget
        self.persist = Path(persist) if persist else None
        self.persist_budget = persist_budget
        self.zero_unused = zero_unused
        self.pool = pool  # a ReceivePool whose idle bytes count against the budget
        self._objects: OrderedDict[str, StoredObject] = OrderedDict()
        # The disk tier, guarded by _disk (see the module's docstring): persisted files in
        # least-recently-used order, their sizes, and those already opened, whose index is
        # parsed and validated once, not per pull (they live in the page cache, outside
        # the memory budget).
        self._disk = threading.RLock()
        self._files: OrderedDict[str, Path] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._mapped: dict[str, StoredObject] = {}
        self.persisted_bytes = 0
        self.persist_reserved = 0  # bytes of files being written
        self._writing: Counter[str] = Counter()  # keys whose files are being written
        self._clock = 0  # the last mtime given (ns): recency order across restarts
        self._gone: list[str] = []  # evicted from disk in a worker: aliases checked later
        self.evictions: Counter[str] = Counter()  # by tier: "memory", "disk"
        self.memory_bytes = 0
        self.reserved_bytes = 0
        self._reserved_by: Counter[str] = Counter()  # by tenant id ("" without tenants)
        self.aliases = AliasTable()
        if self.persist:
            self.persist.mkdir(parents=True, exist_ok=True)
            self._scan()
            self.aliases = AliasTable(self.persist / ALIASES)
            if memory_budget is not None and self.aliases.nbytes > memory_budget:
                log.warning("the %d aliases in %s hold %s, over the memory budget of %s: "
                            "new aliases are refused until some go", len(self.aliases),
                            self.persist / ALIASES, units.size(self.aliases.nbytes),
                            units.size(memory_budget))
            if persist_budget is not None and self.persisted_bytes > persist_budget:
                log.warning("%s holds %s, over the persist budget of %s: evicting the "
                            "least recently used", self.persist,
                            units.size(self.persisted_bytes), units.size(persist_budget))
                with self._disk:
                    self._evict_disk_down_to(persist_budget)
                self._drop_gone()

    # -- the budget ----------------------------------------------------------------------
    def idle_room(self) -> int | None:
        """Bytes the receive pool may keep idle now (None: no budget)."""
        if self.memory_budget is None:
            return None
        return max(0, self.memory_budget - self._used())

    def _used(self) -> int:
        """Bytes held against the budget: objects in memory, reservations, aliases."""
        return self.memory_bytes + self.reserved_bytes + self.aliases.nbytes

    def reserve(self, nbytes: int, *, keep: str | None = None, lossy: bool = True,
                owner: str = "") -> None:
        """Account ``nbytes`` of a PUT before its data arrives, or raise ``StoreFull``.

        Whether the bytes can fit at all (evicting every other object) is decided before
        anything is evicted.  With ``lossy=False`` (a member of a group whose size is not
        yet known: more members follow) only objects that stay on disk or in the backing
        store leave memory; objects that would be lost are evicted only once the group's
        last member shows the whole group fits, so a group refused midway loses nobody
        else's key (meanwhile memory may pass the budget by at most the group's bytes)."""
        budget = self.memory_budget
        if budget is None:
            self._add_reserved(nbytes, owner)
            return
        self._make_room(nbytes, keep, lossy)
        self._add_reserved(nbytes, owner)

    def _make_room(self, nbytes: int, keep: str | None, lossy: bool,
                   field: str = "total_data_bytes") -> None:
        """Room for ``nbytes`` more under the budget: decided first (``StoreFull`` if even
        evicting every object but ``keep`` cannot make it), then idle receive buffers are
        dropped and least recently used objects evicted (``lossy=False``: only those kept
        on disk or in the backing store)."""
        budget = self.memory_budget
        assert budget is not None
        kept = self._objects[keep].nbytes if keep in self._objects else 0
        aliases = self.aliases.nbytes
        if self.reserved_bytes + kept + aliases + nbytes > budget:  # not even evicting all
            raise StoreFull(nbytes, budget, self.reserved_bytes, kept, aliases, field)
        if self.pool is not None:
            self.pool.trim(max(0, budget - self._used() - nbytes))
        for key in list(self._objects):
            if self._used() + nbytes <= budget:
                break
            if key != keep and (lossy or self._objects[key].durable):
                self._evict_key(key)

    def _add_reserved(self, nbytes: int, owner: str) -> None:
        self.reserved_bytes += nbytes
        self._reserved_by[owner] += nbytes

    def release(self, nbytes: int, owner: str = "") -> None:
        self.reserved_bytes = max(0, self.reserved_bytes - nbytes)
        self._reserved_by[owner] = max(0, self._reserved_by[owner] - nbytes)
        if not self._reserved_by[owner]:
            del self._reserved_by[owner]

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
        for path in self.persist.glob("*.hrry"):
            try:
                st = path.stat()
                key = HrryFile.open(path).kv.get("hurraykv.key")
            except (HurrayError, OSError) as e:
                log.warning("skipping %s: %s", path, e)
                continue
            if isinstance(key, str):
                found.append((st.st_mtime_ns, path.name, key, path, st.st_size))
        for mtime, _, key, path, size in sorted(found):
            if key in self._files:  # the older of two files naming one key is unreachable
                log.warning("skipping %s: %s also holds key %r and is newer",
                            self._files[key], path, key)
                self.persisted_bytes -= self._sizes[key]
            self._files[key] = path
            self._files.move_to_end(key)
            self._sizes[key] = size
            self.persisted_bytes += size
            self._clock = max(self._clock, mtime)
        log.info("persisted objects: %d in %s, %s", len(self._files), self.persist,
                 units.size(self.persisted_bytes))

    # -- the disk tier (callers hold _disk) -----------------------------------------------
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
            if not self._writing[key]:
                self._evict_disk(key)

    def _reserve_disk(self, nbytes: int, key: str) -> None:
        """Room under the persist budget for a file of ``nbytes`` replacing ``key``'s,
        or ``PersistFull`` (decided before anything is evicted)."""
        with self._disk:
            budget = self.persist_budget
            if budget is not None:
                # what cannot leave meanwhile: files being written and the old files of
                # the keys they replace (this key's goes as its new file is renamed)
                pinned = sum(self._sizes.get(k, 0) for k in self._writing if k != key)
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

    def _add_file(self, key: str, path: Path, reserved: int) -> None:
        """Index the file just written for ``key``: its reservation becomes its size."""
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
            self._files[key] = path
            self._use(key)
            if self.persist_budget is not None:  # only if the expected size was short
                self._evict_disk_down_to(self.persist_budget)

    def _forget_file(self, key: str) -> None:
        """A file removed behind the server's back: out of the index and the accounts."""
        self._files.pop(key, None)
        self.persisted_bytes -= self._sizes.pop(key, 0)
        self._mapped.pop(key, None)

    def _drop_gone(self) -> None:
        """On the event loop: aliases of keys evicted from disk for good go with them."""
        while self._gone:
            key = self._gone.pop()
            if key not in self:
                self.aliases.drop_target(key)

    def _path(self, key: str) -> Path:
        assert self.persist is not None
        return self.persist / (hashlib.sha256(key.encode("utf-8")).hexdigest()[:40] + ".hrry")

    def __contains__(self, key: str) -> bool:
        return key in self._objects or key in self._files or (
            self.backing is not None and key in self.backing)

    def get(self, key: str) -> StoredObject | None:
        if key not in self:
            key = self.aliases.target(key) or key
        obj = self._objects.get(key)
        if obj is not None:
            self._objects.move_to_end(key)
            if key in self._files:  # a read is a use of its file as well
                with self._disk:
                    if key in self._files:
                        self._use(key)
            return obj
        with self._disk:
            obj = self._mapped.get(key)
            if obj is not None:
                self._use(key)
                return obj
            path = self._files.get(key)
            if path is not None:
                try:
                    f = HrryFile.open(path)  # served zero-copy from the mapping
                except FileNotFoundError:
                    log.warning("%s (key %r) was removed from %s by someone else", path.name,
                                key, self.persist)
                    self._forget_file(key)
                else:
                    items = [(f.descriptor(n), f.buffers(n)) for n in f.names]
                    obj = StoredObject(items, sum(h.byte_size for d, _ in items
                                                  for h in d.buffers), path)
                    self._mapped[key] = obj
                    self._use(key)
                    return obj
        return self._from_backing(key)

    def _from_backing(self, key: str) -> StoredObject | None:
        if self.backing is None or key not in self.backing:
            return None
        snap = self.backing.get(key)
        items = [(snap.head(), [])] + [(d, list(b)) for _, d, b in snap.members()]
        obj = StoredObject(items, snap.nbytes, backed=True)
        self.commit(key, obj, None)  # kept in memory (LRU) until evicted
        return obj

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
        tensors, kv = self._file_contents(key, obj, snap)
        reserved = hrry_size(tensors, kv)
        self._reserve_disk(reserved, key)
        added = False
        try:
            if self.backing is not None and snap is not None:
                self.backing.put(key, snap)
                obj.backed = True
            path = write_hrry(self._path(key), tensors, kv)
            self._add_file(key, path, reserved)
            added = True
        finally:
            if not added:
                with self._disk:
                    self._done_writing(key, reserved)
        return path

    def _file_contents(self, key: str, obj: StoredObject, snap: Any
                       ) -> tuple[list[tuple[str, TensorDescriptor, Any]], dict[str, Any]]:
        """The named tensors and KV metadata of ``key``'s .hrry file."""
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

    def commit(self, key: str, obj: StoredObject, path: Path | None, reserved: int = 0,
               owner: str = "") -> None:
        """Make ``obj`` the value of ``key`` (its ``reserved`` bytes become held bytes)."""
        self._drop_memory(key)
        self.release(reserved, owner)
        if path is not None:
            with self._disk:  # unless evicted from disk already, by a PUT since
                if self._files.get(key) == path:
                    obj.path = path
        self._objects[key] = obj
        self.memory_bytes += obj.nbytes
        self._evict(keep=key)
        self._drop_gone()

    def _drop_memory(self, key: str) -> None:
        with self._disk:
            self._mapped.pop(key, None)  # a replaced file is a new inode: map it afresh
        old = self._objects.pop(key, None)
        if old is not None:
            self.memory_bytes -= old.nbytes

    def _evict_key(self, key: str) -> None:
        old = self._objects.pop(key)
        self.memory_bytes -= old.nbytes
        self.evictions["memory"] += 1
        log.info("evicted %r (%s)%s", key, units.size(old.nbytes),
                 "; still on disk" if key in self._files else "")
        if not old.durable and key not in self._files:
            self.aliases.drop_target(key)  # gone for good: so are its aliases

    def _evict(self, keep: str) -> None:
        """Objects loaded from the backing store may overshoot: evict down to the budget."""
        if self.memory_budget is None:
            return
        for key in list(self._objects):
            if self._used() <= self.memory_budget:
                return
            if key != keep:
                self._evict_key(key)

    # -- aliases -------------------------------------------------------------------------
    def link(self, pairs: list[tuple[str, str]]) -> None:
        """Each alias names its target's object from now on.  Aliases are held against the
        memory budget (``StoreFull`` when it cannot hold them: decided before anything is
        evicted) and appended to the persist directory's ``aliases.jsonl``, fsynced, so a
        restarted server keeps them."""
        added = self.aliases.added_bytes(pairs)
        if self.memory_budget is not None and added > 0:
            self._make_room(added, None, True, field="aliases")
        self.aliases.link(pairs)

    def locate(self, key: str) -> str | None:
        """The stored object ``key`` names: itself, or its alias's target; None if gone."""
        if key in self:
            return key
        target = self.aliases.target(key)
        return target if target is not None and target in self else None

    def alias_listing(self) -> list[tuple[str, str]]:
        """Every ``(alias, target)``."""
        return self.aliases.items()

    def listing(self) -> list[tuple[str, int]]:
        """Every key held in memory or on disk, with its data bytes (a file's size for an
        object not loaded since a restart); keys only in the backing store are not listed."""
        with self._disk:
            sizes = {key: obj.nbytes for key, obj in {**self._mapped, **self._objects}.items()}
            for key, nbytes in self._sizes.items():
                sizes.setdefault(key, nbytes)
        return sorted(sizes.items())

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """Server-wide counts, or (``tenant``) that tenant's own: its objects and bytes,
        the bytes its PUTs in flight reserve, and only whether the server persists."""
        if tenant is None:
            return {"objects_in_memory": len(self._objects),
                    "persisted_objects": len(self._files),
                    "memory_bytes": self.memory_bytes, "reserved_bytes": self.reserved_bytes,
                    "memory_budget": self.memory_budget,
                    "idle_receive_bytes": self.pool.idle_bytes if self.pool is not None else 0,
                    "persist": str(self.persist) if self.persist else None,
                    "persisted_bytes": self.persisted_bytes,
                    "persist_reserved_bytes": self.persist_reserved,
                    "persist_budget": self.persist_budget,
                    "memory_evictions": self.evictions["memory"],
                    "disk_evictions": self.evictions["disk"],
                    "backing_store": self.backing is not None,
                    "aliases": len(self.aliases), "alias_bytes": self.aliases.nbytes}
        prefix = tenant + SEPARATOR
        aliases = [cost(a, t) for a, t in self.aliases.items() if a.startswith(prefix)]
        mine = [o.nbytes for k, o in self._objects.items() if k.startswith(prefix)]
        with self._disk:
            files = [n for k, n in self._sizes.items() if k.startswith(prefix)]
        # evictions are not split by tenant: a count of others' would tell their activity
        return {"objects_in_memory": len(mine), "persisted_objects": len(files),
                "memory_bytes": sum(mine), "reserved_bytes": self._reserved_by[tenant],
                "memory_budget": self.memory_budget, "persist": self.persist is not None,
                "persisted_bytes": sum(files), "persist_budget": self.persist_budget,
                "backing_store": self.backing is not None, "aliases": len(aliases),
                "alias_bytes": sum(aliases)}

    def delete(self, key: str) -> bool:
        """Delete the object ``key`` (its aliases go with it) and the alias ``key``;
        False when there was neither."""
        found = key in self
        if self.backing is not None and key in self.backing:
            self.backing.delete(key)
        self._drop_memory(key)
        with self._disk:  # out of the index first: no reader finds a file being removed
            path = self._files.pop(key, None)
            self.persisted_bytes -= self._sizes.pop(key, 0)
            if path is not None:
                path.unlink(missing_ok=True)
        # the key as an alias, and an object's own aliases, in one fsynced append
        removed = self.aliases.remove([key, *sorted(self.aliases.aliases_of(key))]
                                      if found else [key])
        return found or key in removed


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
