"""PageStore: KV snapshots in Redis or Valkey, every distinct page stored once.

Keys (``{...}`` is a cluster hash tag):

* ``hkv:p:{H}`` - one page: its bytes in the pool, followed (per-block-affine
  quantization) by its ``page_size`` scales and zero-points.  ``H`` is a 128-bit
  (truncated SHA-256) digest of the page's geometry (element type, page_size, heads,
  head_dim, the quantization section) and its bytes, so identical pages of any sequence,
  layer or snapshot share one key.  Pages spread evenly over the cluster's slots by digest.
* ``hkv:o:{H}`` - the page's owners: the generations of the manifests naming it (its
  reference count is their number), in the page's slot so one Lua script updates both.
* ``hkv:m:{id}`` - a snapshot's manifest (below), with its generation.
* ``hkv:d:{id}`` - releases not yet completed: the manifests a put replaced or a delete
  removed, moved there in the same atomic step (``writes.py``).
* ``hkv:x:{C}`` - prefix index: ``C`` chains a digest over each full page of token ids;
  the value names the snapshot, sequence and token count that end there.
* ``hkv:stats`` - ``logical_bytes`` (pages as each snapshot holds them), ``stored_bytes``
  and ``pages`` (distinct pages stored), ``snapshots``.

Manifest: ``"HKVM" | u32 version (2) | 16-byte generation | u64 n | n Hurray bytes | u64 n
| page digests (16 bytes each, all zero for a page no sequence references) | u64 n | token
ids``.  The Hurray bytes are the snapshot's group head, ``seq_lens``, ``kv_scales`` and the
info member (model and metadata) as stream tensors, then each block-paged member's
descriptor followed by its non-page buffers (block_table, seq_ptr, per-tensor/per-channel
parameters) in table order, then every other member whole (a hybrid model's states) -
everything of the snapshot but the pages.  Token ids are
int64, sequences back to back.

A put draws a new generation, adds it to the owners of each of its pages (storing the
pages Redis lacks), then swaps its manifest in; the manifest it replaces moves to the
pending releases in that same script, so among any number of concurrent puts and deletes
of one id each old manifest is released exactly once, and releasing is idempotent.  So in
any interleaving, from any number of processes, each page's owners are the manifests
naming it once every call has returned; a client or server killed midway leaves at worst
references nobody holds (pages kept too long), which ``fsck`` removes.

Unused page slots are zeroed before pages are hashed and stored (better sharing, and
nothing stale leaves the process); pages no sequence references are not stored and come
back as zeros.  A page that has gone missing (deleted, evicted) makes ``get`` fail with an
error naming the snapshot, layer and page - never wrong data.

Capacity (decision H91).  The store's capacity is Redis's own ``maxmemory``; hurraykv keeps
no byte budget of its own.  For a cache, configure Redis with ``maxmemory <size>`` and
``maxmemory-policy allkeys-lru`` (or ``allkeys-lfu``): Redis then evicts the least recently
used keys, whichever they are, and hurraykv reads whatever is left as follows.

* A snapshot whose manifest is gone is not stored: ``in`` and ``contains_many`` say False,
  ``get`` raises "no snapshot", ``lookup_prefix`` skips it.
* A snapshot that lost a page is damaged: ``get`` raises ``MissingPagesError`` (a
  ``StoreError``) naming the snapshot, layer and page, never other bytes; a store made with
  ``drop_damaged=True`` (a cache that recomputes) also removes it then, so the next lookup
  is a miss and the caller stores it again.
* A lost owner set, pending release or statistics hash costs at worst pages kept or freed
  too early (a later miss, never other bytes) and statistics that are off; a lost prefix-index
  entry is a lookup miss, and an entry naming a manifest that is gone is ignored.
* ``fsck`` (``hurraykv store fsck URL``) removes damaged snapshots, drops the references of
  evicted manifests, frees their orphaned pages and recomputes the statistics.

With ``noeviction`` (and with ``volatile-*`` policies, since hurraykv sets no TTLs) Redis
refuses writes at the limit instead: a put raises ``StoreFullError`` (field
``maxmemory``) after taking back what it wrote, nothing stored before is touched, and
deletes still work.  See ``capacity.py``.

A Redis that goes away (killed, ``SHUTDOWN``, failed over, loading its data after a restart,
a cluster node down) makes every call that needs it raise ``TransportError`` naming the
server, never a redis-py exception; a reply refusing a command for another reason (a key of
another type) is ``StoreError``.  Once Redis is back, the same store works again: the Lua
scripts, which a restarted server no longer holds, are loaded again when Redis answers
NOSCRIPT, in pipelines too (only the refused calls are sent again).

Pages travel on the raw path of ``resp.py`` (MSETs gathered from the pool's memory, GET
replies received into the rows being rebuilt) where the connection allows, else in
redis-py pipelines.  A get is one pipelined pass (``reads.py``): the GETs of the next
1 MiB of pages are sent while the replies to the 1 MiB before arrive, each reply lands
in its row by a scatter read, every member's rows are one buffer (recycled between gets
when ``get`` is given ``buffers``, a ``buffers.ReadBuffers``: the ``redis://`` chunk
store's), and ``get_hashed`` hashes each page as it lands, for the checksums the
``redis://`` chunk store verifies.  ``members.py`` digests pages, ``manifest.py``
encodes manifests and prefix values, ``scripts.py`` holds the keys and the Lua,
``refs.py`` the reference calls, ``reads.py`` and ``writes.py`` the two paths,
``buffers.py`` the recycled read buffers, ``fsck.py`` the repair after crashes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError, StoreError, require
from ..paged import BlockPagedTensor
from ..snapshot import KVCacheSnapshot, SnapshotAssembler
from ..threads import executor
from .buffers import ReadBuffers
from .capacity import MissingPagesError, StoreFullError, best_effort, is_full, refusing_full
from .fsck import fsck as repair
from .manifest import (
    encode_manifest,
    manifest_generation,
    parse_manifest,
    parse_prefix_value,
    token_chains,
)
from .members import ZERO, Member
from .reach import reaching, server_name, unreachable_as_transport
from .reads import Hashed, assemble, piece_digests
from .refs import Refs, refusing_legacy
from .scripts import (
    PAGE_SIZES,
    STATS,
    manifest_key,
    new_generation,
    owners_key,
    page_key,
    pending_key,
    prefix_key,
)
from .writes import drain, index_prefixes, store_pages


def _legacy(snapshot_id: str) -> StoreError:
    return StoreError(f"snapshot {snapshot_id!r} was stored by a hurraykv that counted "
                      "references without generations (manifest version 1): run "
                      "`hurraykv store fsck URL` once to upgrade the store",
                      field="manifest.version", value=1, rule="manifest version 2")


URL_SCHEMES = ("redis", "redis+cluster", "rediss", "unix")


class PageStore:
    """Snapshots in Redis/Valkey with page-level deduplication and prefix lookup."""

    def __init__(self, client: Any, *, zero_unused: bool = True,
                 drop_damaged: bool = False) -> None:
        """``drop_damaged``: a ``get`` or ``get_layer`` that finds a page of the snapshot
        missing (Redis evicted it) removes the snapshot before raising
        ``MissingPagesError``, so it is a miss from then on (for a cache whose callers
        recompute and store again; without it the snapshot stays, its other layers
        readable, until ``fsck`` or a delete removes it)."""
        if not isinstance(drop_damaged, bool):
            raise StoreError(f"drop_damaged {drop_damaged!r} is not a bool",
                             field="drop_damaged", value=drop_damaged, rule="True or False")
        self.client = client
        self.zero_unused = zero_unused
        self.drop_damaged = drop_damaged
        self.hash_seconds = 0.0  # spent hashing pages in get_hashed, all calls together
        with unreachable_as_transport(server_name(client)):  # its scripts load at once
            self._refs = Refs(client)

    @classmethod
    def from_url(cls, url: str, *, cluster: bool | None = None, **kw: Any) -> PageStore:
        """``redis://HOST:PORT`` (one server; also ``rediss://`` for TLS and
        ``unix:///path``) or ``redis+cluster://HOST:PORT``; the store is reached at once.

        A URL of another scheme, or one redis-py cannot use, is ``ConfigError`` (naming
        the URL and the schemes taken); a store that cannot be reached (refused, timed
        out, unknown host) is ``TransportError`` naming it."""
        redis = require("redis", "redis", "the Redis page store")
        from redis.cluster import RedisCluster

        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme not in URL_SCHEMES:
            raise ConfigError(
                f"store url {url!r}: " + (f"scheme {scheme + '://'!r} is not a Redis store"
                                          if scheme else "no scheme")
                + f"; use {' or '.join(s + '://HOST:PORT' for s in URL_SCHEMES[:2])} "
                f"(also {', '.join(s + '://' for s in URL_SCHEMES[2:])})",
                field="url", value=url, rule="a redis:// URL")
        on_cluster = scheme == "redis+cluster" or bool(cluster)
        plain = "redis://" + url.partition("://")[2] if scheme == "redis+cluster" else url
        with unreachable_as_transport(url):
            try:
                client = (RedisCluster.from_url(plain) if on_cluster
                          else redis.Redis.from_url(plain))
            except ValueError as e:  # redis-py's word for a URL it cannot use
                raise ConfigError(f"store url {url!r}: {e}", field="url", value=url,
                                  rule="a URL redis-py takes") from None
            return cls(client, **kw)

    def _script(self, name: str, snapshot_id: str, args: list[Any] | None = None) -> int:
        """``swap`` or ``remove`` on the manifest of ``snapshot_id``."""
        with refusing_legacy(lambda: _legacy(snapshot_id)):
            return int(self._refs.scripts[name](
                keys=[manifest_key(snapshot_id), pending_key(snapshot_id)], args=args))

    # -- put ---------------------------------------------------------------------------
    @reaching
    def put(self, snapshot_id: str, snapshot: KVCacheSnapshot,
            token_ids: Sequence[Any] | np.ndarray | None = None) -> dict[str, int]:
        """Store a snapshot (replacing one under the same id); returns byte counts.
        ``StoreFullError`` where Redis refuses the write for memory (``noeviction``)."""
        with refusing_full(self.client, f"put of snapshot {snapshot_id!r}",
                           "what it wrote was taken back, and nothing stored before was "
                           "touched"):
            return self._put(snapshot_id, snapshot, token_ids)

    def _put(self, snapshot_id: str, snapshot: KVCacheSnapshot,
             token_ids: Sequence[Any] | np.ndarray | None) -> dict[str, int]:
        if snapshot.seq_lens is None:
            raise StoreError("a snapshot without seq_lens cannot be stored", field="seq_lens")
        members = [Member(snapshot.tensor(*k), self.zero_unused)
                   for k in snapshot.member_keys()]
        generation = new_generation()
        seen: dict[bytes, None] = {}
        written: set[bytes] = set()
        swapping = False
        try:
            # Members are hashed on worker threads (hashlib releases the GIL) while the
            # pages of the members already hashed travel to Redis.
            futures = [executor().submit(m.digests) for m in members]
            digests: list[list[bytes]] = []
            logical = new_bytes = new_pages = 0
            for m, future in zip(members, futures, strict=True):
                ds = future.result()
                digests.append(ds)
                batch: dict[bytes, memoryview] = {}
                for i, d in enumerate(ds):
                    if d != ZERO:
                        logical += m.rows.shape[1]
                        if d not in seen:
                            seen[d] = None
                            batch[d] = memoryview(m.rows[i])
                pages, nbytes = store_pages(self._refs, snapshot_id, batch, generation,
                                            written)
                new_pages += pages
                new_bytes += nbytes
            manifest = encode_manifest(snapshot, members, digests, token_ids, generation)
            swapping = True  # from here a failure may or may not have swapped: fsck decides
            try:
                replaced = self._script("swap", snapshot_id, [manifest])
            except Exception as e:
                # A version 1 manifest (StoreError) or Redis at its memory limit: the script
                # stopped before its first write, so nothing was swapped.
                if isinstance(e, StoreError) or is_full(e):
                    swapping = False
                raise
        except BaseException:
            if not swapping:
                self._abandon(generation, list(seen), list(written))
            raise
        # The snapshot is stored: what follows is bookkeeping, skipped where Redis refuses it
        # for memory (capacity.py) rather than reporting a stored snapshot as failed.
        pipe = self._refs.pipe()
        pipe.hincrby(STATS, "logical_bytes", logical)
        pipe.hincrby(STATS, "stored_bytes", new_bytes)
        pipe.hincrby(STATS, "pages", new_pages)
        if not replaced:
            pipe.hincrby(STATS, "snapshots", 1)
        best_effort(pipe)
        if replaced:  # the replaced snapshot's references go only now
            drain(self._refs, snapshot_id)
        if token_ids is not None:
            index_prefixes(self._refs, snapshot_id, snapshot, token_ids, generation)
        return {"logical_bytes": logical, "new_bytes": new_bytes, "new_pages": new_pages,
                "pages": len(seen)}

    def _abandon(self, generation: bytes, digests: list[bytes], written: list[bytes]
                 ) -> None:
        """A put failed before its manifest was swapped in: drop what it referenced, and
        free the pages it wrote that nobody owns (at Redis's memory limit, the room it
        took), best effort: what cannot be done now, ``fsck`` does.  Only pages it wrote
        itself: one it found stored may be counted the old way (no owner set), or have lost
        its owner set to eviction while snapshots name it.  The statistics are left alone:
        they count a put's pages only once its manifest is in."""
        with contextlib.suppress(Exception):  # the connection that failed the put may
            self._refs.drop_all(digests, generation)  # be gone too
            orphan = self._refs.scripts["del_orphan"]
            self._refs.batched(written, [0] * len(written), lambda p, d: orphan(
                keys=[page_key(d), owners_key(d)], client=p))

    # -- get ---------------------------------------------------------------------------
    def _load_manifest(self, snapshot_id: str) -> tuple[list, list[bytes], bytes | None]:
        """(items, page digests, generation; None for a version 1 manifest)."""
        raw = self.client.get(manifest_key(snapshot_id))
        if raw is None:
            raise StoreError(f"no snapshot {snapshot_id!r} in the store", field="snapshot_id",
                             value=snapshot_id)
        items, table, _ = parse_manifest(snapshot_id, raw)
        return items, table, manifest_generation(raw)

    def _assemble(self, snapshot_id: str, layer: int | None,
                  buffers: ReadBuffers | None = None, hashed: Hashed | None = None
                  ) -> tuple[list, list]:
        items, table, generation = self._load_manifest(snapshot_id)
        try:
            return assemble(self._refs, snapshot_id, items, table, layer, buffers, hashed)
        except MissingPagesError as e:
            if not self.drop_damaged or generation is None:
                raise
            dropped = self._drop(snapshot_id, generation)
            raise MissingPagesError(
                f"{e}; the snapshot " + ("was removed (drop_damaged): store it again" if
                                        dropped else "was not removed (replaced meanwhile, "
                                        "or the removal failed)"),
                field=e.field, value=e.value, rule=e.rule) from None

    def _drop(self, snapshot_id: str, generation: bytes) -> bool:
        """Remove a damaged snapshot if its manifest is still of ``generation`` (a put that
        replaced it meanwhile stays); False where it did not (the get fails anyway)."""
        try:
            removed = int(self._refs.scripts["remove_if"](
                keys=[manifest_key(snapshot_id), pending_key(snapshot_id)], args=[generation]))
            drain(self._refs, snapshot_id)
        except Exception:  # the damage is reported either way; fsck removes it later
            return False
        return bool(removed)

    @reaching
    def get(self, snapshot_id: str, *, buffers: ReadBuffers | None = None
            ) -> KVCacheSnapshot:
        """The snapshot, pages fetched in one pipelined pass and received straight into
        their pools.  ``MissingPagesError`` if Redis lost one of its pages (evicted or
        deleted).  ``buffers``: the pages land in one buffer taken from it, which a later
        get takes again once no snapshot over it is left (memory already faulted in),
        instead of fresh memory every get."""
        scalars, members = self._assemble(snapshot_id, None, buffers)
        return KVCacheSnapshot.from_members(scalars + members)

    @reaching
    def get_hashed(self, snapshot_id: str, *, buffers: ReadBuffers | None = None
                   ) -> tuple[KVCacheSnapshot, np.ndarray]:
        """``get``, and the xxh3-64 digests of the snapshot's checksum pieces in the order
        of its ``checksum.xxh3_64`` entry (``io/checksums.py``), for
        ``checksums.verify(snapshot, what, digests)``: each page is hashed right after
        its bytes land, while they are still in the core's cache, instead of in a second
        pass over the whole snapshot.  The seconds hashing took are added to
        ``hash_seconds``."""
        hashed = Hashed()
        scalars, members = self._assemble(snapshot_id, None, buffers, hashed)
        snapshot = KVCacheSnapshot.from_members(scalars + members)
        started = time.perf_counter()
        digests = piece_digests(snapshot, hashed)
        self.hash_seconds += hashed.seconds + time.perf_counter() - started
        return snapshot, digests

    @reaching
    def get_layer(self, snapshot_id: str, layer: int) -> tuple[BlockPagedTensor, ...]:
        """One layer's tensors (key, value), fetching only that layer's pages."""
        scalars, members = self._assemble(snapshot_id, layer)
        if not members:
            raise StoreError(f"snapshot {snapshot_id!r} has no layer {layer}", field="layer",
                             value=layer)
        asm = SnapshotAssembler()
        done = [asm.add(desc, bufs) for _, desc, bufs in scalars + members]
        if done[-1] is None:
            raise StoreError(f"snapshot {snapshot_id!r}: layer {layer} lacks one of its roles",
                             field="kv_role", value=layer)
        return done[-1][1]

    # -- prefix lookup -------------------------------------------------------------------
    @reaching
    def lookup_prefix(self, token_ids: Any, page_size: int | None = None
                      ) -> tuple[str, int, int] | None:
        """``(snapshot_id, sequence, matched_tokens)`` of the longest stored prefix of
        ``token_ids`` at page granularity, or None.  An entry whose manifest is gone
        (deleted, replaced, evicted) is passed over for the next shorter one."""
        tokens = np.asarray(token_ids).reshape(-1)
        sizes = [page_size] if page_size else sorted(
            int(x) for x in self.client.smembers(PAGE_SIZES))
        best: tuple[str, int, int] | None = None
        for ps in sizes:
            chains = token_chains(tokens, ps)
            if not chains:
                continue
            pipe = self._refs.pipe()
            for c in chains:
                pipe.get(prefix_key(c))
            found = []
            for value in reversed(pipe.execute()):  # longest first
                if value is not None:
                    with contextlib.suppress(StoreError):  # a damaged entry: passed over
                        found.append(parse_prefix_value(value))
            if not found:
                continue
            ids = list(dict.fromkeys(f[0] for f in found))
            pipe = self._refs.pipe()
            for sid in ids:
                pipe.getrange(manifest_key(sid), 8, 23)  # the generation (H85)
            held = dict(zip(ids, pipe.execute(), strict=True))
            for sid, seq, count, generation in found:
                # entries written before they carried a generation: the id must exist
                live = held[sid] == generation if generation else bool(held[sid])
                if live:
                    if best is None or count > best[2]:
                        best = (sid, seq, count)
                    break
        return best

    # -- delete / repair / stats ---------------------------------------------------------
    @reaching
    def delete(self, snapshot_id: str) -> None:
        """Delete a snapshot; idempotent: the manifest leaves in one atomic step with its
        release recorded, and a retry after a crash completes that release (without
        dropping any reference twice) instead of failing."""
        with refusing_full(self.client, f"delete of snapshot {snapshot_id!r}"):
            moved = self._script("remove", snapshot_id)
            kinds = drain(self._refs, snapshot_id)
        if not moved and b"d" not in kinds:
            raise StoreError(f"no snapshot {snapshot_id!r} in the store", field="snapshot_id",
                             value=snapshot_id)

    @reaching
    def fsck(self, *, grace: float = 3600.0, drop_damaged: bool = True) -> dict[str, Any]:
        """Repair the store after a client or server crash, after Redis evicted keys, or
        after keys were damaged: every page a manifest names is verified against its key
        (length and digest), and a damaged one is deleted, never quarantined, so the
        snapshots naming it are removed as those that lost a page are; statistics that
        are not a hash of integers are rewritten; a manifest, release or owner set of
        another type or that does not parse is deleted.  Returns what was found and
        changed (``damaged_pages`` and ``damaged_keys``: key -> what was wrong;
        ``missing_pages``: snapshot -> pages lost or damaged; ``stats_damaged``): see
        ``fsck.py``."""
        with refusing_full(self.client, "fsck", "it stopped there: run it again when "
                           "Redis has room"):
            return repair(self._refs, grace=grace, drop_damaged=drop_damaged)

    @reaching
    def stats(self) -> dict[str, int]:
        """``logical_bytes``, ``stored_bytes``, ``pages`` and ``snapshots``; statistics
        that are damaged (not a hash, a field not a number) are ``StoreError`` naming
        ``hkv:stats`` (``fsck`` rewrites them; puts and deletes skip them meanwhile)."""
        return self._refs.stats()

    @reaching
    def __contains__(self, snapshot_id: str) -> bool:
        return bool(self.client.exists(manifest_key(snapshot_id)))

    @reaching
    def contains_many(self, snapshot_ids: Sequence[str]) -> list[bool]:
        """Which snapshots are stored, in one pipelined round trip (per cluster node)."""
        if not snapshot_ids:
            return []
        pipe = self._refs.pipe()
        for sid in snapshot_ids:
            pipe.exists(manifest_key(sid))
        return [bool(n) for n in pipe.execute()]


__all__ = ["MissingPagesError", "PageStore", "StoreError", "StoreFullError", "page_key"]
