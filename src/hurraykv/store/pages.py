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
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import StoreError, require
from ..info import info_member
from ..io.stream import write_tensor
from ..paged import BlockPagedTensor, byte_view
from ..snapshot import (
    KVCacheSnapshot,
    SnapshotAssembler,
    group_head,
    kv_scales_member,
    seq_lens_member,
)
from ..wire.descriptor import TensorDescriptor, decode_descriptor
from ..wire.dtypes import BY_NAME
from ..wire.layouts import BlockPaged, Composite
from ..wire.quantization import SCALE_TYPES, PerBlockAffine

MAGIC = b"HKVM"
DIGEST = 16
ZERO = bytes(DIGEST)
BATCH_BYTES = 64 << 20  # bytes per pipeline round trip
STATS = "hkv:stats"
PAGE_SIZES = "hkv:page_sizes"

# Lua: keys[1] page, keys[2] refcount; in one slot (same hash tag), so atomic in a cluster.
# Page bytes never go through Lua (it would copy them): a plain SET NX stores a page, then
# INCREF counts the reference only if the page is still there (else the caller stores it
# again: a concurrent delete may have removed it in between).
_INCREF = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('INCR', KEYS[2])
"""
# The same for many pages in one call (a single server: no slot rule to respect).
_INCREF_MANY = """
local out = {}
for i = 1, #KEYS, 2 do
  if redis.call('EXISTS', KEYS[i]) == 0 then out[#out + 1] = 0
  else out[#out + 1] = redis.call('INCR', KEYS[i + 1]) end
end
return out
"""
_EXISTS_MANY = """
local out = {}
for i = 1, #KEYS do out[i] = redis.call('EXISTS', KEYS[i]) end
return out
"""
MANY = 512  # pages per *_MANY call
_DECREF = """
local n = redis.call('DECR', KEYS[2])
if n <= 0 then
  local size = redis.call('STRLEN', KEYS[1])
  redis.call('DEL', KEYS[1], KEYS[2])
  return -1 - size
end
return n
"""
_DEL_IF = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class _Script:
    """A Lua script run by EVALSHA, also inside cluster pipelines (redis-py refuses its
    Script helpers there; a raw EVALSHA whose keys share one slot is routed normally).
    The script is loaded on every primary first, so pipelines never meet NOSCRIPT."""

    def __init__(self, client: Any, lua: str) -> None:
        self.lua = lua
        self.client = client
        self.sha = hashlib.sha1(lua.encode()).hexdigest()
        self.load()

    def load(self) -> None:
        if hasattr(self.client, "get_primaries"):  # a cluster: every primary
            for node in self.client.get_primaries():
                self.client.get_redis_connection(node).script_load(self.lua)
        else:
            self.client.script_load(self.lua)

    def __call__(self, keys: list[str], args: list[Any] | None = None, client: Any = None
                 ) -> Any:
        target = client if client is not None else self.client
        return target.execute_command("EVALSHA", self.sha, len(keys), *keys, *(args or []))


def page_key(digest: bytes) -> str:
    return f"hkv:p:{{{digest.hex()}}}"


def ref_key(digest: bytes) -> str:
    return f"hkv:r:{{{digest.hex()}}}"


def manifest_key(snapshot_id: str) -> str:
    return f"hkv:m:{{{snapshot_id}}}"


def prefix_key(chain: bytes) -> str:
    return f"hkv:x:{{{chain.hex()}}}"


class _Member:
    """One block-paged member as the store sees it: page values and where they go."""

    def __init__(self, t: BlockPagedTensor, zero_unused: bool = True) -> None:
        self.tensor = t
        self.desc = t.descriptor()
        q = t.quantization
        self.per_slot = isinstance(q, PerBlockAffine)
        views = t.clean_buffers() if zero_unused and t.seq_lens is not None else list(
            t.buffers())
        pool_parts = len(views) - (len(t.buffers()) - 1)
        pool = np.concatenate([np.frombuffer(v, np.uint8) for v in views[:pool_parts]]) \
            if pool_parts > 1 else np.frombuffer(views[0], np.uint8)
        self.rows = pool.reshape(t.num_pages, -1) if t.num_pages else pool.reshape(0, 0)
        extra = [np.frombuffer(byte_view(p), np.uint8) for p in t.quant_params]
        if self.per_slot and q is not None:
            # scales (and zero-points) of a page travel with the page (D4)
            slot = [p.reshape(t.num_pages, -1) for p in extra]
            if q.zero_point_buffer is not None and q.zero_point_buffer == q.scale_buffer:
                half = slot[0].shape[1] // 2 if t.num_pages else 0
                slot = [np.ascontiguousarray(slot[0][:, :half]),
                        np.ascontiguousarray(slot[0][:, half:])]
            self.rows = np.concatenate([self.rows, *slot], axis=1)
            self.global_params: list[Any] = []
        else:
            self.global_params = extra
        self.referenced = np.zeros(t.num_pages, bool)
        self.referenced[t.block_table.astype(np.int64)] = True
        geometry = self.desc.encode()[14:15] + struct.pack(
            "<III", t.page_size, t.num_heads, t.head_dim) + (q.encode() if q is not None
                                                              else b"")
        self.geometry = geometry

    def digests(self) -> list[bytes]:
        """One digest per page (ZERO for unreferenced pages): SHA-256 (hardware-assisted
        where the CPU has it) truncated to 128 bits.  The loop's body hashes a whole page
        in C with the GIL released, so members hash in parallel on worker threads."""
        geometry = hashlib.sha256(self.geometry)
        out = []
        for i, row in enumerate(self.rows):
            if not self.referenced[i]:
                out.append(ZERO)
                continue
            h = geometry.copy()
            h.update(row)
            out.append(h.digest()[:DIGEST])
        return out

    def skeleton(self) -> bytes:
        t = self.tensor
        parts = [self.desc.encode(), bytes(byte_view(t.block_table)), bytes(byte_view(t.seq_ptr))]
        parts += [bytes(p) for p in self.global_params]
        return b"".join(parts)


_POOL: Any = None


def _hash_pool() -> Any:
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                   thread_name_prefix="hurraykv-hash")
    return _POOL


def _token_chains(tokens: np.ndarray, page_size: int) -> list[bytes]:
    """Chained digest over each full page of token ids (engine-style prefix hashing)."""
    out, prev = [], struct.pack("<I", page_size)
    full = len(tokens) // page_size
    data = np.ascontiguousarray(tokens[: full * page_size], dtype="<i8").reshape(full, -1)
    for row in data:
        prev = hashlib.blake2b(prev + row.tobytes(), digest_size=DIGEST).digest()
        out.append(prev)
    return out


class PageStore:
    """Snapshots in Redis/Valkey with page-level deduplication and prefix lookup."""

    def __init__(self, client: Any, *, zero_unused: bool = True) -> None:
        self.client = client
        self.zero_unused = zero_unused
        self._scripts = {name: _Script(client, lua) for name, lua in (
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
        members = [_Member(snapshot.tensor(*k), self.zero_unused)
                   for k in snapshot.member_keys()]
        # Members are hashed on worker threads (hashlib releases the GIL) while the pages
        # of the members already hashed travel to Redis: hashing overlaps the network.
        futures = [_hash_pool().submit(m.digests) for m in members]
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
        manifest = self._manifest(snapshot, members, digests, token_ids)
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
        pages and bytes newly stored."""
        keys = list(values)
        exists = self._exists_all(keys)
        todo = [d for d, e in zip(keys, exists, strict=True) if not e]
        counted = [d for d, e in zip(keys, exists, strict=True) if e]
        new_bytes = new_pages = 0
        for _attempt in range(5):
            # store the missing pages' bytes (SET NX: a racing writer's copy is identical)
            created = self._batched(todo, [values[d].nbytes for d in todo],
                                    lambda p, d: p.set(page_key(d), values[d], nx=True))
            for d, c in zip(todo, created, strict=True):
                if c:
                    new_pages += 1
                    new_bytes += values[d].nbytes
            refs = self._incref_all(counted + todo)
            todo = [d for d, n in zip(counted + todo, refs, strict=True) if n == 0]
            counted = []
            if not todo:
                return new_pages, new_bytes
        raise StoreError(f"pages of {snapshot_id!r} kept vanishing while being stored "
                         "(concurrent deletes)", field="page")

    def _manifest(self, snapshot: KVCacheSnapshot, members: list[_Member],
                  digests: list[list[bytes]], token_ids: Any) -> bytes:
        import io

        buf = io.BytesIO()
        write_tensor(buf, group_head(snapshot.member_count()), [])
        write_tensor(buf, *seq_lens_member(snapshot.seq_lens))
        if snapshot.kv_scales is not None:
            write_tensor(buf, *kv_scales_member(snapshot.kv_scales))
        if snapshot.has_info:
            write_tensor(buf, *info_member(snapshot.model, snapshot.metadata))
        for m in members:
            buf.write(m.skeleton())
        hurray = buf.getvalue()
        table = b"".join(d for ds in digests for d in ds)
        tokens = b""
        if token_ids is not None:
            tokens = np.concatenate([np.asarray(t, dtype="<i8").reshape(-1)
                                     for t in self._split_tokens(snapshot, token_ids)]
                                    or [np.zeros(0, "<i8")]).tobytes()
        return b"".join([MAGIC, struct.pack("<IQ", 1, len(hurray)), hurray,
                         struct.pack("<Q", len(table)), table,
                         struct.pack("<Q", len(tokens)), tokens])

    @staticmethod
    def _split_tokens(snapshot: KVCacheSnapshot, token_ids: Any) -> list[np.ndarray]:
        lens = snapshot.seq_lens
        if isinstance(token_ids, np.ndarray) and token_ids.ndim == 1:
            if len(token_ids) != int(lens.sum()):
                raise StoreError(f"token_ids holds {len(token_ids)} ids for "
                                 f"{int(lens.sum())} tokens", field="token_ids")
            return np.split(token_ids, np.cumsum(lens)[:-1])
        seqs = [np.asarray(t).reshape(-1) for t in token_ids]
        if [len(t) for t in seqs] != lens.tolist():
            raise StoreError(f"token_ids lengths {[len(t) for t in seqs]} differ from seq_lens "
                             f"{lens.tolist()}", field="token_ids")
        for t in seqs:
            if t.size and t.dtype.kind not in "iu":
                raise StoreError("token_ids are integers", field="token_ids")
        return seqs

    def _index_prefixes(self, snapshot_id: str, snapshot: KVCacheSnapshot, token_ids: Any
                        ) -> None:
        pipe = self._pipe()
        pipe.sadd(PAGE_SIZES, snapshot.page_size)
        for s, tokens in enumerate(self._split_tokens(snapshot, token_ids)):
            for k, chain in enumerate(_token_chains(tokens, snapshot.page_size)):
                pipe.set(prefix_key(chain), _prefix_value(snapshot_id, s,
                                                          (k + 1) * snapshot.page_size))
        pipe.execute()

    # -- get ---------------------------------------------------------------------------
    def _load_manifest(self, snapshot_id: str) -> tuple[list, list[bytes], bytes]:
        raw = self.client.get(manifest_key(snapshot_id))
        if raw is None:
            raise StoreError(f"no snapshot {snapshot_id!r} in the store", field="snapshot_id",
                             value=snapshot_id)
        return _parse_manifest(snapshot_id, raw)

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
        wanted: dict[bytes, None] = {}
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
            if take:
                for d in ds:
                    if d != ZERO:
                        wanted.setdefault(d, None)
        if pos != len(table):
            raise StoreError(f"manifest of {snapshot_id!r}: {len(table)} page digests for "
                             f"{pos} pages", field="manifest")
        keys = list(wanted)
        fetched = dict(zip(keys, self._batched(keys, [1 << 16] * len(keys),
                                               lambda p, d: p.get(page_key(d))), strict=True))
        members = []
        for desc, skeleton, ds, take in plan:
            if take:
                members.append((None, desc, self._member_buffers(snapshot_id, desc, skeleton, ds,
                                                                 fetched)))
        scalars = [(None, d, b) for d, b in items if not isinstance(d.layout, BlockPaged)
                   and not isinstance(d.layout, Composite)]
        return scalars, members

    def _member_buffers(self, snapshot_id: str, desc: TensorDescriptor, skeleton: list,
                        digests: list[bytes], fetched: dict[bytes, Any]) -> list[Any]:
        layout = desc.layout
        n = layout.num_pages
        pool_bytes = desc.buffers[0].byte_size
        row = pool_bytes // n if n else 0
        q = desc.quantization
        slot_sizes = [desc.buffers[i].byte_size // n if n else 0 for i in range(3, len(
            desc.buffers))] if isinstance(q, PerBlockAffine) else []
        width = row + sum(slot_sizes)
        present = np.array([d != ZERO for d in digests], bool)
        values = []
        for i, d in enumerate(digests):
            if d == ZERO:
                continue
            v = fetched.get(d)
            if v is None:
                raise StoreError(
                    f"snapshot {snapshot_id!r}: layer {layout.layer_index} "
                    f"{layout.kv_role_name} page {i} ({page_key(d)}) is missing from the "
                    "store (evicted or deleted)", field="page", value=i,
                    rule="every page a manifest names must be stored")
            if len(v) != width:
                raise StoreError(f"snapshot {snapshot_id!r}: page {i} holds {len(v)} bytes, "
                                 f"expected {width}", field="page", value=i)
            values.append(v)
        if present.all():  # every page referenced: one copy, straight from the replies
            rows = np.frombuffer(b"".join(values), np.uint8).reshape(n, width) if n else \
                np.zeros((0, width), np.uint8)
        else:
            rows = np.zeros((n, width), np.uint8)
            if values:
                rows[present] = np.frombuffer(b"".join(values), np.uint8).reshape(-1, width)
        buffers = [rows[:, :row].reshape(-1), *skeleton[:2]]
        if not slot_sizes:
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
            chains = _token_chains(tokens, ps)
            if not chains:
                continue
            pipe = self._pipe()
            for c in chains:
                pipe.get(prefix_key(c))
            hits = pipe.execute()
            for k in range(len(chains) - 1, -1, -1):
                if hits[k] is None:
                    continue
                sid, seq, count = _parse_prefix_value(hits[k])
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
        items, table, tokens = _parse_manifest(snapshot_id, raw)
        logical = 0
        pos = 0
        for desc, _ in items:
            if isinstance(desc.layout, BlockPaged):
                n = desc.layout.num_pages
                width = sum(h.byte_size for h in desc.buffers[:1]) // n if n else 0
                if isinstance(desc.quantization, PerBlockAffine) and n:
                    width += sum(h.byte_size for h in desc.buffers[3:]) // n
                logical += width * sum(1 for d in table[pos:pos + n] if d != ZERO)
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
            for k, chain in enumerate(_token_chains(seq, page_size)):
                value = _prefix_value(snapshot_id, s, (k + 1) * page_size)
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


def _prefix_value(snapshot_id: str, seq: int, count: int) -> bytes:
    raw = snapshot_id.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw + struct.pack("<IQ", seq, count)


def _parse_prefix_value(value: bytes) -> tuple[str, int, int]:
    (n,) = struct.unpack_from("<I", value)
    seq, count = struct.unpack_from("<IQ", value, 4 + n)
    return value[4:4 + n].decode("utf-8"), seq, count


def _parse_manifest(snapshot_id: str, raw: bytes) -> tuple[list, list[bytes], bytes]:
    """(items: [(descriptor, buffers)], page digests, token bytes)."""
    mv = memoryview(raw)
    try:
        if bytes(mv[:4]) != MAGIC:
            raise ValueError("magic")
        version, n = struct.unpack_from("<IQ", mv, 4)
        if version != 1:
            raise ValueError(f"version {version}")
        pos = 16
        hurray = mv[pos:pos + n]
        pos += n
        (tn,) = struct.unpack_from("<Q", mv, pos)
        table_raw = bytes(mv[pos + 8:pos + 8 + tn])
        pos += 8 + tn
        (kn,) = struct.unpack_from("<Q", mv, pos)
        tokens = bytes(mv[pos + 8:pos + 8 + kn])
        if len(table_raw) != tn or tn % DIGEST or len(tokens) != kn:
            raise ValueError("truncated")
    except (ValueError, struct.error) as e:
        raise StoreError(f"manifest of {snapshot_id!r} does not parse: {e}",
                         field="manifest", value=snapshot_id) from None
    items = []
    off = 0
    while off < len(hurray):
        desc = decode_descriptor(hurray[off:])
        off += len(desc.encode())
        bufs = []
        for i, h in enumerate(desc.buffers):
            if isinstance(desc.layout, BlockPaged) and (
                    i == 0 or (i >= 3 and isinstance(desc.quantization, PerBlockAffine))):
                continue  # page data: in the page keys
            bufs.append(np.frombuffer(hurray[off:off + h.byte_size], np.uint8))
            off += h.byte_size
        items.append((desc, bufs))
    table = [table_raw[i:i + DIGEST] for i in range(0, len(table_raw), DIGEST)]
    return items, table, tokens


__all__ = ["PageStore", "StoreError"]
