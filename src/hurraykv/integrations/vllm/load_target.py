"""The engine's KV cache as loads see it (``Target``): its layers, and what a stored
segment must be to be written into them.  ``Target.get_checked`` fetches a segment and
checks it against this engine's cache, answering ``Fetched``: the segment with the
checks its read left, or what was wrong with it (``loads.py`` drives the loads,
``load_job.py`` is one request's).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...chunks.keys import segment_first
from ...errors import HurrayError, TransportError
from ...io.checksums import ChecksumError, Pending
from ...io.scatter import Destination, PageSource
from ...snapshot import KVCacheSnapshot
from ...snapshot_members import member_name
from . import direct, hybrid
from .common import Context
from .groups import METADATA_KEY, SLIDING, KVGroup
from .store_format import StoreFormat

if TYPE_CHECKING:  # no torch import here: loads are tested without an engine
    from ...adapters.vllm import LayerView

ROLES = ("key", "value", "fused")

# a fetched segment, or what was wrong with it (shared by the jobs of one step)
Fetched = tuple[KVCacheSnapshot, Pending | PageSource | None] | HurrayError


def later_members(layers: int) -> frozenset[str]:
    """The members a read leaves to ``Pending`` (every layer's but layer 0's): each is
    verified just before its layer is written."""
    return frozenset(member_name(layer, role) for layer in range(1, layers) for role in ROLES)


def layer_members(layer: int) -> frozenset[str]:
    return frozenset(member_name(layer, role) for role in ROLES)


@dataclass
class Target:
    """The engine's KV cache as loads see it: its layers, and what a segment must be to
    be written into them."""

    ctx: Context
    layers: list[tuple[str, LayerView]]
    segment_dtype: str  # the cache's dtype in a segment of format auto
    format: StoreFormat  # this engine's own store format
    # a hybrid model's (groups.py): each attention layer's group, the Mamba layers'
    # states (adapters.vllm.StateView) with their group, the group map of its segments
    groups: list[KVGroup] = field(default_factory=list)
    states: list[tuple[Any, KVGroup]] = field(default_factory=list)
    group_map: dict[str, Any] = field(default_factory=dict)
    # each layer's parts' memory, where a load reads pages straight into the blocks
    # (direct.py; None: a segment is read whole first)
    destinations: list[list[Destination]] | None = None

    def __post_init__(self) -> None:
        if self.destinations is None and not self.groups and not self.states:
            self.destinations = direct.destinations(self.layers)

    @property
    def later(self) -> frozenset[str]:
        return later_members(len(self.layers))

    @property
    def pools(self) -> frozenset[str]:
        return later_members(len(self.layers)) | layer_members(0)

    def format_of(self, snap: KVCacheSnapshot) -> StoreFormat | None:
        """The store format of an identity this engine loads (None: not one of them)."""
        if snap.model == self.ctx.identity:
            return self.format
        return self.ctx.formats.get(snap.model)

    def check_segment(self, snap: KVCacheSnapshot, name: str | None = None) -> None:
        ctx = self.ctx
        view = self.layers[0][1]
        want = (len(self.layers), ctx.block_size, view.heads, *view.dims)
        have = (snap.num_layers, snap.page_size, snap.num_kv_heads,
                *(t.head_dim for t in snap.layer(0)))
        fmt = self.format_of(snap)
        if fmt is None or snap.dtype != fmt.segment_dtype(self.segment_dtype):
            # same geometry is not the same cache: another model's KV would load silently
            raise HurrayError(f"a stored segment of identity {snap.model!r} and dtype "
                              f"{snap.dtype} is not this engine's ({ctx.identity!r}, "
                              f"{self.format.segment_dtype(self.segment_dtype)}; or one of "
                              f"accept_store_dtypes)", field="segment.model",
                              value=snap.model, rule="the cache identity")
        if want != have or snap.num_seqs != 1 or snap.total_tokens % ctx.chunk_size:
            raise HurrayError(f"a stored segment holds (layers, page_size, heads, dims) "
                              f"{list(have)} and {snap.total_tokens} tokens in "
                              f"{snap.num_seqs} sequences, this engine needs {list(want)} "
                              f"in whole chunks of {ctx.chunk_size}", field="segment",
                              value=list(have), rule="the cache identity")
        # quantization and scales as the format says; the pages kept in order
        fmt.check(snap, self.segment_dtype, self._tables(snap, name))
        if self.groups:
            have = hybrid.groups_of(snap)
            if have != self.group_map:
                raise HurrayError(f"a stored segment's KV cache groups {have} are not this "
                                  f"engine's {self.group_map}",
                                  field=f"metadata.{METADATA_KEY}", value=have,
                                  rule="the cache identity")
        snap.tensors()  # builds every member: index buffers and token counts checked

    def _tables(self, snap: KVCacheSnapshot, name: str | None) -> dict[int, Any] | None:
        """A hybrid model's sliding-window layers' block tables, as ``hybrid.page_table``
        makes them for a segment of this name and length."""
        if not self.groups or name is None:
            return None
        per = self.ctx.per
        pages = snap.total_tokens // snap.page_size
        first = segment_first(name) * per
        out = {}
        for layer, group in enumerate(self.groups):
            if group.kind == SLIDING:
                table = hybrid.page_table(group.kept(first, pages, per))
                if table is not None:
                    out[layer] = table
        return out

    def get_checked(self, store: Any, name: str) -> Fetched:
        """A segment that fits this engine (and the checks its read left, or its pages
        left in its file: ``PageSource``), or the error that says why the object is bad
        (the store answered: not a store failure)."""
        before = store.verify_seconds
        source = None
        try:
            got = None
            if self.destinations is not None and self.format.auto and hasattr(
                    store, "get_pages"):
                got = store.get_pages(name, self.pools)
            if got is not None:
                snap, source = got
                if source.fill is not None and not hasattr(store, "tiers"):
                    # its pages come later, outside the guard: their failures its too
                    source.fill = self.ctx.loads.watched("fill", source.fill)
                fmt = self.format_of(snap)
                if fmt is None or not fmt.auto:  # decoded on the way: read it whole
                    source.close()
                    got = source = None
            snap, pending = got if got is not None else store.get_checked(name, self.later)
            self.check_segment(snap, name)
            source = None  # the job's now
            return snap, pending
        except TransportError:
            raise
        except ChecksumError as e:  # damaged: out of the store, stored again once computed
            with contextlib.suppress(Exception):
                store.discard(name)
            return e
        except HurrayError as e:
            return e
        finally:
            if source is not None:
                source.close()
            self.ctx.stats.add(verify_seconds=store.verify_seconds - before)


__all__ = ["ROLES", "Fetched", "Target", "later_members", "layer_members"]
