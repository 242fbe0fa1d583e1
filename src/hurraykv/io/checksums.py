"""Content checksums of a snapshot's stored values (decision H89).

A snapshot's structure is checked by every reader (descriptors, index buffers, the .hrry
index CRC); the values in its page pools are not: a flipped bit in a pool decodes to a
wrong key or value and, loaded into an engine, to wrong tokens, silently.  So a writer
may record an xxh3-64 digest of every page of every block-paged member's pool and of
every other buffer of every member (block tables, sequence pointers and lengths,
``kv_scales``, quantization parameters), as one metadata entry:

    metadata["checksum.xxh3_64"] = hex digests, 16 characters each, in member order
        (``snapshot.members()``, the ``info`` member left out: it carries this entry);
        within a member, buffer by buffer; a page pool page by page.

It is ordinary metadata: every Hurray reader keeps it (pyhurray included) and one that
does not know it ignores it; ``verify`` recomputes it.  The digests are those of the entry
under this key in the metadata the snapshot was read with (a file's info member, or its KV
section when it has none): a reader that knows a file's structure (``FileChunks``) takes
them from that same entry, located through the file's structure, never by searching for
the text, so a copy of it in another entry decides nothing.  xxh3-64 (the ``xxhash``
package) reads at the speed of a copy here (10.8 GiB/s; hardware CRC-32C 11.4 GiB/s needs
an LGPL package, BLAKE3 4.6, zlib's CRC-32 3.7): one more pass over the bytes a load reads.

That pass is what a load cannot afford (from memory it cost a fifth of a connector
load), so a reader that knows a file's structure uses a ``ReadPlan``: the file is read in
sub-ranges cut between pieces, and each sub-range's pieces are hashed right after it is
read, while it is in the core's cache, by a compiled loop that holds no GIL
(``page_hash``).  The digests themselves are computed by ``checksum_digests.py``.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from .. import errors
from ..errors import HurrayError
from ..paged import byte_view
from ..snapshot import KVCacheSnapshot
from ..threads import run_bands
from . import page_hash
from .checksum_digests import (
    KEY,
    WIDTH,
    PoolDigests,
    digests,
    hash_all,
    piece_views,
    pieces,
    with_checksums,
)

NOT_HEX = re.compile(r"[^0-9a-fA-F]")


class ChecksumError(HurrayError):
    """Stored values that do not match the checksums written with them."""


# What reading a stored object that is damaged raises: a checksum that does not match, or
# bytes that do not parse (cut short, a mangled structure).  Not damage: a missing object,
# a store that fails, one of another identity or geometry (a plain HurrayError).
DAMAGED: tuple[type[HurrayError], ...] = (
    ChecksumError, errors.ContainerError, errors.DescriptorError, errors.ElementTypeError,
    errors.HurrayBufferError, errors.LayoutError, errors.QuantizationError,
    errors.SnapshotError, errors.StreamError)


def _stored(snapshot: KVCacheSnapshot, count: int) -> np.ndarray | None:
    """The stored digests, or None when the entry is not ``count`` of them in hex."""
    text = str(snapshot.metadata.get(KEY, ""))
    if len(text) != WIDTH * count:
        return None
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    if len(raw) != 8 * count:  # fromhex skips whitespace: fewer digests than characters
        return None
    return np.frombuffer(raw, ">u8").astype(np.uint64)


def mismatches(snapshot: KVCacheSnapshot, computed: np.ndarray | None = None,
               only: frozenset[str] | None = None, parallel: bool = True
               ) -> list[tuple[str, int, int | None]]:
    """``(member, buffer, page)`` of every piece whose bytes do not match the stored
    checksums (every piece, when their number does not); [] when they all match.
    ``computed``: the pieces' digests when a ``ReadPlan`` already hashed them; ``only``:
    the members whose pieces are compared (None: all).  A snapshot without checksums has
    nothing to compare: ``has_checksums`` says."""
    if computed is not None:  # the common case, all equal, without listing the pieces
        stored = _stored(snapshot, len(computed))
        if stored is not None and np.array_equal(stored, computed):
            return []
    pieces = list(piece_views(snapshot))
    stored = _stored(snapshot, len(pieces))
    if stored is None:
        return [(m, b, p) for m, b, p, _ in pieces if only is None or m in only]
    chosen = [k for k, (m, *_) in enumerate(pieces) if only is None or m in only]
    if computed is None or len(computed) != len(pieces):
        computed = np.zeros(len(pieces), np.uint64)
        computed[chosen] = hash_all([pieces[k][3] for k in chosen], parallel)
    return [pieces[k][:3] for k in chosen if computed[k] != stored[k]]


def has_checksums(snapshot: KVCacheSnapshot) -> bool:
    return KEY in snapshot.metadata


def verify(snapshot: KVCacheSnapshot, what: str = "snapshot",
           computed: np.ndarray | None = None) -> None:
    """Raise ``ChecksumError`` naming the first damaged piece (and how many there are)
    unless every stored value matches its checksum; a snapshot without checksums is
    refused too (its values cannot be vouched for), and so is an entry that is not one
    digest per piece (said as such).  ``computed``: as for ``mismatches``."""
    if not has_checksums(snapshot):
        raise ChecksumError(f"{what} carries no {KEY} checksums", field=KEY,
                            rule="values verified before use")
    _raise_for(what, mismatches(snapshot, computed), snapshot)


def _entry_error(snapshot: KVCacheSnapshot, what: str) -> ChecksumError | None:
    """Why the entry is not one digest per piece, or None when it is: without this, every
    piece would be reported damaged, which a wrong count does not say."""
    text = str(snapshot.metadata.get(KEY, ""))
    count = sum(1 for _ in piece_views(snapshot))
    rule = f"{WIDTH} hex digits per checksummed piece, {count} pieces: {WIDTH * count} digits"
    if len(text) != WIDTH * count:
        found = f"{len(text) // WIDTH} digests" + (
            f" and {len(text) % WIDTH} hex digit(s) more" if len(text) % WIDTH else "")
        return ChecksumError(f"{what}: {KEY} holds {found} ({len(text)} characters) for "
                             f"{count} checksummed pieces; the number of digests must equal "
                             "the number of pieces", field=KEY, value=len(text) // WIDTH,
                             rule=rule)
    found = NOT_HEX.search(text)
    if found is not None:
        bad = found.start()
        return ChecksumError(f"{what}: {KEY} at character {bad} (digest {bad // WIDTH}): "
                             f"found {text[bad]!r}; a digest is {WIDTH} hex digits",
                             field=KEY, offset=bad, value=text[bad], rule=rule)
    return None


def check_entry(snapshot: KVCacheSnapshot, what: str = "snapshot") -> None:
    """Raise ``ChecksumError`` when the entry is not one digest per piece (a wrong count,
    a character that is not a hex digit): said as such, not as every piece damaged."""
    error = _entry_error(snapshot, what)
    if error is not None:
        raise error


def _raise_for(what: str, bad: list[tuple[str, int, int | None]],
               snapshot: KVCacheSnapshot) -> None:
    if bad:
        error = _entry_error(snapshot, what)
        if error is not None:
            raise error
        member, buf, page = bad[0]
        where = f"page {page} of " if page is not None else ""
        raise ChecksumError(f"{what}: {where}buffer {buf} of member {member} does not match "
                            f"its checksum ({len(bad)} damaged piece(s))", field=KEY,
                            value=f"{member}[{buf}]" + (f" page {page}" if page is not None
                                                        else ""),
                            rule="stored bytes equal those checksummed when written")


@dataclass
class Pending:
    """The checks of a snapshot's ``members`` that a reader left for later (``ReadPlan``'s
    ``skip``): the engine verifies each layer just before it writes that layer, on another
    core while the forward pass runs, so no unverified byte reaches its blocks and the
    hashing is off the load's path.  ``places`` are, per member, the ``(address, length,
    stored digest)`` columns of its pieces in the file's buffer (one compiled call a
    check, no Python per page)."""

    snapshot: KVCacheSnapshot
    what: str
    members: frozenset[str]
    places: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    keep: Any = None  # the buffer the addresses point into, alive as long as this

    def check(self, members: frozenset[str]) -> None:
        """Raise ``ChecksumError`` unless the pieces of ``members`` (those of them left for
        later) match their checksums."""
        wanted = members & self.members
        if not wanted:
            return
        parts = [self.places[m] for m in sorted(wanted) if m in self.places]
        if parts:
            addresses, lengths, stored = (np.concatenate(c) for c in zip(*parts, strict=True))
            compiled = page_hash.hasher()
            if compiled is not None:
                found = np.zeros(len(addresses), np.uint64)
                compiled(0, addresses, lengths, found)  # one core: the engine has the other
                if np.array_equal(found, stored):
                    return
        _raise_for(self.what, mismatches(self.snapshot, only=wanted, parallel=False),
                   self.snapshot)


def warm() -> None:
    """Compile the hasher ``ReadPlan.read`` uses (once a process, about half a second)."""
    compiled, reader = page_hash.hasher(), page_hash.reader()
    if compiled is not None and reader is not None:
        one, none = np.zeros(1, np.uint64), np.zeros(1, np.int64)
        compiled(np.zeros(8, np.uint8).ctypes.data, one, one, one)
        reader(-1, 0, none, none, one, one, one, none, 0, 0)


@dataclass(frozen=True)
class ReadPlan:
    """How to read a file of one structure and hash its checksum pieces in the same pass:
    ``edges`` cut the file into sub-ranges, none inside a piece; sub-range ``s`` holds the
    pieces ``starts[s]:starts[s + 1]`` of ``offsets`` and ``lengths`` (in file order,
    uint64 for the compiled hasher), whose indices in checksum order are ``order``;
    ``outside`` are the ``(index, member, buffer)`` of the small buffers a snapshot builds
    rather than views in the file (``seq_lens``), hashed from the snapshot by
    ``complete``; ``count``: all the pieces."""

    size: int
    edges: np.ndarray
    starts: np.ndarray
    order: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    outside: list[tuple[int, str, int]]
    count: int
    file_members: list[str]  # the member of each piece, in file order
    _skips: dict = field(default_factory=dict, compare=False, repr=False)

    # A sub-range is hashed right after the kernel copied it in: at 256 KiB it is still in
    # the core's L2 (34 GiB/s here; 22 at 1 MiB, 13 at 4 MiB).
    STEP = 256 << 10

    @classmethod
    def of(cls, snapshot: KVCacheSnapshot, data: memoryview) -> ReadPlan | None:
        """The plan for files laid out as ``data``, the bytes ``snapshot``'s buffers view;
        None when a piece is not a view of ``data`` (nothing to hash while reading)."""
        base = np.frombuffer(data, np.uint8).ctypes.data if len(data) else 0
        offsets, lengths, outside, inside, members = [], [], [], [], []
        for k, (member, buf, page, view) in enumerate(piece_views(snapshot)):
            members.append(member)
            at = np.frombuffer(view, np.uint8).ctypes.data - base if len(view) else 0
            if not 0 <= at <= at + len(view) <= len(data):
                if page is not None:
                    return None
                outside.append((k, member, buf))
                at = 0
            else:
                inside.append(k)
            offsets.append(at)
            lengths.append(len(view))
        order = sorted(inside, key=offsets.__getitem__)
        edges, starts, reach = [0], [0], 0
        for j, i in enumerate(order):
            if offsets[i] - edges[-1] >= cls.STEP and offsets[i] >= reach:
                edges.append(offsets[i])
                starts.append(j)
            reach = max(reach, offsets[i] + lengths[i])
        return cls(len(data), np.array([*edges, len(data)], np.int64),
                   np.array([*starts, len(order)], np.int64),
                   np.array(order, np.int64), np.array([offsets[i] for i in order], np.uint64),
                   np.array([lengths[i] for i in order], np.uint64), outside, len(offsets),
                   [members[i] for i in order])

    def _skipping(self, skip: frozenset[str]
                  ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The lengths to hash (0 for a piece of a skipped member), in file order, the
        checksum indices skipped, and each skipped member's pieces (file order)."""
        got = self._skips.get(skip)
        if got is None:
            mask = np.array([m in skip for m in self.file_members], bool)
            by_member: dict[str, list[int]] = {}
            for j in np.flatnonzero(mask).tolist():
                by_member.setdefault(self.file_members[j], []).append(j)
            got = self._skips[skip] = (
                np.where(mask, 0, self.lengths).astype(np.uint64), self.order[mask],
                {m: np.array(js, np.int64) for m, js in by_member.items()})
        return got

    def read(self, fd: int, view: memoryview, skip: frozenset[str] = frozenset()
             ) -> tuple[int, np.ndarray, float, np.ndarray]:
        """Fill ``view`` (``size`` bytes) from file ``fd`` in bands, one per core, hashing
        as it goes: the bytes read (fewer when the file is shorter), every piece's digest
        in checksum order, and the seconds hashing added to the read (the longest band's
        share), and the checksum indices of the pieces of ``skip`` members, left unhashed
        (``Pending``).  Compiled (``page_hash.reader``) where numba is, else the same steps
        in Python."""
        lengths, skipped, _ = self._skipping(skip) if skip else (self.lengths,
                                                                 self.order[:0], None)
        got = np.zeros(len(self.edges) - 1, np.int64)
        hashing: list[float] = []
        address = np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0
        sorted_digests = np.zeros(len(self.order), np.uint64)
        compiled = page_hash.reader()
        if compiled is not None:
            def band(first: int, stop: int) -> None:
                hashing.append(compiled(fd, address, self.edges, self.starts, self.offsets,
                                        lengths, sorted_digests, got, first, stop))
        else:
            def band(first: int, stop: int) -> None:
                spent = 0.0
                for s in range(first, stop):
                    pos, end = int(self.edges[s]), int(self.edges[s + 1])
                    while pos < end:
                        n = os.preadv(fd, [view[pos:end]], pos)
                        if n <= 0:
                            break
                        pos += n
                    got[s] = pos - self.edges[s]
                    if pos < end:
                        break
                    t = time.perf_counter()
                    for j in range(self.starts[s], self.starts[s + 1]):
                        at = int(self.offsets[j])
                        sorted_digests[j] = xxhash.xxh3_64_intdigest(
                            view[at:at + int(lengths[j])])
                    spent += time.perf_counter() - t
                hashing.append(spent)

        run_bands(band, len(got), self.size)
        found = np.zeros(self.count, np.uint64)
        found[self.order] = sorted_digests
        return int(got.sum()), found, max(hashing, default=0.0), skipped

    def hash_in_memory(self, data: memoryview, skip: frozenset[str]
                       ) -> tuple[np.ndarray, np.ndarray]:
        """``read``'s answer for a file whose bytes other than those of the ``skip``
        members are in ``data`` already (read with small reads: ``skip``'s pages are
        read and verified where they go, ``io.scatter``)."""
        lengths, skipped, _ = self._skipping(skip)
        base = np.frombuffer(data, np.uint8).ctypes.data if len(data) else 0
        compiled = page_hash.hasher()
        sorted_digests = np.zeros(len(self.order), np.uint64)
        if compiled is not None:
            compiled(base, self.offsets, lengths, sorted_digests)
        else:
            for j, (at, n) in enumerate(zip(self.offsets.tolist(), lengths.tolist(),
                                            strict=True)):
                sorted_digests[j] = xxhash.xxh3_64_intdigest(data[at:at + n])
        found = np.zeros(self.count, np.uint64)
        found[self.order] = sorted_digests
        return found, skipped

    def places(self, snapshot: KVCacheSnapshot, members: frozenset[str]
               ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
        """Per member of ``members``: its pieces' file offsets, lengths and stored
        digests (file order: a page pool's pages in order); None without stored
        digests."""
        stored = _stored(snapshot, self.count)
        if stored is None:
            return None
        return {m: (self.offsets[js], self.lengths[js], stored[self.order[js]])
                for m, js in self._skipping(members)[2].items()}

    def pending(self, snapshot: KVCacheSnapshot, data: memoryview, what: str,
                skip: frozenset[str]) -> Pending:
        """The checks ``read(..., skip)`` left, over ``data`` (the file's bytes)."""
        base = np.frombuffer(data, np.uint8).ctypes.data if len(data) else 0
        stored = _stored(snapshot, self.count)
        places = {}
        for member, js in self._skipping(skip)[2].items():
            if stored is not None:
                places[member] = (self.offsets[js] + np.uint64(base), self.lengths[js],
                                  stored[self.order[js]])
        return Pending(snapshot, what, skip, places, data)

    def complete(self, snapshot: KVCacheSnapshot, found: np.ndarray,
                 skipped: np.ndarray | None = None) -> np.ndarray:
        """``found`` (from ``read``) with the ``outside`` pieces hashed from ``snapshot``,
        the snapshot of the file read, and the ``skipped`` ones taken as stored (their
        check is a ``Pending``'s)."""
        if skipped is not None and len(skipped):
            stored = _stored(snapshot, self.count)
            if stored is not None:
                found[skipped] = stored[skipped]
        if self.outside:
            members = {name: bufs for name, _, bufs in snapshot.members()}
            for k, member, buf in self.outside:
                found[k] = xxhash.xxh3_64_intdigest(byte_view(members[member][buf]))
        return found


__all__ = ["DAMAGED", "KEY", "ChecksumError", "Pending", "PoolDigests", "ReadPlan",
           "check_entry", "digests", "has_checksums", "mismatches", "pieces", "verify",
           "with_checksums"]
