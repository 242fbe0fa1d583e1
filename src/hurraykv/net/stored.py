"""What the KV server stores, and the budgets' refusals: ``StoredObject`` (an object as
the wire carries it, in pre-order), ``object_from_items`` (received items validated and
prepared for storage), ``StoreFull`` (the memory budget; ``TenantFull`` a tenant's quota,
``SharedFull`` the budget held by other tenants, ``PinnedFull`` the pinned bytes) and
``PersistFull`` (the persist budget), all answered with ERROR STORE_FULL; ``FileBytes`` (a
buffer of an object served from its persisted file) and ``UnreadableObject`` (such a file
found damaged: ERROR INTERNAL).

An object is a snapshot (a group head and its members) or one tensor, kept as the list
of ``(descriptor, buffers)`` the wire carries, in pre-order.  Objects are immutable once
committed: a reader holds a reference to the object it started with, so a PUT that
replaces a key never shows anyone a partial snapshot.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import HurrayError
from ..paged import BlockPagedTensor
from ..snapshot import KVCacheSnapshot
from ..wire.descriptor import TensorDescriptor
from ..wire.layouts import BlockPaged, Composite
from .messages import ErrorCode

Items = list[tuple[TensorDescriptor, list[Any]]]


class StoreFull(HurrayError):
    """A PUT the memory budget cannot hold; answered with ERROR STORE_FULL."""

    RULE = "--memory-budget"

    def __init__(self, nbytes: int, budget: int, in_flight: int, kept: int, aliases: int = 0,
                 field: str = "total_data_bytes") -> None:
        self.nbytes, self.budget, self.in_flight, self.kept = nbytes, budget, in_flight, kept
        self.aliases = aliases
        super().__init__(self.needs(nbytes), field=field, value=nbytes, rule=self.RULE)

    def needs(self, nbytes: int) -> str:
        """Why ``nbytes`` do not fit, in the budget's terms."""
        held = f" and {self.aliases} hold aliases" if self.aliases else ""
        return (f"needs {nbytes} bytes ({nbytes / (1 << 30):.3f} GiB) but the memory budget "
                f"is {self.budget} bytes ({self.budget / (1 << 30):.3f} GiB), of which "
                f"{self.in_flight} are reserved by other PUTs in flight and {self.kept} hold "
                f"the key's current value{held}")


class TenantFull(StoreFull):
    """A PUT (or LINK) past its tenant's ``--max-bytes-per-tenant`` once that tenant's own
    least recently used objects are evicted; answered with ERROR STORE_FULL."""

    RULE = "--max-bytes-per-tenant"

    def __init__(self, nbytes: int, quota: int, in_flight: int, kept: int, aliases: int = 0
                 ) -> None:
        super().__init__(nbytes, quota, in_flight, kept, aliases, field="max_bytes_per_tenant")

    def needs(self, nbytes: int) -> str:
        return (f"needs {nbytes} bytes but this tenant's quota (--max-bytes-per-tenant) is "
                f"{self.budget} bytes, of which {self.in_flight} are reserved by its other "
                f"PUTs in flight, {self.kept} held by its pinned objects and the key's "
                f"current value and {self.aliases} by its aliases")


class SharedFull(StoreFull):
    """A tenant's PUT (or LINK) within its quota that ``--memory-budget`` cannot hold
    without other tenants' objects, which a tenant's push never evicts (under
    ``--max-bytes-per-tenant``); answered with ERROR STORE_FULL.  Only this tenant's own
    bytes are named: the others' would tell their activity."""

    def needs(self, nbytes: int) -> str:
        return (f"needs {nbytes} bytes but the memory budget (--memory-budget, {self.budget} "
                f"bytes) is held by other tenants, whose objects no tenant's push evicts; of "
                f"this tenant's, {self.in_flight} bytes are reserved by its other PUTs in "
                f"flight, {self.kept} held by its pinned objects and the key's current value "
                f"and {self.aliases} by its aliases")


class PinnedFull(StoreFull):
    """A PUT replacing a pinned object whose new size would take the pinned bytes past
    ``--max-pinned-bytes``: an overwrite keeps the pin, at the new size.  Answered with
    ERROR STORE_FULL; the old value stays, pinned."""

    RULE = "--max-pinned-bytes"

    def __init__(self, nbytes: int, cap: int, others: int) -> None:
        self.others = others  # bytes pinned besides the key's own
        super().__init__(nbytes, cap, 0, 0, field="max_pinned_bytes")

    def needs(self, nbytes: int) -> str:
        return (f"is pinned, and its new value of {nbytes} bytes would pin {self.others + nbytes} "
                f"bytes in all, over max_pinned_bytes {self.budget} (--max-pinned-bytes): not "
                "stored, the old value stays pinned (unpin it first, or raise "
                "--max-pinned-bytes)")


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


class UnreadableObject(HurrayError):
    """A persisted object whose file cannot be served: cut short or otherwise damaged
    since it was written, or not to be opened; answered with ERROR INTERNAL.  ``why`` says
    what is wrong without the directory (a tenant is not told where the server persists);
    the message, for the server's log, names the file."""

    def __init__(self, why: str, path: Path, *, field: str | None = "file_size",
                 offset: int | None = None, value: Any = None,
                 rule: str | None = "a persisted file holds every byte its index names"
                 ) -> None:
        self.why, self.path = why, path
        super().__init__(f"{path}: {why}", field=field, offset=offset, value=value,
                         rule=rule)

    @classmethod
    def of(cls, e: HurrayError, path: Path) -> UnreadableObject:
        """The file at ``path`` refused by the reader with ``e``."""
        return cls(str(e), path, field=e.field, offset=e.offset, value=e.value, rule=e.rule)


class ObjectFile:
    """An open persisted file, read with ``pread`` and never mapped: a mapped file cut
    underneath raises SIGBUS in whoever copies it (the TLS layer) and EFAULT in
    ``send()``, where a short read is an error a pull can report.  The descriptor closes
    when the last object or pull holding it lets go, so a pull under way keeps reading an
    evicted (unlinked) file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.close = weakref.finalize(self, os.close, self.fd)


class FileBytes:
    """``nbytes`` bytes of an ``ObjectFile`` from ``offset``: a buffer of an object served
    from disk.  Sliced like a byte view (``DataPlan`` cuts frames from it); ``read()``
    returns the bytes, or ``UnreadableObject`` when the file now ends before them."""

    __slots__ = ("file", "nbytes", "offset")

    def __init__(self, file: ObjectFile, offset: int, nbytes: int) -> None:
        self.file, self.offset, self.nbytes = file, offset, nbytes

    def __getitem__(self, part: slice) -> FileBytes:
        start, stop, _ = part.indices(self.nbytes)
        return FileBytes(self.file, self.offset + start, max(stop - start, 0))

    def read(self) -> bytes:
        data = os.pread(self.file.fd, self.nbytes, self.offset)
        if len(data) != self.nbytes:
            size = os.fstat(self.file.fd).st_size
            raise UnreadableObject(f"file_size: found {size} bytes; its index puts "
                                   f"{self.nbytes} bytes of data at byte {self.offset} "
                                   "(the file was cut short after it was written)",
                                   self.file.path, value=size)
        return data

    def __bytes__(self) -> bytes:
        return self.read()


@dataclass
class StoredObject:
    items: Items
    nbytes: int
    path: Path | None = None
    backed: bool = False  # also in the backing store
    # the sealed memory file it lives in once handed over (handover.py), or its making
    sealed: Any = field(default=None, repr=False, compare=False)

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
