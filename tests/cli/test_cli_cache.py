"""``hurraykv cache ls|clear URL`` over real stores: a directory, a ``hurraykv serve``, a
Redis server (started by the suite)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.chunks.keys import ChunkKeys, identity_digest, identity_key
from hurraykv.chunks.urls import open_store
from hurraykv.cli import main
from hurraykv.io import checksums
from tests.support import store_urls

A, B = "model=alpha;cache_dtype=float16", "model=beta;cache_dtype=float16"


def fill(url: str) -> dict[str, list[str]]:
    """Three segments of A (two, then one more chunk), one of B: their names."""
    store = open_store(url)
    names: dict[str, list[str]] = {A: [], B: []}
    try:
        for identity, count in ((A, 3), (B, 1)):
            for i in range(count):
                pool = np.full((2, 16, 1, 8), i + 1, np.float16)
                snap = checksums.with_checksums(hk.KVCacheSnapshot.from_arrays(
                    [pool], [pool], np.arange(2), [0, 2], [32], model=identity))
                keys = ChunkKeys(identity_digest(identity), 16).upto(
                    [i, np.random.randint(1 << 30)] * 20, 2)
                store.put(keys, 0, snap, {})
                names[identity].append(store.locate(keys)[0])
    finally:
        store.close()
    return names


@pytest.fixture(params=store_urls.builtin())  # each built-in store
def url(request, tmp_path):
    with store_urls.live_url(request.param, tmp_path, request) as url:
        yield url


def ls(url: str, capsys) -> dict:
    assert main(["cache", "ls", "--json", url]) == 0
    return json.loads(capsys.readouterr().out)


def test_ls_lists_each_identity_and_clear_removes_one(url, capsys):
    names = fill(url)
    listed = ls(url, capsys)
    rows = {r["identity_key"]: r for r in listed["identities"]}
    assert rows[identity_key(A)]["segments"] == 3 and rows[identity_key(B)]["segments"] == 1
    assert rows[identity_key(A)]["bytes"] > 2 * rows[identity_key(B)]["bytes"] > 0
    assert sorted(s["name"] for s in listed["segments"]) == sorted(names[A] + names[B])
    assert main(["cache", "ls", "--segments", url]) == 0
    table = capsys.readouterr().out
    assert identity_key(A) in table and names[B][0] in table and "4 segments" in table

    # by a prefix of its key
    assert main(["cache", "clear", "--json", url, "--identity", identity_key(A)[:8]]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == 3
    assert [r["identity_key"] for r in ls(url, capsys)["identities"]] == [identity_key(B)]
    store = open_store(url)
    try:
        assert store.exists(names[A]) == [False] * 3 and store.exists(names[B]) == [True]
    finally:
        store.close()
    # by the identity string, as the connector logs it; then nothing is left
    assert main(["cache", "clear", url, "--identity", B]) == 0
    assert "removed 1 segment " in capsys.readouterr().out
    assert ls(url, capsys)["segments"] == []


def test_clear_all_and_the_refusals(url, capsys):
    fill(url)
    assert main(["cache", "clear", url, "--identity", "ffff"]) == 1
    err = capsys.readouterr().err
    assert "--identity 'ffff' names no identity stored" in err and identity_key(A) in err
    assert len(ls(url, capsys)["segments"]) == 4  # nothing removed
    assert main(["cache", "clear", url, "--all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == 4
    assert ls(url, capsys)["segments"] == []
    with pytest.raises(SystemExit):  # --identity or --all, one of them
        main(["cache", "clear", url])


def test_a_missing_directory_is_not_made(tmp_path, capsys):
    where = tmp_path / "typo"
    assert main(["cache", "ls", where.as_uri()]) == 2
    assert "no such directory" in capsys.readouterr().err and not where.exists()


def test_pin_by_segment_and_by_prompt_prefix(tmp_path, capsys):
    """``cache pin`` by a segment's name, and by a prompt's token ids under the identity
    string the connector logs (its keys computed as the connector computes them)."""
    from tests.integrations.vllm.test_vllm_scheduler import store_chunks

    url = (tmp_path / "kv").as_uri()
    names = fill(url)
    assert main(["cache", "pin", url, "--segment", names[A][0], "--ttl", "600"]) == 0
    assert "pinned 1 segment, a miss in 600 s" in capsys.readouterr().out
    listed = {s["name"]: s for s in ls(url, capsys)["segments"]}
    assert listed[names[A][0]]["pinned"] and listed[names[A][0]]["expiry"] > time.time()
    assert not listed[names[A][1]]["pinned"]
    assert main(["cache", "pin", url, "--segment", names[A][0], "--unpin"]) == 0
    capsys.readouterr()
    assert not ls(url, capsys)["segments"][0]["pinned"]

    identity = "model=tiny;cache_dtype=float16;chunk_size=32;tp_size=1"
    prompt = list(range(1, 101))
    store = open_store(url)
    store_chunks(store, identity_digest(identity), prompt, 2)
    stored = store.locate(ChunkKeys(identity_digest(identity), 32).upto(prompt, 1))[0]
    store.close()
    tokens = tmp_path / "prompt.json"
    tokens.write_text(json.dumps(prompt))
    assert main(["cache", "pin", url, "--tokens", str(tokens), "--identity", identity,
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["retained"] == [stored]
    assert main(["cache", "pin", url, "--tokens", str(tokens), "--identity", identity,
                 "--salt", "tenant-b"]) == 1  # salted keys: nothing of it stored
    assert "no segment of that prefix is stored" in capsys.readouterr().err
    assert main(["cache", "pin", url, "--tokens", str(tokens)]) == 1
    assert "--tokens needs --identity" in capsys.readouterr().err


def test_several_urls_are_the_tiers_of_a_stack_listed_and_cleared_whole(tmp_path, capsys):
    """Issue 49: `hurraykv cache` on a whole stack (URLs fastest first) and on each tier:
    ls lists every tier's segments once and each tier's totals; clear empties them all."""
    top, below = (tmp_path / "top").as_uri(), (tmp_path / "below").as_uri()
    names = fill(below)  # the older segments, only further away
    (tmp_path / "top").mkdir()
    store = open_store(top)
    moved = open_store(below).get_verified(names[B][0])
    keys = ChunkKeys(identity_digest(B), 16).upto([7, 8] * 20, 2)
    store.put(keys, 0, moved, {})  # one more segment, in the top tier only
    listed = ls_all([top, below], capsys)
    assert [(t["url"], t["segments"]) for t in listed["tiers"]] == [(top, 1), (below, 4)]
    assert len(listed["segments"]) == 5 and listed["url"] == f"{top} > {below}"
    assert main(["cache", "clear", "--all", "--json", top, below]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == 5
    assert [t["segments"] for t in ls_all([top, below], capsys)["tiers"]] == [0, 0]
    assert ls(below, capsys)["segments"] == []  # each tier on its own: empty too


def ls_all(urls: list[str], capsys) -> dict:
    assert main(["cache", "ls", "--json", *urls]) == 0
    return json.loads(capsys.readouterr().out)
