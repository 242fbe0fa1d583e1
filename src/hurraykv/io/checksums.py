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
does not know it ignores it; ``verify`` recomputes it.  xxh3-64 (the ``xxhash`` package)
reads at the speed of a copy here (10.8 GiB/s; hardware CRC-32C 11.4 GiB/s needs an LGPL
package, BLAKE3 4.6, zlib's CRC-32 3.7): one more pass over the bytes a load reads.
"""

from __future__ import annotations

from collections.abc import Iterator

import xxhash

from ..errors import HurrayError
from ..paged import byte_view
from ..snapshot import KVCacheSnapshot
from ..wire.layouts import BlockPaged

KEY = "checksum.xxh3_64"  # the "hurraykv." prefix is reserved for the KV section's own keys
WIDTH = 16  # hex characters per digest


class ChecksumError(HurrayError):
    """Stored values that do not match the checksums written with them."""


def _pieces(snapshot: KVCacheSnapshot) -> Iterator[tuple[str, int, int | None, memoryview]]:
    """``(member, buffer, page or None, bytes)`` in checksum order."""
    for name, desc, bufs in snapshot.members():
        if name == "info":
            continue
        for i, buf in enumerate(bufs):
            view = byte_view(buf)
            if i == 0 and isinstance(desc.layout, BlockPaged) and desc.layout.num_pages:
                step = len(view) // desc.layout.num_pages
                for page in range(desc.layout.num_pages):
                    yield name, i, page, view[page * step:(page + 1) * step]
            else:
                yield name, i, None, view


def digests(snapshot: KVCacheSnapshot) -> str:
    """The checksum entry's value for ``snapshot``."""
    return "".join(f"{xxhash.xxh3_64_intdigest(v):016x}" for *_, v in _pieces(snapshot))


def with_checksums(snapshot: KVCacheSnapshot) -> KVCacheSnapshot:
    """``snapshot`` (nothing copied) with its checksum entry."""
    return snapshot.with_info(metadata={KEY: digests(snapshot)})


def mismatches(snapshot: KVCacheSnapshot) -> list[tuple[str, int, int | None]]:
    """``(member, buffer, page)`` of every piece whose bytes do not match the stored
    checksums (every piece, when their number does not); [] when they all match.
    A snapshot without checksums has nothing to compare: ``has_checksums`` says."""
    stored = str(snapshot.metadata.get(KEY, ""))
    pieces = list(_pieces(snapshot))
    if len(stored) != WIDTH * len(pieces):
        return [(m, b, p) for m, b, p, _ in pieces]
    return [(m, b, p) for k, (m, b, p, v) in enumerate(pieces)
            if stored[k * WIDTH:(k + 1) * WIDTH] != f"{xxhash.xxh3_64_intdigest(v):016x}"]


def has_checksums(snapshot: KVCacheSnapshot) -> bool:
    return KEY in snapshot.metadata


def verify(snapshot: KVCacheSnapshot, what: str = "snapshot") -> None:
    """Raise ``ChecksumError`` naming the first damaged piece (and how many there are)
    unless every stored value matches its checksum; a snapshot without checksums is
    refused too (its values cannot be vouched for)."""
    if not has_checksums(snapshot):
        raise ChecksumError(f"{what} carries no {KEY} checksums", field=KEY,
                            rule="values verified before use")
    bad = mismatches(snapshot)
    if bad:
        member, buf, page = bad[0]
        where = f"page {page} of " if page is not None else ""
        raise ChecksumError(f"{what}: {where}buffer {buf} of member {member} does not match "
                            f"its checksum ({len(bad)} damaged piece(s))", field=KEY,
                            value=f"{member}[{buf}]" + (f" page {page}" if page is not None
                                                        else ""),
                            rule="stored bytes equal those checksummed when written")


__all__ = ["KEY", "ChecksumError", "digests", "has_checksums", "mismatches", "verify",
           "with_checksums"]
