"""PageStore: KV snapshots in Redis or Valkey, every distinct page stored once.

Keys (``{...}`` is a cluster hash tag):

* ``hkv:p:{H}`` - one page: its bytes in the pool, followed (per-block-affine
  quantization) by its ``page_size`` scales and zero-points.  ``H`` is a 128-bit
  (truncated SHA-256) digest of the page's geometry (element type, page_size, heads, head_dim, the
  quantization section) and its bytes, so identical pages of any sequence, layer or
  snapshot share one key.  Pages spread evenly over the cluster's slots by their digest.
* ``hkv:r:{H}`` - the page's reference count (snapshots naming it), in the page's slot so
  one Lua script updates both atomically.
* ``hkv:m:{id}`` - a snapshot's manifest (below).
* ``hkv:x:{C}`` - prefix index: ``C`` chains a digest over each full page of token ids;
  the value names the snapshot, sequence and token count that end there.
* ``hkv:stats`` - ``logical_bytes`` (pages as each snapshot holds them), ``stored_bytes``
  and ``pages`` (distinct pages stored), ``snapshots``.

Manifest: ``"HKVM" | u32 version (1) | u64 n | n Hurray bytes | u64 n | page digests
(16 bytes each, all zero for a page no sequence references) | u64 n | token ids``.  The
Hurray bytes are the snapshot's group head, ``seq_lens``, ``kv_scales`` and the info
member (model and metadata) as stream tensors, then each block-paged member's
descriptor followed by its non-page buffers
(block_table, seq_ptr, per-tensor/per-channel parameters) in table order - everything of
the snapshot but the pages.  Token ids are int64, sequences back to back.

Unused page slots are zeroed before pages are hashed and stored (better sharing, and
nothing stale leaves the process); pages no sequence references are not stored and come
back as zeros.  A page that has gone missing (deleted, evicted) makes ``get`` fail with an
error naming the snapshot, layer and page - never wrong data.

Pages travel on the raw path of ``resp.py`` (MSETs gathered from the pool's memory, GET
replies received into the rows being rebuilt) where the connection allows, else in
redis-py pipelines.  ``members.py`` digests pages, ``manifest.py`` encodes manifests and
prefix values, ``scripts.py`` holds the keys and the reference-counting Lua.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import alloc
from ..errors import StoreError, require
from ..paged import BlockPagedTensor
from ..snapshot import (
    KVCacheSnapshot,
    SnapshotAssembler,
)
from ..threads import executor
from ..wire.descriptor import TensorDescriptor
from ..wire.dtypes import BY_NAME
from ..wire.layouts import BlockPaged, Composite
from ..wire.quantization import SCALE_TYPES, PerBlockAffine
from . import resp
from .manifest import (
    encode_manifest,
    parse_manifest,
    parse_prefix_value,
    prefix_value,
    split_tokens,
    token_chains,
)
from .members import ZERO, Member
from .scripts import (
    _DECREF,
    _DEL_IF,
    _EXISTS_MANY,
    _INCREF,
    _INCREF_MANY,
    MANY,
    Script,
    manifest_key,
    page_key,
    prefix_key,
    ref_key,
)

BATCH_BYTES = 64 << 20  # bytes per pipeline round trip
MSET_BYTES = 1 << 20  # page bytes per MSET
STATS = "hkv:stats"
PAGE_SIZES = "hkv:page_sizes"

def _page_width(desc: TensorDescriptor) -> int:
    """Bytes a member's page occupies in the store: its pool row, plus its slots'
    scales and zero-points under per-block-affine quantization (D4)."""
    n = desc.layout.num_pages
    if not n:
        return 0
    width = desc.buffers[0].byte_size // n
    if isinstance(desc.quantization, PerBlockAffine):
        width += sum(h.byte_size for h in desc.buffers[3:]) // n
    return width


def _rounds(sizes: list[int]) -> list[tuple[int, int]]:
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


def _missing(snapshot_id: str, plan: list, missing: set[bytes]) -> StoreError:
    """The error for pages gone from the store, naming the first one's layer and page."""
    for desc, _, ds, take in plan:
        for i, d in enumerate(ds):
            if take and d in missing:
                lay = desc.layout
                return StoreError(
                    f"snapshot {snapshot_id!r}: layer {lay.layer_index} {lay.kv_role_name} "
                    f"page {i} ({page_key(d)}) is missing from the store (evicted or "
                    f"deleted; {len(missing)} page(s) in all)", field="page", value=i,
                    rule="every page a manifest names must be stored")
    return StoreError(f"snapshot {snapshot_id!r}: {len(missing)} page(s) missing",
                      field="page")


class PageStore:
    """Snapshots in Redis/Valkey with page-level deduplication and prefix lookup."""

    def __init__(self, client: Any, *, zero_unused: bool = True) -> None:
        self.client = client
        self.zero_unused = zero_unused
        self._scripts = {name: Script(client, lua) for name, lua in (
            ("incref", _INCREF), ("incref_many", _INCREF_MANY),
            ("exists_many", _EXISTS_MANY), ("decref", _DECREF), ("del_if", _DEL_IF))}
        self._cluster = hasattr(client, "get_primaries")
        self._incref = self._scripts["incref"]
        self._decref = self._scripts["decref"]
        self._del_if = self._scripts["del_if"]

    @classmethod
    def from_url(cls, url: str, *, cluster: bool | None = None, **kw: Any) -> PageStore:
        """``redis://HOST:PORT`` (one server) or ``redis+cluster://HOST:PORT``."""
        redis = require("redis", "redis", "the Redis page store")
        from redis.cluster import RedisCluster

        if url.startswith("redis+cluster://") or cluster:
            return cls(RedisCluster.from_url(url.replace("redis+cluster://", "redis://")), **kw)
        return cls(redis.Redis.from_url(url), **kw)

    # -- pipelines ---------------------------------------------------------------------
    def _pipe(self) -> Any:
        return self.client.pipeline(transaction=False)

    def _batched(self, keys: Sequence[Any], sizes: Sequence[int], run) -> list[Any]:
        """Run ``run(pipe, key)`` for every key in pipelines of ~BATCH_BYTES each."""
        out: list[Any] = []
        pipe, pending = self._pipe(), 0
        for key, size in zip(keys, sizes, strict=True):
            run(pipe, key)
            pending += size + 64
            if pending >= BATCH_BYTES:
                out += pipe.execute()
                pipe, pending = self._pipe(), 0
        out += pipe.execute()
        return out

    # -- put ---------------------------------------------------------------------------
    def put(self, snapshot_id: str, snapshot: KVCacheSnapshot,
            token_ids: Sequence[Any] | np.ndarray | None = None) -> dict[str, int]:
        """Store a snapshot (replacing one under the same id); returns byte counts."""
        if snapshot.seq_lens is None:
            raise StoreError("a snapshot without seq_lens cannot be stored", field="seq_lens")
        members = [Member(snapshot.tensor(*k), self.zero_unused)
                   for k in snapshot.member_keys()]
        # Members are hashed on worker threads (hashlib releases the GIL) while the pages
        # of the members already hashed travel to Redis: hashing overlaps the network.
        futures = [executor().submit(m.digests) for m in members]
        digests: list[list[bytes]] = []
        seen: set[bytes] = set()
        logical = new_bytes = new_pages = 0
        for m, future in zip(members, futures, strict=True):
            ds = future.result()
            digests.append(ds)
            batch: dict[bytes, memoryview] = {}
            for i, d in enumerate(ds):
                if d != ZERO:
                    logical += m.rows.shape[1]
                    if d not in seen:
                        seen.add(d)
                        batch[d] = memoryview(m.rows[i])
            pages, nbytes = self._store_pages(snapshot_id, batch)
            new_pages += pages
            new_bytes += nbytes
        manifest = encode_manifest(snapshot, members, digests, token_ids)
        old = self.client.get(manifest_key(snapshot_id))
        pipe = self._pipe()
        pipe.set(manifest_key(snapshot_id), manifest)
        pipe.hincrby(STATS, "logical_bytes", logical)
        pipe.hincrby(STATS, "stored_bytes", new_bytes)
        pipe.hincrby(STATS, "pages", new_pages)
        if old is None:
            pipe.hincrby(STATS, "snapshots", 1)
        pipe.execute()
        if old is not None:  # the replaced snapshot's references go only now
            self._release(snapshot_id, old, keep_manifest=True)
        if token_ids is not None:
            self._index_prefixes(snapshot_id, snapshot, token_ids)
        return {"logical_bytes": logical, "new_bytes": new_bytes, "new_pages": new_pages,
                "pages": len(seen)}

    def _exists_all(self, digests: list[bytes]) -> list[int]:
        if self._cluster:
            return self._batched(digests, [0] * len(digests),
                                 lambda p, d: p.exists(page_key(d)))
        groups = [digests[a:a + MANY] for a in range(0, len(digests), MANY)]
        many = self._scripts["exists_many"]
        out = self._batched(groups, [0] * len(groups), lambda p, g: many(
            keys=[page_key(d) for d in g], client=p))
        return [int(n) for group in out for n in group]

    def _incref_all(self, digests: list[bytes]) -> list[int]:
        """New reference counts (0: the page is gone).  A cluster needs one script call per
        page (its keys share a slot); a single server takes hundreds per call."""
        if self._cluster:
            return self._batched(digests, [0] * len(digests), lambda p, d: self._incref(
                keys=[page_key(d), ref_key(d)], client=p))
        groups = [digests[a:a + MANY] for a in range(0, len(digests), MANY)]
        many = self._scripts["incref_many"]
        out = self._batched(groups, [0] * len(groups), lambda p, g: many(
            keys=[k for d in g for k in (page_key(d), ref_key(d))], client=p))
        return [int(n) for group in out for n in group]

    def _store_pages(self, snapshot_id: str, values: dict[bytes, memoryview]
                     ) -> tuple[int, int]:
        """Count one reference to each page, storing the pages Redis lacks; returns the
        pages and bytes newly stored (those whose count went from 0 to 1)."""
        keys = list(values)
        exists = self._exists_all(keys)
        todo = [d for d, e in zip(keys, exists, strict=True) if not e]
        counted = [d for d, e in zip(keys, exists, strict=True) if e]
        new_bytes = new_pages = 0
        for _attempt in range(5):
            # store the missing pages' bytes (a racing writer's copy is identical)
            self._set_pages(todo, values)
            refs = self._incref_all(counted + todo)
            for d, n in zip(counted + todo, refs, strict=True):
                if n == 1:
                    new_pages += 1
                    new_bytes += values[d].nbytes
            todo = [d for d, n in zip(counted + todo, refs, strict=True) if n == 0]
            counted = []
            if not todo:
                return new_pages, new_bytes
        raise StoreError(f"pages of {snapshot_id!r} kept vanishing while being stored "
                         "(concurrent deletes)", field="page")

    def _set_pages(self, digests: list[bytes], values: dict[bytes, memoryview]) -> None:
        """Page bytes under their keys: MSETs of ~1 MiB sent straight from the pages'
        memory, BATCH_BYTES per round trip (redis-py pipelines where that cannot be)."""
        with resp.open_wire(self.client) as wire:
            if wire is None:
                self._batched(digests, [values[d].nbytes for d in digests],
                              lambda p, d: p.set(page_key(d), values[d]))
                return
            parts: list[Any] = []
            group: list[bytes] = []
            pending = group_bytes = commands = 0
            for i, d in enumerate(digests):
                group.append(d)
                group_bytes += values[d].nbytes
                if group_bytes >= MSET_BYTES or i == len(digests) - 1:
                    parts += resp.mset([page_key(g) for g in group], [values[g] for g in group])
                    commands += 1
                    pending += group_bytes
                    group, group_bytes = [], 0
                    if pending >= BATCH_BYTES or i == len(digests) - 1:
                        wire.send(parts)
                        for _ in range(commands):
                            wire.simple()
                        parts, pending, commands = [], 0, 0

    def _index_prefixes(self, snapshot_id: str, snapshot: KVCacheSnapshot, token_ids: Any
                        ) -> None:
        pipe = self._pipe()
        pipe.sadd(PAGE_SIZES, snapshot.page_size)
        for s, tokens in enumerate(split_tokens(snapshot, token_ids)):
            for k, chain in enumerate(token_chains(tokens, snapshot.page_size)):
                pipe.set(prefix_key(chain), prefix_value(snapshot_id, s,
                                                          (k + 1) * snapshot.page_size))
        pipe.execute()

    # -- get ---------------------------------------------------------------------------
    def _load_manifest(self, snapshot_id: str) -> tuple[list, list[bytes], bytes]:
        raw = self.client.get(manifest_key(snapshot_id))
        if raw is None:
            raise StoreError(f"no snapshot {snapshot_id!r} in the store", field="snapshot_id",
                             value=snapshot_id)
        return parse_manifest(snapshot_id, raw)

    def get(self, snapshot_id: str) -> KVCacheSnapshot:
        """The snapshot, pages fetched with pipelined reads and put back into their pools."""
        items, table, _ = self._load_manifest(snapshot_id)
        scalars, members = self._assemble(snapshot_id, items, table, None)
        return KVCacheSnapshot.from_members(scalars + members)

    def get_layer(self, snapshot_id: str, layer: int) -> tuple[BlockPagedTensor, ...]:
        """One layer's tensors (key, value), fetching only that layer's pages."""
        items, table, _ = self._load_manifest(snapshot_id)
        scalars, members = self._assemble(snapshot_id, items, table, layer)
        if not members:
            raise StoreError(f"snapshot {snapshot_id!r} has no layer {layer}", field="layer",
                             value=layer)
        asm = SnapshotAssembler()
        done = [asm.add(desc, bufs) for _, desc, bufs in scalars + members]
        if done[-1] is None:
            raise StoreError(f"snapshot {snapshot_id!r}: layer {layer} lacks one of its roles",
                             field="kv_role", value=layer)
        return done[-1][1]

    def _assemble(self, snapshot_id: str, items: list, table: list[bytes],
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
                rows = self._rows_for(desc, ds, jobs)
                members.append((desc, skeleton, ds, rows))
        self._fetch(snapshot_id, jobs, plan)
        out = [(None, desc, self._member_buffers(desc, skeleton, ds, rows))
               for desc, skeleton, ds, rows in members]
        scalars = [(None, d, b) for d, b in items if not isinstance(d.layout, BlockPaged)
                   and not isinstance(d.layout, Composite)]
        return scalars, out

    @staticmethod
    def _rows_for(desc: TensorDescriptor, digests: list[bytes],
                  jobs: list[tuple[bytes, np.ndarray]]) -> np.ndarray:
        """The member's page rows, each referenced one a job for ``_fetch``."""
        rows = alloc.empty((desc.layout.num_pages, _page_width(desc)), np.uint8)
        for i, d in enumerate(digests):
            if d == ZERO:
                rows[i] = 0  # a page no sequence references comes back as zeros
            else:
                jobs.append((d, rows[i]))
        return rows

    def _fetch(self, snapshot_id: str, jobs: list[tuple[bytes, np.ndarray]], plan: list
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
        with resp.open_wire(self.client) as wire:
            for a, b in _rounds([row.nbytes for _, row in fetch]):
                batch = fetch[a:b]
                if wire is None:
                    values = self._batched([d for d, _ in batch], [0] * len(batch),
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
                wire.send([resp.get(page_key(d)) for d, _ in batch])
                for d, row in batch:
                    if not wire.bulk_into(memoryview(row)):
                        missing.append(d)
        if missing:
            raise _missing(snapshot_id, plan, set(missing))
        for row, src in copies:
            row[...] = src

    @staticmethod
    def _member_buffers(desc: TensorDescriptor, skeleton: list, digests: list[bytes],
                        rows: np.ndarray) -> list[Any]:
        layout = desc.layout
        n = layout.num_pages
        row = desc.buffers[0].byte_size // n if n else 0
        width = rows.shape[1]
        q = desc.quantization
        present = np.array([d != ZERO for d in digests], bool)
        buffers = [rows[:, :row].reshape(-1) if width == row else
                   np.ascontiguousarray(rows[:, :row]).reshape(-1), *skeleton[:2]]
        if not isinstance(q, PerBlockAffine):
            return buffers + skeleton[2:]
        # Per-page-slot parameters (D4): scales, then zero-points, after each page's bytes.
        ps = layout.page_size
        scale_np = BY_NAME[SCALE_TYPES[q.scale_type]].numpy
        sw = scale_np.itemsize * ps
        scales = np.array(rows[:, row:row + sw])  # a writable copy
        scales.view(scale_np)[~present] = 1.0  # pages no sequence reads: a valid scale
        zps = np.ascontiguousarray(rows[:, row + sw:width])
        if q.zero_point_buffer is not None and q.zero_point_buffer == q.scale_buffer:
            return [*buffers, np.concatenate([scales.reshape(-1), zps.reshape(-1)])]
        return [*buffers, scales.reshape(-1)] + ([zps.reshape(-1)] if zps.size else [])

    # -- prefix lookup -------------------------------------------------------------------
    def lookup_prefix(self, token_ids: Any, page_size: int | None = None
                      ) -> tuple[str, int, int] | None:
        """``(snapshot_id, sequence, matched_tokens)`` of the longest stored prefix of
        ``token_ids`` at page granularity, or None."""
        tokens = np.asarray(token_ids).reshape(-1)
        sizes = [page_size] if page_size else sorted(
            int(x) for x in self.client.smembers(PAGE_SIZES))
        best: tuple[str, int, int] | None = None
        for ps in sizes:
            chains = token_chains(tokens, ps)
            if not chains:
                continue
            pipe = self._pipe()
            for c in chains:
                pipe.get(prefix_key(c))
            hits = pipe.execute()
            for k in range(len(chains) - 1, -1, -1):
                if hits[k] is None:
                    continue
                sid, seq, count = parse_prefix_value(hits[k])
                if self.client.exists(manifest_key(sid)) and (best is None or count > best[2]):
                    best = (sid, seq, count)
                break
        return best

    # -- delete / stats ------------------------------------------------------------------
    def delete(self, snapshot_id: str) -> None:
        raw = self.client.get(manifest_key(snapshot_id))
        if raw is None:
            raise StoreError(f"no snapshot {snapshot_id!r} in the store", field="snapshot_id",
                             value=snapshot_id)
        self._release(snapshot_id, raw, keep_manifest=False)

    def _release(self, snapshot_id: str, raw: bytes, keep_manifest: bool) -> None:
        items, table, tokens = parse_manifest(snapshot_id, raw)
        logical = 0
        pos = 0
        for desc, _ in items:
            if isinstance(desc.layout, BlockPaged):
                n = desc.layout.num_pages
                logical += _page_width(desc) * sum(1 for d in table[pos:pos + n] if d != ZERO)
                pos += n
        distinct = list(dict.fromkeys(d for d in table if d != ZERO))
        results = self._batched(distinct, [0] * len(distinct), lambda p, d: self._decref(
            keys=[page_key(d), ref_key(d)], client=p))
        freed = [-1 - r for r in results if r < 0]
        pipe = self._pipe()
        if not keep_manifest:
            pipe.delete(manifest_key(snapshot_id))
            pipe.hincrby(STATS, "snapshots", -1)
        pipe.hincrby(STATS, "logical_bytes", -logical)
        pipe.hincrby(STATS, "stored_bytes", -sum(freed))
        pipe.hincrby(STATS, "pages", -len(freed))
        pipe.execute()
        if tokens and not keep_manifest:
            self._unindex(snapshot_id, items, tokens)

    def _unindex(self, snapshot_id: str, items: list, tokens: bytes) -> None:
        asm = SnapshotAssembler()
        for desc, bufs in items:
            if not isinstance(desc.layout, BlockPaged):
                asm.add(desc, bufs)
        seq_lens = asm.seq_lens
        if seq_lens is None:  # not a manifest put() wrote; lookup_prefix skips dead ids anyway
            return
        page_size = next(d.layout.page_size for d, _ in items
                         if isinstance(d.layout, BlockPaged))
        ids = np.frombuffer(tokens, "<i8")
        pipe = self._pipe()
        for s, seq in enumerate(np.split(ids, np.cumsum(seq_lens)[:-1])):
            for k, chain in enumerate(token_chains(seq, page_size)):
                value = prefix_value(snapshot_id, s, (k + 1) * page_size)
                self._del_if(keys=[prefix_key(chain)], args=[value], client=pipe)
        pipe.execute()

    def stats(self) -> dict[str, int]:
        raw = self.client.hgetall(STATS)
        out = {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in raw.items()}
        for k in ("logical_bytes", "stored_bytes", "pages", "snapshots"):
            out.setdefault(k, 0)
        return out

    def __contains__(self, snapshot_id: str) -> bool:
        return bool(self.client.exists(manifest_key(snapshot_id)))

    def contains_many(self, snapshot_ids: Sequence[str]) -> list[bool]:
        """Which snapshots are stored, in one pipelined round trip (per cluster node)."""
        if not snapshot_ids:
            return []
        pipe = self._pipe()
        for sid in snapshot_ids:
            pipe.exists(manifest_key(sid))
        return [bool(n) for n in pipe.execute()]


__all__ = ["PageStore", "StoreError"]
