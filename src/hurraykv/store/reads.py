"""The page store's read path (floor 4): a manifest's pages fetched and put back into
their members' pools.

On a plain connection (``resp.py``) one get is one pipelined pass: the GETs of
``WINDOW`` bytes of pages are sent while the replies to the window before arrive, so
Redis always has the next GETs queued and never holds more than two windows of replies
for us; each reply is received by scatter reads straight into its page's row, and (a
hashed read) each page is hashed right after it lands, while it is still in the core's
cache.  The rows of every member are one buffer, recycled between gets when a
``ReadBuffers`` is given."""

from __future__ import annotations

import binascii
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from .. import alloc
from ..errors import StoreError
from ..io import page_hash
from ..paged import byte_view
from ..snapshot import KVCacheSnapshot
from ..wire.descriptor import TensorDescriptor
from ..wire.dtypes import BY_NAME
from ..wire.layouts import BlockPaged, Composite
from .buffers import ReadBuffers
from .capacity import MissingPagesError
from .members import ZERO
from .refs import BATCH_BYTES, Refs
from .resp import get as get_command
from .resp import open_wire
from .scripts import page_key

# GETs of this many bytes of pages in flight while the window before is received: big
# enough for many replies a system call, small enough that a window's replies and hashes
# stay in L2-to-L3 sized pieces and Redis buffers little
WINDOW = 1 << 20


# a page to receive: its digest, its row, the pool's bytes of the row (a checksum piece),
# the row's address (for the compiled hasher)
Job = tuple[bytes, memoryview, int, int]


@dataclass
class Hashed:
    """The xxh3-64 digests of every page a hashed read received, by member (``(layer,
    kv_role)``: one per page of its pool, the pool's part of a row under per-slot
    quantization), and the seconds hashing took."""

    pages: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)
    seconds: float = 0.0


def page_width(desc: TensorDescriptor) -> int:
    """Bytes a member's page occupies in the store: its pool row, plus its slots'
    scales and zero-points under per-block-affine quantization (D4)."""
    n = desc.layout.num_pages
    if not n:
        return 0
    width = desc.buffers[0].byte_size // n
    if desc.quantization is not None and desc.quantization.per_slot:
        width += sum(h.byte_size for h in desc.buffers[3:]) // n
    return width


def rounds(sizes: list[int], limit: int = BATCH_BYTES) -> list[tuple[int, int]]:
    """``[a, b)`` index ranges of about ``limit`` bytes each."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        acc += n + 64
        if acc >= limit:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def missing_error(snapshot_id: str, plan: list, missing: set[bytes]) -> MissingPagesError:
    """The error for pages gone from the store, naming the first one's layer and page."""
    for desc, _, ds, take in plan:
        for i, d in enumerate(ds):
            if take and d in missing:
                lay = desc.layout
                return MissingPagesError(
                    f"snapshot {snapshot_id!r}: layer {lay.layer_index} {lay.kv_role_name} "
                    f"page {i} ({page_key(d)}) is missing from the store (evicted or "
                    f"deleted; {len(missing)} page(s) in all)", field="page", value=i,
                    rule="every page a manifest names must be stored")
    return MissingPagesError(f"snapshot {snapshot_id!r}: {len(missing)} page(s) missing",
                             field="page")


def assemble(refs: Refs, snapshot_id: str, items: list, table: list[bytes],
             only_layer: int | None, buffers: ReadBuffers | None = None,
             hashed: Hashed | None = None) -> tuple[list, list]:
    """(non-page members, block-paged members) as ``(None, descriptor, buffers)``; the
    pages received into one buffer of ``buffers`` where given, and hashed into
    ``hashed`` where given."""
    plan = []
    pos = 0
    for desc, skeleton in items:
        if not isinstance(desc.layout, BlockPaged):
            continue
        n = desc.layout.num_pages
        ds = table[pos:pos + n]
        pos += n
        take = only_layer is None or desc.layout.layer_index == only_layer
        plan.append((desc, skeleton, ds, take))
    if pos != len(table):
        raise StoreError(f"manifest of {snapshot_id!r}: {len(table)} page digests for "
                         f"{pos} pages", field="manifest")
    taken = [(desc, skeleton, ds) for desc, skeleton, ds, take in plan if take]
    sizes = [_aligned(desc.layout.num_pages * page_width(desc)) for desc, _, _ in taken]
    block = buffers.take(sum(sizes)) if buffers is not None else None
    jobs: list[Job] = []
    members = []
    at = 0
    for (desc, skeleton, ds), size in zip(taken, sizes, strict=True):
        rows = rows_for(desc, ds, jobs, None if block is None else block[at:at + size])
        at += size
        members.append((desc, skeleton, ds, rows))
    landed = fetch(refs, snapshot_id, jobs, plan, hashed)
    if hashed is not None:
        zero: dict[int, int] = {}
        for desc, _, ds, _rows in members:
            pool = _pool_bytes(desc)
            if pool not in zero:
                zero[pool] = xxhash.xxh3_64_intdigest(bytes(pool))
            hashed.pages[(desc.layout.layer_index, desc.layout.kv_role_name)] = np.array(
                [zero[pool] if d == ZERO else landed[d] for d in ds], np.uint64)
    out = [(None, desc, member_buffers(desc, skeleton, ds, rows))
           for desc, skeleton, ds, rows in members]
    scalars = [(None, d, b) for d, b in items if not isinstance(d.layout, BlockPaged)
               and not isinstance(d.layout, Composite)]
    return scalars, out


def piece_digests(snapshot: KVCacheSnapshot, hashed: Hashed) -> np.ndarray:
    """The xxh3-64 digests of ``snapshot``'s checksum pieces, in the order of its
    ``checksum.xxh3_64`` entry (``io/checksums.py``: member by member, the info member
    left out, buffer by buffer, a pool page by page): the pool pages' from ``hashed``,
    every other buffer's (block tables, sequence pointers, parameters, a hybrid model's
    states: small) computed here."""
    out = []
    for name, desc, bufs in snapshot.members():
        if name == "info":
            continue
        for i, buf in enumerate(bufs):
            if i == 0 and isinstance(desc.layout, BlockPaged) and desc.layout.num_pages:
                out.append(hashed.pages[(desc.layout.layer_index, desc.layout.kv_role_name)])
            else:
                out.append(np.array([xxhash.xxh3_64_intdigest(byte_view(buf))], np.uint64))
    return np.concatenate(out) if out else np.zeros(0, np.uint64)


def _aligned(n: int) -> int:
    """``n`` rounded up to 64 bytes: each member's rows start on a cache line, aligned
    for any element type of its pool or parameters."""
    return -(-n // 64) * 64


def _pool_bytes(desc: TensorDescriptor) -> int:
    """Bytes of a page in the member's pool (a checksum piece): its row without the
    per-slot quantization parameters."""
    n = desc.layout.num_pages
    return desc.buffers[0].byte_size // n if n else 0


def rows_for(desc: TensorDescriptor, digests: list[bytes],
             jobs: list[Job], memory: np.ndarray | None = None
             ) -> np.ndarray:
    """The member's page rows (in ``memory``, at least their size, where given), each
    referenced one a job for ``fetch`` (the row's bytes, the pool's part of them)."""
    n, width = desc.layout.num_pages, page_width(desc)
    rows = alloc.empty((n, width), np.uint8) if memory is None else \
        memory[:n * width].reshape(n, width)
    flat = memoryview(rows.reshape(-1))  # a row a slice of it: cheaper than rows[i]
    pool = _pool_bytes(desc)
    base = rows.ctypes.data
    for i, d in enumerate(digests):
        if d == ZERO:
            rows[i] = 0  # a page no sequence references comes back as zeros
        else:
            at = i * width
            jobs.append((d, flat[at:at + width], pool, base + at))
    return rows


def _where(plan: list, digest: bytes) -> str:
    """``layer L ROLE page P`` of the first page of ``plan`` stored under ``digest``."""
    for desc, _, ds, take in plan:
        if take and digest in ds:
            lay = desc.layout
            return f"layer {lay.layer_index} {lay.kv_role_name} page {ds.index(digest)}"
    return "a page"


def _resized(snapshot_id: str, plan: list, digest: bytes, found: Any, width: int
             ) -> StoreError:
    return StoreError(f"snapshot {snapshot_id!r}: {_where(plan, digest)} "
                      f"({page_key(digest)}) holds {found} bytes, expected {width}",
                      field="page", value=found, rule="a page of the size its manifest says")


def fetch(refs: Refs, snapshot_id: str, jobs: list[Job],
          plan: list, hashed: Hashed | None = None) -> dict[bytes, int]:
    """Fill every job's row: each distinct page is fetched once, its GET reply received
    straight into its first row; later rows of the same page are copied from that one.
    A hashed read returns each page's xxh3-64 digest (of the row's first ``pool`` bytes)
    by page digest, computed as the page lands."""
    first: dict[bytes, memoryview] = {}
    fetch: list[Job] = []
    copies: list[tuple[memoryview, memoryview]] = []
    for job in jobs:
        d, row = job[0], job[1]
        if d in first:
            copies.append((row, first[d]))
        else:
            first[d] = row
            fetch.append(job)
    digests = np.zeros(len(fetch), np.uint64)
    hasher = _hasher(fetch, digests, hashed)
    missing: list[bytes] = []
    with open_wire(refs.client) as wire:
        if wire is None:
            missing = _fetch_pipelined(refs, snapshot_id, fetch, plan, hasher)
        else:
            windows = rounds([row.nbytes for _, row, _, _ in fetch], WINDOW)
            commands = _gets(fetch)
            if windows:
                wire.send([commands[slice(*windows[0])]])
            for k, (a, b) in enumerate(windows):
                if k + 1 < len(windows):  # queued before this window's replies are read
                    wire.send([commands[slice(*windows[k + 1])]])
                views = [row for _, row, _, _ in fetch[a:b]]
                landed = None if hasher is None else hasher(a, views)
                try:
                    missing += [fetch[a + i][0] for i in wire.bulks_into(views, landed)]
                except StoreError as e:
                    if e.field != "page" or e.offset is None:
                        raise
                    raise _resized(snapshot_id, plan, fetch[a + e.offset][0],
                                   e.value, views[e.offset].nbytes) from None
    if missing:
        raise missing_error(snapshot_id, plan, set(missing))
    for row, src in copies:
        row[:] = src
    return {} if hashed is None else dict(zip([d for d, _, _, _ in fetch], digests.tolist(),
                                              strict=True))


def _gets(fetch: list[Job]) -> np.ndarray:
    """The GET command of every page of ``fetch``, one a row: page keys are all of one
    length, so the commands are one template with each digest's hex put in place (no
    Python per page)."""
    probe = bytes(range(16))
    template = get_command(page_key(probe))
    at = template.index(probe.hex().encode())
    out = np.tile(np.frombuffer(template, np.uint8), (len(fetch), 1))
    out[:, at:at + 32] = np.frombuffer(
        binascii.hexlify(b"".join([d for d, _, _, _ in fetch])), np.uint8).reshape(-1, 32)
    return out


def _hasher(fetch: list[Job], digests: np.ndarray, hashed: Hashed | None
            ) -> Callable[[int, list[memoryview]], Any] | None:
    """``hasher(a, views)``: the ``landed(x, y)`` of the window of ``fetch`` from page
    ``a`` on received into ``views``: pages ``a + x`` to ``a + y - 1`` have landed, and
    their digests are taken at once, while they are in cache (None: a read that hashes
    nothing).  With the compiled hasher (``io/page_hash.py``, once the process has built
    it, as the vLLM connector does at start) one call hashes them all, 2.5x faster than
    ``xxhash`` page by page here (it picks the CPU's widest vectors)."""
    if hashed is None:
        return None
    clock = time.perf_counter
    compiled = page_hash.hasher() if page_hash.built() else None
    if compiled is not None:
        addresses = np.array([job[3] for job in fetch], np.uint64)
        lengths = np.array([job[2] for job in fetch], np.uint64)

        def hasher(a: int, views: list[memoryview]) -> Callable[[int, int], None]:
            def landed(x: int, y: int) -> None:
                started = clock()
                compiled(0, addresses[a + x:a + y], lengths[a + x:a + y],
                         digests[a + x:a + y])
                hashed.seconds += clock() - started
            return landed
        return hasher
    digest = xxhash.xxh3_64_intdigest

    def hasher(a: int, views: list[memoryview]) -> Callable[[int, int], None]:
        def landed(x: int, y: int) -> None:
            started = clock()
            for i in range(x, y):
                pool = fetch[a + i][2]
                view = views[i]
                digests[a + i] = digest(view if pool == view.nbytes else view[:pool])
            hashed.seconds += clock() - started
        return landed
    return hasher


def _fetch_pipelined(refs: Refs, snapshot_id: str, fetch: list[Job],
                     plan: list, hasher: Callable[[int, list[memoryview]], Any] | None
                     ) -> list[bytes]:
    """``fetch``'s pages through redis-py pipelines (a cluster, TLS), BATCH_BYTES a round
    trip, each copied into its row; the digests of those missing."""
    missing = []
    for a, b in rounds([row.nbytes for _, row, _, _ in fetch]):
        batch = fetch[a:b]
        values = refs.batched([d for d, _, _, _ in batch], [0] * len(batch),
                              lambda p, d: p.get(page_key(d)))
        for i, ((d, row, _, _), v) in enumerate(zip(batch, values, strict=True)):
            if v is None:
                missing.append(d)
            elif len(v) != row.nbytes:
                raise _resized(snapshot_id, plan, d, len(v), row.nbytes)
            else:
                row[:] = v
                if hasher is not None:
                    hasher(a + i, [row])(0, 1)
    return missing


def member_buffers(desc: TensorDescriptor, skeleton: list, digests: list[bytes],
                    rows: np.ndarray) -> list[Any]:
    layout = desc.layout
    n = layout.num_pages
    row = desc.buffers[0].byte_size // n if n else 0
    width = rows.shape[1]
    q = desc.quantization
    present = np.array([d != ZERO for d in digests], bool)
    buffers = [rows[:, :row].reshape(-1) if width == row else
               np.ascontiguousarray(rows[:, :row]).reshape(-1), *skeleton[:2]]
    if q is None or not q.per_slot:
        return buffers + skeleton[2:]
    # Per-page-slot parameters (D4): scales, then zero-points, after each page's bytes.
    ps = layout.page_size
    scale_np = BY_NAME[q.scale_dtype].numpy
    sw = scale_np.itemsize * ps
    scales = np.array(rows[:, row:row + sw])  # a writable copy
    scales.view(scale_np)[~present] = 1.0  # pages no sequence reads: a valid scale
    zps = np.ascontiguousarray(rows[:, row + sw:width])
    if q.zero_point_buffer is not None and q.zero_point_buffer == q.scale_buffer:
        return [*buffers, np.concatenate([scales.reshape(-1), zps.reshape(-1)])]
    return [*buffers, scales.reshape(-1)] + ([zps.reshape(-1)] if zps.size else [])
