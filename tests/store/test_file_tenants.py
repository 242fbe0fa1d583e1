"""``max_bytes_per_tenant`` on a ``file://`` directory (``chunks/file/tenants.py``):
a noisy tenant evicts its own segments, never another tenant's."""

from __future__ import annotations

import pytest

from hurraykv.chunks.file.store import TENANT_KEY
from hurraykv.chunks.file.tenants import LOG
from hurraykv.chunks.urls import open_store
from hurraykv.errors import HurrayError
from hurraykv.testing import keys, segment


def size_of(tmp_path) -> int:
    probe = open_store((tmp_path / "probe").as_uri())
    probe.put(["0" * 32], 0, segment(16, 0), {})
    return (tmp_path / "probe" / f"{'0' * 32}-0.hrry").stat().st_size


def test_a_noisy_tenant_evicts_only_its_own_segments(tmp_path):
    size = size_of(tmp_path)
    url = (tmp_path / "kv").as_uri()
    # four segments each (a tenant's name in the metadata makes its files a few bytes longer)
    store = open_store(url, max_bytes=20 * size, max_bytes_per_tenant=4 * size + 1000)
    quiet = [keys(4) for _ in range(3)]
    for i, k in enumerate(quiet):
        store.put(k, 0, segment(16, i), {TENANT_KEY: "b0b"})
    plain = keys(4)
    store.put(plain, 0, segment(16, 9), {})  # no cache_salt: the tenant ""
    noisy = [keys(4) for _ in range(12)]
    for i, k in enumerate(noisy):
        store.put(k, 0, segment(16, 100 + i), {TENANT_KEY: "a1"})
    assert all(store.locate(k)[0] is not None for k in quiet)  # untouched
    assert store.locate(plain)[0] is not None
    held = [k for k in noisy if store.locate(k)[0] is not None]
    assert len(held) == 4 and held == noisy[-4:]  # its quota, its most recent
    assert sum(1 for _ in (tmp_path / "kv").glob("*.hrry")) == 3 + 1 + 4
    assert (tmp_path / "kv" / LOG).read_text().count(" a1\n") == 12  # compacted later

    # a tenant whose pinned segments fill its quota is refused, saying so
    fourth = keys(4)
    store.put(fourth, 0, segment(16, 50), {TENANT_KEY: "b0b"})  # 4 of 4: fits
    pins = [store.locate(k)[0] for k in (*quiet, fourth)]
    assert store.retain(pins, pin=True, ttl_s=None) == pins
    with pytest.raises(HurrayError, match="max_bytes_per_tenant") as e:
        store.put(keys(4), 0, segment(16, 51), {TENANT_KEY: "b0b"})
    assert e.value.field == "max_bytes_per_tenant"
    assert all(store.locate(k)[0] is not None for k in (*quiet, fourth))
    store.close()
    left = [p.name for p in (tmp_path / "kv").iterdir() if p.name.startswith(".evict.")]
    assert left == []  # a refused save evicted nothing, left nothing behind


def test_a_refused_save_evicts_nothing_of_its_tenant(tmp_path):
    size = size_of(tmp_path)
    store = open_store((tmp_path / "kv").as_uri(), max_bytes_per_tenant=2 * size + 1000)
    pinned, loose = keys(4), keys(4)
    store.put(pinned, 0, segment(16, 1), {TENANT_KEY: "c"})
    store.retain(store.locate(pinned), pin=True, ttl_s=None)
    store.put(loose, 0, segment(16, 2), {TENANT_KEY: "c"})
    big = segment(32, 3)  # two segments' worth: with the pinned one, past the quota
    with pytest.raises(HurrayError, match=r"holds .* bytes pinned"):
        store.put(keys(8), 0, big, {TENANT_KEY: "c"})
    assert store.locate(loose)[0] is not None  # decided before evicting


def test_a_tenant_that_is_not_a_digest_is_refused(tmp_path):
    store = open_store((tmp_path / "kv").as_uri(), max_bytes_per_tenant=1 << 20)
    with pytest.raises(HurrayError, match="1-32 hex digits"):
        store.put(keys(1), 0, segment(1, 0), {TENANT_KEY: "../evil"})


def test_without_a_quota_tenants_are_still_recorded(tmp_path):
    """So that a quota set later, on a directory already filled, knows whose is whose."""
    store = open_store((tmp_path / "kv").as_uri())
    k = keys(1)
    store.put(k, 0, segment(1, 0), {TENANT_KEY: "d1"})
    store.put(keys(1), 0, segment(1, 1), {})  # no salt: no line
    assert (tmp_path / "kv" / LOG).read_text() == f"{store.locate(k)[0]} d1\n"
