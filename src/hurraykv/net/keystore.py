"""What the KV server stores: committed objects by key, LRU under a memory budget,
optionally persisted as .hrry files that are served from an mmap after a restart.

An object is a snapshot (a group head and its members) or one tensor, kept as the list
of ``(descriptor, buffers)`` the wire carries, in pre-order.  Objects are immutable once
committed: a reader holds a reference to the object it started with, so a PUT that
replaces a key never shows anyone a partial snapshot.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import units
from ..errors import HurrayError
from ..info import is_info
from ..io.atomic import remove_stale
from ..io.hrry import HrryFile, write_hrry
from ..io.snapshots import HEAD_NAME, snapshot_kv
from ..paged import BlockPagedTensor
from ..snapshot import KVCacheSnapshot, is_kv_scales, is_seq_lens, member_name
from ..wire.descriptor import TensorDescriptor
from ..wire.layouts import BlockPaged, Composite
from .aliases import AliasTable, cost
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
                 zero_unused: bool = True, backing: Any = None, pool: Any = None) -> None:
        self.backing = backing  # a hurraykv.store.PageStore: snapshots beyond this machine
        self.memory_budget = memory_budget
        self.persist = Path(persist) if persist else None
        self.zero_unused = zero_unused
        self.pool = pool  # a ReceivePool whose idle bytes count against the budget
        self._objects: OrderedDict[str, StoredObject] = OrderedDict()
        self._files: dict[str, Path] = {}
        # Persisted objects already opened: their index is parsed and validated once, not
        # per pull.  They live in the page cache (mmap), outside the memory budget.
        self._mapped: dict[str, StoredObject] = {}
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
        """Index the persisted objects; temporary files that a killed server left behind
        (``.NAME.XXXXXXXX.tmp``, its own writer's names, unless a live writer holds one
        locked) are removed."""
        assert self.persist is not None
        stale = remove_stale(self.persist, None, min_age=0)
        if stale:
            log.info("removed %d stale temporary file(s) from %s", len(stale), self.persist)
        for path in sorted(self.persist.glob("*.hrry")):
            try:
                key = HrryFile.open(path).kv.get("hurraykv.key")
            except HurrayError as e:
                log.warning("skipping %s: %s", path, e)
                continue
            if isinstance(key, str):
                self._files[key] = path
        log.info("persisted objects: %d in %s", len(self._files), self.persist)

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
            return obj
        obj = self._mapped.get(key)
        if obj is not None:
            return obj
        path = self._files.get(key)
        if path is None:
            return self._from_backing(key)
        f = HrryFile.open(path)  # served zero-copy from the mapping
        items = [(f.descriptor(n), f.buffers(n)) for n in f.names]
        obj = StoredObject(items, sum(h.byte_size for d, _ in items for h in d.buffers), path)
        self._mapped[key] = obj
        return obj

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
        runs in a worker thread, before the PUT is acknowledged."""
        if self.backing is not None and snap is not None:
            self.backing.put(key, snap)
            obj.backed = True
        if self.persist is None:
            return None
        path = self._path(key)
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
        write_hrry(path, tensors, kv)
        return path

    def commit(self, key: str, obj: StoredObject, path: Path | None, reserved: int = 0,
               owner: str = "") -> None:
        """Make ``obj`` the value of ``key`` (its ``reserved`` bytes become held bytes)."""
        self._drop_memory(key)
        self.release(reserved, owner)
        if path is not None:
            self._files[key] = path
            obj.path = path
        self._objects[key] = obj
        self.memory_bytes += obj.nbytes
        self._evict(keep=key)

    def _drop_memory(self, key: str) -> None:
        self._mapped.pop(key, None)  # a replaced file is a new inode: map it afresh
        old = self._objects.pop(key, None)
        if old is not None:
            self.memory_bytes -= old.nbytes

    def _evict_key(self, key: str) -> None:
        old = self._objects.pop(key)
        self.memory_bytes -= old.nbytes
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
        sizes = {key: obj.nbytes for key, obj in {**self._mapped, **self._objects}.items()}
        for key, path in self._files.items():
            if key not in sizes:
                try:
                    sizes[key] = path.stat().st_size
                except OSError:
                    continue
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
                    "backing_store": self.backing is not None,
                    "aliases": len(self.aliases), "alias_bytes": self.aliases.nbytes}
        prefix = tenant + SEPARATOR
        aliases = [cost(a, t) for a, t in self.aliases.items() if a.startswith(prefix)]
        mine = [o.nbytes for k, o in self._objects.items() if k.startswith(prefix)]
        return {"objects_in_memory": len(mine),
                "persisted_objects": sum(1 for k in self._files if k.startswith(prefix)),
                "memory_bytes": sum(mine), "reserved_bytes": self._reserved_by[tenant],
                "memory_budget": self.memory_budget, "persist": self.persist is not None,
                "backing_store": self.backing is not None, "aliases": len(aliases),
                "alias_bytes": sum(aliases)}

    def delete(self, key: str) -> bool:
        """Delete the object ``key`` (its aliases go with it) and the alias ``key``;
        False when there was neither."""
        found = key in self
        if self.backing is not None and key in self.backing:
            self.backing.delete(key)
        self._drop_memory(key)
        path = self._files.pop(key, None)
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
