"""The compiled kernels give the bytes and values the NumPy path gives.

Every case runs twice on the same tensor, kernels on and kernels off (``ENABLED`` is read
at call time), and compares every buffer byte and every dequantized float bit.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hurraykv as hk
from hurraykv import kernels, quant, threads
from hurraykv.wire.quantization import storage_range


def test_kernels_are_on_in_the_test_environment():
    # numba is a test dependency: a silent fallback would make every test below vacuous
    assert kernels.ENABLED or os.environ.get("HURRAYKV_KERNELS") == "numpy"


def both_paths(fn, monkeypatch):
    monkeypatch.setattr(kernels, "ENABLED", False)
    slow = fn()
    monkeypatch.setattr(kernels, "ENABLED", True)
    fast = fn()
    return slow, fast


def tensor(pool: np.ndarray, rng: np.random.Generator) -> hk.BlockPagedTensor:
    """Two sequences over a permuted pool, one page shared, a partial last page and
    pages nobody reads."""
    pages, ps = pool.shape[:2]
    bt = rng.permutation(pages)[: pages - 3].astype(np.uint32)
    cut = len(bt) // 2
    bt[cut] = bt[0]  # shared by both sequences
    lens = [cut * ps - 5, (len(bt) - cut) * ps - 1]
    return hk.BlockPagedTensor(pool, bt, np.array([0, cut, len(bt)], np.uint32),
                               seq_lens=np.array(lens))


def quantized_outputs(t, dtype, symmetric, scale_dtype):
    q = t.quantize("per_block_affine", dtype, symmetric, scale_dtype=scale_dtype)
    out = np.empty((int(q.seq_lens[1]), q.num_heads, q.head_dim), np.float32)
    return ([bytes(b) for b in q.buffers()], q.to_dense(dequantize=True).view(np.uint32),
            q.gather(1, out=out, dequantize=True).view(np.uint32),
            q.dequantize().page_pool.view(np.uint32))


def assert_same(slow, fast):
    buffers, *floats = slow
    fast_buffers, *fast_floats = fast
    assert len(buffers) == len(fast_buffers)
    for i, (a, b) in enumerate(zip(buffers, fast_buffers, strict=True)):
        assert a == b, f"buffer {i} differs"
    for a, b in zip(floats, fast_floats, strict=True):
        np.testing.assert_array_equal(a, b)


POOL_TYPES = [np.float16, ml_dtypes.bfloat16, np.float32]
CODES = [("int8", True), ("int8", False), ("uint8", False), ("int4", True), ("int4", False),
         ("uint4", False), ("int2", True), ("uint2", False)]


def outcome(fn):
    """What a quantization gives: its outputs, or the text of its refusal."""
    try:
        return fn()
    except hk.QuantizationError as exc:
        return str(exc)


def assert_same_outcome(slow, fast):
    if isinstance(slow, str) or isinstance(fast, str):
        assert slow == fast
    else:
        assert_same(slow, fast)


def qmax_of(dtype: str, symmetric: bool) -> int:
    lo, hi = storage_range(dtype)
    return hi if symmetric else hi - lo


@pytest.mark.parametrize("pool_type", POOL_TYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize(("dtype", "symmetric"), CODES)
@pytest.mark.parametrize("scale_dtype", ["float32", "float16", "bfloat16"])
def test_block_affine_kernels_match_numpy(pool_type, dtype, symmetric, scale_dtype,
                                          monkeypatch):
    rng = np.random.default_rng(7)
    pool = (rng.standard_normal((24, 16, 4, 32)) * 5).astype(pool_type)
    flat = pool.reshape(-1, 4 * 32)
    flat[3] = 0  # an all-zero slot: scale 1
    flat[4] = pool_type(2.5)  # a constant slot
    flat[5, :6] = np.array([6e-8, -6e-8, 1e-5, -1e-5, 0, -0.0]).astype(pool_type)
    flat[6] = np.finfo(pool_type).max if pool_type is not ml_dtypes.bfloat16 else 1e30
    flat[7] = -flat[6]
    slow, fast = both_paths(lambda: outcome(lambda: quantized_outputs(
        tensor(pool, rng=np.random.default_rng(1)), dtype, symmetric, scale_dtype)),
        monkeypatch)
    assert_same_outcome(slow, fast)
    # slot 6 needs a scale of its value / qmax (its range / (qmax - qmin) when
    # asymmetric): refused where that passes the scale type's largest value, and where
    # the scale's extreme code would decode to Inf (H74); nothing else is refused
    need = np.float32(flat[6, 0]) / np.float32(qmax_of(dtype, symmetric))
    if not need <= quant.scale_limit(quant.SCALE_TAGS[scale_dtype]):
        assert isinstance(slow, str)
    if isinstance(slow, str):
        assert "page_pool slot at index 6" in slow and scale_dtype in slow
        assert float(need) * qmax_of(dtype, symmetric) > 1e4


def test_defined_at_the_edges_under_the_generic_target_too():
    # make test runs this file again with NUMBA_CPU_NAME=generic (no AVX-512): the kernels
    # must give the same bytes there as here, which the tests above check on each run
    assert os.environ.get("NUMBA_CPU_NAME", "host") in ("host", "generic")
    if os.environ.get("NUMBA_CPU_NAME") == "generic":
        import numba
        assert numba.config.CPU_NAME == "generic" and numba.config.CPU_FEATURES == ""


EDGES = [  # (pool dtype, a slot's values, storage, symmetric, scale_dtype): all refused
    (np.float32, [1e10, 1, -1, 0], "int8", True, "float16"),  # 1e10/127 > 65504
    (np.float32, [8.4e6, 1, -1, 0], "int8", True, "float16"),  # just past: 66142 > 65504
    (np.float32, [0, 3e38, -3e38, 0], "uint8", False, "float32"),  # range overflows f32
    (np.float32, [3e38, -3e38, 1, 0], "int4", False, "float32"),
    (np.float32, [3e38, -3e38, 1, 0], "int2", False, "float32"),
    (ml_dtypes.bfloat16, [1e30, -1e30, 0, 0], "int4", True, "float16"),
]


@pytest.mark.parametrize(("pool_type", "values", "dtype", "symmetric", "scale_dtype"), EDGES)
@pytest.mark.parametrize("enabled", [False, True])
def test_scales_a_type_cannot_hold_are_refused_by_slot(pool_type, values, dtype, symmetric,
                                                      scale_dtype, enabled, monkeypatch):
    monkeypatch.setattr(kernels, "ENABLED", enabled)
    pool = np.zeros((4, 4, 1, 4), pool_type)
    pool[2, 1, 0] = np.array(values, np.float32).astype(pool_type)
    t = hk.BlockPagedTensor(pool, np.array([0, 2], np.uint32), np.array([0, 2], np.uint32),
                            seq_lens=np.array([8]))
    with pytest.raises(hk.QuantizationError,
                       match=rf"page_pool slot at index 9: .*at most {scale_dtype}'s largest"):
        t.quantize("per_block_affine", dtype, symmetric, scale_dtype=scale_dtype)


@pytest.mark.parametrize("scheme", ["per_tensor", "per_channel"])
def test_float32_ranges_that_overflow_are_refused_for_every_scheme(scheme):
    pool = np.zeros((4, 4, 2, 4), np.float32)
    pool[0, 1, 1, 2], pool[0, 2, 1, 3] = 3e38, -3e38
    t = hk.BlockPagedTensor(pool, np.array([0], np.uint32), np.array([0, 1], np.uint32),
                            seq_lens=np.array([4]))
    where = "quantization channel at index 1" if scheme == "per_channel" else \
        "quantization range at index 0"
    with pytest.raises(hk.QuantizationError, match=rf"{where}: .*float32's largest"):
        t.quantize(scheme, "uint8", False, axis=1 if scheme == "per_channel" else None)


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(("dtype", "symmetric"), CODES)
def test_every_accepted_value_is_within_half_a_stored_scale(dtype, symmetric, scale_dtype,
                                                            enabled, monkeypatch):
    # values spread over float32's exponents (tiny, subnormal for float16 scales, huge):
    # whatever is accepted decodes within half a stored step of the input, the stored scale being
    # the one the file carries (a scale below its type's smallest normal is raised to it)
    monkeypatch.setattr(kernels, "ENABLED", enabled)
    rng = np.random.default_rng(11)
    exps = rng.integers(-40, 36, size=(64, 1, 1)).astype(np.float32)
    pool = (rng.standard_normal((64, 2, 1, 16)) * 10.0 ** exps[..., None]).astype(np.float32)
    t = hk.BlockPagedTensor(pool, np.arange(64, dtype=np.uint32), np.array([0, 64], np.uint32),
                            seq_lens=np.array([128]))
    limit = quant.scale_limit(quant.SCALE_TAGS[scale_dtype])
    absmax = np.abs(pool.reshape(128, -1)).max(axis=1)
    keep = absmax / qmax_of(dtype, symmetric) < limit * 0.25
    pool.reshape(128, -1)[~keep] = 0
    q = t.quantize("per_block_affine", dtype, symmetric, scale_dtype=scale_dtype)
    got = q.to_dense(dequantize=True).reshape(128, -1)
    scales, _ = quant.params_arrays(q.quantization, tuple(
        np.frombuffer(b, np.uint8) for b in q.buffers()[3:]), 128)
    err = np.abs(got.astype(np.float64) - pool.reshape(128, -1))
    # half a step, plus what multiplying by a rounded 1 / scale can add (H74: 2**-15 of a
    # step; 1.36e-5 measured just under a rounding tie)
    assert (err <= scales[:, None].astype(np.float64) * (0.5 + 2.0 ** -15)).all()


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("scheme", ["per_block_affine", "per_tensor", "per_channel"])
@pytest.mark.parametrize("enabled", [True, False])
def test_non_finite_values_are_refused_by_slot(bad, scheme, enabled, monkeypatch):
    monkeypatch.setattr(kernels, "ENABLED", enabled)
    pool = np.random.default_rng(3).standard_normal((8, 4, 2, 16)).astype(np.float16)
    pool[2, 1, 0, 3] = bad
    t = hk.BlockPagedTensor(pool, np.array([0, 2, 5], np.uint32), np.array([0, 3], np.uint32),
                            seq_lens=np.array([10]))
    axis = 1 if scheme == "per_channel" else None
    with pytest.raises(hk.QuantizationError, match=r"page_pool slot at index 9: .*finite"):
        t.quantize(scheme, "int8", axis=axis)
    pool[2, 1, 0, 3] = 0
    pool[7, 0, 0, 0] = bad  # a page no sequence reads: its values do not matter
    assert np.isfinite(t.quantize(scheme, "int8", axis=axis).to_dense(dequantize=True)).all()


def test_bfloat16_subnormals_quantize_into_range(monkeypatch):
    # absmax / qmax below float32's smallest normal: 1/scale must stay finite, codes in range
    pool = np.zeros((2, 1, 1, 8), ml_dtypes.bfloat16)
    pool[0, 0, 0] = np.arange(8, dtype=np.uint16).view(ml_dtypes.bfloat16)
    t = hk.BlockPagedTensor(pool, np.array([0], np.uint32), np.array([0, 1], np.uint32),
                            seq_lens=np.array([1]))
    for enabled in (False, True):
        monkeypatch.setattr(kernels, "ENABLED", enabled)
        q = t.quantize("per_block_affine", "int4")
        values = q.to_dense(dequantize=True).reshape(-1)
        err = np.abs(values - pool[0, 0, 0].astype(np.float32))
        assert (err <= np.finfo(np.float32).tiny / 2).all()


def test_fp8_pools_quantize_through_the_float32_kernel(monkeypatch):
    rng = np.random.default_rng(4)
    pool = rng.standard_normal((12, 8, 2, 16)).astype(ml_dtypes.float8_e4m3fn)
    t = tensor(pool, rng)
    t.fp8_scale = 0.37
    slow, fast = both_paths(lambda: quantized_outputs(t, "int8", True, "float32"),
                            monkeypatch)
    assert_same(slow, fast)


def test_large_work_is_split_over_threads_with_the_same_result(monkeypatch):
    # above PARALLEL_BYTES the kernels run in bands on several threads
    monkeypatch.setattr(threads, "workers", lambda: 3)
    rng = np.random.default_rng(5)
    pool = rng.standard_normal((320, 16, 8, 128)).astype(np.float16)  # 10 MiB
    assert pool.nbytes >= threads.PARALLEL_BYTES
    assert len(threads.bands(len(pool) * 16, pool.nbytes)) == 3
    slow, fast = both_paths(lambda: quantized_outputs(
        tensor(pool, np.random.default_rng(6)), "int4", False, "float32"), monkeypatch)
    assert_same(slow, fast)


def test_a_failing_band_is_raised_after_every_band_finished(monkeypatch):
    monkeypatch.setattr(threads, "workers", lambda: 4)
    seen = []

    def work(a, b):
        seen.append((a, b))
        if a == 0:
            raise hk.LayoutError("band 0 failed")

    with pytest.raises(hk.LayoutError, match="band 0"):
        threads.run_bands(work, 100, threads.PARALLEL_BYTES)
    assert sorted(seen) == [(0, 25), (25, 50), (50, 75), (75, 100)]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 0xFFFF), min_size=64, max_size=64),
       st.sampled_from(CODES), st.sampled_from([np.float16, ml_dtypes.bfloat16]),
       st.sampled_from(["float32", "bfloat16"]))
def test_any_16_bit_pattern_quantizes_as_numpy_does(bits, code, pool_type, scale_dtype):
    # every 16-bit pattern: subnormals, signed zeros, extremes; Inf and NaN are refused
    pool = np.array(bits, np.uint16).view(pool_type).reshape(4, 2, 1, 8)
    t = hk.BlockPagedTensor(pool, np.array([1, 3, 0], np.uint32), np.array([0, 2, 3], np.uint32),
                            seq_lens=np.array([3, 2]))

    def run():
        try:
            return quantized_outputs(t, code[0], code[1], scale_dtype)
        except hk.QuantizationError as exc:
            return str(exc)

    saved = kernels.ENABLED
    kernels.ENABLED = False
    try:
        slow = run()
    finally:
        kernels.ENABLED = saved
    fast = run()
    if isinstance(slow, str):
        assert slow == fast
        magnitude = pool.view(np.uint16) & 0x7FFF
        assert (magnitude >= (0x7C00 if pool_type is np.float16 else 0x7F80)).any()
    else:
        assert_same(slow, fast)


def test_a_block_table_changed_after_validation_cannot_make_a_kernel_read_out_of_bounds(
        monkeypatch):
    # the kernels do not bound-check: such slots take the NumPy path, whatever it does
    rng = np.random.default_rng(8)
    t = tensor(rng.standard_normal((8, 4, 2, 16)).astype(np.float16), rng)

    def read(q):
        try:
            return q.to_dense(dequantize=True).view(np.uint32)
        except Exception as exc:
            return type(exc)

    for dtype in ("int8", "int4"):
        q = t.quantize("per_block_affine", dtype, False)
        q.block_table[0] = 1 << 30  # past the pool, behind validate()'s back
        slow, fast = both_paths(lambda q=q: read(q), monkeypatch)
        if isinstance(slow, type):
            assert slow is fast
        else:
            np.testing.assert_array_equal(slow, fast)


# ---- stored pages decoded into the cache dtype (BlockPagedTensor.decode_pages) ---------
@pytest.mark.parametrize("cache", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("fmt", ["int8:per_block_affine", "int8:per_channel",
                                 "int4:per_block_affine", "int4:per_channel", "fp8"])
def test_stored_pages_decode_into_the_cache_dtype_as_numpy_converts(fmt, cache, monkeypatch):
    """One compiled pass from codes and scales to the cache's bits: the float32 values of
    the NumPy path, converted to the cache dtype as NumPy converts them (bfloat16 rounded
    to nearest even), for any run of pages, into a reused buffer of another dtype, codes
    read-only or not; both paths give those bytes (float16 has no kernel)."""
    from hurraykv.integrations.vllm.store_format import decode, parse

    store = parse(fmt, "store_dtype", None)
    rng = np.random.default_rng(7)
    pages = (rng.standard_normal((6, 16, 2, 64)) * 3).astype(np.float32)
    pages[..., 5] *= 40  # an outlier channel
    pages[2, 3] = 0  # a zero slot: scale 1
    t = store.encode(pages.astype(cache), "value", 1)
    rows = t.pool_rows
    frozen = t.derive(np.frombuffer(rows.tobytes(), rows.dtype).reshape(rows.shape))
    scratch = np.empty(7 * 16 * 2 * 64 * 4, np.uint8)
    for each in (t, frozen):
        for first, count in ((0, 6), (1, 3), (5, 1)):
            monkeypatch.setattr(kernels, "ENABLED", False)
            want = decode(t, first, count)  # float32, the NumPy formula
            slow, fast = both_paths(lambda e=each, f=first, c=count: e.decode_pages(
                f, c, cache, scratch).copy(), monkeypatch)
            assert want.dtype == np.float32
            expect = want.astype(cache)
            assert slow.dtype == fast.dtype == np.dtype(cache)
            assert slow.tobytes() == fast.tobytes() == expect.tobytes(), (fmt, first, count)


@pytest.mark.parametrize("cache", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_fp8_store_encodes_as_numpy_converts(cache, monkeypatch):
    """The compiled float -> e4m3 conversion of store_dtype fp8 gives NumPy's (ml_dtypes')
    bits: every e4m3 value, every midpoint between two (ties to even), subnormals,
    negative zero, and values spread over 30 binades; the peak 448 makes the scale 1."""
    from hurraykv.integrations.vllm.store_format import StoreFormat, decode

    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(e4m3[np.isfinite(e4m3)])
    mids = (grid[:-1] + grid[1:]) / 2
    rng = np.random.default_rng(3)
    spread = rng.standard_normal(4096).astype(np.float32) * np.float32(2.0) ** rng.integers(
        -24, 6, 4096)
    values = np.concatenate([grid, mids, np.nextafter(mids, np.float32(0)),
                             np.nextafter(mids, np.float32(1000)), [-0.0, 448.0], spread])
    values = np.clip(values, -448, 448).astype(cache)
    slots = -(-len(values) // 32)
    pages = np.zeros(slots * 32, cache)
    pages[:len(values)] = values
    pages = pages.reshape(slots, 1, 2, 16)
    slow, fast = both_paths(lambda: StoreFormat("fp8").encode(pages, "key", 0), monkeypatch)
    assert slow.fp8_scale == fast.fp8_scale == 1.0
    assert bytes(slow.buffers()[0]) == bytes(fast.buffers()[0])
    # every finite code decodes (compiled, into the cache dtype) to its e4m3 value
    assert set(np.frombuffer(fast.buffers()[0], np.uint8)) >= set(range(127)) | set(
        range(128, 255))
    monkeypatch.setattr(kernels, "ENABLED", False)
    want = decode(fast, 0, slots)  # the NumPy formula
    slow, got = both_paths(lambda: fast.decode_pages(0, slots, cache), monkeypatch)
    assert slow.tobytes() == got.tobytes() == want.astype(cache).tobytes()
    scaled = pages.astype(np.float32) * 1e-3  # a scale that is not 1: division by it
    slow, fast = both_paths(lambda: StoreFormat("fp8").encode(scaled.astype(cache), "key", 0),
                            monkeypatch)
    assert slow.fp8_scale == fast.fp8_scale != 1.0
    assert bytes(slow.buffers()[0]) == bytes(fast.buffers()[0])


@pytest.mark.parametrize("pool_type", POOL_TYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("dtype", ["int8", "int4", "int2"])
@pytest.mark.parametrize("axis", [1, 2])
def test_per_channel_kernels_match_numpy(pool_type, dtype, axis, monkeypatch):
    """Symmetric per-channel quantization with float32 scales (store_dtype's
    per_channel): column ranges over the used slots and the codes, compiled, give the
    NumPy path's bytes: unused slots, zero and constant slots, subnormals, a huge slot."""
    rng = np.random.default_rng(11)
    pool = (rng.standard_normal((24, 16, 4, 32)) * 5).astype(pool_type)
    flat = pool.reshape(-1, 4 * 32)
    flat[3] = 0
    flat[4] = pool_type(2.5)
    flat[5, :6] = np.array([6e-8, -6e-8, 1e-5, -1e-5, 0, -0.0]).astype(pool_type)
    flat[6, 7] = 3e4 if pool_type is not ml_dtypes.bfloat16 else 1e30
    pool[:, :, 2, 5] *= 60  # an outlier channel

    def run():
        t = tensor(pool, rng=np.random.default_rng(1))
        q = t.quantize("per_channel", dtype, True, axis=axis)
        return ([bytes(b) for b in q.buffers()], q.to_dense(dequantize=True).view(np.uint32),
                q.dequantize().page_pool.view(np.uint32))

    slow, fast = both_paths(lambda: outcome(run), monkeypatch)
    assert not isinstance(slow, str), slow
    assert_same(slow, fast)


def test_decoding_follows_the_numpy_path_for_foreign_forms(monkeypatch):
    """What the connector never writes but a foreign segment may hold decodes as the
    NumPy path does: per-channel scales over heads (axis 1), fp8 NaN codes (0x7F, 0xFF),
    subnormal fp8 codes; and warm() compiles every format for every cache dtype."""
    from hurraykv.integrations.vllm.decode_buffers import DecodeBuffers, warm
    from hurraykv.integrations.vllm.store_format import decode, parse

    def decode_pages(t, first, count, dtype):
        return t.decode_pages(first, count, dtype)

    rng = np.random.default_rng(5)
    pages = (rng.standard_normal((3, 8, 4, 16)) * 2).astype(np.float32)
    pages[:, :, 1] *= 30
    t = hk.BlockPagedTensor(pages, np.arange(3), [0, 3], [24], kv_role="key", layer_index=0)
    for q in (t.quantize("per_channel", "int8", True, axis=1),
              t.quantize("per_channel", "int4", True, axis=1)):
        slow, fast = both_paths(lambda q=q: decode_pages(q, 1, 2, ml_dtypes.bfloat16),
                                monkeypatch)
        assert slow.tobytes() == fast.tobytes() == decode(q, 1, 2).astype(
            ml_dtypes.bfloat16).tobytes()
    codes = np.arange(3 * 8 * 4 * 16, dtype=np.int64).reshape(3, 8, 4, 16) % 256
    f8 = hk.BlockPagedTensor(codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn),
                             np.arange(3), [0, 3], [24], kv_role="key", layer_index=0,
                             element_type="float8_e4m3", fp8_scale=0.25)
    want = decode(f8, 0, 3)
    assert np.isnan(want).sum() == 2 * (want.size // 256)  # 0x7F and 0xFF
    got = decode_pages(f8, 0, 3, np.float32)
    assert np.array_equal(got, want, equal_nan=True)
    assert got.view(np.uint32)[~np.isnan(got)].tobytes() == want.view(np.uint32)[
        ~np.isnan(want)].tobytes()  # -0.0 and subnormal steps to the bit
    formats = [parse(f, "store_dtype", None) for f in
               ("auto", "int8", "int8:per_channel", "int4", "int4:per_channel", "fp8")]
    for cache in (np.float32, ml_dtypes.bfloat16, np.float16):
        warm(formats, cache)
    # a worker's buffers: one per role, reused; each result is whole until the next
    buffers = DecodeBuffers(ml_dtypes.bfloat16)
    q = t.quantize("per_block_affine", "int8", True)
    key, value = buffers.pages(0, q, 0, 3), buffers.pages(1, q, 1, 2)
    assert key.tobytes() == decode(q, 0, 3).astype(ml_dtypes.bfloat16).tobytes()
    assert value.tobytes() == decode(q, 1, 2).astype(ml_dtypes.bfloat16).tobytes()
    again = buffers.pages(0, q, 2, 1)
    assert np.shares_memory(again, key)
