"""What a KVCacheSnapshot is made of, member by member (decision D7).

The pieces ``snapshot.py`` builds a snapshot from, each usable on its own by the
containers and transports: member names (``layers.{i}.{role}``) and the group head;
the ``seq_lens`` and ``kv_scales`` members built (``seq_lens_member``,
``kv_scales_member``) and recognised by their own fields on the way in (``is_seq_lens``,
``is_kv_scales``, ``row_major_array``); descriptors of bytes handed out from host memory;
and ``check_members``, the rules that make a set of block-paged members one snapshot.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .errors import SnapshotError
from .paging import byte_view
from .wire.buffers import handle
from .wire.descriptor import TensorDescriptor
from .wire.dtypes import ELEMENT_TYPES
from .wire.layouts import Composite, RowMajor

ROLES = ("key", "value")
GROUP = 0x03
UINT64, FLOAT32, UINT8 = 0x17, 0x03, 0x11
Buffers = Sequence[Any]
Loader = Callable[[], Buffers]


def unfit(msg: str, field: str, value: Any = None) -> SnapshotError:
    """The error for members that do not make one snapshot."""
    return SnapshotError(msg, field=field, value=value, rule="snapshot members fit together")


def member_name(layer: int, role: str) -> str:
    return f"layers.{layer}.{role}"


def group_head(member_count: int) -> TensorDescriptor:
    """The group head as the reference writes one: uint8, rank 1, shape [member_count]."""
    return TensorDescriptor(UINT8, (member_count,), Composite(GROUP, member_count))


def row_major_member(data: np.ndarray, tag: int) -> tuple[TensorDescriptor, Buffers]:
    """A row-major member of ``data`` (contiguous, little-endian) whose element type is
    ``tag``: ``seq_lens``, ``kv_scales``, a hybrid model's states."""
    data = np.ascontiguousarray(data)
    return (TensorDescriptor(tag, tuple(data.shape), RowMajor(), (handle(data.nbytes),)),
            [memoryview(data.reshape(-1).view(np.uint8))])


def seq_lens_member(seq_lens: np.ndarray) -> tuple[TensorDescriptor, Buffers]:
    return row_major_member(np.asarray(seq_lens, dtype="<u8").reshape(-1), UINT64)


def kv_scales_member(kv_scales: np.ndarray) -> tuple[TensorDescriptor, Buffers]:
    return row_major_member(np.asarray(kv_scales, dtype="<f4"), FLOAT32)


def host_descriptor(desc: TensorDescriptor) -> TensorDescriptor:
    """The descriptor of bytes handed out from host memory: a member whose pool stayed on
    a device records that device, but what is written (file, stream, socket) is a host
    copy, so it is described as CPU memory."""
    if all(h.device_tag == 0 and h.memory_class == 0 and h.sync_mode == 0
           for h in desc.buffers):
        return desc
    return dataclasses.replace(desc, buffers=tuple(
        handle(h.byte_size, h.alignment) for h in desc.buffers))


def role_rank(role: str) -> int:
    return {"key": 0, "fused": 0, "value": 1}[role]


def is_seq_lens(desc: TensorDescriptor) -> bool:
    et = desc.element_type
    return (isinstance(desc.layout, RowMajor) and desc.rank == 1 and et is not None
            and not et.is_float and et.bits in (8, 16, 32, 64) and et.name != "bool"
            and desc.quantization is None)


def is_kv_scales(desc: TensorDescriptor) -> bool:
    return (isinstance(desc.layout, RowMajor) and desc.type_tag == FLOAT32 and desc.rank == 2
            and desc.shape[1] == 2 and desc.quantization is None)


def row_major_array(desc: TensorDescriptor, buffers: Buffers) -> np.ndarray:
    et = desc.element_type
    raw = byte_view(buffers[0]) if len(buffers) else memoryview(b"")
    count = math.prod(desc.shape)  # exact: shapes are u64, NumPy would wrap
    need = desc.byte_offset + et.nbytes(count)
    if raw.nbytes < need or raw.nbytes != desc.buffers[0].byte_size:
        raise unfit(f"{desc.element_type_name} {list(desc.shape)} at byte_offset "
                    f"{desc.byte_offset} needs {need} bytes, the buffer holds {raw.nbytes}",
                    "buffers[0]", raw.nbytes)
    arr = np.frombuffer(raw, et.numpy, count=count, offset=desc.byte_offset) if count else \
        np.zeros(0, et.numpy)
    if not et.is_float and et.is_signed and count and arr.min() < 0:
        raise unfit("seq_lens entries MUST be >= 0", "seq_lens", int(arr.min()))
    return arr.reshape(desc.shape)


def check_members(members: dict[tuple[int, str], tuple[TensorDescriptor, Loader]],
                  seq_lens: np.ndarray | None, kv_scales: np.ndarray | None) -> None:
    """The rules that make block-paged members (sorted by layer, then role), ``seq_lens``
    and ``kv_scales`` one snapshot: layers 0..L-1, each with key and value or one fused
    member; every member shares the first one's facts and seq_ptr (a role's head_dim is
    its own); seq_lens fit the sequences; kv_scales are ``[L, 2]``, finite, non-zero and
    belong to an fp8 cache.  Only descriptors and seq_ptr buffers are read."""
    if not members:
        raise unfit("a snapshot holds at least one block-paged member", "members", 0)
    keys = list(members)
    layers = sorted({k[0] for k in keys})
    if layers != list(range(len(layers))):
        # the first gap, found without listing a range a hostile layer_index could make
        # billions long
        first = next(i for i, layer in enumerate(layers) if layer != i)
        raise unfit(f"layer {first} is missing (layers present: {len(layers)}, highest "
                    f"{layers[-1]}): a snapshot has layers 0..L-1", "layer_index", first)
    for i in layers:
        roles = {k[1] for k in keys if k[0] == i}
        if roles not in ({"key", "value"}, {"fused"}):
            raise unfit(f"layer {i} has roles {sorted(roles)}; every layer has key and "
                        "value, or one fused member", "kv_role", sorted(roles))
    first_key = keys[0]
    d0, load0 = members[first_key]
    facts0 = _facts(d0)
    sp0 = _seq_ptr(d0, load0())
    role_dims: dict[str, tuple[tuple[int, str], int]] = {}
    for key in keys:
        desc, load = members[key]
        # a role's head_dim is its own (key and value may differ: DIFFKV, MLA-style)
        first, dim = role_dims.setdefault(key[1], (key, desc.shape[2]))
        if desc.shape[2] != dim:
            raise unfit(f"{member_name(*key)} has head_dim {desc.shape[2]}, "
                        f"{member_name(*first)} has {dim}", "head_dim", desc.shape[2])
        if key == first_key:
            continue
        facts = _facts(desc)
        for field, a, b in zip(_FACT_NAMES, facts0, facts, strict=True):
            if a != b:
                raise unfit(f"{member_name(*key)} has {field} {b}, "
                            f"{member_name(*first_key)} has {a}", field, b)
        sp = _seq_ptr(desc, load())
        if not np.array_equal(sp, sp0):
            raise unfit(f"{member_name(*key)} has a different seq_ptr than "
                        f"{member_name(*first_key)}; every member shares one", "seq_ptr")
    if seq_lens is not None:
        lens = seq_lens
        num_seqs, page_size, total = facts0[0], facts0[1], facts0[3]
        if lens.ndim != 1 or len(lens) != num_seqs:
            raise unfit(f"seq_lens has {lens.size} entries for {num_seqs} sequences",
                        "seq_lens", lens.size)
        cap = np.diff(sp0.astype(np.int64)) * page_size
        bad = (lens < 0) | (lens > cap)
        if bad.any():
            s = int(np.flatnonzero(bad)[0])
            raise unfit(f"seq_lens[{s}] = {int(lens[s])} does not fit sequence {s}'s "
                        f"{int(cap[s]) // page_size} pages", f"seq_lens[{s}]", int(lens[s]))
        if int(lens.sum()) != total:
            raise unfit(f"sum(seq_lens) = {int(lens.sum())} but members hold {total} "
                        "tokens", "seq_lens", int(lens.sum()))
    if kv_scales is not None:
        ks = kv_scales
        if ks.shape != (len(layers), 2):
            raise unfit(f"kv_scales has shape {list(ks.shape)}, expected "
                        f"[{len(layers)}, 2]", "kv_scales", list(ks.shape))
        if not (np.isfinite(ks).all() and (ks != 0).all()):
            raise unfit("kv_scales MUST be finite and non-zero", "kv_scales")
        pool_type = ELEMENT_TYPES[facts0[4]].name
        if pool_type not in ("float8_e4m3", "float8_e5m2"):
            raise unfit(f"kv_scales belong to fp8 caches, not {pool_type} pools",
                        "kv_scales", pool_type)


_FACT_NAMES = ("num_seqs", "page_size", "num_heads", "total_tokens", "type_tag")


def _facts(desc: TensorDescriptor) -> tuple[int, ...]:
    layout = desc.layout
    return (layout.num_seqs, layout.page_size, desc.shape[1], desc.shape[0], desc.type_tag)


def _seq_ptr(desc: TensorDescriptor, buffers: Buffers) -> np.ndarray:
    if len(buffers) < 3:
        raise unfit("a block-paged member needs its seq_ptr buffer", "buffers", len(buffers))
    dt = "<u8" if desc.layout.index_type == 1 else "<u4"
    raw = byte_view(buffers[2])
    if raw.nbytes != desc.buffers[2].byte_size:
        raise unfit(f"seq_ptr buffer holds {raw.nbytes} bytes, the descriptor declares "
                    f"{desc.buffers[2].byte_size}", "buffers[2]", raw.nbytes)
    return np.frombuffer(raw, dt)
