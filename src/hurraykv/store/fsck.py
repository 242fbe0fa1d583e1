"""``PageStore.fsck()`` / ``hurraykv store fsck URL``: the page store made consistent
with its manifests after a client or server crash, or after Redis evicted keys under
``maxmemory`` (floor 4).

1. Releases left pending (a put or delete killed after its manifest moved) are completed.
   Keys that are not what their name says (a manifest, a release, an owner set of another
   type, or one that does not parse) are deleted as steps 1-3 meet them and reported by
   key (``damaged_keys``); the references they held are dropped in step 3.
2. Every manifest is read; version 1 manifests (references counted before generations)
   get a generation and are rewritten as version 2, and the counters of those references
   (``hkv:r:``) are removed (upgrade a store while no client writes to it).  Every page a
   manifest names is read and verified against its key (its length, and the SHA-256 of its
   geometry and bytes, which is the key's digest): a page value that is truncated, has a
   byte changed or is not a string is deleted, never kept under quarantine (a snapshot
   cannot be read whole from other bytes), and reported by key (``damaged_pages``).  A
   manifest naming a page the store no longer holds (evicted, lost in a failover, deleted
   as damaged) is damaged: it is reported, and removed with its references unless
   ``drop_damaged=False`` (its snapshot cannot be read whole again: removed, it is a miss
   that its writer stores again).
3. Each page's owners become exactly the generations of the manifests naming it: a
   generation no manifest holds (a put killed before its manifest went in) is dropped -
   unless it was drawn less than ``grace`` seconds ago, being then possibly a put still
   running - and a page a manifest names but does not own is given that reference (after
   checking the manifest still holds it).  A page whose last reference goes is freed; an
   owner set whose page Redis evicted goes with its last reference.
4. Pages nobody owns (bytes a killed put stored before referencing them) are freed.
5. ``hkv:stats`` is recomputed from what is left; one that is damaged (a key of another
   type, a field that is not a number: reported as ``stats_damaged``) is replaced whole.

Nothing a whole manifest names is ever freed, so fsck is safe while clients run; what they
change meanwhile may leave the recomputed statistics off by their work (run it again
when they are idle).  Pages a manifest names that are not in the store cannot be made
again: they are reported per snapshot (``missing_pages``: how many of its pages were lost
or damaged), and those snapshots removed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from ..errors import HurrayError, StoreError, require
from ..wire.layouts import BlockPaged
from .capacity import best_effort
from .manifest import manifest_generation, parse_manifest, with_generation
from .members import ZERO, page_digest, page_geometry
from .reads import page_width, rounds
from .refs import Refs
from .scripts import (
    STATS,
    generation_age,
    id_of,
    legacy_ref_key,
    manifest_key,
    new_generation,
    owners_key,
    page_key,
    pending_key,
)
from .writes import drain, logical_bytes

BATCH = 512  # keys per pipeline round trip


def _scan(client: Any, kind: str) -> Iterator[str]:
    """The snapshot ids (m, d) or page digests in hex (p, o, r) of the keys of ``kind``."""
    seen: set[str] = set()
    for key in client.scan_iter(match=f"hkv:{kind}:*", count=1000):
        name = id_of(key, kind)
        if name not in seen:  # SCAN may return a key twice
            seen.add(name)
            yield name


def _chunks(items: list[Any]) -> Iterator[list[Any]]:
    for a in range(0, len(items), BATCH):
        yield items[a:a + BATCH]


def fsck(refs: Refs, *, grace: float = 3600.0, drop_damaged: bool = True
         ) -> dict[str, Any]:
    """Repair the store ``refs`` reaches; returns what was found and changed."""
    stats_before, stats_damage = refs.read_stats()
    report: dict[str, Any] = {
        "releases_completed": 0, "manifests": 0, "manifests_upgraded": 0,
        "references_dropped": 0, "references_added": 0, "pages_freed": 0,
        "orphan_pages_freed": 0, "legacy_counters_removed": 0, "missing_pages": {},
        "damaged_pages": {}, "damaged_pages_removed": 0, "damaged_keys": {},
        "damaged_keys_removed": 0, "damaged_removed": 0,
        "dangling_owners_removed": 0, "stats_damaged": stats_damage,
        "stats_before": stats_before}
    _complete_releases(refs, report)
    named, snapshot_of, logical_of, geometry_of = _read_manifests(refs, report)
    _remove_damaged_pages(refs, geometry_of, report)
    lost = _damaged(refs, named, snapshot_of, report, drop_damaged)
    logical = sum(logical_of[g] for g in snapshot_of)
    _remove_legacy_counters(refs, report)
    _reconcile_owners(refs, named, snapshot_of, lost, grace, report)
    kept, stored_bytes = _free_orphans(refs, report)
    _write_stats(refs, {"logical_bytes": logical, "stored_bytes": stored_bytes,
                        "pages": kept, "snapshots": len(snapshot_of)}, bool(stats_damage))
    report["stats_after"] = refs.read_stats()[0]
    return report


def _complete_releases(refs: Refs, report: dict[str, Any]) -> None:
    """1. Releases left pending; an entry that is not a release (or a key that is not a
    hash) is removed first: the references it held go in step 3, as those of a put
    killed before its manifest went in."""
    redis = require("redis", "redis", "the Redis page store")
    for sid in list(_scan(refs.client, "d")):
        key = pending_key(sid)
        try:
            entries = refs.client.hgetall(key)
        except redis.ResponseError as e:
            _remove_key(refs, key, _not_its_type(e, "a hash"), report)
            continue
        for generation, value in entries.items():
            try:
                if value[:1] not in (b"r", b"d"):
                    raise StoreError(f"a release starts with 'r' or 'd', not {value[:1]!r}")
                parse_manifest(sid, value[1:])
            except HurrayError as e:
                if refs.client.hdel(key, generation):
                    report["damaged_keys_removed"] += 1
                report["damaged_keys"][f"{key} {bytes(generation).hex()}"] = str(e)
        report["releases_completed"] += len(drain(refs, sid))


def _not_its_type(error: Exception, kind: str) -> str:
    """A WRONGTYPE reply said as what fsck found; any other error raised."""
    if "WRONGTYPE" not in str(error):
        raise error
    return f"not {kind} (WRONGTYPE)"


def _remove_key(refs: Refs, key: str, problem: str, report: dict[str, Any],
                value: bytes | None = None) -> None:
    """A damaged key deleted (with ``value``, only if it still holds it) and reported."""
    if value is None:
        gone = refs.client.delete(key)
    else:
        gone = refs.scripts["del_if"](keys=[key], args=[value])
    report["damaged_keys"][key] = problem
    report["damaged_keys_removed"] += int(gone)


def _read_manifests(refs: Refs, report: dict[str, Any]
                    ) -> tuple[dict[bytes, set[bytes]], dict[bytes, str], dict[bytes, int],
                               dict[bytes, tuple[bytes, int]]]:
    """2. Who should own what: the generations naming each page, the snapshot of each
    generation and its logical bytes, and each page's geometry and size (what its digest
    and length are verified by); a version 1 manifest is given a generation first."""
    named: dict[bytes, set[bytes]] = {}
    snapshot_of: dict[bytes, str] = {}
    logical_of: dict[bytes, int] = {}
    geometry_of: dict[bytes, tuple[bytes, int]] = {}
    for ids in _chunks(list(_scan(refs.client, "m"))):
        pipe = refs.pipe()
        for sid in ids:
            pipe.get(manifest_key(sid))
        for sid, raw in zip(ids, pipe.execute(raise_on_error=False), strict=True):
            if raw is None:
                continue  # deleted meanwhile
            # a manifest that is not one names no page fsck can trust: it goes, and the
            # references it held with it (step 3)
            if isinstance(raw, Exception):
                _remove_key(refs, manifest_key(sid), _not_its_type(raw, "a string"), report)
                continue
            try:
                items, table, _ = parse_manifest(sid, raw)
            except HurrayError as e:
                _remove_key(refs, manifest_key(sid), str(e), report, raw)
                continue
            generation = manifest_generation(raw)
            if generation is None:
                generation = new_generation()
                refs.client.set(manifest_key(sid), with_generation(raw, generation))
                report["manifests_upgraded"] += 1
            logical_of[generation] = logical_bytes(items, table)
            snapshot_of[generation] = sid
            for d in set(table) - {ZERO}:
                named.setdefault(d, set()).add(generation)
            geometry_of.update(_geometries(items, table))
            report["manifests"] += 1
    return named, snapshot_of, logical_of, geometry_of


def _geometries(items: list, table: list[bytes]) -> Iterator[tuple[bytes, tuple[bytes, int]]]:
    """(digest, (geometry, bytes)) of every page a manifest names."""
    pos = 0
    for desc, _ in items:
        if isinstance(desc.layout, BlockPaged):
            n = desc.layout.num_pages
            shape = (page_geometry(desc), page_width(desc))
            for d in table[pos:pos + n]:
                if d != ZERO:
                    yield d, shape
            pos += n


def _remove_damaged_pages(refs: Refs, geometry_of: dict[bytes, tuple[bytes, int]],
                          report: dict[str, Any]) -> None:
    """2, then: every page a manifest names is read and checked against its key: a value of
    another type, of another length or whose digest is not its key's (truncated, a bit
    flipped) is deleted, so the snapshots naming it are damaged (step 3 removes them)
    instead of read wrong.  Pages are read BATCH_BYTES per round trip."""
    digests = list(geometry_of)
    for a, b in rounds([geometry_of[d][1] for d in digests]):
        batch = digests[a:b]
        pipe = refs.pipe()
        for d in batch:
            pipe.get(page_key(d))
        bad: dict[bytes, tuple[str, bytes | None]] = {}
        for d, value in zip(batch, pipe.execute(raise_on_error=False), strict=True):
            geometry, width = geometry_of[d]
            if isinstance(value, Exception):
                bad[d] = (f"not a string ({str(value).split(' ', 1)[0]})", None)
            elif value is not None and len(value) != width:
                bad[d] = (f"holds {len(value)} bytes, expected {width}", value)
            elif value is not None and page_digest(geometry, value) != d:
                bad[d] = ("its bytes do not match its digest", value)
        if not bad:
            continue
        pipe = refs.pipe()
        del_if = refs.scripts["del_if"]
        for d, (_, value) in bad.items():
            if value is None:  # nothing of the store's writes another type there
                pipe.delete(page_key(d))
            else:  # only those bytes: not a copy a writer stored again meanwhile
                del_if(keys=[page_key(d)], args=[value], client=pipe)
        for d, gone in zip(bad, pipe.execute(), strict=True):
            report["damaged_pages"][page_key(d)] = bad[d][0]
            report["damaged_pages_removed"] += int(gone)


def _remove_legacy_counters(refs: Refs, report: dict[str, Any]) -> None:
    """3, first: the counters of before generations go (every manifest now has a generation
    its pages will own)."""
    for hexes in _chunks(list(_scan(refs.client, "r"))):
        pipe = refs.pipe()
        for h in hexes:
            pipe.delete(legacy_ref_key(bytes.fromhex(h)))
        report["legacy_counters_removed"] += sum(int(n) for n in pipe.execute())


def _reconcile_owners(refs: Refs, named: dict[bytes, set[bytes]],
                      snapshot_of: dict[bytes, str], lost: set[bytes], grace: float,
                      report: dict[str, Any]) -> None:
    """3. Owners: drop what no manifest holds (older than ``grace``), add what one lacks."""
    now = time.time()
    stored = [bytes.fromhex(h) for h in _scan(refs.client, "o")]
    add: list[tuple[bytes, bytes]] = []
    drops: list[tuple[bytes, bytes]] = []
    for digests in _chunks(stored):
        pipe = refs.pipe()
        for d in digests:
            pipe.smembers(owners_key(d))
        for d, owners in zip(digests, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(owners, Exception):  # made again from the manifests below
                _remove_key(refs, owners_key(d), _not_its_type(owners, "a set"), report)
                owners = set()
            want = named.get(d, set())
            drops += [(d, g) for g in owners - want if generation_age(g, now) > grace]
            add += [(d, g) for g in want - owners]
    have = set(stored)
    add += [(d, g) for d, gens in named.items() if d not in have and d not in lost
            for g in gens]
    _add(refs, add, snapshot_of, report)  # first: a drop must not free a named page
    for batch in _chunks(drops):
        _drop(refs, batch, report)


def _free_orphans(refs: Refs, report: dict[str, Any]) -> tuple[int, int]:
    """4. Pages nobody owns are freed; returns the pages kept and their bytes."""
    pages = [bytes.fromhex(h) for h in _scan(refs.client, "p")]
    kept, stored_bytes = 0, 0
    for digests in _chunks(pages):
        pipe = refs.pipe()
        orphan = refs.scripts["del_orphan"]
        for d in digests:
            orphan(keys=[page_key(d), owners_key(d)], client=pipe)
        freed = pipe.execute()
        report["orphan_pages_freed"] += sum(int(n) for n in freed)
        left = [d for d, n in zip(digests, freed, strict=True) if not int(n)]
        pipe = refs.pipe()
        for d in left:
            pipe.strlen(page_key(d))
        # a value of another type no manifest names, still owned (within grace): no bytes
        sizes = [n if isinstance(n, int) else 0 for n in pipe.execute(raise_on_error=False)]
        kept += sum(1 for n in sizes if n)
        stored_bytes += sum(sizes)
    return kept, stored_bytes


def _write_stats(refs: Refs, after: dict[str, int], damaged: bool) -> None:
    """5. The statistics, recomputed; a ``damaged`` hash (not a hash, a field not a
    number) is deleted first, so it is rewritten whole."""
    pipe = refs.pipe()
    if damaged:  # refused at the memory limit after this: no statistics, fsck again
        pipe.delete(STATS)
    pipe.hset(STATS, mapping=after)
    best_effort(pipe)  # refused at Redis's memory limit: the old figures stay


def _damaged(refs: Refs, named: dict[bytes, set[bytes]], snapshot_of: dict[bytes, str],
             report: dict[str, Any], drop: bool) -> set[bytes]:
    """The named pages the store lacks; each manifest naming one is reported and, with
    ``drop``, removed with its release completed (its generations leave ``named`` and
    ``snapshot_of``, so the steps after it neither add nor keep their references)."""
    digests = list(named)
    lost = {d for d, n in zip(digests, refs.exists_all(digests), strict=True) if not n}
    damaged: dict[bytes, int] = {}
    for d in lost:
        for g in named[d]:
            damaged[g] = damaged.get(g, 0) + 1
    for g, n in damaged.items():
        sid = snapshot_of[g]
        report["missing_pages"][sid] = n
        if not drop:
            continue
        # only that manifest: one a put swapped in meanwhile is whole
        if int(refs.scripts["remove_if"](keys=[manifest_key(sid), pending_key(sid)],
                                         args=[g])):
            report["damaged_removed"] += 1
        drain(refs, sid)
        del snapshot_of[g]
    if drop and damaged:
        for gens in named.values():
            gens.difference_update(damaged)
    return lost


def _drop(refs: Refs, drops: list[tuple[bytes, bytes]], report: dict[str, Any]) -> None:
    if not drops:
        return
    one = refs.scripts["dropref"]
    pipe = refs.pipe()
    for d, g in drops:
        one(keys=[page_key(d), owners_key(d)], args=[g], client=pipe)
    results = [int(r) for r in pipe.execute()]
    report["references_dropped"] += len(drops)
    # -1 - size: a size of 0 was an owner set whose page Redis had evicted
    report["pages_freed"] += sum(1 for r in results if r < -1)
    report["dangling_owners_removed"] += sum(1 for r in results if r == -1)


def _add(refs: Refs, add: list[tuple[bytes, bytes]], snapshot_of: dict[bytes, str],
         report: dict[str, Any]) -> None:
    """Give pages the references their manifests lack, if those manifests still hold
    them (a delete completed meanwhile must not be undone)."""
    for batch in _chunks(add):
        generations = list(dict.fromkeys(g for _, g in batch))  # each manifest read once
        pipe = refs.pipe()
        for g in generations:
            pipe.getrange(manifest_key(snapshot_of[g]), 8, 23)
        held = {g for g, now in zip(generations, pipe.execute(), strict=True) if now == g}
        live = [(d, g) for d, g in batch if g in held]
        pipe = refs.pipe()
        one = refs.scripts["addref"]
        for d, g in live:
            one(keys=[page_key(d), owners_key(d), legacy_ref_key(d)], args=[g], client=pipe)
        for (_, g), n in zip(live, pipe.execute(), strict=True):
            if int(n):
                report["references_added"] += 1
            else:  # named, but its bytes are gone: the snapshot is damaged
                sid = snapshot_of[g]
                report["missing_pages"][sid] = report["missing_pages"].get(sid, 0) + 1
