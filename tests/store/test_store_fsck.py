"""``fsck`` on the damage it exists to repair (issue 46 item 8): a real Redis (single server
and a real 3-master cluster) holding real snapshots stored through the PageStore, then
damaged with raw Redis commands: statistics that are a string or hold a non-number, a page
key of another type, a page value cut short, a page value with a byte changed.  fsck, as
a library call and as ``hurraykv store fsck`` in a subprocess, names each damage, removes
the damaged pages and the snapshots naming them, rewrites the statistics, and leaves the
other snapshots reading back byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hurraykv.store import PageStore
from hurraykv.store.manifest import parse_manifest
from hurraykv.store.members import ZERO
from hurraykv.store.pages import StoreError, page_key
from hurraykv.store.scripts import STATS, manifest_key
from tests.store.test_page_store_faults import snap
from tests.support import store_checks
from tests.support.paths import ROOT
from tests.support.redis_fixtures import emptied_url

STATS_DAMAGE = {"string": "hkv:stats is a string, not a hash",
                "field": "field 'pages' holds b'many', not an integer"}


@pytest.fixture(params=["single", "cluster"])
def url(request):
    return emptied_url(request)


def table(store: PageStore, sid: str) -> set[bytes]:
    return set(parse_manifest(sid, store.client.get(manifest_key(sid)))[1]) - {ZERO}


def damage(store: PageStore, stats: str) -> dict[str, str]:
    """Snapshots good, other (sharing pages with every one), trunc, flip and typed; one
    page of each of the last three, its own, damaged; the statistics damaged as ``stats``
    says.  Returns what fsck must say of each damaged page, by key."""
    c = store.client
    for seed, sid in enumerate(("good", "other", "trunc", "flip", "typed"), 1):
        store.put(sid, snap(seed))
    shared = table(store, "good") | table(store, "other")
    own = {sid: sorted(table(store, sid) - shared) for sid in ("trunc", "flip", "typed")}
    width = c.strlen(page_key(own["trunc"][0]))
    cut, flipped, typed = (page_key(own[sid][0]) for sid in ("trunc", "flip", "typed"))
    c.set(cut, c.get(cut)[:-3])
    value = bytearray(c.get(flipped))
    value[5] ^= 0x01
    c.set(flipped, bytes(value))
    c.delete(typed)
    c.hset(typed, "not", "a page")
    if stats == "string":
        c.delete(STATS)
        c.set(STATS, "garbage")
    else:
        c.hset(STATS, "pages", "many")
    return {cut: f"holds {width - 3} bytes, expected {width}",
            flipped: "its bytes do not match its digest", typed: "not a string (WRONGTYPE)"}


def check_repaired(store: PageStore, report: dict, said: dict[str, str], stats: str
                   ) -> None:
    assert report["stats_damaged"] == STATS_DAMAGE[stats]
    assert report["damaged_pages"] == said
    assert report["damaged_pages_removed"] == 3
    assert report["missing_pages"] == {"trunc": 1, "flip": 1, "typed": 1}
    assert report["damaged_removed"] == 3 and report["manifests"] == 5
    for sid in ("trunc", "flip", "typed"):  # gone: a miss, not a read that fails
        assert sid not in store
        with pytest.raises(StoreError, match=f"no snapshot '{sid}'"):
            store.get(sid)
    # the others read back byte for byte; references, pages and statistics add up
    assert store_checks.check_consistent(store, snap) == 2
    again = store.fsck()
    assert not again["damaged_pages"] and not again["stats_damaged"]
    assert not again["missing_pages"] and again["stats_before"] == again["stats_after"]


@pytest.mark.parametrize("stats", ["string", "field"])
def test_fsck_removes_damaged_pages_and_rewrites_damaged_statistics(url, stats):
    store = PageStore.from_url(url)
    said = damage(store, stats)
    # the statistics are an account: a damaged one fails no put, and says what it is
    store.put("late", snap(9))
    store.delete("late")
    with pytest.raises(StoreError, match=r"statistics are damaged.*store fsck") as exc:
        store.stats()
    assert exc.value.field == STATS
    # before: WRONGTYPE or ValueError from fsck itself, and damaged_removed 0
    check_repaired(store, store.fsck(), said, stats)
    store.client.close()


@pytest.mark.parametrize("stats", ["string", "field"])
def test_store_fsck_command_reports_and_repairs_each_damage(url, stats):
    store = PageStore.from_url(url)
    said = damage(store, stats)
    out = subprocess.run([sys.executable, "-m", "hurraykv", "store", "fsck", "--json", url],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    check_repaired(store, json.loads(out.stdout), said, stats)
    said = damage(store, stats)  # again, for the lines a person reads
    out = subprocess.run([sys.executable, "-m", "hurraykv", "store", "fsck", url],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    lines = out.stdout.splitlines()
    assert f"damaged: statistics ({STATS_DAMAGE[stats]}): rewritten" in lines
    for key, problem in said.items():
        assert f"damaged: page {key}: {problem} (removed)" in lines
    for sid in ("trunc", "flip", "typed"):
        assert (f"damaged: snapshot {sid!r} named 1 page(s) the store had lost or that were "
                "damaged (removed; store it again)") in lines
    assert any(line.split() == ["3", "pages", "whose", "bytes", "did", "not", "match",
                                "their", "key", "(truncated,", "changed,", "another",
                                "type),", "removed"] for line in lines), out.stdout
    assert store_checks.check_consistent(store, snap) == 2
    store.client.close()


def test_fsck_removes_manifests_releases_and_owner_sets_that_are_not_theirs(url):
    """Keys of the store's names holding something else: before, fsck ended in WRONGTYPE
    or in the StoreError of the first manifest or release that did not parse."""
    from hurraykv.store.scripts import owners_key, pending_key

    store = PageStore.from_url(url)
    c = store.client
    store.put("good", snap(1))
    store.put("other", snap(2))
    garbled = b"HKVM" + bytes([7, 0, 0, 0]) + bytes(40)
    with pytest.raises(StoreError) as unreadable:
        parse_manifest("garbled", garbled)
    c.rpush(manifest_key("listed"), "x")
    c.set(manifest_key("garbled"), garbled)
    c.set(pending_key("typed"), "x")
    c.hset(pending_key("gone"), bytes(16), b"xjunk")
    c.hset(pending_key("cut"), bytes(range(16)), b"r" + garbled)
    shared = sorted(table(store, "good") & table(store, "other"))[0]
    c.delete(owners_key(shared))
    c.set(owners_key(shared), "x")
    with pytest.raises(StoreError, match="WRONGTYPE"):  # a read meeting one: StoreError
        store.get("listed")
    report = store.fsck()
    assert report["damaged_keys"] == {
        manifest_key("listed"): "not a string (WRONGTYPE)",
        manifest_key("garbled"): str(unreadable.value),
        pending_key("typed"): "not a hash (WRONGTYPE)",
        f"{pending_key('gone')} {bytes(16).hex()}": "a release starts with 'r' or 'd', "
                                                    "not b'x'",
        f"{pending_key('cut')} {bytes(range(16)).hex()}": str(unreadable.value).replace(
            "'garbled'", "'cut'"),
        owners_key(shared): "not a set (WRONGTYPE)"}
    assert report["damaged_keys_removed"] == 6 and report["manifests"] == 2
    assert report["references_added"] == 2  # the shared page's two owners, made again
    assert store_checks.check_consistent(store, snap) == 2
    out = subprocess.run([sys.executable, "-m", "hurraykv", "store", "fsck", url],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stderr == "" and "damaged:" not in out.stdout
    store.client.close()
