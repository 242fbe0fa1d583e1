"""Snapshots to and from .hrry files: ``save_snapshot`` and ``load_snapshot``.

A file holds the snapshot group as consecutive tensors named ``snapshot`` (the group
head), ``seq_lens``, ``kv_scales`` (fp8 caches) and ``layers.{i}.key`` /
``layers.{i}.value`` (or ``layers.{i}.fused``), plus KV metadata mirroring the facts a
tool may want without decoding tensors: ``hurraykv.num_layers`` (uint64),
``hurraykv.seq_lens`` (array of uint64) and ``hurraykv.model`` when given.  Loading maps
the file and builds each layer's tensors on first use, as views onto the mapping.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..errors import ContainerError
from ..snapshot import GROUP, KVCacheSnapshot
from ..wire.layouts import BlockPaged, Composite
from .hrry import HrryFile, Progress, read_hrry_sequential, write_hrry

HEAD_NAME = "snapshot"
RESERVED_PREFIX = "hurraykv."


def snapshot_kv(snapshot: KVCacheSnapshot, model: str | None,
                metadata: dict[str, Any] | None) -> dict[str, Any]:
    kv: dict[str, Any] = {"hurraykv.num_layers": np.uint64(snapshot.num_layers),
                          "hurraykv.seq_lens": np.asarray(snapshot.seq_lens, np.uint64)}
    model = model if model is not None else snapshot.model
    if model is not None:
        kv["hurraykv.model"] = model
    for key, value in (metadata or {}).items():
        if key.startswith(RESERVED_PREFIX):
            raise ContainerError(f"metadata key {key!r} uses the reserved prefix "
                                 f"{RESERVED_PREFIX!r}", field="metadata", value=key)
        kv[key] = value
    return kv


def save_snapshot(snapshot: KVCacheSnapshot, path: str | os.PathLike, *,
                  model: str | None = None, metadata: dict[str, Any] | None = None,
                  alignment: int = 4096, progress: Progress | None = None,
                  fsync: bool = True) -> Path:
    """Write ``snapshot`` to ``path`` atomically (temporary file, fsync, rename).
    ``fsync=False`` skips the flushes to disk (the rename stays atomic)."""
    tensors = [(HEAD_NAME, snapshot.head(), []), *snapshot.members()]
    return write_hrry(path, tensors, snapshot_kv(snapshot, model, metadata),
                      alignment=alignment, progress=progress, fsync=fsync)


def load_snapshot(path: str | os.PathLike, *, mmap: bool = True) -> KVCacheSnapshot:
    """Open a snapshot file: reads header, trailer, index, KV metadata and the small
    seq_lens / seq_ptr buffers; every tensor is a zero-copy view of an mmap of the file
    (or, with ``mmap=False``, of one in-memory copy read at full speed)."""
    return snapshot_from_file(HrryFile.open(path) if mmap else HrryFile.read(path))


def snapshot_from_file(f: HrryFile) -> KVCacheSnapshot:
    heads = [n for n in f.names if isinstance(f.descriptor(n).layout, Composite)
             and f.descriptor(n).layout.rule == GROUP]
    if heads:
        head = HEAD_NAME if HEAD_NAME in heads else heads[0]
        names = f.members(head)
    else:  # a file of named block-paged tensors, no group
        names = [n for n in f.names if isinstance(f.descriptor(n).layout, BlockPaged)
                 or n in ("seq_lens", "kv_scales")]
    snap = KVCacheSnapshot.from_members(
        [(n, f.descriptor(n), (lambda n=n: f.buffers(n))) for n in names],
        model=f.kv.get("hurraykv.model"), owner=f)
    _check_mirrors(f, snap)
    return snap


def _check_mirrors(f: HrryFile, snap: KVCacheSnapshot) -> None:
    layers = f.kv.get("hurraykv.num_layers")
    if layers is not None and layers != snap.num_layers:
        raise ContainerError(f"{f.source}: KV hurraykv.num_layers is {layers}, the file holds "
                             f"{snap.num_layers} layers", field="hurraykv.num_layers",
                             value=layers)
    lens = f.kv.get("hurraykv.seq_lens")
    if lens is not None and (snap.seq_lens is None or not np.array_equal(
            np.asarray(lens).astype(np.int64), snap.seq_lens)):
        raise ContainerError(f"{f.source}: KV hurraykv.seq_lens disagrees with the seq_lens "
                             "tensor", field="hurraykv.seq_lens")


def read_snapshot_sequential(source: BinaryIO | str | os.PathLike) -> KVCacheSnapshot:
    """A snapshot from a .hrry file read front to back - a non-seekable source (a pipe,
    a socket's file) or a path - held to exactly the rules of ``load_snapshot``."""
    if isinstance(source, str | os.PathLike):
        try:
            with open(source, "rb") as f:
                return snapshot_from_file(read_hrry_sequential(f))
        except OSError as e:
            raise ContainerError(f"cannot read {source}: {e.strerror}", field="path",
                                 value=str(source)) from None
    return snapshot_from_file(read_hrry_sequential(source))
