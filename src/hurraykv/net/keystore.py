"""What the KV server stores: committed objects by key (``stored.py``), LRU under a
memory budget, optionally persisted as .hrry files (the disk tier, ``persisted.py``:
LRU under a persist budget, served from an mmap after a restart) and backed by a page
store, with LINK's aliases (``aliases.py``) held against the memory budget.

The memory budget bounds objects in memory, PUTs in flight, the receive pool's idle
buffers and the aliases; ``KeyStore`` here holds that tier and its accounts, lookups
through memory, disk and the backing store in that order, and the listings.

Under ``--max-bytes-per-tenant`` (mutual TLS) every byte a tenant makes the server hold
counts against that tenant's quota (its objects in memory, copies read back from the
backing store, its pushes and payloads in flight, its aliases), and room is only ever made
from the tenant's own objects: under the quota and under the memory budget alike, no
tenant's request evicts another tenant's object.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Collection
from pathlib import Path
from typing import Any

from .. import units
from ..errors import HurrayError
from ..io import retention
from .aliases import AliasTable, cost
from .persisted import PersistedTier, hrry_size
from .stored import (
    Items,
    PersistFull,
    PinnedFull,
    SharedFull,
    StoredObject,
    StoreFull,
    TenantFull,
    object_from_items,
)
from .tenants import SEPARATOR, tenant_of

log = logging.getLogger("hurraykv.server")
ALIASES = "aliases.jsonl"


class KeyStore(PersistedTier):
    """Committed objects by key, in memory under ``memory_budget`` (LRU), persisted
    and backed when configured.

    The budget bounds everything the server holds for data: committed objects in memory,
    the bytes of PUTs still arriving (reserved before their data is accepted) and the
    receive pool's idle buffers.  A reservation that does not fit first drops idle
    buffers, then evicts least recently used objects - never the current value of the
    key being replaced, which must survive a PUT that fails - and is refused otherwise."""

    def __init__(self, memory_budget: int | None = None, persist: str | os.PathLike | None = None,
                 zero_unused: bool = True, backing: Any = None, pool: Any = None,
                 persist_budget: int | None = None, max_pinned_bytes: int | None = None,
                 max_bytes_per_tenant: int | None = None) -> None:
        if persist_budget is not None and not persist:
            raise HurrayError(f"persist_budget {persist_budget}: bounds the --persist "
                              "directory, and none is given", field="persist_budget",
                              value=persist_budget, rule="--persist-budget needs --persist")
        self.backing = backing  # a hurraykv.store.PageStore: snapshots beyond this machine
        self.memory_budget = memory_budget
        self.tenant_max = max_bytes_per_tenant  # memory per mutual-TLS tenant
        self.zero_unused = zero_unused
        self.pool = pool  # a ReceivePool whose idle bytes count against the budget
        self._objects: OrderedDict[str, StoredObject] = OrderedDict()
        self._init_disk(persist, persist_budget)
        self.evictions: Counter[str] = Counter()  # by tier: "memory", "disk"
        self.memory_bytes = 0
        self._memory_by: Counter[str] = Counter()  # by tenant id ("" without tenants)
        self.reserved_bytes = 0
        self._reserved_by: Counter[str] = Counter()  # by tenant id ("" without tenants)
        self.aliases = AliasTable()
        # pins and lifetimes (RETAIN): pinned objects never leave to make room, within
        # max_pinned_bytes (a quarter of the smallest budget by default)
        budgets = [b for b in (memory_budget, persist_budget) if b is not None]
        self.max_pinned_bytes = max_pinned_bytes if max_pinned_bytes is not None else (
            min(budgets) // 4 if budgets else None)
        self.kept: dict[str, retention.Kept] = (
            retention.read(self.persist) if self.persist else {})
        if self.persist:
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

    def close(self) -> None:
        """Let a compaction of the alias log in progress finish (a server stopping: a new
        one on the same directory must not see it renamed over its appends)."""
        self.aliases.wait_compacted()

    # -- the budget ----------------------------------------------------------------------
    def idle_room(self) -> int | None:
        """Bytes the receive pool may keep idle now (None: no budget)."""
        if self.memory_budget is None:
            return None
        return max(0, self.memory_budget - self._used())

    def _used(self) -> int:
        """Bytes held against the budget: objects in memory, reservations, aliases."""
        return self.memory_bytes + self.reserved_bytes + self.aliases.nbytes

    def _tenant_used(self, tenant: str) -> int:
        """Bytes held against ``tenant``'s quota: its objects in memory, its reservations
        (pushes and payloads in flight) and its aliases."""
        return (self._memory_by[tenant] + self._reserved_by[tenant]
                + self.aliases.nbytes_by[tenant])

    def _isolated(self, owner: str) -> bool:
        """Whether room for ``owner`` comes from its own objects only (tenant quotas)."""
        return self.tenant_max is not None and bool(owner)

    def reserve(self, nbytes: int, *, keep: str | None = None, lossy: bool = True,
                owner: str = "") -> None:
        """Account ``nbytes`` of a PUT before its data arrives, or raise ``StoreFull``.

        Whether the bytes can fit at all (evicting every other object) is decided before
        anything is evicted.  With ``lossy=False`` (a member of a group whose size is not
        yet known: more members follow) only objects that stay on disk or in the backing
        store leave memory; objects that would be lost are evicted only once the group's
        last member shows the whole group fits, so a group refused midway loses nobody
        else's key (meanwhile memory may pass the budget by at most the group's bytes).
        Under tenant quotas only ``owner``'s own objects leave, for both bounds."""
        if self._isolated(owner):
            self._within_quota(nbytes, keep, lossy, owner)
        if self.memory_budget is not None:
            self._make_room(nbytes, keep, lossy, owner=owner)
        self._add_reserved(nbytes, owner)

    def _within_quota(self, nbytes: int, keep: str | None, lossy: bool, tenant: str,
                      targets: Collection[str] = ()) -> None:
        """Room for ``nbytes`` more of ``tenant``'s under ``--max-bytes-per-tenant``: its
        own least recently used objects leave memory (never another tenant's, nor ``keep``
        or the ``targets`` of aliases being linked), or ``TenantFull`` (decided before
        anything is evicted)."""
        quota, prefix, spare = self.tenant_max, tenant + SEPARATOR, {keep, *targets}
        assert quota is not None
        mine = [k for k in self._objects if k.startswith(prefix)]
        fixed = sum(self._objects[k].nbytes for k in mine if k in spare or self.pinned(k))
        aliases = self.aliases.nbytes_by[tenant]
        if self._reserved_by[tenant] + fixed + aliases + nbytes > quota:
            raise TenantFull(nbytes, quota, self._reserved_by[tenant], fixed, aliases)
        for key in mine:  # oldest use first
            used = self._tenant_used(tenant)  # an object lost takes its aliases with it
            if used + nbytes <= quota:
                break
            if key not in spare and (lossy or self._objects[key].durable) and not self.pinned(key):
                self._evict_key(key)

    def _evictable(self, key: str, spare: Collection[str | None], owner: str) -> bool:
        """Whether ``key`` may leave memory to make room for ``owner``: not spared, not
        pinned, and under tenant quotas ``owner``'s own."""
        return key not in spare and not self.pinned(key) and (
            not self._isolated(owner) or key.startswith(owner + SEPARATOR))

    def _make_room(self, nbytes: int, keep: str | None, lossy: bool,
                   field: str = "total_data_bytes", owner: str = "",
                   targets: Collection[str] = ()) -> None:
        """Room for ``nbytes`` more under the budget: decided first (``StoreFull`` if even
        evicting every object it may cannot make it; ``SharedFull`` when, under tenant
        quotas, the rest is other tenants'), then idle receive buffers are dropped and
        least recently used objects evicted (``lossy=False``: only those kept on disk or in
        the backing store): never ``keep`` nor the ``targets`` of aliases being linked,
        and under tenant quotas only ``owner``'s."""
        budget = self.memory_budget
        assert budget is not None
        spare = {keep, *targets}
        aliases = self.aliases.nbytes
        fixed = sum(o.nbytes for k, o in self._objects.items()
                    if not self._evictable(k, spare, owner))
        if self.reserved_bytes + aliases + fixed + nbytes > budget:  # not even evicting
            if self._isolated(owner):  # every object it may: named in its own terms
                prefix = owner + SEPARATOR
                mine = sum(o.nbytes for k, o in self._objects.items()
                           if k.startswith(prefix) and not self._evictable(k, spare, owner))
                raise SharedFull(nbytes, budget, self._reserved_by[owner], mine,
                                 self.aliases.nbytes_by[owner], field)
            raise StoreFull(nbytes, budget, self.reserved_bytes, fixed, aliases, field)
        if self.pool is not None:
            self.pool.trim(max(0, budget - self._used() - nbytes))
        for key in list(self._objects):
            if self._used() + nbytes <= budget:
                break
            if self._evictable(key, spare, owner) and (lossy or self._objects[key].durable):
                self._evict_key(key)

    def _add_reserved(self, nbytes: int, owner: str) -> None:
        self.reserved_bytes += nbytes
        self._reserved_by[owner] += nbytes

    def release(self, nbytes: int, owner: str = "") -> None:
        self.reserved_bytes = max(0, self.reserved_bytes - nbytes)
        self._reserved_by[owner] = max(0, self._reserved_by[owner] - nbytes)
        if not self._reserved_by[owner]:
            del self._reserved_by[owner]

    def _drop_gone(self) -> None:
        """On the event loop: aliases of keys evicted from disk for good go with them."""
        while self._gone:
            key = self._gone.pop()
            if key not in self:
                self.aliases.drop_target(key)

    def __contains__(self, key: str) -> bool:
        if key in self.kept and self.kept[key].expired(time.time()):
            self._expire(key)
            return False
        return key in self._objects or key in self._files or (
            self.backing is not None and key in self.backing)

    # -- pins and lifetimes (io/retention.py) --------------------------------------------
    def pinned(self, key: str) -> bool:
        k = self.kept.get(key)
        return k is not None and k.pinned and not k.expired(time.time())

    def _expire(self, key: str) -> None:
        """``key`` is past its lifetime: removed, as a DELETE would."""
        self.kept.pop(key, None)
        self.delete(key)
        log.info("expired %r", key)
        self._save_kept()

    def _save_kept(self) -> None:
        if self.persist:
            try:
                retention.write(self.persist, self.kept)
            except (OSError, HurrayError) as e:  # kept in memory; lost at a restart
                log.warning("cannot record the pins in %s: %s", self.persist, e)

    def _size(self, key: str) -> int | None:
        obj = self._objects.get(key)
        if obj is not None:
            return obj.nbytes
        with self._disk:
            return self._data.get(key)

    def retain(self, keys: list[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        """Pin and give a lifetime to the objects ``keys`` held (memory or disk), as
        ``io.retention.updated`` says; those retained.  ``PinRefused`` (nothing changed)
        past ``max_pinned_bytes``."""
        present = {k: n for k in dict.fromkeys(keys)
                   if k in self and (n := self._size(k)) is not None}  # expires some
        self.kept = retention.updated(self.kept, present, pin=pin, ttl_s=ttl_s,
                                      max_pinned=self.max_pinned_bytes, now=time.time(),
                                      extend=extend)
        self._save_kept()
        return list(present)

    def check_pin(self, key: str, nbytes: int) -> None:
        """A PUT replacing a pinned ``key`` keeps the pin at its new size: ``PinnedFull``
        (nothing changes) when ``nbytes``, the PUT's bytes announced so far, would take
        the pinned bytes past ``max_pinned_bytes``."""
        cap = self.max_pinned_bytes
        if cap is None or not self.pinned(key):
            return
        before = retention.pinned_bytes(self.kept, time.time())
        others = before - self.kept[key].nbytes
        if others + nbytes > max(before, cap):
            raise PinnedFull(nbytes, cap, others)

    def _repin(self, key: str, nbytes: int) -> None:
        """``key``'s retention at the size of the object just stored under it.  Its size
        was checked as it arrived (``check_pin``); should pins added meanwhile leave it no
        room now, the pin is dropped (logged) rather than pass ``max_pinned_bytes``."""
        old = self.kept.get(key)
        if old is None or old.nbytes == nbytes:
            return
        pinned = old.pinned
        if pinned and self.max_pinned_bytes is not None and nbytes > old.nbytes:
            total = retention.pinned_bytes(self.kept, time.time()) - old.nbytes + nbytes
            if total > self.max_pinned_bytes:
                log.warning("unpinned %r: stored again with %s, it would pin %s, over "
                            "max_pinned_bytes %s (pins added while it was pushed)", key,
                            units.size(nbytes), units.size(total),
                            units.size(self.max_pinned_bytes))
                pinned = False
        if pinned or old.expiry is not None:
            self.kept[key] = retention.Kept(pinned, old.expiry, nbytes)
        else:
            del self.kept[key]
        self._save_kept()

    def retention_listing(self) -> dict[str, retention.Kept]:
        now = time.time()
        return {k: v for k, v in self.kept.items() if not v.expired(now)}

    # -- objects -------------------------------------------------------------------------
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
        obj = self._from_disk(key)
        return obj if obj is not None else self._from_backing(key)

    def _from_backing(self, key: str) -> StoredObject | None:
        if self.backing is None or key not in self.backing:
            return None
        snap = self.backing.get(key)
        items = [(snap.head(), [])] + [(d, list(b)) for _, d, b in snap.members()]
        obj = StoredObject(items, snap.nbytes, backed=True)
        if self._room_for_copy(key, obj.nbytes):
            self.commit(key, obj, None)  # kept in memory (LRU) until evicted
        return obj

    def _room_for_copy(self, key: str, nbytes: int) -> bool:
        """Whether a copy of ``key``'s object read back from the backing store may stay in
        memory: room is made by evicting only objects that lose nothing by it (kept on
        disk or in the backing store) and, under tenant quotas, only the key's tenant's;
        False when that is not enough (the copy is served, not kept)."""
        owner = tenant_of(key)
        try:
            self.reserve(nbytes, keep=key, lossy=False, owner=owner)
        except StoreFull:
            return False
        self.release(nbytes, owner)
        quota, budget = self.tenant_max, self.memory_budget
        over_quota = (quota is not None and self._isolated(owner)
                      and self._tenant_used(owner) + nbytes > quota)
        return not over_quota and (budget is None or self._used() + nbytes <= budget)

    def commit(self, key: str, obj: StoredObject, path: Path | None, reserved: int = 0,
               owner: str = "") -> None:
        """Make ``obj`` the value of ``key`` (its ``reserved`` bytes become held bytes)."""
        old = self.kept.get(key)
        if old is not None and old.expired(time.time()):  # a new object, not an old one
            del self.kept[key]                             # past its lifetime
            self._save_kept()
        self._drop_memory(key)
        self.release(reserved, owner)
        self._repin(key, obj.nbytes)
        if path is not None:
            with self._disk:  # unless evicted from disk already, by a PUT since
                if self._files.get(key) == path:
                    obj.path = path
        self._objects[key] = obj
        self.memory_bytes += obj.nbytes
        self._memory_by[tenant_of(key)] += obj.nbytes
        self._evict(keep=key)
        self._drop_gone()

    def _drop_memory(self, key: str) -> None:
        with self._disk:
            self._mapped.pop(key, None)  # a replaced file is a new inode: map it afresh
        old = self._objects.pop(key, None)
        if old is not None:
            self._forget_memory(key, old)

    def _forget_memory(self, key: str, old: StoredObject) -> None:
        self.memory_bytes -= old.nbytes
        tenant = tenant_of(key)
        self._memory_by[tenant] -= old.nbytes
        if not self._memory_by[tenant]:
            del self._memory_by[tenant]

    def _evict_key(self, key: str) -> None:
        old = self._objects.pop(key)
        self._forget_memory(key, old)
        self.evictions["memory"] += 1
        log.info("evicted %r (%s)%s", key, units.size(old.nbytes),
                 "; still on disk" if key in self._files else "")
        if not old.durable and key not in self._files:
            self.aliases.drop_target(key)  # gone for good: so are its aliases

    def _evict(self, keep: str) -> None:
        """Memory past the budget at a commit (the PUT's room was made as it arrived, so
        only by what came in meanwhile): evict down to it (under tenant quotas, only
        objects of ``keep``'s tenant)."""
        if self.memory_budget is None:
            return
        owner = tenant_of(keep)
        for key in list(self._objects):
            if self._used() <= self.memory_budget:
                return
            if self._evictable(key, {keep}, owner):
                self._evict_key(key)

    # -- aliases -------------------------------------------------------------------------
    def link(self, pairs: list[tuple[str, str]]) -> None:
        """Each alias names its target's object from now on.  Aliases are held against the
        memory budget and their tenant's quota (``StoreFull`` when they cannot hold them:
        decided before anything is evicted; room is never made by evicting a target being
        linked) and appended to the persist directory's ``aliases.jsonl``, fsynced, so a
        restarted server keeps them."""
        added = self.aliases.added_bytes(pairs)
        if added > 0:
            owner, targets = tenant_of(pairs[0][0]), {t for _, t in pairs}
            if self._isolated(owner):  # a session links its own tenant's keys only
                self._within_quota(added, None, True, owner, targets)
            if self.memory_budget is not None:
                self._make_room(added, None, True, field="aliases", owner=owner,
                                targets=targets)
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
        """Every key held in memory or on disk, with its data bytes (the tensors' buffers,
        as pushed: the same number in memory, on disk and after a restart, not the file's
        size); keys only in the backing store are not listed."""
        with self._disk:
            sizes = {key: obj.nbytes for key, obj in {**self._mapped, **self._objects}.items()}
            for key, nbytes in self._data.items():
                sizes.setdefault(key, nbytes)
        now = time.time()  # past their lifetime: gone, though removed when next asked for
        return sorted((k, n) for k, n in sizes.items()
                      if not (k in self.kept and self.kept[k].expired(now)))

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
                    "max_bytes_per_tenant": self.tenant_max,
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
                "backing_store": self.backing is not None,
                "max_bytes_per_tenant": self.tenant_max, "aliases": len(aliases),
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
            self._data.pop(key, None)
            if path is not None:
                path.unlink(missing_ok=True)
        # the key as an alias, and the object's own aliases, in one fsynced append; also
        # when the object is gone already: an rm whose aliases could not be recorded as
        # removed (a full disk) is retried this way
        removed = self.aliases.remove([key, *sorted(self.aliases.aliases_of(key))])
        if self.kept.pop(key, None) is not None:
            self._save_kept()
        return found or bool(removed)


__all__ = ["ALIASES", "Items", "KeyStore", "PersistFull", "StoreFull", "StoredObject",
           "hrry_size", "object_from_items"]
