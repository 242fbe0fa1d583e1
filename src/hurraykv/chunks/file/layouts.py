"""What a segment file's structure puts where, learned once per structure: the
``.hrry`` layout of the segments a connector writes and reads by the thousand (same
geometry, only the values differ).

``FileLayout`` is one structure's layout: the bytes every file of it shares, and where
each value (page pools, scales, the checksum entry) sits.  ``Layouts`` remembers the
structures seen (bounded), so that a file whose bytes outside its values are a known
structure's is read as that structure over its own values without being parsed again,
and a file's pages can be left where they are (``Layouts.pages``: a ``PageSource`` for
``io.scatter``, everything else read with small reads and verified).  The file is any
readable descriptor: a segment in a ``file://`` directory, or a sealed memory file a
``hurraykv serve`` on the same host hands over (``server_store``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ... import alloc
from ...errors import HurrayError
from ...info import PREFIX, info_member, is_info, text_offset
from ...io import checksums
from ...io.hrry import HrryFile, read_bands
from ...io.hrry_format import kv_text_spans
from ...io.scatter import PageSource
from ...io.snapshots import member_names, snapshot_from_file
from ...snapshot import KV_SCALES, KVCacheSnapshot
from ...snapshot_members import is_kv_scales, member_name
from ...wire.layouts import BlockPaged


@dataclass
class FileLayout:
    """Where everything of one snapshot structure sits in its .hrry file: ``static`` are
    the bytes that are the same in every file of the structure (header, descriptors,
    index buffers, KV metadata, index, trailer), ``regions`` the ``(offset, nbytes,
    source)`` of what differs, in file order: each value (source: its key in
    ``snapshot.values()``: page pools, quantization scales, ``kv_scales``) and the text of
    the checksum entry (source: ``CHECKSUMS``, fixed width for a structure: the entry
    the snapshot's metadata comes from) and of its copy in the KV section (``MIRROR``,
    equal to it in a file that ``matches``); ``snapshot`` is that file's validated
    snapshot; ``plan`` reads such a file and hashes its checksum pieces in one pass (None:
    the structure has no checksums)."""

    size: int
    static: list[tuple[int, bytes]]
    regions: list[tuple[int, int, Any]]
    snapshot: KVCacheSnapshot
    plan: checksums.ReadPlan | None

    @classmethod
    def learn(cls, data: memoryview, snapshot: KVCacheSnapshot, f: HrryFile,
              plan: checksums.ReadPlan | None = None) -> FileLayout | None:
        """The layout of ``data`` (the file ``f``, read as ``snapshot``), or None when a
        value or the checksum entry cannot be placed in it (such files are then parsed one
        by one)."""
        regions = _values(f, snapshot, data)
        text = checksums.KEY in snapshot.metadata
        places = _checksum_places(f, snapshot, data) if text else []
        if regions is None or places is None:
            return None
        regions += places
        regions.sort(key=lambda r: r[0])
        if text and plan is None:  # the caller's, when it read the file with one
            plan = checksums.ReadPlan.of(snapshot, data)
        plan = plan if text else None
        return cls(len(data), complement(data, regions), regions, snapshot.skeleton(), plan)

    def matches(self, data: memoryview) -> bool:
        # tobytes(): a memoryview compared with == unpacks element by element
        if len(data) != self.size or not all(data[off:off + len(b)].tobytes() == b
                                             for off, b in self.static):
            return False
        entry = [data[off:off + n].tobytes() for off, n, source in self.regions
                 if source in TEXT]
        # a KV copy that differs decides nothing (the digests are the entry's), but such
        # a file is not one of this structure's: the full rules read it
        return all(copy == entry[0] for copy in entry[1:])

    def pieces(self, snapshot: KVCacheSnapshot) -> list[memoryview]:
        """The file's bytes for ``snapshot`` (this structure), in order, pools not copied."""
        values = snapshot.values()
        out = [memoryview(self.static[0][1])]
        for (_, _, source), (_, b) in zip(self.regions, self.static[1:], strict=True):
            if source in TEXT:
                out.append(memoryview(str(snapshot.metadata[checksums.KEY]).encode()))
            else:
                out.append(values[source])
            out.append(memoryview(b))
        return out

    def read(self, data: memoryview) -> KVCacheSnapshot:
        """The snapshot of a file that ``matches``: this structure over its own pools and
        with its own checksums."""
        snap = self.snapshot.with_pools({source: data[off:off + n]
                                         for off, n, source in self.regions
                                         if source not in TEXT}, owner=data)
        for off, n, source in self.regions:
            if source == CHECKSUMS:
                return snap.with_info(metadata={
                    checksums.KEY: data[off:off + n].tobytes().decode("ascii", "replace")})
        return snap


CHECKSUMS = "checksums"
MIRROR = "checksums in the KV section"
TEXT = (CHECKSUMS, MIRROR)


def _checksum_places(f: HrryFile, snapshot: KVCacheSnapshot, data: memoryview
                     ) -> list[tuple[int, int, Any]] | None:
    """``(offset, nbytes, CHECKSUMS or MIRROR)`` of the checksum entry the snapshot's
    metadata was read from (the info member's, else the KV section's) and of its KV copy,
    placed by the file's structure (the index, the info member's form, the KV keys), never
    found by searching for the text: a copy in another entry is metadata like any other,
    so the digests a known structure reads are those a full parse reads.  None when they
    cannot be placed so (such files are then parsed one by one)."""
    text = snapshot.metadata[checksums.KEY]
    if not isinstance(text, str):
        return None
    n = len(text.encode())
    kv = kv_text_spans(data).get(checksums.KEY)
    if kv is not None and kv[1] != n:
        return None
    infos = [name for name in member_names(f) if is_info(f.descriptor(name)) and
             data[f.entry(name).data_offset:][:len(PREFIX)].tobytes() == PREFIX]
    if not infos:  # read from the KV section (a file of another writer)
        return None if kv is None else [(kv[0], n, CHECKSUMS)]
    member = info_member(snapshot.model, snapshot.metadata)[1][0].tobytes()
    at = text_offset(snapshot.model, snapshot.metadata, checksums.KEY)
    start = f.entry(infos[0]).data_offset  # the one snapshot_from_file took
    if (at is None or f.descriptor(infos[0]).shape[0] != len(member)
            or data[start:start + len(member)].tobytes() != member):
        return None  # written in another form: where its entry sits is not known
    return [(start + at, n, CHECKSUMS)] + ([(kv[0], n, MIRROR)] if kv is not None else [])


def pools_of(f: HrryFile) -> list[tuple[int, int, Any]]:
    """``(offset, nbytes, (layer, role))`` of every page pool of a parsed file."""
    regions = []
    for e in f.entries:
        desc = f.descriptor(e.name)
        if isinstance(desc.layout, BlockPaged):
            regions.append((e.data_offset, desc.buffers[0].byte_size,
                            (desc.layout.layer_index, desc.layout.kv_role_name)))
    return regions


def _values(f: HrryFile, snapshot: KVCacheSnapshot, data: memoryview
            ) -> list[tuple[int, int, Any]] | None:
    """``(offset, nbytes, source)`` of every value of ``snapshot`` (read from ``f`` over
    ``data``) in the file: where its view points, each checked to hold the value's bytes,
    so that no value is ever left in ``static`` (a later segment would be written with
    this one's scales); None when one cannot be placed.  ``kv_scales`` is a float32 copy:
    its place is the one member of its form (recognised by its fields, D7) holding its
    bytes."""
    base = np.frombuffer(data, np.uint8).ctypes.data if len(data) else 0
    regions = []
    for source, view in snapshot.values().items():
        if source == KV_SCALES:
            places = [e.data_offset for e in f.entries if is_kv_scales(f.descriptor(e.name))
                      and data[e.data_offset:e.data_offset + len(view)] == view.cast("B")]
            if len(places) != 1:
                return None
            at = places[0]
        else:
            at = np.frombuffer(view, np.uint8).ctypes.data - base if len(view) else 0
        if not 0 <= at <= at + len(view) <= len(data) or (
                len(view) <= 4096 and data[at:at + len(view)] != view.cast("B")):
            return None
        regions.append((at, len(view), source))
    return regions


def _page_places(snapshot: KVCacheSnapshot, data: memoryview,
                 places: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], what: str
                 ) -> dict[str, tuple[int, int, np.ndarray]] | None:
    """Per member of ``places``: the file offset of its page 0, a page's bytes and its
    pages' stored digests (the pieces inside its page pool); the member's other buffers
    (in ``data`` already) verified here.  None unless each pool is its pages in order,
    one piece a page."""
    base = np.frombuffer(data, np.uint8).ctypes.data if len(data) else 0
    out = {}
    for key, view in snapshot.values().items():
        if not (isinstance(key, tuple) and len(key) == 2):
            continue  # quantization parameters, kv_scales: read and verified already
        member = member_name(*key)
        if member not in places:
            continue
        offsets, lengths, digests = places[member]
        at = np.frombuffer(view, np.uint8).ctypes.data - base if len(view) else 0
        inside = (offsets >= at) & (offsets < at + len(view))
        offs, lens = offsets[inside].astype(np.int64), lengths[inside].astype(np.int64)
        if not len(offs) or offs[0] != at or np.any(lens != lens[0]) or np.any(
                np.diff(offs) != lens[0]) or len(offs) * lens[0] != len(view):
            return None
        for o, n, d in zip(offsets[~inside].tolist(), lengths[~inside].tolist(),
                           digests[~inside].tolist(), strict=True):
            if xxhash.xxh3_64_intdigest(data[o:o + n]) != d:  # its block table, lengths
                raise checksums.ChecksumError(
                    f"{what}: a buffer of member {member} other than its pages (at byte "
                    f"{o}, {n} bytes) does not match its checksum", field=checksums.KEY,
                    value=member, rule="stored bytes equal those checksummed when written")
        out[member] = (at, int(lens[0]), digests[inside])
    return out


def complement(data: memoryview, regions: list[tuple[int, int, Any]]
                ) -> list[tuple[int, bytes]]:
    """The bytes of ``data`` between ``regions`` (sorted by offset), with their offsets."""
    out, pos = [], 0
    for off, n, _ in sorted(regions, key=lambda r: r[0]):
        out.append((pos, bytes(data[pos:off])))
        pos = off + n
    out.append((pos, bytes(data[pos:])))
    return out


def structure_key(snapshot: KVCacheSnapshot) -> bytes:
    """What two segments of one file layout share: their structure, the checksum entry's
    digits blanked (its width is the structure's; its digits are each file's own; a copy
    of them in another entry is structure like any metadata)."""
    text = snapshot.metadata.get(checksums.KEY)
    if not isinstance(text, str):
        return snapshot.structure()
    return snapshot.with_info(metadata={checksums.KEY: "#" * len(text)}).structure()


def _pools(regions: list[tuple[int, int, Any]], members: frozenset[str]
           ) -> list[tuple[int, int, Any]]:
    """The regions of ``regions`` that are the page pools of ``members``, in file order."""
    return sorted(r for r in regions if isinstance(r[2], tuple) and len(r[2]) == 2
                  and member_name(*r[2]) in members)


def whole(label: str, size: int, got: int) -> None:
    """``got`` bytes of ``size`` read from file ``label``: ``HurrayError`` unless all."""
    if got != size:
        raise HurrayError(f"{label} shrank from {size} to {got} bytes while it was read",
                          field="segment", value=label, rule="a file that stays whole")


class Layouts:
    """The layouts of the last ``most`` structures learned, by structure and by file
    size (forgotten all at once when full: a connector sees a handful)."""

    def __init__(self, most: int = 32) -> None:
        self.most = most
        self.by_structure: dict[bytes, FileLayout] = {}
        self.by_size: dict[int, list[FileLayout]] = {}

    def remember(self, structure: bytes, layout: FileLayout | None) -> None:
        if layout is None:
            return
        if len(self.by_structure) >= self.most:
            self.by_structure.clear()
            self.by_size.clear()
        self.by_structure[structure] = layout
        self.by_size.setdefault(layout.size, []).append(layout)

    def planned(self, size: int) -> FileLayout | None:
        """A known layout of files of ``size`` bytes that hashes while it reads."""
        return next((layout for layout in self.by_size.get(size, ())
                     if layout.plan is not None), None)

    def parse(self, data: memoryview, label: str) -> KVCacheSnapshot:
        """The snapshot of file bytes ``data``: a known structure's if they match one,
        else parsed by the full rules (and learned)."""
        for layout in self.by_size.get(len(data), ()):
            if layout.matches(data):
                return layout.read(data)
        f = HrryFile.from_bytes(data, label)
        snap = snapshot_from_file(f)
        snap.tensors()  # every member built: index buffers and token counts checked
        self.remember(structure_key(snap), FileLayout.learn(data, snap, f))
        return snap

    def structure_only(self, fd: int, label: str, members: frozenset[str],
                       layout: FileLayout | None = None
                       ) -> tuple[KVCacheSnapshot, checksums.ReadPlan, memoryview] | None:
        """The snapshot of file ``fd`` over memory holding every byte but the page pools
        of ``members`` (read with small reads; those pools' memory untouched), and its
        read plan; None when it has none (no checksums) or does not parse.  With
        ``layout`` (a file that holds only what that layout puts outside those pools, the
        rest holes: a fetched ``s3://`` segment), None unless its pools are where
        ``layout``'s are: then its structure is that layout's, another known one of those
        pools (another tenant's metadata), or parsed from what was fetched (and
        learned)."""
        size = os.fstat(fd).st_size
        data = memoryview(alloc.sparse(size)) if size else memoryview(b"")
        known = self.planned(size) if layout is None else layout
        fetched = None  # with ``layout``: the pools its bytes were fetched around
        if known is not None and known.size == size:
            pools = _pools(known.regions, members)
            for off, piece in complement(data, pools):
                whole(label, len(piece), read_bands(fd, data[off:off + len(piece)], off))
            if known.matches(data):
                return known.read(data), known.plan, data  # type: ignore[return-value]
            if layout is not None:
                fetched = pools
                for other in self.by_size.get(size, ()):  # another tenant's, seen before
                    if other.plan is not None and _pools(other.regions, members) == pools \
                            and other.matches(data):
                        return other.read(data), other.plan, data
        elif layout is not None:
            return None
        try:
            f = HrryFile.over(fd, data, label)
            pools = _pools(pools_of(f), members)
            if fetched is not None and pools != fetched:
                # its structure lies where holes are: parsed, they would read as its bytes
                return None
            for off, piece in complement(data, pools):
                whole(label, len(piece), read_bands(fd, data[off:off + len(piece)], off))
            snap = snapshot_from_file(f)
            snap.tensors()  # every member built: index buffers and token counts checked
            plan = checksums.ReadPlan.of(snap, data)
        except HurrayError:
            return None
        if plan is None:
            return None
        self.remember(structure_key(snap), FileLayout.learn(data, snap, f, plan))
        return snap, plan, data

    def pages(self, fd: int, name: str, label: str, members: frozenset[str],
              layout: FileLayout | None = None
              ) -> tuple[KVCacheSnapshot, PageSource, float] | None:
        """Segment ``name`` (file ``fd``, called ``label`` in errors) with the pages of
        ``members`` left in the file: a ``PageSource`` over ``fd`` (which it then owns),
        everything else read with small reads and verified now (the seconds that took
        returned).  None where that cannot be (no checksums, a pool that is not one whole
        member's pages, a file that does not match ``layout``: ``structure_only``): the
        caller reads the segment whole; ``fd`` is then still its."""
        got = self.structure_only(fd, label, members, layout)
        if got is None:
            return None
        snap, plan, data = got
        what = f"segment {name}"
        started = time.perf_counter()
        found, skipped = plan.hash_in_memory(data, members)
        checksums.verify(snap, what, plan.complete(snap, found, skipped))
        seconds = time.perf_counter() - started
        places = plan.places(snap, members)
        if not places:
            return None
        pages = _page_places(snap, data, places, what)
        if pages is None:
            return None
        return snap, PageSource(fd, name, pages), seconds


__all__ = ["FileLayout", "Layouts", "complement", "pools_of", "structure_key", "whole"]
