"""Snapshots to and from .hrry files: ``save_snapshot`` and ``load_snapshot``.

A file holds the snapshot group as consecutive tensors named ``snapshot`` (the group
head), ``seq_lens``, ``kv_scales`` (fp8 caches) and ``layers.{i}.key`` /
``layers.{i}.value`` (or ``layers.{i}.fused``), plus KV metadata mirroring the facts a
tool may want without decoding tensors: ``hurraykv.num_layers`` (uint64),
``hurraykv.seq_lens`` (array of uint64) and ``hurraykv.model`` when given, then the user
metadata; the model and metadata also travel in the info member (``info.py``), as on
every other path.  Loading maps the file and builds each layer's tensors on first use, as
views onto the mapping; members are recognised by their fields, never by their names.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from ..errors import ContainerError, HurrayError, SnapshotError
from ..info import MAX_BYTES, check_metadata, info_member
from ..snapshot import GROUP, KVCacheSnapshot
from ..wire.layouts import Composite
from .checksums import KEY as CHECKSUMS_KEY
from .checksums import WIDTH, pieces, with_checksums
from .hrry import HrryFile, Progress, read_hrry_sequential, write_hrry

HEAD_NAME = "snapshot"
RESERVED_PREFIX = "hurraykv."


def snapshot_kv(snapshot: KVCacheSnapshot) -> dict[str, Any]:
    """The file's KV section: mirrors of what the members hold (for tools that read only
    the KV section, such as the reference's ``load_kv``) and the user metadata."""
    kv: dict[str, Any] = {"hurraykv.num_layers": np.uint64(snapshot.num_layers),
                          "hurraykv.seq_lens": np.asarray(snapshot.seq_lens, np.uint64)}
    if snapshot.model is not None:
        kv["hurraykv.model"] = snapshot.model
    return kv | snapshot.metadata


def save_snapshot(snapshot: KVCacheSnapshot, path: str | os.PathLike, *,
                  model: str | None = None, metadata: dict[str, Any] | None = None,
                  alignment: int = 4096, progress: Progress | None = None,
                  fsync: bool = True,
                  checksums: bool | Literal["auto", "keep"] = "auto",
                  into: int | None = None) -> Path:
    """Write ``snapshot`` to ``path`` atomically (temporary file, fsync, rename).
    ``model`` replaces the snapshot's, ``metadata`` is merged into its own; both come back
    as ``snap.model`` / ``snap.metadata`` from every reader.  ``fsync=False`` skips the
    flushes to disk (the rename stays atomic).  ``into``: written into that open, empty
    file descriptor instead (a memory file: ``s3://`` uploads it), ``path`` only naming it
    in messages.

    Checksums: an xxh3-64 digest of every page and buffer of the values written, as the
    metadata entry ``checksum.xxh3_64`` (``checksums.py``), so that ``hurraykv validate``
    and ``checksums.verify`` catch a flipped byte that would otherwise load as wrong keys
    and values; one pass over the bytes at about the speed of a copy, small beside the
    write itself.  ``load_snapshot`` does not check them (it maps the file and reads
    nothing it is not asked for).  The entry takes 16 bytes a page in the info member,
    whose model and metadata are at most 1 MiB (``info.MAX_BYTES``): about 65,000 pages.

    * ``"auto"`` (the default): recorded when they fit; beyond, none, with a
      ``ChecksumsNotWritten`` warning (``validate`` then says the values are not
      verified).
    * ``True``: recorded, or ``SnapshotError`` when they do not fit.
    * ``False``: none; an entry the snapshot carries (it was loaded from a file that had
      one) is left out, as it may no longer match.
    * ``"keep"``: the entry the snapshot carries, as it is (its caller has just computed
      it: the connector's segments)."""
    if model is not None or metadata:
        snapshot = snapshot.with_info(model, metadata)
    if checksums not in (True, False, "auto", "keep"):
        raise SnapshotError(f"checksums is {checksums!r}; it is \"auto\", True, False or "
                            "\"keep\"", field="checksums", value=checksums,
                            rule="\"auto\", True, False or \"keep\"")
    if checksums in (True, "auto"):
        unchecked = _without_checksums(snapshot)
        count = pieces(unchecked)
        room = MAX_BYTES - len(info_member(unchecked.model, unchecked.metadata)[1][0])
        need = WIDTH * count + len(f',"{CHECKSUMS_KEY}":""')
        if need <= room:
            snapshot = with_checksums(unchecked)
        elif checksums is True:
            raise SnapshotError(f"checksums of {count} pages and buffers take {need} bytes of "
                                f"metadata, {room} are left (info.MAX_BYTES): write them "
                                "with checksums=\"auto\" or False", field="checksums",
                                value=count, rule=f"at most {room // WIDTH} checksums")
        else:
            warnings.warn(ChecksumsNotWritten(
                f"{path}: no checksums written: {count} pages and buffers would take "
                f"{need} bytes of metadata, more than the {room} left"), stacklevel=2)
            snapshot = unchecked
    elif checksums is False:
        snapshot = _without_checksums(snapshot)
    tensors = [(HEAD_NAME, snapshot.head(), []), *snapshot.members()]
    return write_hrry(path, tensors, snapshot_kv(snapshot), alignment=alignment,
                      progress=progress, fsync=fsync, into=into)


class ChecksumsNotWritten(UserWarning):
    """``save_snapshot`` wrote no checksums: they would not fit in the info member."""


def _without_checksums(snapshot: KVCacheSnapshot) -> KVCacheSnapshot:
    if CHECKSUMS_KEY not in snapshot.metadata:
        return snapshot
    kept = {k: v for k, v in snapshot.metadata.items() if k != CHECKSUMS_KEY}
    out = snapshot.with_info()  # a copy: the caller's snapshot keeps its entry
    out.metadata = kept
    return out


def load_snapshot(path: str | os.PathLike, *, mmap: bool = True) -> KVCacheSnapshot:
    """Open a snapshot file: reads header, trailer, index, KV metadata and the small
    seq_lens / seq_ptr buffers; every tensor is a zero-copy view of an mmap of the file
    (or, with ``mmap=False``, of one in-memory copy read at full speed)."""
    return snapshot_from_file(HrryFile.open(path) if mmap else HrryFile.read(path))


def member_names(f: HrryFile) -> list[str]:
    """The tensors of ``f`` a snapshot is read from, in order."""
    heads = [n for n in f.names if isinstance(f.descriptor(n).layout, Composite)
             and f.descriptor(n).layout.rule == GROUP]
    if heads:
        return f.members(HEAD_NAME if HEAD_NAME in heads else heads[0])
    # a file of tensors and no group: its members are recognised by their fields
    return [n for n in f.names if not isinstance(f.descriptor(n).layout, Composite)]


def snapshot_from_file(f: HrryFile) -> KVCacheSnapshot:
    names = member_names(f)
    # files written without an info member (older ones, other writers) keep the model and
    # metadata in the KV section only
    user = {k: _plain(v) for k, v in f.kv.items() if not k.startswith(RESERVED_PREFIX)}
    snap = KVCacheSnapshot.from_members(
        [(n, f.descriptor(n), (lambda n=n: f.buffers(n))) for n in names],
        model=f.kv.get("hurraykv.model"), metadata=_carried(user), owner=f)
    _check_mirrors(f, snap)
    return snap


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value.item() if isinstance(value, np.generic) else value


def _carried(kv: dict[str, Any]) -> dict[str, Any]:
    """The KV entries a snapshot's metadata can hold (bytes values stay in the file)."""
    out = {}
    for k, v in kv.items():
        try:
            out |= check_metadata({k: v})
        except HurrayError:
            continue
    return out


def _check_mirrors(f: HrryFile, snap: KVCacheSnapshot) -> None:
    layers = f.kv.get("hurraykv.num_layers")
    if layers is not None and layers != snap.num_layers:
        raise ContainerError(f"{f.source}: KV hurraykv.num_layers is {layers}, the file holds "
                             f"{snap.num_layers} layers", field="hurraykv.num_layers",
                             value=layers)
    model = f.kv.get("hurraykv.model")
    if model is not None and model != snap.model:
        raise ContainerError(f"{f.source}: KV hurraykv.model is {model!r}, the info member "
                             f"says {snap.model!r}", field="hurraykv.model", value=model)
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
