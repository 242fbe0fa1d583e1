"""BlockPagedTensor on real data: lookup formula, gather, sharing, invariants, D6, wire."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hurraykv as hk
from hurraykv.paged import BlockPagedTensor
from hurraykv.wire.descriptor import decode_descriptor
from tests.vectors.make_vectors import WORKED


def reference_element(pool_flat, bt, sp, ps, H, D, s, t, h, d):
    """block-paged.md § Element Lookup, written out literally."""
    page_in_seq = t // ps
    offset_in_page = t % ps
    phys_page = bt[sp[s] + page_in_seq]
    flat = ((phys_page * ps + offset_in_page) * H + h) * D + d
    return pool_flat[flat]


@st.composite
def batches(draw):
    H, D = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    ps = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    prefix = rng.standard_normal((draw(st.integers(0, 3 * ps)), H, D)).astype(np.float32)
    seqs = []
    for _ in range(draw(st.integers(0, 6))):
        keep = draw(st.integers(0, len(prefix)))
        tail = rng.standard_normal((draw(st.integers(0, 2 * ps + 1)), H, D)).astype(np.float32)
        seqs.append(np.concatenate([prefix[:keep], tail]))
    return seqs, ps, H, D


@settings(max_examples=150, deadline=None)
@given(batches(), st.booleans())
def test_from_sequences_gather_and_lookup_match_the_input(batch, share):
    seqs, ps, H, D = batch
    t = BlockPagedTensor.from_sequences(seqs, ps, share_prefix=share, element_type="float32",
                                        num_heads=H, head_dim=D)
    t.validate()
    assert t.shape == (sum(len(s) for s in seqs), H, D)
    flat = t.page_pool.reshape(-1)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(t.gather(i), s)
        for tok in range(len(s)):
            h, d = tok % H, (tok * 7) % D
            assert t.element(i, tok, h, d) == s[tok, h, d]
            assert reference_element(flat, t.block_table, t.seq_ptr, ps, H, D,
                                     i, tok, h, d) == s[tok, h, d]
    dense = t.to_dense()
    expect = np.concatenate(seqs) if seqs else np.zeros((0, H, D), np.float32)
    np.testing.assert_array_equal(dense, expect)
    if not share:
        assert len(t.shared_pages) == 0


def test_prefix_sharing_stores_identical_leading_pages_once():
    rng = np.random.default_rng(1)
    prompt = rng.standard_normal((8, 2, 4)).astype(np.float16)
    a = np.concatenate([prompt, rng.standard_normal((3, 2, 4)).astype(np.float16)])
    b = np.concatenate([prompt, rng.standard_normal((5, 2, 4)).astype(np.float16)])
    c = np.concatenate([prompt[:4], prompt[:4]])  # page 1 equals a's page 0 but not a prefix
    t = BlockPagedTensor.from_sequences([a, b, c], 4)
    bt, sp = t.block_table, t.seq_ptr
    assert list(bt[sp[0]:sp[0] + 2]) == list(bt[sp[1]:sp[1] + 2])  # two shared pages
    assert bt[sp[2]] == bt[sp[0]] and bt[sp[2] + 1] != bt[sp[0] + 1]
    assert set(t.shared_pages) == {bt[0], bt[1]}
    # a's and b's partial last pages are their own
    assert t.num_pages == 2 + 1 + 2 + 1
    unshared = BlockPagedTensor.from_sequences([a, b, c], 4, share_prefix=False)
    assert unshared.num_pages == 3 + 4 + 2


def test_worked_example_from_the_spec():
    pool = np.arange(320, dtype=np.float16).reshape(5, 4, 2, 8)
    t = BlockPagedTensor(pool, [0, 1, 0], [0, 2, 3], [6, 3], kv_role="key", layer_index=3)
    assert t.descriptor() == WORKED
    np.testing.assert_array_equal(t.gather(0), pool[[0, 1]].reshape(8, 2, 8)[:6])
    np.testing.assert_array_equal(t.gather(1), pool[0, :3])
    assert list(t.shared_pages) == [0]
    assert list(t.referenced_pages) == [0, 1]


def test_element_refuses_to_read_past_the_valid_token_count():
    pool = np.zeros((5, 4, 2, 8), np.float16)
    t = BlockPagedTensor(pool, [0, 1, 0], [0, 2, 3], [6, 3])
    with pytest.raises(hk.LayoutError, match="3 valid tokens"):
        t.element(1, 3, 0, 0)  # slot 3 of page 0 is within the page, past the sequence
    with pytest.raises(hk.LayoutError, match=r"h in \[0, 2\)"):
        t.element(0, 0, 2, 0)


def test_gather_does_not_touch_slots_past_a_sequence():
    pool = np.zeros((2, 4, 1, 1), np.float32)
    pool[1, 2:] = np.nan  # undefined slots of the partial last page
    t = BlockPagedTensor(pool, [0, 1], [0, 2], [6])
    assert not np.isnan(t.gather(0)).any() and t.gather(0).shape == (6, 1, 1)


@pytest.mark.parametrize(("bt", "sp", "lens", "field"), [
    ([0, 1, 0], [1, 2, 3], [6, 3], "seq_ptr[0]"),
    ([0, 1, 0], [0, 4, 3], [6, 3], "seq_ptr[2]"),
    ([0, 1, 0], [0, 2, 2], [6, 3], "seq_ptr[2]"),
    ([0, 7, 0], [0, 2, 3], [6, 3], "block_table[1]"),
    ([0, 1, 0], [0, 2, 3], [9, 0], "seq_lens[0]"),
    ([0, 1, 0], [0, 2, 3], [6], "seq_lens"),
    ([0, -1, 0], [0, 2, 3], [6, 3], "block_table[1]"),
])
def test_constructor_validates_invariants(bt, sp, lens, field):
    with pytest.raises(hk.LayoutError) as exc:
        BlockPagedTensor(np.zeros((5, 4, 2, 8), np.float16), bt, sp, lens)
    assert exc.value.field == field


def test_validate_on_a_million_entry_block_table_is_vectorised():
    n = 1_000_000
    rng = np.random.default_rng(0)
    bt = rng.integers(0, 64, n)
    sp = np.linspace(0, n, 1001).astype(np.int64)
    lens = np.diff(sp) * 2
    t = BlockPagedTensor(np.zeros((64, 2, 1, 1), np.int8), bt, sp, lens)
    t.block_table = t.block_table.copy()
    t.block_table[n - 3] = 64
    with pytest.raises(hk.LayoutError, match=f"block_table\\[{n - 3}\\]"):
        t.validate()


def test_descriptor_round_trip_is_zero_copy():
    rng = np.random.default_rng(3)
    seqs = [rng.standard_normal((n, 2, 8)).astype(np.float16) for n in (5, 11, 4)]
    t = BlockPagedTensor.from_sequences(seqs, 4, kv_role="value", layer_index=7)
    bufs = t.buffers()
    assert np.shares_memory(np.frombuffer(bufs[0], np.uint8), t.page_pool)
    desc = decode_descriptor(t.descriptor().encode())
    back = BlockPagedTensor.from_descriptor(desc, bufs, seq_lens=t.seq_lens)
    assert np.shares_memory(back.page_pool, t.page_pool)
    assert back.equal(t) and back.kv_role == "value" and back.layer_index == 7
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(back.gather(i), s)


def test_from_descriptor_checks_buffer_sizes():
    desc = WORKED
    with pytest.raises(hk.BufferError, match=r"buffers\[1\] at buffer 1: found 8"):
        BlockPagedTensor.from_descriptor(desc, [bytes(640), bytes(8), bytes(12)])
    with pytest.raises(hk.BufferError, match="declares 3 buffers"):
        BlockPagedTensor.from_descriptor(desc, [bytes(640)])


def test_seq_lens_derived_only_when_unambiguous():
    pool = np.arange(320, dtype=np.float16).reshape(5, 4, 2, 8)
    bt, sp = np.array([0, 1, 0], "<u4"), np.array([0, 2, 3], "<u4")
    ragged = BlockPagedTensor.from_descriptor(WORKED, [pool.tobytes(), bt.tobytes(),
                                                       sp.tobytes()])
    assert ragged.seq_lens is None
    with pytest.raises(hk.SeqLensRequiredError, match="supply seq_lens"):
        ragged.gather(0)
    with pytest.raises(hk.SeqLensRequiredError):
        ragged.to_dense()
    full = BlockPagedTensor(pool, [0, 1, 0], [0, 2, 3], [8, 4])
    back = BlockPagedTensor.from_descriptor(full.descriptor(), full.buffers())
    assert list(back.seq_lens) == [8, 4]
    one = BlockPagedTensor(pool, [0, 1], [0, 2], [7])
    assert list(BlockPagedTensor.from_descriptor(one.descriptor(), one.buffers()).seq_lens) \
        == [7]


def test_empty_batch():
    t = BlockPagedTensor(np.zeros((0, 4, 2, 8), np.float16), [], [0], [])
    assert t.num_seqs == 0 and t.shape == (0, 2, 8)
    assert t.to_dense().shape == (0, 2, 8)
    desc = decode_descriptor(t.descriptor().encode())
    back = BlockPagedTensor.from_descriptor(desc, t.buffers())
    assert back.num_seqs == 0 and list(back.seq_lens) == []


def test_zero_unused_slots_zeroes_exactly_what_no_sequence_reads():
    pool = np.ones((6, 4, 1, 2), np.float32)
    t = BlockPagedTensor(pool, [0, 1, 0, 2], [0, 2, 4], [6, 5])
    before = [t.gather(s).copy() for s in range(2)]
    # page 0: all 4 used (seq 0); page 1: 2 of 4; page 2: 1 of 4; pages 3-5 unreferenced
    assert t.zero_unused_slots() == 2 + 3 + 12
    used = t.used_slots().reshape(6, 4)
    assert (t.page_pool[~used] == 0).all() and (t.page_pool[used] == 1).all()
    for s in range(2):
        np.testing.assert_array_equal(t.gather(s), before[s])


def test_zero_unused_slots_refuses_a_read_only_pool():
    t = BlockPagedTensor(np.zeros((5, 4, 2, 8), np.float16), [0, 1, 0], [0, 2, 3], [6, 3])
    ro = BlockPagedTensor.from_descriptor(t.descriptor(), [bytes(b) for b in t.buffers()],
                                          t.seq_lens)
    with pytest.raises(hk.BufferError, match="read-only"):
        ro.zero_unused_slots()


def test_compact_keeps_referenced_pages_and_aliasing():
    rng = np.random.default_rng(5)
    pool = rng.standard_normal((8, 2, 1, 3)).astype(np.float32)
    t = BlockPagedTensor(pool, [6, 2, 6, 4], [0, 2, 4], [4, 3])
    c = t.compact()
    assert c.num_pages == 3 and list(c.block_table) == [2, 0, 2, 1]
    for s in range(2):
        np.testing.assert_array_equal(c.gather(s), t.gather(s))
    assert list(c.shared_pages) == [2]


@pytest.mark.parametrize("name", ["int4", "uint4", "int2", "uint2"])
def test_sub_byte_pools_are_packed_per_page(name):
    rng = np.random.default_rng(7)
    lo, hi = {"int4": (-8, 8), "uint4": (0, 16), "int2": (-2, 2), "uint2": (0, 4)}[name]
    seqs = [rng.integers(lo, hi, (n, 2, 4)).astype(np.int8) for n in (5, 9, 3)]
    t = BlockPagedTensor.from_sequences(seqs, 4, element_type=name)
    bits = int(name[-1])
    assert len(t.buffers()[0]) == t.num_pages * 4 * 2 * 4 * bits // 8
    back = BlockPagedTensor.from_descriptor(decode_descriptor(t.descriptor().encode()),
                                            t.buffers(), t.seq_lens)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(back.gather(i), s)
        assert back.element(i, len(s) - 1, 1, 3) == s[-1, 1, 3]
    back_copy = back.copy()
    back_copy.zero_unused_slots()
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(back_copy.gather(i), s)


def test_sub_byte_pages_must_be_byte_aligned():
    with pytest.raises(hk.UnsupportedError, match="D11"):
        BlockPagedTensor(np.zeros((2, 1, 1, 1), np.int8), [0], [0, 1], [1], element_type="int4")


def test_index_type_chosen_and_checked():
    pool = np.zeros((5, 4, 2, 8), np.float16)
    t = BlockPagedTensor(pool, [0, 1, 0], [0, 2, 3], [6, 3], index_type="uint64")
    assert t.block_table.dtype == np.dtype("<u8")
    assert t.descriptor().layout.index_type == 1
    with pytest.raises(hk.LayoutError, match="index_type"):
        BlockPagedTensor(pool, [0], [0, 1], [1], index_type="int16")


def test_fp8_and_bf16_pools():
    import ml_dtypes

    rng = np.random.default_rng(9)
    for dt, tag in ((ml_dtypes.float8_e4m3fn, 0x40), (ml_dtypes.float8_e5m2, 0x41),
                    (ml_dtypes.bfloat16, 0x02)):
        seqs = [rng.standard_normal((n, 2, 8)).astype(dt) for n in (3, 17)]
        t = BlockPagedTensor.from_sequences(seqs, 16)
        assert t.descriptor().type_tag == tag
        back = BlockPagedTensor.from_descriptor(decode_descriptor(t.descriptor().encode()),
                                                t.buffers(), t.seq_lens)
        for i, s in enumerate(seqs):
            assert back.gather(i).tobytes() == s.tobytes()


def test_quantized_descriptor_and_params_survive_the_round_trip():
    from tests.vectors.make_vectors import QUANT

    scales = np.linspace(0.5, 2.0, 20).astype("<f4")
    pool = np.arange(320, dtype=np.int64).astype(np.int8)
    bufs = [pool.tobytes(), np.array([0, 1, 0], "<u4").tobytes(),
            np.array([0, 2, 3], "<u4").tobytes(), scales.tobytes()]
    t = BlockPagedTensor.from_descriptor(QUANT, bufs, seq_lens=[6, 3])
    assert t.descriptor() == QUANT
    assert [bytes(b) for b in t.buffers()] == bufs
    c = BlockPagedTensor.from_descriptor(QUANT, [bytes(b) for b in bufs], [6, 3]).compact()
    assert c.num_pages == 2
    kept = np.frombuffer(bytes(c.buffers()[3]), "<f4")
    np.testing.assert_array_equal(kept, scales[:8])  # pages 0 and 1 keep their slot scales


def test_gather_into_a_reused_buffer():
    rng = np.random.default_rng(11)
    seqs = [rng.standard_normal((n, 2, 8)).astype(np.float16) for n in (5, 9)]
    t = BlockPagedTensor.from_sequences(seqs, 4)
    buf = np.empty((9, 2, 8), np.float16)
    assert t.gather(1, out=buf) is buf
    np.testing.assert_array_equal(buf, seqs[1])
    dense = np.empty((14, 2, 8), np.float16)
    t.to_dense(out=dense)
    np.testing.assert_array_equal(dense, np.concatenate(seqs))
    with pytest.raises(hk.LayoutError, match="out must be"):
        t.gather(0, out=buf)


def test_used_slots_with_look_ahead_pages():
    """A sequence may own more pages than its tokens fill (engines allocate ahead)."""
    pool = np.ones((6, 4, 1, 1), np.float32)
    t = BlockPagedTensor(pool, [0, 1, 2, 3, 4], [0, 3, 5], [5, 0])
    used = t.used_slots().reshape(6, 4)
    assert used[0].all() and list(used[1]) == [True, False, False, False]
    assert not used[2:].any()
    reference = np.zeros(24, bool)
    reference[t._slots(np.arange(2))] = True
    np.testing.assert_array_equal(t.used_slots(), reference)
