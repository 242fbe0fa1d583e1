"""PageStore against a real redis-server and a real 3-master Redis Cluster."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.paged import BlockPagedTensor
from hurraykv.snapshot import KVCacheSnapshot
from hurraykv.store import PageStore
from hurraykv.store.manifest import parse_prefix_value, prefix_value, token_chains
from hurraykv.store.pages import StoreError, page_key
from hurraykv.store.scripts import prefix_key
from tests.support.redis_fixtures import emptied_url
from tests.support.snapshots import make_snapshot, zeroed


@pytest.fixture(params=["single", "cluster"])
def store(request):
    s = PageStore.from_url(emptied_url(request))
    yield s
    s.client.close()



@pytest.mark.parametrize("kind", ["float16", "int8", "int4", "fp8"])
def test_round_trip_bit_exact(store, kind):
    s = make_snapshot(kind)
    store.put("snap", s)
    back = store.get("snap")
    assert back.equal(zeroed(s))
    if kind == "fp8":
        np.testing.assert_array_equal(back.kv_scales, s.kv_scales)
    key, value = store.get_layer("snap", 2)
    assert key.equal(zeroed(s).layer(2)[0]) and value.equal(zeroed(s).layer(2)[1])
    if kind == "fp8":
        assert value.fp8_scale == s.layer(2)[1].fp8_scale
    with pytest.raises(StoreError, match=f"has no layer {s.num_layers}"):
        store.get_layer("snap", s.num_layers)


def _prompt_batch(seed: int, shared_pages: int, own_pages: int, layers: int = 2):
    """Sequences that start with the same system prompt (shared_pages full pages)."""
    rng = np.random.default_rng(100)
    prompt = [rng.standard_normal((shared_pages * 4, 2, 8)).astype(np.float16)
              for _ in range(2 * layers)]
    own = np.random.default_rng(seed)
    tensors = []
    for i in range(layers):
        for r, role in enumerate(("key", "value")):
            seqs = [np.concatenate([prompt[2 * i + r], own.standard_normal(
                (own_pages * 4 - 1, 2, 8)).astype(np.float16)]) for _ in range(2)]
            tensors.append(BlockPagedTensor.from_sequences(seqs, 4, kv_role=role,
                                                           layer_index=i))
    return KVCacheSnapshot.from_tensors(tensors)


def test_shared_pages_are_stored_once_and_delete_keeps_the_other(store):
    a, b = _prompt_batch(1, shared_pages=3, own_pages=2), _prompt_batch(2, 3, 2)
    store.put("a", a)
    after_a = store.stats()
    store.put("b", b)
    stats = store.stats()
    page_bytes = 4 * 2 * 8 * 2
    # each snapshot: 4 members x (3 prompt pages + 2 x 2 own pages) referenced
    assert after_a["pages"] == 4 * (3 + 4)
    assert stats["pages"] == 4 * (3 + 4 + 4)  # b adds only its own pages
    assert stats["logical_bytes"] == 2 * 4 * (3 + 4) * page_bytes
    assert stats["stored_bytes"] == stats["pages"] * page_bytes
    assert stats["logical_bytes"] / stats["stored_bytes"] > 1.2
    store.delete("a")
    assert store.get("b").equal(b)
    left = store.stats()
    assert left["pages"] == 4 * 7 and left["snapshots"] == 1
    store.delete("b")
    assert store.stats()["pages"] == 0 and store.stats()["stored_bytes"] == 0
    with pytest.raises(StoreError, match="no snapshot 'a'"):
        store.get("a")


def test_lookup_prefix_on_shared_and_diverging_prompts(store):
    s = _prompt_batch(3, shared_pages=3, own_pages=2, layers=1)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 32000, 12)
    tails = [rng.integers(0, 32000, 7), rng.integers(0, 32000, 7)]
    tokens = [np.concatenate([prompt, t]) for t in tails]
    store.put("chat", s, token_ids=tokens)
    # the whole of sequence 1's full pages
    assert store.lookup_prefix(tokens[1]) == ("chat", 1, 16)
    # a new request with the same system prompt and a different question
    new = np.concatenate([prompt, rng.integers(0, 32000, 9)])
    sid, _seq, matched = store.lookup_prefix(new)
    assert (sid, matched) == ("chat", 12)
    # diverging inside the second page: only the first page matches
    early = prompt.copy()
    early[5] += 1
    assert store.lookup_prefix(early)[2] == 4
    assert store.lookup_prefix(rng.integers(0, 32000, 40)) is None
    store.delete("chat")
    assert store.lookup_prefix(tokens[0]) is None


def test_a_sequence_shorter_than_a_page_is_indexed_by_its_full_pages_only(store):
    """Before: a put whose token_ids held a sequence of fewer tokens than a page failed
    with NumPy's ValueError (no full page to reshape) after the snapshot was stored."""
    s = make_snapshot()  # sequences of 10, 6, 5 and 1 tokens, pages of 4
    tokens = np.arange(22)
    store.put("short", s, token_ids=tokens)
    assert store.get("short").equal(zeroed(s))
    assert store.lookup_prefix(tokens[:10], 4) == ("short", 0, 8)
    assert store.lookup_prefix(tokens[21:], 4) is None  # the 1-token sequence: no page


_GEN = bytes(range(16))
_GOOD = prefix_value("chat", 1, 16, _GEN)
_DAMAGED = [
    b"", _GOOD[:3], _GOOD[:8], _GOOD[:4 + 4 + 4 + 7],   # truncated before and inside fields
    _GOOD[:-1], _GOOD + b"\0",                           # a generation of 15 or 17 bytes
    struct.pack("<I", 1 << 31) + _GOOD[4:],              # an id longer than the value
    struct.pack("<I", 4) + b"ch\xffa" + _GOOD[8:],       # an id that is not UTF-8
]


def test_prefix_values_parse_or_raise_store_error():
    assert parse_prefix_value(_GOOD) == ("chat", 1, 16, _GEN)
    assert parse_prefix_value(_GOOD[:-16]) == ("chat", 1, 16, None)  # before generations
    for bad in _DAMAGED:
        with pytest.raises(StoreError) as exc:
            parse_prefix_value(bad)
        assert exc.value.field and exc.value.rule, bad


def test_lookup_prefix_passes_over_damaged_index_entries(store):
    """A damaged prefix-index value is a StoreError inside lookup_prefix, never a
    struct.error or UnicodeDecodeError: the entry is passed over for a shorter one."""
    s = _prompt_batch(3, shared_pages=3, own_pages=2, layers=1)
    rng = np.random.default_rng(7)
    tokens = [rng.integers(0, 32000, 19), rng.integers(0, 32000, 19)]
    store.put("chat", s, token_ids=tokens)
    chains = token_chains(tokens[1], s.layer(0)[0].page_size)
    for bad in _DAMAGED:
        for c in chains[1:]:
            store.client.set(prefix_key(c), bad)
        assert store.lookup_prefix(tokens[1]) == ("chat", 1, 4)


def test_missing_page_is_an_error_never_wrong_data(store):
    s = make_snapshot("float16", layers=2)
    store.put("victim", s)
    member = s.tensor(1, "value")
    from hurraykv.store.members import Member as _Member

    digests = _Member(member).digests()
    others = {d for k in s.member_keys() if k != (1, "value")
              for d in _Member(s.tensor(*k)).digests()}
    victim = next(d for d in digests if d != bytes(16) and d not in others)
    store.client.delete(page_key(victim))
    with pytest.raises(StoreError, match=r"'victim': layer 1 value page \d+ .* missing"):
        store.get("victim")
    assert store.get_layer("victim", 0)[0].equal(zeroed(s).layer(0)[0])


def test_token_ids_must_fit_the_snapshot(store):
    s = make_snapshot("float16", layers=1)
    with pytest.raises(StoreError, match="token_ids"):
        store.put("bad", s, token_ids=[np.arange(3)] * 4)


def test_replacing_a_snapshot_keeps_counts_right(store):
    s1, s2 = make_snapshot("float16", seed=1), make_snapshot("float16", seed=2)
    store.put("x", s1)
    store.put("x", s2)
    assert store.get("x").equal(zeroed(s2))
    stats = store.stats()
    assert stats["snapshots"] == 1 and stats["pages"] == 42
    store.delete("x")
    assert store.stats()["pages"] == 0


def test_the_kv_server_uses_the_store_as_backing_tier(redis_url):
    from hurraykv.net.client import KVClient
    from hurraykv.net.server import KVServer

    s = make_snapshot("int8")
    with KVServer(listen="127.0.0.1:0", store=redis_url).run_in_thread() as st, \
            KVClient(st.address) as c:
        c.push("tiered", s)
    # a new server with an empty memory finds it in Redis
    with KVServer(listen="127.0.0.1:0", store=redis_url).run_in_thread() as st, \
            KVClient(st.address) as c:
        assert c.pull("tiered").equal(zeroed(s))
        c.delete("tiered")
    assert "tiered" not in PageStore.from_url(redis_url)
    assert hk  # the package imports without redis for users who do not need it
