"""The page store's write path (floor 4): pages stored and referenced, releases of
replaced and deleted manifests completed, the prefix index kept.

A manifest's release is a pending entry (``hkv:d:{id}``: generation -> ``r`` or ``d`` +
the manifest's bytes) made in the same atomic step that replaced or removed the manifest.
Anyone may complete it, any number of times: each page's reference to that generation is
dropped (idempotent), then the entry is deleted; whoever deletes it accounts its logical
bytes (and, for a deleted snapshot, its prefix entries and the snapshot count).  A client
killed at any point leaves either the entry (completed by the next put or delete of the
id, or by ``fsck``) or nothing; never a count dropped twice.  At Redis's memory limit the
statistics and prefix-index writes are skipped where Redis refuses them (``capacity.py``):
a release only shrinks memory, so it completes there too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import StoreError
from ..snapshot import KVCacheSnapshot, SnapshotAssembler
from ..wire.layouts import BlockPaged
from .capacity import best_effort
from .manifest import parse_manifest, prefix_value, split_tokens, token_chains
from .members import ZERO
from .reads import page_width
from .refs import BATCH_BYTES, Refs
from .resp import mset, open_wire
from .scripts import PAGE_SIZES, STATS, page_key, pending_key, prefix_key

MSET_BYTES = 1 << 20  # page bytes per MSET


def logical_bytes(items: list, table: list[bytes]) -> int:
    """Bytes of the pages a manifest's members reference, as each member holds them."""
    total = pos = 0
    for desc, _ in items:
        if isinstance(desc.layout, BlockPaged):
            n = desc.layout.num_pages
            total += page_width(desc) * sum(1 for d in table[pos:pos + n] if d != ZERO)
            pos += n
    return total


def store_pages(refs: Refs, snapshot_id: str, values: dict[bytes, memoryview],
                generation: bytes, written: set[bytes]) -> tuple[int, int]:
    """Add ``generation``'s reference to each page, storing the pages Redis lacks (added
    to ``written`` before they are sent); returns the pages and bytes newly stored (those
    it was the first reference of)."""
    keys = list(values)
    exists = refs.exists_all(keys)
    todo = [d for d, e in zip(keys, exists, strict=True) if not e]
    counted = [d for d, e in zip(keys, exists, strict=True) if e]
    new_bytes = new_pages = 0
    for _attempt in range(5):
        # store the missing pages' bytes (a racing writer's copy is identical)
        written.update(todo)
        set_pages(refs, todo, values)
        owners = refs.add_all(counted + todo, generation)
        for d, n in zip(counted + todo, owners, strict=True):
            if n == 1:
                new_pages += 1
                new_bytes += values[d].nbytes
        todo = [d for d, n in zip(counted + todo, owners, strict=True) if n == 0]
        counted = []
        if not todo:
            return new_pages, new_bytes
    raise StoreError(f"pages of {snapshot_id!r} kept vanishing while being stored "
                     f"({len(todo)} after 5 attempts: concurrent deletes, or Redis evicting "
                     "them under maxmemory as fast as they are written: the store is too small "
                     "for this snapshot)", field="page", value=len(todo),
                     rule="a page must stay stored until its reference is added")


def set_pages(refs: Refs, digests: list[bytes], values: dict[bytes, memoryview]) -> None:
    """Page bytes under their keys: MSETs of ~1 MiB sent straight from the pages'
    memory, BATCH_BYTES per round trip (redis-py pipelines where that cannot be)."""
    with open_wire(refs.client) as wire:
        if wire is None:
            refs.batched(digests, [values[d].nbytes for d in digests],
                         lambda p, d: p.set(page_key(d), values[d]))
            return
        parts: list[Any] = []
        group: list[bytes] = []
        pending = group_bytes = commands = 0
        for i, d in enumerate(digests):
            group.append(d)
            group_bytes += values[d].nbytes
            if group_bytes >= MSET_BYTES or i == len(digests) - 1:
                parts += mset([page_key(g) for g in group], [values[g] for g in group])
                commands += 1
                pending += group_bytes
                group, group_bytes = [], 0
                if pending >= BATCH_BYTES or i == len(digests) - 1:
                    wire.send(parts)
                    for _ in range(commands):
                        wire.simple()
                    parts, pending, commands = [], 0, 0


def drain(refs: Refs, snapshot_id: str) -> list[bytes]:
    """Complete every pending release of ``snapshot_id``; returns the kinds (``b"r"``,
    ``b"d"``) of the entries found."""
    key = pending_key(snapshot_id)
    entries = refs.client.hgetall(key)
    for generation, value in entries.items():
        kind, raw = value[:1], value[1:]
        items, table, tokens = parse_manifest(snapshot_id, raw)
        distinct = list(dict.fromkeys(d for d in table if d != ZERO))
        pipe = refs.release(distinct, generation)
        pipe.hdel(key, generation)
        if not best_effort(pipe)[-1]:  # HDEL only shrinks memory: never refused
            continue  # another client completed this release first
        pipe = refs.pipe()
        pipe.hincrby(STATS, "logical_bytes", -logical_bytes(items, table))
        if kind == b"d":
            pipe.hincrby(STATS, "snapshots", -1)
        best_effort(pipe)
        if kind == b"d" and tokens:
            unindex(refs, snapshot_id, items, tokens, generation)
    return [value[:1] for value in entries.values()]


def index_prefixes(refs: Refs, snapshot_id: str, snapshot: KVCacheSnapshot, token_ids: Any,
                   generation: bytes) -> None:
    """Prefix-index entries of every full page of each sequence's tokens; entries Redis
    refuses at its memory limit are left out (lookups miss them, as evicted ones)."""
    pipe = refs.pipe()
    pipe.sadd(PAGE_SIZES, snapshot.page_size)
    for s, tokens in enumerate(split_tokens(snapshot, token_ids)):
        for k, chain in enumerate(token_chains(tokens, snapshot.page_size)):
            pipe.set(prefix_key(chain), prefix_value(snapshot_id, s,
                                                      (k + 1) * snapshot.page_size, generation))
    best_effort(pipe)


def unindex(refs: Refs, snapshot_id: str, items: list, tokens: bytes, generation: bytes
            ) -> None:
    asm = SnapshotAssembler()
    for desc, bufs in items:
        if not isinstance(desc.layout, BlockPaged):
            asm.add(desc, bufs)
    seq_lens = asm.seq_lens
    if seq_lens is None:  # not a manifest put() wrote; lookup_prefix skips dead ids anyway
        return
    page_size = next(d.layout.page_size for d, _ in items if isinstance(d.layout, BlockPaged))
    ids = np.frombuffer(tokens, "<i8")
    pipe = refs.pipe()
    del_if = refs.scripts["del_if"]
    for s, seq in enumerate(np.split(ids, np.cumsum(seq_lens)[:-1])):
        for k, chain in enumerate(token_chains(seq, page_size)):
            value = prefix_value(snapshot_id, s, (k + 1) * page_size, generation)
            del_if(keys=[prefix_key(chain)], args=[value], client=pipe)
            # as written before entries carried the generation
            del_if(keys=[prefix_key(chain)], args=[value[:-len(generation)]], client=pipe)
    pipe.execute()
