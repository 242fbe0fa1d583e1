"""KVCacheSnapshot: the whole KV cache of one batch, as Hurray tensors (decision D7).

A snapshot is one group composite (layout 0x0B, rule group) whose members are

* ``seq_lens``  - row-major uint64 ``[num_seqs]``, the per-sequence token counts (D6);
* ``kv_scales`` - row-major float32 ``[num_layers, 2]`` (key, value), fp8 caches only (D5);
* optionally the *info member* (``info.py``): the model name and user metadata;
* one block-paged tensor per (layer_index, kv_role): ``key`` and ``value``, or one
  ``fused`` tensor per layer.

Members are identified by their own fields (kv_role, layer_index, type and shape),
never by position.  Every block-paged member shares page_size, num_seqs, seq_ptr,
num_heads, head_dim, total_tokens and element type.  The same list of members is what
the stream format, the .hrry file and the network transport carry; this module and
``snapshot_members`` (the members built, recognised and checked together) are the only
ones that know what a snapshot is made of.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from . import units
from .arrays import as_numpy
from .errors import LayoutError, SeqLensRequiredError
from .info import check_metadata, info_member, parse_info
from .paged import BlockPagedTensor, byte_view
from .paging import check_fp8_scale
from .snapshot_members import (
    GROUP,
    ROLES,
    Buffers,
    Loader,
    check_members,
    group_head,
    host_descriptor,
    is_kv_scales,
    is_seq_lens,
    kv_scales_member,
    member_name,
    role_rank,
    row_major_array,
    seq_lens_member,
)
from .snapshot_members import unfit as _fail
from .wire.descriptor import TensorDescriptor
from .wire.layouts import BlockPaged

KV_SCALES = "kv_scales"  # the member name, and its key in ``values`` / ``with_pools``


def _sized(buf: Any, nbytes: int, what: str) -> memoryview:
    """``buf`` as bytes, refused unless it holds exactly ``nbytes``."""
    raw = byte_view(buf)
    if raw.nbytes != nbytes:
        raise _fail(f"{what}: {raw.nbytes} bytes given for a buffer of {nbytes}", what,
                    raw.nbytes)
    return raw

_POOL_ORDER = ("pools are [num_pages, page_size, num_heads, head_dim]; pass an HND pool "
               "as pool.transpose(0, 2, 1, 3)")


def _layout(msg: str, field: str | None, value: Any) -> LayoutError:
    return LayoutError(msg, field=field, value=value, rule="page pools are NHD")


class KVCacheSnapshot:
    """``seq_lens``, optional ``kv_scales`` and one BlockPagedTensor per (layer, role).

    Members may be held in memory or loaded on first use (a memory-mapped file): only
    descriptors and the small ``seq_ptr`` buffers are read to validate a snapshot.
    """

    def __init__(self, members: dict[tuple[int, str], tuple[TensorDescriptor, Loader]],
                 seq_lens: Any, kv_scales: Any = None, *, model: str | None = None,
                 metadata: dict[str, Any] | None = None,
                 extras: Sequence[tuple[str | None, TensorDescriptor, Buffers]] = (),
                 owner: Any = None) -> None:
        self._members = dict(sorted(members.items(), key=lambda kv: (kv[0][0],
                                                                     role_rank(kv[0][1]))))
        self._cache: dict[tuple[int, str], BlockPagedTensor] = {}
        self.seq_lens = None if seq_lens is None else as_numpy(seq_lens, "seq_lens").astype(
            np.int64)
        self.kv_scales = None if kv_scales is None else as_numpy(kv_scales, "kv_scales").astype(
            np.float32)
        self.model = model
        self.metadata = check_metadata(metadata)
        self.extras = list(extras)
        self._owner = owner  # keeps an mmap (or file) alive while members are views on it
        check_members(self._members, self.seq_lens, self.kv_scales)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_tensors(cls, tensors: Iterable[BlockPagedTensor], seq_lens: Any = None,
                     kv_scales: Any = None, *, model: str | None = None,
                     metadata: dict[str, Any] | None = None,
                     extras: Sequence[tuple[str | None, TensorDescriptor, Buffers]] = ()
                     ) -> KVCacheSnapshot:
        """From in-memory block-paged tensors (each with its layer_index and kv_role).

        ``seq_lens`` defaults to the tensors' own; ``kv_scales`` to their ``fp8_scale``;
        ``extras``: other members ``(name, descriptor, buffers)``, kept as they are."""
        tensors = list(tensors)
        if seq_lens is None and tensors:
            seq_lens = tensors[0].seq_lens
        members, cache = {}, {}
        for t in tensors:
            if t.layer_index is None:
                raise _fail(f"{t!r} is not layer-scoped; snapshot members need a layer_index",
                            "layer_index")
            key = (t.layer_index, t.kv_role)
            if key in members:
                raise _fail(f"two members for layer {key[0]} role {key[1]}", "kv_role", key)
            if t.seq_lens is not None and seq_lens is not None and not np.array_equal(
                    t.seq_lens, seq_lens):
                raise _fail(f"{member_name(*key)} has seq_lens {t.seq_lens.tolist()}, the "
                            f"snapshot {np.asarray(seq_lens).tolist()}", "seq_lens")
            members[key] = (t.descriptor(), t.buffers)
            cache[key] = t
        layers = max((k[0] for k in members), default=-1) + 1
        if kv_scales is None and any(t.fp8_scale is not None for t in tensors) and \
                layers <= len(tensors):  # else a layer is missing: the validation says so
            kv_scales = np.ones((layers, 2), np.float32)
            for (layer, role), t in cache.items():
                if t.fp8_scale is not None:
                    kv_scales[layer, 1 if role == "value" else 0] = t.fp8_scale
                    if role == "fused":
                        kv_scales[layer, 1] = t.fp8_scale
        snap = cls(members, seq_lens, kv_scales, model=model, metadata=metadata,
                   extras=extras)
        for key, t in cache.items():
            if t.seq_lens is None:
                t = t.copy()
                t.seq_lens = snap.seq_lens
                t.validate()
            snap._cache[key] = t
        return snap

    @classmethod
    def from_arrays(cls, key_pools: Sequence[np.ndarray], value_pools: Sequence[np.ndarray] | None,
                    block_table: Any, seq_ptr: Any, seq_lens: Any, *, kv_scales: Any = None,
                    index_type: str | None = None, element_type: str | None = None,
                    model: str | None = None, metadata: dict[str, Any] | None = None,
                    page_size: int | None = None) -> KVCacheSnapshot:
        """From per-layer page pools ``[num_pages, page_size, H, D]`` sharing one block
        table, as an engine holds them.  ``value_pools=None`` makes fused members.
        ``page_size``, when given, is checked against the pools (an HND pool ``[num_pages,
        H, page_size, D]`` is named as such)."""
        first = as_numpy(key_pools[0], "key_pools[0]") if len(key_pools) else None
        if page_size is not None and first is not None and first.ndim == 4 and \
                first.shape[1] != page_size:
            hnd = first.shape[2] == page_size
            raise _layout(f"key_pools[0] is {list(first.shape)}; with page_size {page_size} "
                          + ("that is the HND order [num_pages, num_heads, page_size, "
                             "head_dim]: " if hnd else "") + _POOL_ORDER, "page_size",
                          first.shape[1])
        tensors = []
        roles = [("key", key_pools)] if value_pools is None else [("key", key_pools),
                                                                   ("value", value_pools)]
        if value_pools is not None and len(value_pools) != len(key_pools):
            raise _fail(f"{len(key_pools)} key pools but {len(value_pools)} value pools",
                        "value_pools")
        for i in range(len(key_pools)):
            for role, pools in roles:
                scale = None
                if kv_scales is not None:
                    scale = float(as_numpy(kv_scales)[i, 0 if role == "key" else 1])
                try:
                    tensors.append(BlockPagedTensor(
                        pools[i], block_table, seq_ptr, seq_lens,
                        kv_role=role if value_pools is not None else "fused", layer_index=i,
                        index_type=index_type, element_type=element_type, fp8_scale=scale))
                except LayoutError as e:
                    if not (e.field or "").startswith("seq_lens"):
                        raise
                    raise _layout(f"{e} ({_POOL_ORDER})", e.field, e.value) from None
        return cls.from_tensors(tensors, seq_lens, kv_scales, model=model, metadata=metadata)

    @classmethod
    def from_members(cls, items: Iterable[tuple[str | None, TensorDescriptor, Any]], *,
                     model: str | None = None, metadata: dict[str, Any] | None = None,
                     owner: Any = None) -> KVCacheSnapshot:
        """From decoded members ``(name or None, descriptor, buffers or loader)`` in any
        order, each recognised by its own fields, never by its name (D7): the block-paged
        tensors by (layer_index, kv_role), ``seq_lens`` as the first integer vector,
        ``kv_scales`` as the first float32 ``[L, 2]`` matrix, the info member by its type
        and prefix (``model``/``metadata`` are the fallbacks when there is none)."""
        members: dict[tuple[int, str], tuple[TensorDescriptor, Loader]] = {}
        seq_lens = kv_scales = info = None
        extras = []
        for name, desc, bufs in items:
            loader = bufs if callable(bufs) else (lambda b=bufs: b)
            layout = desc.layout
            if isinstance(layout, BlockPaged):
                if layout.layer_index is None:
                    raise _fail(f"block-paged member {name or ''} is not layer-scoped",
                                "layer_index")
                key = (layout.layer_index, layout.kv_role_name)
                if key in members:
                    raise _fail(f"two members for layer {key[0]} role {key[1]}", "kv_role",
                                key)
                members[key] = (desc, loader)
                continue
            found = parse_info(desc, loader()) if info is None else None
            if found is not None:
                info = found
            elif is_seq_lens(desc) and seq_lens is None:
                seq_lens = row_major_array(desc, loader()).astype(np.int64)
            elif is_kv_scales(desc) and kv_scales is None:
                kv_scales = row_major_array(desc, loader())
            else:
                extras.append((name, desc, loader()))
        if info is not None:
            model, metadata = info
        return cls(members, seq_lens, kv_scales, model=model, metadata=metadata,
                   extras=extras, owner=owner)

    def with_info(self, model: str | None = None, metadata: dict[str, Any] | None = None
                  ) -> KVCacheSnapshot:
        """This snapshot (same members, nothing copied) with ``model`` replaced when
        given and ``metadata`` merged into its own."""
        out = KVCacheSnapshot.__new__(KVCacheSnapshot)
        out.__dict__.update(self.__dict__)
        out._structure = None
        out.model = self.model if model is None else model
        out.metadata = {**self.metadata, **check_metadata(metadata)}
        return out

    # ----------------------------------------------------------------- facts
    def _first(self) -> TensorDescriptor:
        return next(iter(self._members.values()))[0]

    @property
    def num_layers(self) -> int:
        return max(k[0] for k in self._members) + 1

    @property
    def fused(self) -> bool:
        return next(iter(self._members))[1] == "fused"

    @property
    def num_seqs(self) -> int:
        return self._first().layout.num_seqs

    @property
    def page_size(self) -> int:
        return self._first().layout.page_size

    @property
    def num_kv_heads(self) -> int:
        return self._first().shape[1]

    @property
    def head_dim(self) -> int:
        """The key's (or fused member's) head_dim."""
        return self._first().shape[2]

    @property
    def head_dim_v(self) -> int:
        """The value's head_dim (differs from the key's on DIFFKV caches)."""
        return self.descriptor(0, self.roles[-1]).shape[2]

    @property
    def total_tokens(self) -> int:
        return self._first().shape[0]

    @property
    def dtype(self) -> str:
        return self._first().element_type_name

    @property
    def roles(self) -> tuple[str, ...]:
        return ("fused",) if self.fused else ROLES

    @property
    def nbytes(self) -> int:
        """Bytes of every member's buffers (seq_lens and kv_scales included): what a
        stream, a file region or a push carries beside descriptors and padding."""
        extra = 8 * len(self.seq_lens) if self.seq_lens is not None else 0
        extra += 0 if self.kv_scales is None else self.kv_scales.size * 4
        extra += sum(h.byte_size for _, d, _ in self.extras for h in d.buffers)
        if self.has_info:
            extra += info_member(self.model, self.metadata)[0].buffers[0].byte_size
        return extra + sum(h.byte_size for d, _ in self._members.values() for h in d.buffers)

    def descriptor(self, layer: int, role: str) -> TensorDescriptor:
        return self._members[self._key(layer, role)][0]

    def __repr__(self) -> str:
        fp8 = ", fp8 scales" if self.kv_scales is not None else ""
        dims = f"head_dim={self.head_dim}" + (
            f"/{self.head_dim_v}" if self.head_dim_v != self.head_dim else "")
        return (f"KVCacheSnapshot({units.plural(self.num_layers, 'layer')} x "
                f"{'/'.join(self.roles)}, {units.plural(self.num_seqs, 'seq')}, "
                f"{units.plural(self.total_tokens, 'token')}, {self.dtype}, "
                f"heads={self.num_kv_heads}, {dims}, "
                f"page_size={self.page_size}{fp8})")

    # ----------------------------------------------------------------- members
    def _key(self, layer: int, role: str) -> tuple[int, str]:
        key = (layer, role)
        if key not in self._members:
            raise _fail(f"no member for layer {layer} role {role!r}; the snapshot has "
                        f"{self.num_layers} layers of {'/'.join(self.roles)}", "layer", key)
        return key

    def tensor(self, layer: int, role: str) -> BlockPagedTensor:
        key = self._key(layer, role)
        t = self._cache.get(key)
        if t is None:
            desc, load = self._members[key]
            scale = None
            if self.kv_scales is not None:
                scale = float(self.kv_scales[layer, 1 if role == "value" else 0])
            t = BlockPagedTensor.from_descriptor(desc, load(), self.seq_lens, fp8_scale=scale)
            self._cache[key] = t
        return t

    def layer(self, i: int) -> tuple[BlockPagedTensor, ...]:
        """``(key, value)`` of layer ``i``, or ``(fused,)``; views onto the source data."""
        return tuple(self.tensor(i, role) for role in self.roles)

    def __iter__(self) -> Iterator[tuple[BlockPagedTensor, ...]]:
        for i in range(self.num_layers):
            yield self.layer(i)

    def __len__(self) -> int:
        return self.num_layers

    def tensors(self) -> list[BlockPagedTensor]:
        """Every block-paged member, in layer then role order."""
        return [self.tensor(layer, role) for layer, role in self._members]

    def member_keys(self) -> list[tuple[int, str]]:
        return list(self._members)

    def members(self) -> Iterator[tuple[str, TensorDescriptor, Buffers]]:
        """``(name, descriptor, buffers)`` of every member in wire order (D7), without
        the group head: seq_lens, kv_scales, then key and value layer by layer.  Buffers
        are zero-copy views."""
        if self.seq_lens is None:
            raise SeqLensRequiredError("this snapshot has no seq_lens (read from a plain "
                                       "stream whose lengths are ambiguous); supply them",
                                       field="seq_lens", rule="D6")
        yield ("seq_lens", *seq_lens_member(self.seq_lens))
        if self.kv_scales is not None:
            yield ("kv_scales", *kv_scales_member(self.kv_scales))
        if self.has_info:
            yield ("info", *info_member(self.model, self.metadata))
        for layer, role in self._members:
            desc, load = self._members[(layer, role)]
            yield member_name(layer, role), host_descriptor(desc), load()
        for name, desc, bufs in self.extras:
            yield name or f"extra.{id(desc)}", desc, bufs

    @property
    def has_info(self) -> bool:
        return self.model is not None or bool(self.metadata)

    def member_count(self) -> int:
        return (1 + (self.kv_scales is not None) + self.has_info + len(self._members)
                + len(self.extras))

    def head(self) -> TensorDescriptor:
        return group_head(self.member_count())

    # ----------------------------------------------------------------- operations
    def with_pools(self, pools: dict[Any, Any], owner: Any = None) -> KVCacheSnapshot:
        """The same snapshot over other values: ``pools[(layer, role)]`` holds each
        member's pool bytes (any buffer of the member's ``page_pool`` byte size; not
        copied); optionally ``pools[(layer, role, i)]`` a quantized member's parameter
        buffer ``i`` (3: scales, 4: zero-points) and ``pools[KV_SCALES]`` the float32
        ``kv_scales`` bytes.  Pool contents are all valid, so nothing else is validated
        again; new parameters and scales are checked (finite, non-zero scales,
        zero-points in range) - the cheap way to emit many snapshots of one structure."""
        out = KVCacheSnapshot.__new__(KVCacheSnapshot)
        out.__dict__.update(self.__dict__)
        out._members, out._cache, out._owner = {}, {}, owner
        # small arrays copied: the result must not keep this snapshot's buffers alive
        out.seq_lens = None if self.seq_lens is None else self.seq_lens.copy()
        out.metadata = dict(self.metadata)
        out.kv_scales = None if self.kv_scales is None else self.kv_scales.copy()
        if KV_SCALES in pools and self.kv_scales is not None:
            out.kv_scales = np.frombuffer(_sized(pools[KV_SCALES], self.kv_scales.nbytes,
                                                 "kv_scales"), "<f4").astype(np.float32
                                                                             ).reshape(self.kv_scales.shape)
        out.extras = [(n, d, [np.array(byte_view(b)) for b in bufs])
                      for n, d, bufs in self.extras]
        for key, (desc, _) in self._members.items():
            raw = _sized(pools[key], desc.buffers[0].byte_size, f"{member_name(*key)}: "
                         "page_pool")
            t = self.tensor(*key)
            rows = np.frombuffer(raw, t.pool_rows.dtype).reshape(t.pool_rows.shape)
            params = None
            if any((*key, i) in pools for i in range(3, 3 + len(t.quant_params))):
                params = tuple(np.frombuffer(_sized(
                    pools.get((*key, 3 + j), old), old.nbytes,
                    f"{member_name(*key)}: buffer {3 + j}"), np.uint8)
                    for j, old in enumerate(t.quant_params))
            scale: Any = "keep"
            if out.kv_scales is not None and out.kv_scales is not self.kv_scales:
                scale = check_fp8_scale(t.element_type, float(
                    out.kv_scales[key[0], 1 if key[1] == "value" else 0]))
            derived = t.derive(rows, params=params, fp8_scale=scale)
            if params is not None:
                derived.check_quant_params()
            out._cache[key] = derived
            out._members[key] = (desc, derived.buffers)
        return out

    def values(self) -> dict[Any, memoryview]:
        """What ``with_pools`` replaces, by the keys it takes: every member's page pool,
        every quantization parameter buffer, and ``kv_scales`` (zero-copy views)."""
        out: dict[Any, memoryview] = {}
        if self.kv_scales is not None:
            out[KV_SCALES] = byte_view(np.ascontiguousarray(self.kv_scales, "<f4"))
        for key in self._members:
            t = self.tensor(*key)
            out[key] = byte_view(t.pool_rows)
            for j, p in enumerate(t.quant_params):
                out[(*key, 3 + j)] = byte_view(p)
        return out

    def skeleton(self) -> KVCacheSnapshot:
        """This structure over untouched zero pools: what to keep to make more snapshots
        of it (``with_pools``) without holding on to any of its data."""
        self.structure()  # computed once, inherited by every snapshot made from it
        return self.with_pools({k: np.zeros(d.buffers[0].byte_size, np.uint8)
                                for k, (d, _) in self._members.items()})

    def structure(self) -> bytes:
        """Everything of the snapshot but its values (``values``: page pools,
        quantization parameters, ``kv_scales``), as bytes: equal for two snapshots
        exactly when one is the other ``with_pools``."""
        if getattr(self, "_structure", None) is None:
            parts, scales = [self.head().encode()], self.kv_scales is not None
            for name, desc, bufs in self.members():
                parts += [name.encode(), desc.encode()]
                own_scales = scales and name == KV_SCALES  # the first: extras follow
                scales = scales and not own_scales
                kept = bufs[1:3] if isinstance(desc.layout, BlockPaged) else (
                    () if own_scales else bufs)
                parts += [bytes(byte_view(b)) for b in kept]
            parts.append(repr((self.model, sorted(self.metadata.items()))).encode())
            self._structure = b"\x00".join(parts)
        return self._structure

    def compact(self) -> KVCacheSnapshot:
        """Every member keeps only its referenced pages (renumbered; aliasing kept)."""
        return KVCacheSnapshot.from_tensors([t.compact() for t in self.tensors()],
                                            self.seq_lens, self.kv_scales, model=self.model,
                                            metadata=self.metadata)

    def equal(self, other: KVCacheSnapshot) -> bool:
        """Same members with the same bytes, same seq_lens and kv_scales."""
        if self.member_keys() != other.member_keys() or not np.array_equal(self.seq_lens,
                                                                          other.seq_lens):
            return False
        if (self.kv_scales is None) != (other.kv_scales is None) or (
                self.kv_scales is not None and not np.array_equal(self.kv_scales,
                                                                  other.kv_scales)):
            return False
        return all(self.tensor(*k).equal(other.tensor(*k)) for k in self.member_keys())


class SnapshotAssembler:
    """Builds a snapshot from members arriving one at a time (a stream, a socket) and
    hands out each layer as soon as all its roles have arrived."""

    def __init__(self) -> None:
        self.collected: list[tuple[str | None, TensorDescriptor, Any]] = []
        self._pending: dict[int, dict[str, BlockPagedTensor]] = {}
        self.seq_lens: np.ndarray | None = None
        self.kv_scales: np.ndarray | None = None

    def add(self, desc: TensorDescriptor, buffers: Buffers, where: str = ""
            ) -> tuple[int, tuple[BlockPagedTensor, ...]] | None:
        self.collected.append((None, desc, buffers))
        layout = desc.layout
        if not isinstance(layout, BlockPaged):
            # seq_lens and kv_scales come before the layers in wire order; whatever the
            # order, finish() validates every member against them again.
            if parse_info(desc, buffers) is not None:
                return None  # model and metadata: taken by finish()
            if self.seq_lens is None and is_seq_lens(desc):
                self.seq_lens = row_major_array(desc, buffers).astype(np.int64)
            elif self.kv_scales is None and is_kv_scales(desc):
                self.kv_scales = row_major_array(desc, buffers)
            return None
        layer, role = layout.layer_index, layout.kv_role_name
        if layer is None:
            raise _fail(f"block-paged tensor {where} is not layer-scoped", "layer_index")
        scale = None
        if self.kv_scales is not None and 0 <= layer < len(self.kv_scales):
            scale = float(self.kv_scales[layer, 1 if role == "value" else 0])
        t = BlockPagedTensor.from_descriptor(desc, buffers, self.seq_lens, fp8_scale=scale)
        roles = self._pending.setdefault(layer, {})
        if role in roles:
            raise _fail(f"layer {layer} role {role} arrived twice", "kv_role", (layer, role))
        roles[role] = t
        want = ("fused",) if role == "fused" else ROLES
        if all(r in roles for r in want):
            return layer, tuple(roles[r] for r in want)
        return None

    def finish(self, model: str | None = None) -> KVCacheSnapshot:
        snap = KVCacheSnapshot.from_members(self.collected, model=model)
        for layer, roles in self._pending.items():  # reuse what was built while streaming
            for role, t in roles.items():
                if (t.seq_lens is None) == (snap.seq_lens is None):
                    snap._cache.setdefault((layer, role), t)
        return snap


__all__ = ["GROUP", "KVCacheSnapshot", "SnapshotAssembler", "group_head", "host_descriptor",
           "is_kv_scales", "is_seq_lens", "kv_scales_member", "member_name", "row_major_array",
           "seq_lens_member"]
