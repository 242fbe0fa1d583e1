"""What a PageStore in Redis must hold after any sequence of operations and repairs,
recomputed from its manifests (shared by the concurrency, crash and eviction tests)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from hurraykv.snapshot import KVCacheSnapshot
from hurraykv.store import PageStore
from hurraykv.store.manifest import manifest_generation, parse_manifest
from hurraykv.store.members import ZERO
from hurraykv.store.reads import page_width


def keys(client, kind: str) -> list[bytes]:
    return list(dict.fromkeys(client.scan_iter(match=f"hkv:{kind}:*", count=1000)))


def digest(key: bytes) -> bytes:
    return bytes.fromhex(key.decode()[7:-1])


def check_consistent(store: PageStore, expected: Callable[[int], KVCacheSnapshot]) -> int:
    """Every page's stored references equal the manifests naming it, no page is missing
    or unreferenced, nothing is left pending, the statistics add up, and every snapshot
    reads back as ``expected(its metadata's seed)``; returns how many snapshots."""
    c = store.client
    named: dict[bytes, set] = defaultdict(set)
    logical = 0
    manifests = keys(c, "m")
    for key in manifests:
        sid = key.decode()[7:-1]
        raw = c.get(key)
        items, table, _ = parse_manifest(sid, raw)
        for d in set(table) - {ZERO}:
            named[d].add(manifest_generation(raw) or sid)
        pos = 0
        for desc, _ in items:
            if hasattr(desc.layout, "num_pages"):
                n = desc.layout.num_pages
                logical += page_width(desc) * sum(d != ZERO for d in table[pos:pos + n])
                pos += n
    if keys(c, "o") or not keys(c, "r"):  # references as generations
        stored = {digest(k): c.smembers(k) for k in keys(c, "o")}
        assert stored == dict(named), "page owners differ from the manifests naming them"
    else:  # references as counters (before generations)
        stored = {digest(k): int(c.get(k)) for k in keys(c, "r")}
        assert stored == {d: len(g) for d, g in named.items()}, \
            "reference counts differ from the manifests naming the pages"
    pages = {digest(k): c.strlen(k) for k in keys(c, "p")}
    assert set(pages) == set(named), (f"{len(set(named) - set(pages))} named pages missing, "
                                      f"{len(set(pages) - set(named))} nobody names")
    assert keys(c, "d") == []
    assert store.stats() == {"snapshots": len(manifests), "pages": len(pages),
                             "stored_bytes": sum(pages.values()), "logical_bytes": logical}
    for key in manifests:
        sid = key.decode()[7:-1]
        back = store.get(sid)
        assert back.equal(expected(back.metadata["seed"])), sid
    return len(manifests)
