"""The page store's read path (floor 4): a manifest's pages fetched and put back into
their members' pools."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import alloc
from ..errors import StoreError
from ..wire.descriptor import TensorDescriptor
from ..wire.dtypes import BY_NAME
from ..wire.layouts import BlockPaged, Composite
from .capacity import MissingPagesError
from .members import ZERO
from .refs import BATCH_BYTES, Refs
from .resp import get as get_command
from .resp import open_wire
from .scripts import page_key


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


def rounds(sizes: list[int]) -> list[tuple[int, int]]:
    """``[a, b)`` index ranges of about BATCH_BYTES each."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        acc += n + 64
        if acc >= BATCH_BYTES:
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
             only_layer: int | None) -> tuple[list, list]:
    """(non-page members, block-paged members) as ``(None, descriptor, buffers)``."""
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
    jobs: list[tuple[bytes, np.ndarray]] = []
    members = []
    for desc, skeleton, ds, take in plan:
        if take:
            rows = rows_for(desc, ds, jobs)
            members.append((desc, skeleton, ds, rows))
    fetch(refs, snapshot_id, jobs, plan)
    out = [(None, desc, member_buffers(desc, skeleton, ds, rows))
           for desc, skeleton, ds, rows in members]
    scalars = [(None, d, b) for d, b in items if not isinstance(d.layout, BlockPaged)
               and not isinstance(d.layout, Composite)]
    return scalars, out


def rows_for(desc: TensorDescriptor, digests: list[bytes],
             jobs: list[tuple[bytes, np.ndarray]]) -> np.ndarray:
    """The member's page rows, each referenced one a job for ``fetch``."""
    rows = alloc.empty((desc.layout.num_pages, page_width(desc)), np.uint8)
    for i, d in enumerate(digests):
        if d == ZERO:
            rows[i] = 0  # a page no sequence references comes back as zeros
        else:
            jobs.append((d, rows[i]))
    return rows


def fetch(refs: Refs, snapshot_id: str, jobs: list[tuple[bytes, np.ndarray]], plan: list
          ) -> None:
    """Fill every job's row: each distinct page is fetched once, its GET reply received
    straight into its first row (BATCH_BYTES per round trip); later rows of the same
    page are copied from that one."""
    first: dict[bytes, np.ndarray] = {}
    fetch: list[tuple[bytes, np.ndarray]] = []
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    for d, row in jobs:
        if d in first:
            copies.append((row, first[d]))
        else:
            first[d] = row
            fetch.append((d, row))
    missing: list[bytes] = []
    with open_wire(refs.client) as wire:
        for a, b in rounds([row.nbytes for _, row in fetch]):
            batch = fetch[a:b]
            if wire is None:
                values = refs.batched([d for d, _ in batch], [0] * len(batch),
                                      lambda p, d: p.get(page_key(d)))
                for (d, row), v in zip(batch, values, strict=True):
                    if v is None:
                        missing.append(d)
                    elif len(v) != row.nbytes:
                        raise StoreError(f"snapshot {snapshot_id!r}: page {page_key(d)} "
                                         f"holds {len(v)} bytes, expected {row.nbytes}",
                                         field="page", value=len(v))
                    else:
                        row[...] = np.frombuffer(v, np.uint8)
                continue
            wire.send([get_command(page_key(d)) for d, _ in batch])
            for d, row in batch:
                if not wire.bulk_into(memoryview(row)):
                    missing.append(d)
    if missing:
        raise missing_error(snapshot_id, plan, set(missing))
    for row, src in copies:
        row[...] = src


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
