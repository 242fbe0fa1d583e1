"""Content-keyed KV chunks and their stores (what the vLLM connector keeps), on real files,
a real ``hurraykv serve`` and real Redis servers."""

from __future__ import annotations

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.chunks.keys import ChunkKeys, chain, identity_digest, segment_first
from hurraykv.chunks.urls import open_store
from hurraykv.net.client import KVClient
from hurraykv.net.server import KVServer

CHUNK = 4


def segment(chunks: int, seed: int = 0) -> hk.KVCacheSnapshot:
    """A run of ``chunks`` chunks of 4 tokens: one sequence, one page per chunk."""
    rng = np.random.default_rng(seed)
    pools = [rng.standard_normal((chunks, CHUNK, 2, 8)).astype(np.float16) for _ in range(2)]
    return hk.KVCacheSnapshot.from_arrays(pools, [p * 2 for p in pools], np.arange(chunks),
                                          [0, chunks], [chunks * CHUNK])


def test_keys_chain_over_the_whole_prefix_and_the_identity():
    seed = identity_digest("model=m;cache_dtype=bfloat16")
    a = ChunkKeys(seed, CHUNK).upto(list(range(20)), 5)
    b = ChunkKeys(seed, CHUNK).upto(list(range(8)) + [99] * 12, 5)
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]  # shared first 8 tokens only
    other = ChunkKeys(identity_digest("model=m;cache_dtype=float32"), CHUNK).upto(
        list(range(20)), 5)
    assert not set(a) & set(other)  # another dtype never matches
    grown = ChunkKeys(seed, CHUNK)
    assert grown.upto(list(range(9)), 2) == a[:2] and grown.upto(list(range(20)), 5) == a
    assert [d.hex() for d in chain(seed, np.arange(20), CHUNK)] == a
    assert len(a[0]) == 32  # 128 bits


# What every store keeps (locate, put, has, get, damaged objects, concurrent writers,
# eviction) is hurraykv.testing.ChunkStoreTests, run for each backend by
# tests/store/test_chunk_stores.py (and for a store from outside the package by
# tests/store/test_store_plugins.py).


def test_a_rank_suffix_keeps_tensor_parallel_shards_apart(tmp_path):
    url = (tmp_path / "kv").as_uri()
    keys = ChunkKeys(identity_digest("tp"), CHUNK).upto(list(range(8)), 2)
    rank0, rank1 = open_store(url, suffix=".tp0"), open_store(url, suffix=".tp1")
    rank0.put(keys, 0, segment(2, seed=1), {})
    assert rank1.locate(keys) == [None, None]
    rank1.put(keys, 0, segment(2, seed=2), {})
    (name,) = set(rank0.locate(keys))
    assert rank0.get(name).equal(segment(2, seed=1)) and rank1.get(name).equal(segment(2, 2))


def test_file_segments_are_snapshots_and_aliases_a_log(tmp_path):
    store = open_store((tmp_path / "kv").as_uri())
    keys = ChunkKeys(identity_digest("files"), CHUNK).upto(list(range(8)), 2)
    store.put(keys, 0, segment(2), {"note": "x"})
    (file,) = (tmp_path / "kv").glob("*.hrry")
    assert hk.load_snapshot(file).equal(segment(2))
    log = (tmp_path / "kv" / "aliases.log").read_text().splitlines()
    assert log == [f"{k} {file.stem}" for k in keys]
    # a second process sharing the directory sees the aliases, and a line a crash cut
    # short (no newline yet) is not taken
    with open(tmp_path / "kv" / "aliases.log", "a") as f:
        f.write("ab" * 16)
    other = open_store((tmp_path / "kv").as_uri())
    assert other.locate(keys) == [file.stem, file.stem]
    assert other.get(file.stem).equal(segment(2))
    file.unlink()
    assert other.locate(keys) == [None, None]  # an alias of a removed segment is a miss


def test_file_segments_of_one_structure_take_the_fast_paths_and_stay_checked(tmp_path):
    store = open_store((tmp_path / "kv").as_uri())
    keys = ChunkKeys(identity_digest("fast"), CHUNK).upto(list(range(16)), 4)
    for i in range(3):  # the first learns the structure, the others are gathered writes
        store.put(keys[i:i + 1], i, segment(1, seed=i), {})
    names = store.locate(keys[:3])
    for i, name in enumerate(names):  # files equal to a save_snapshot of the same snapshot
        hk.save_snapshot(segment(1, seed=i), tmp_path / "ref.hrry", fsync=False,
                         checksums="keep")  # as the store writes it
        assert store.path(name).read_bytes() == (tmp_path / "ref.hrry").read_bytes()
    reader = open_store((tmp_path / "kv").as_uri())
    assert all(reader.get(n).equal(segment(1, seed=i)) for i, n in enumerate(names))
    # a file of the learnt size whose descriptor bytes differ takes the full rules
    path = store.path(names[2])
    data = bytearray(path.read_bytes())
    data[-40:-36] = b"\xff\xff\xff\xff"  # inside the trailer: the index offset
    path.write_bytes(bytes(data))
    with pytest.raises(hk.HurrayError):
        reader.get(names[2])


def test_server_aliases_survive_a_restart_and_stay_in_their_tenant(tmp_path):
    keys = ChunkKeys(identity_digest("restart"), CHUNK).upto(list(range(12)), 3)
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st:
        store = open_store(f"hurray://{st.address}")
        store.put(keys, 0, segment(3), {})
        store.close()
    with KVServer(listen="127.0.0.1:0", persist=str(tmp_path)).run_in_thread() as st:
        store = open_store(f"hurray://{st.address}")
        (name,) = set(store.locate(keys))
        assert store.get(name).equal(segment(3))
        with KVClient(st.address) as c:
            assert c.locate(["nothing-here"]) == [None]
            c.link([("alias-of-nothing", "missing")])
            assert c.locate(["alias-of-nothing"]) == [None]  # a dangling alias names nothing
        store.close()


@pytest.mark.parametrize(("url", "why"), [
    ("ftp://x/y", "scheme"), ("file://host/x", "local"), ("http://127.0.0.1:1", "scheme"),
    # Issue 29 item 4: a ValueError, a part of the URL dropped, a NUL byte at open
    ("hurray://[::1", "does not parse as a URL"),
    ("file:///tmp/x?max_bytes=1", r"query 'max_bytes=1' is not read by a file:// store "
                                  r"\(file:///DIR\): max_bytes is a setting of its own"),
    ("file:///tmp/x%00y", "NUL byte"), ("hurray://h:1#x", "fragment 'x' is not read"),
    # the outside review of issue 29: a UnicodeError at the first connection, OSErrors at
    # open
    ("hurray://" + "a" * 64 + ":1", "is not a DNS name"),
    ("redis://" + ("a" * 60 + ".") * 5 + "b:1", "a DNS name has at most 253"),
    ("file:///dev/null", "cannot be opened: File exists: /dev/null"),
    ("file:///proc/self/no/such", "cannot be opened: No such file or directory"),
    ("file:///tmp/" + "x" * 300, "cannot be opened: File name too long"),
])
def test_store_urls_are_checked(url, why):
    with pytest.raises(hk.HurrayError, match=why) as e:
        open_store(url, timeout=0.1)
    assert e.value.field == "url"


def test_a_fresh_process_finds_every_ranks_aliases(tmp_path):
    # a restarted TP=2 engine: each rank's store reads the log others wrote (".tpR" keys)
    url = (tmp_path / "kv").as_uri()
    keys = ChunkKeys(identity_digest("tp"), CHUNK).upto(list(range(8)), 2)
    for rank in (0, 1):
        open_store(url, suffix=f".tp{rank}").put(keys, 0, segment(2, seed=rank), {})
    for rank in (0, 1):
        fresh = open_store(url, suffix=f".tp{rank}")
        (name,) = set(fresh.locate(keys))
        assert fresh.get(name).equal(segment(2, seed=rank))


def test_an_operators_clean_up_is_seen_without_a_restart(tmp_path):
    url = (tmp_path / "kv").as_uri()
    keys = ChunkKeys(identity_digest("ops"), CHUNK).upto(list(range(8)), 2)
    writer, reader = open_store(url), open_store(url)
    writer.put(keys, 0, segment(2), {})
    assert None not in reader.locate(keys)
    (tmp_path / "kv" / "aliases.log").write_bytes(b"")  # emptied in place
    assert reader.locate(keys) == [None, None]
    writer.put(keys, 0, segment(2), {})
    assert None not in reader.locate(keys)  # appended to the emptied log: found again
    log = tmp_path / "kv" / "aliases.log"
    log.rename(tmp_path / "old.log")
    log.write_bytes(b"")  # replaced by another file (bigger than nothing read yet: 0)
    assert reader.locate(keys) == [None, None]
    for p in (tmp_path / "kv").iterdir():
        p.unlink()
    (tmp_path / "kv").rmdir()  # the whole directory removed
    assert reader.locate(keys) == [None, None]
    writer.put(keys, 0, segment(2), {})  # recreated by the next store
    assert None not in reader.locate(keys)


def test_a_log_replaced_by_a_longer_one_is_read_from_its_start(tmp_path):
    """A log replaced by another file is read again from its start, even when the new one
    is no shorter than what was read of the old (its size alone says nothing: its inode
    does), so aliases the new log no longer holds are forgotten."""
    url = (tmp_path / "kv").as_uri()
    first = ChunkKeys(identity_digest("first"), CHUNK).upto(list(range(8)), 2)
    second = ChunkKeys(identity_digest("second"), CHUNK).upto(list(range(8)), 2)
    writer, reader = open_store(url), open_store(url)
    writer.put(first, 0, segment(2), {})
    log = tmp_path / "kv" / "aliases.log"
    kept = log.read_bytes()
    writer.put(second, 0, segment(2, seed=1), {})
    assert None not in reader.locate(first) and None not in reader.locate(second)
    # the first segment's lines, then a line that is no alias, past what was read
    replacement = tmp_path / "kv" / "new.log"
    replacement.write_bytes(kept + b"#" * (2 * len(log.read_bytes())) + b"\n")
    replacement.replace(log)
    assert reader.locate(second) == [None, None]
    assert None not in reader.locate(first)


@pytest.mark.parametrize("name", ["../x-0", "/etc/passwd-0", "a" * 300 + "-0", "ab\0cd-0",
                                  "ab" * 16, "ab" * 16 + "-x", "ab" * 16 + ".tp1/../y-3"])
def test_names_outside_the_grammar_are_misses(tmp_path, name):
    store = open_store((tmp_path / "kv").as_uri())
    key = "cd" * 16
    with open(tmp_path / "kv" / "aliases.log", "ab") as f:
        f.write(f"{key} {name}\n".encode("utf-8", "surrogateescape"))
    assert store.locate([key]) == [None]
    with pytest.raises(hk.HurrayError, match=r"segment name .* is not KEY-FIRST"):
        store.get(name)
    with pytest.raises(hk.HurrayError, match="segment name"):
        segment_first(name)


def test_linked_segments_and_logs_are_not_followed(tmp_path):
    url = (tmp_path / "kv").as_uri()
    keys = ChunkKeys(identity_digest("links"), CHUNK).upto(list(range(8)), 2)
    store = open_store(url)
    store.put(keys, 0, segment(2), {})
    (file,) = (tmp_path / "kv").glob("*.hrry")
    target = tmp_path / "elsewhere.hrry"
    file.rename(target)
    file.symlink_to(target)  # a planted link where a segment was
    assert open_store(url).locate(keys) == [None, None]
    with pytest.raises(hk.HurrayError):
        open_store(url).get(file.stem)
    log = tmp_path / "kv" / "aliases.log"
    log.rename(tmp_path / "real.log")
    log.symlink_to(tmp_path / "real.log")
    with pytest.raises(hk.HurrayError, match="aliases"):
        store.put(keys, 0, segment(2), {})  # never appends through a link
    assert (tmp_path / "real.log").read_text().count("\n") == 2


def test_a_segment_that_shrinks_while_read_is_an_error_not_a_signal(tmp_path, monkeypatch):
    import os

    from hurraykv.chunks.file import store as chunks

    url = (tmp_path / "kv").as_uri()
    keys = ChunkKeys(identity_digest("cut"), CHUNK).upto(list(range(8)), 2)
    open_store(url).put(keys, 0, segment(2), {})
    (file,) = (tmp_path / "kv").glob("*.hrry")
    real = os.preadv

    def cut_first(fd, buffers, offset):  # the file is truncated between stat and read
        os.truncate(file, 100)
        return real(fd, buffers, offset)

    monkeypatch.setattr(chunks.os, "preadv", cut_first)
    with pytest.raises(hk.HurrayError, match=r"shrank from .* to 100 bytes"):
        open_store(url).get(file.stem)
