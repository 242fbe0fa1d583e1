"""What the KV server stores, and the budgets' refusals: ``StoredObject`` (an object as
the wire carries it, in pre-order), ``object_from_items`` (received items validated and
prepared for storage), ``StoreFull`` (the memory budget) and ``PersistFull`` (the persist
budget), both answered with ERROR STORE_FULL.

An object is a snapshot (a group head and its members) or one tensor, kept as the list
of ``(descriptor, buffers)`` the wire carries, in pre-order.  Objects are immutable once
committed: a reader holds a reference to the object it started with, so a PUT that
replaces a key never shows anyone a partial snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
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
