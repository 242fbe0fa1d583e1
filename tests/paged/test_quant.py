"""Quantized block-paged pools against a per-element reference of the spec formulas."""

from __future__ import annotations

import itertools
import json
import struct
import subprocess
import sys
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

import hurraykv as hk
from hurraykv.cli import main as cli_main
from hurraykv.paged import BlockPagedTensor
from hurraykv.wire.buffers import BufferHandle
from hurraykv.wire.descriptor import TensorDescriptor, decode_descriptor
from hurraykv.wire.dtypes import BY_NAME, unpack
from hurraykv.wire.layouts import RowMajor
from hurraykv.wire.quantization import (
    MXFP,
    NF4,
    PerBlockAffine,
    PerChannel,
    PerTensor,
    storage_range,
)
from tests.vectors.make_vectors import QUANT, mutate

SCALE_NP = {1: np.float16, 2: ml_dtypes.bfloat16, 3: np.float32}


def batch(seed=0, H=2, D=8, ps=4, dtype=np.float16):
    rng = np.random.default_rng(seed)
    prompt = (rng.standard_normal((9, H, D)) * 3).astype(dtype)
    seqs = [np.concatenate([prompt, rng.standard_normal((n, H, D)).astype(dtype)])
            for n in (3, 0, 6)] + [rng.standard_normal((5, H, D)).astype(dtype) + 2]
    return seqs, BlockPagedTensor.from_sequences(seqs, ps, kv_role="value", layer_index=1)


def reference_dequant(t: BlockPagedTensor, s: int) -> np.ndarray:
    """Spec formulas element by element, from the wire buffers alone."""
    desc = t.descriptor()
    q = desc.quantization
    bufs = [bytes(b) for b in t.buffers()]
    L = desc.layout
    et = BY_NAME[desc.element_type_name]
    n_el = L.num_pages * L.page_size * t.num_heads * t.head_dim
    pool = unpack(bufs[0], et, n_el)
    bt = np.frombuffer(bufs[1], "<u4")
    sp = np.frombuffer(bufs[2], "<u4")
    H, D, ps = t.num_heads, t.head_dim, L.page_size
    T = int(t.seq_lens[s])
    out = np.empty((T, H, D), np.float32)
    if isinstance(q, PerBlockAffine):
        scales = np.frombuffer(bufs[q.scale_buffer], SCALE_NP[q.scale_type])
        zps = None if q.symmetric else np.frombuffer(bufs[q.zero_point_buffer], "<i4")
    elif isinstance(q, PerChannel):
        scales = np.frombuffer(bufs[q.scale_buffer], "<f4")
        zps = None if q.symmetric else np.frombuffer(bufs[q.zero_point_buffer], "<i4")
    for tok in range(T):
        phys = int(bt[sp[s] + tok // ps])
        slot = phys * ps + tok % ps
        for h in range(H):
            for d in range(D):
                v = int(pool[(slot * H + h) * D + d])
                if isinstance(q, PerTensor):
                    scale, zp = np.float32(q.scale), q.zero_point
                elif isinstance(q, PerChannel):
                    c = (h, d)[q.axis - 1]
                    scale, zp = np.float32(scales[c]), 0 if zps is None else int(zps[c])
                else:
                    scale = np.float32(scales[slot])  # f16/bf16 widened first
                    zp = 0 if zps is None else int(zps[slot])
                out[tok, h, d] = scale * np.float32(v - zp)
    return out


CASES = [
    ("per_block_affine", dt, sym, None, sd)
    for dt, sym, sd in itertools.product(["int8", "int4", "int2"], [True, False],
                                         ["float32", "float16", "bfloat16"])
] + [("per_block_affine", dt, False, None, "float32") for dt in ("uint8", "uint4", "uint2")] + [
    ("per_tensor", "int8", True, None, "float32"), ("per_tensor", "uint8", False, None, "float32"),
    ("per_tensor", "int4", False, None, "float32"), ("per_tensor", "int16", True, None, "float32"),
    ("per_channel", "int8", True, 1, "float32"), ("per_channel", "int4", False, 2, "float32"),
    ("per_channel", "uint4", False, 1, "float32"), ("per_channel", "int2", True, 2, "float32"),
]


@pytest.mark.parametrize(("scheme", "dtype", "sym", "axis", "scale_dtype"), CASES)
def test_dequantize_matches_the_per_element_formula(scheme, dtype, sym, axis, scale_dtype):
    seqs, t = batch()
    q = t.quantize(scheme, dtype, sym, axis, scale_dtype=scale_dtype)
    desc = decode_descriptor(q.descriptor().encode())
    assert desc.element_type_name == dtype and desc.quantization == q.quantization
    back = BlockPagedTensor.from_descriptor(desc, q.buffers(), q.seq_lens)
    dense = back.dequantize()
    for s in range(len(seqs)):
        ref = reference_dequant(back, s)
        np.testing.assert_array_equal(back.gather(s, dequantize=True), ref)
        np.testing.assert_array_equal(dense.gather(s), ref)
    np.testing.assert_array_equal(back.to_dense(dequantize=True),
                                  np.concatenate([reference_dequant(back, s)
                                                  for s in range(len(seqs))]))


@pytest.mark.parametrize(("scheme", "dtype", "sym", "axis", "scale_dtype"), CASES)
def test_round_trip_error_is_at_most_half_a_scale(scheme, dtype, sym, axis, scale_dtype):
    seqs, t = batch(seed=3)
    q = t.quantize(scheme, dtype, sym, axis, scale_dtype=scale_dtype)
    bufs = [np.frombuffer(b, np.uint8) for b in q.buffers()]
    qq = q.quantization
    for s, x in enumerate(seqs):
        got = q.gather(s, dequantize=True)
        slots = q._slots(np.array([s]))
        if isinstance(qq, PerTensor):
            scale = np.float32(qq.scale)
        elif isinstance(qq, PerChannel):
            sc = bufs[3].view("<f4")
            scale = sc.reshape((1, -1, 1) if axis == 1 else (1, 1, -1))
        else:
            scale = bufs[3].view(SCALE_NP[qq.scale_type]).astype(np.float32)[slots][:, None, None]
        err = np.abs(got - x.astype(np.float32))
        assert (err <= scale / 2 * (1 + 1e-5) + 1e-6).all(), float((err - scale / 2).max())
        lo, hi = storage_range(dtype)
        if isinstance(qq, PerTensor):
            assert lo <= qq.zero_point <= hi
        elif not sym:
            zps = bufs[qq.zero_point_buffer].view("<i4")
            assert zps.min() >= lo and zps.max() <= hi


def test_aliased_pages_dequantize_identically_for_every_sequence():
    _, t = batch(seed=5)
    q = t.quantize("per_block_affine", "int4")
    shared = 9 // 4 * 4  # the full prompt pages
    a, b = q.gather(0, dequantize=True), q.gather(2, dequantize=True)
    assert len(q.shared_pages) == 2
    assert a[:shared].tobytes() == b[:shared].tobytes()


def test_unused_slots_get_scale_one_and_zero_point_zero():
    _, t = batch(seed=6)
    q = t.quantize("per_block_affine", "uint8", symmetric=False)
    used = q.used_slots()
    scales = np.frombuffer(q.buffers()[3], "<f4")
    zps = np.frombuffer(q.buffers()[4], "<i4")
    assert (scales[~used] == 1.0).all() and (zps[~used] == 0).all()
    assert (~used).any() and (scales[used] != 1.0).all()


def test_sub_byte_pools_are_packed_in_spec_bit_order():
    _, t = batch(seed=7)
    q = t.quantize("per_block_affine", "int4")
    pool = bytes(q.buffers()[0])
    assert len(pool) == q.num_pages * q.page_size * 2 * 8 // 2
    codes = q.page_pool.reshape(-1)
    assert pool[0] == ((int(codes[0]) & 0xF) | ((int(codes[1]) & 0xF) << 4))


def test_compact_keeps_dequantized_values():
    _, t = batch(seed=8)
    rows = t.pool_rows
    t.pool_rows = np.concatenate([rows, np.ones((3, rows.shape[1]), rows.dtype)])
    q = t.quantize("per_block_affine", "int8", symmetric=False)
    c = q.compact()
    assert c.num_pages == q.num_pages - 3
    for s in range(q.num_seqs):
        np.testing.assert_array_equal(c.gather(s, dequantize=True), q.gather(s, dequantize=True))


def test_zero_unused_slots_on_a_quantized_pool():
    _, t = batch(seed=9)
    q = t.quantize("per_block_affine", "int8")
    before = q.to_dense(dequantize=True)
    q.zero_unused_slots()
    np.testing.assert_array_equal(q.to_dense(dequantize=True), before)
    assert (np.frombuffer(q.buffers()[3], "<f4")[~q.used_slots()] == 1.0).all()


def test_shared_scale_and_zero_point_buffer_is_read():
    _, t = batch(seed=10)
    q = t.quantize("per_block_affine", "int8", symmetric=False)
    bufs = [bytes(b) for b in q.buffers()]
    shared = replace(q.descriptor(), quantization=PerBlockAffine(0, 4, 3, 3),
                     buffers=q.descriptor().buffers[:3] + (BufferHandle(len(bufs[3]) * 2),))
    desc = decode_descriptor(shared.encode())
    one = BlockPagedTensor.from_descriptor(desc, bufs[:3] + [bufs[3] + bufs[4]], q.seq_lens)
    np.testing.assert_array_equal(one.to_dense(dequantize=True), q.to_dense(dequantize=True))
    c = one.compact()
    np.testing.assert_array_equal(c.to_dense(dequantize=True), q.to_dense(dequantize=True))


def test_fp8_pool_carries_its_scale_beside_the_data():
    rng = np.random.default_rng(11)
    seqs = [(rng.standard_normal((n, 2, 8)) * 4).astype(ml_dtypes.float8_e4m3fn)
            for n in (7, 3)]
    t = BlockPagedTensor.from_sequences(seqs, 4, fp8_scale=0.5)
    desc = t.descriptor()
    assert desc.quantization is None and desc.type_tag == 0x40
    back = BlockPagedTensor.from_descriptor(desc, t.buffers(), t.seq_lens, fp8_scale=0.5)
    for s, x in enumerate(seqs):
        np.testing.assert_array_equal(back.gather(s), x)
        np.testing.assert_array_equal(back.gather(s, dequantize=True),
                                      x.astype(np.float32) * np.float32(0.5))
    np.testing.assert_array_equal(back.to_float().to_dense(), back.to_dense(dequantize=True))
    q8 = back.quantize("per_block_affine", "int8")  # the scale is applied before quantizing
    assert np.abs(q8.to_dense(dequantize=True) - back.to_dense(dequantize=True)).max() < 0.2
    with pytest.raises(hk.QuantizationError, match="fp8_scale belongs to float8 pools"):
        BlockPagedTensor.from_sequences([np.zeros((1, 1, 1), np.float16)], 1, fp8_scale=1.0)
    with pytest.raises(hk.QuantizationError, match="finite and non-zero"):
        BlockPagedTensor.from_sequences(seqs, 4, fp8_scale=0.0)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"scheme": "per_block_affine", "dtype": "uint8", "symmetric": True}, "signed storage"),
    ({"scheme": "per_channel", "dtype": "int8", "axis": 0}, "axis 1 .heads. or 2"),
    ({"scheme": "per_block_affine", "dtype": "int16"}, "per_block_affine storage"),
    ({"scheme": "per_token", "dtype": "int8"}, "scheme is per_tensor"),
    ({"scheme": "per_tensor", "dtype": "int8", "scale_dtype": "float16"}, "scales are float32"),
])
def test_quantize_rejects_what_the_spec_forbids(kwargs, match):
    _, t = batch()
    with pytest.raises(hk.QuantizationError, match=match):
        t.quantize(**kwargs)


def test_quantize_needs_byte_aligned_sub_byte_pages():
    t = BlockPagedTensor.from_sequences([np.ones((3, 1, 1), np.float32)], 1)
    with pytest.raises(hk.UnsupportedError, match="D11"):
        t.quantize("per_block_affine", "int4")  # page_size 1 would fail anyway
    with pytest.raises(hk.QuantizationError, match="unquantized float pool"):
        t.quantize("per_tensor", "int8").quantize("per_tensor", "int8")


def test_inspect_json_shows_parsed_quantization(tmp_path, capsys):
    _, t = batch()
    path = tmp_path / "q.bin"
    path.write_bytes(t.quantize("per_block_affine", "int8", False, scale_dtype="bfloat16")
                     .descriptor().encode())
    assert cli_main(["inspect", "--json", str(path)]) == 0
    q = json.loads(capsys.readouterr().out)["quantization"]
    assert q == {"scheme": "per_block_affine", "scheme_tag": 3, "axis": 0, "block_size": 4,
                 "scale_buffer": 3, "zero_point_buffer": 4, "scale_type": "bfloat16",
                 "symmetric": False}


# ---- quantization payload rules: one minimal mutation each ------------------------------
Q = QUANT.encode()
QOFF = 84 + 1 + 16 * 4 + 4  # scheme_tag


def _rm(**kw) -> bytes:
    return TensorDescriptor(kw.pop("tag", 0x10), kw.pop("shape", (4, 64)), RowMajor(),
                            kw.pop("buffers", (BufferHandle(256), BufferHandle(256))),
                            **kw).encode()


@pytest.mark.parametrize(("data", "error", "field"), [
    (mutate(Q, QOFF + 2, "H", 0), hk.QuantizationError, "q.zero_point_buffer_index"),
    (replace(QUANT, quantization=PerBlockAffine(0, 4, 3, 4),
             buffers=QUANT.buffers + (BufferHandle(80),)).encode()[:-24]
     + struct.pack("<BBHIIIIB3x", 3, 1, 1, 0, 4, 3, 4, 3), hk.QuantizationError,
     "q.zero_point_buffer_index"),
    (mutate(Q, QOFF + 20, "B", 4), hk.QuantizationError, "q.scale_type"),
    (mutate(Q, QOFF + 21, "B", 1), hk.QuantizationError, "q._reserved"),
    (mutate(Q, QOFF + 12, "I", 0xFFFFFFFF), hk.QuantizationError, "q.scale_buffer_index"),
    (replace(QUANT, quantization=PerChannel(1, 3, scale_type=1),
             buffers=QUANT.buffers[:3] + (BufferHandle(8),)).encode(), hk.QuantizationError,
     "q.scale_type"),
    (replace(QUANT, quantization=PerChannel(1, 3, 4),
             buffers=QUANT.buffers[:3] + (BufferHandle(8), BufferHandle(4))).encode(),
     hk.QuantizationError, "buffers[4].byte_size"),
    (replace(QUANT, quantization=PerBlockAffine(0, 4, 3, 4),
             buffers=QUANT.buffers + (BufferHandle(80, device_tag=1),)).encode(),
     hk.BufferError, "buffers[4].device_tag"),
    (replace(QUANT, quantization=PerBlockAffine(0, 4, 3, 4),
             buffers=QUANT.buffers + (BufferHandle(80), BufferHandle(80))).encode(),
     hk.BufferError, "buffer_count"),
    (mutate(replace(QUANT, quantization=PerTensor(0.5), buffers=QUANT.buffers[:3]).encode(),
            QOFF - 16 + 2, "H", 1), hk.QuantizationError, "q.flags"),
    (mutate(replace(QUANT, quantization=PerTensor(0.5), buffers=QUANT.buffers[:3]).encode(),
            QOFF - 16 + 4, "f", float("inf")), hk.QuantizationError, "q.scale"),
    (_rm(quantization=NF4(1, 64, 1)), hk.QuantizationError, "type_tag"),
    (_rm(tag=0x40, quantization=MXFP(1, 8, 1)), hk.QuantizationError, "q.block_size"),
    (_rm(tag=0x40, shape=(4, 48), quantization=MXFP(1, 32, 1)), hk.QuantizationError,
     "shape[1]"),
    (_rm(quantization=PerBlockAffine(1, 128, 1)), hk.QuantizationError, "q.block_size"),
    (_rm(quantization=PerBlockAffine(1, 32, 0)), hk.QuantizationError, "q.scale_buffer_index"),
    (_rm(quantization=PerChannel(0, 1)), hk.QuantizationError, "buffers[1].byte_size"),
])
def test_quantization_payload_rules(data, error, field):
    with pytest.raises(error) as exc:
        decode_descriptor(data)
    assert field in str(exc.value)


def test_valid_quantized_row_major_descriptors_pass():
    decode_descriptor(_rm(quantization=PerChannel(0, 1), buffers=(BufferHandle(256),
                                                                    BufferHandle(16))))
    decode_descriptor(_rm(tag=0x40, quantization=MXFP(1, 32, 1),
                          buffers=(BufferHandle(256), BufferHandle(8))))
    decode_descriptor(_rm(tag=0x49, quantization=NF4(1, 64, 1),
                          buffers=(BufferHandle(128), BufferHandle(16))))


def test_zero_point_array_out_of_storage_range_is_rejected_with_the_data():
    _, t = batch()
    q = t.quantize("per_block_affine", "int4", symmetric=False)
    bufs = [bytearray(b) for b in q.buffers()]
    bufs[4][8:12] = struct.pack("<i", 9)  # int4 holds [-8, 7]
    with pytest.raises(hk.QuantizationError, match=r"zero_points\[2\] at index 2: found 9"):
        BlockPagedTensor.from_descriptor(q.descriptor(), [bytes(b) for b in bufs], q.seq_lens)


# ------------------------------------------- issue 46 item 10: scales that decode to Inf
F32_MAX = float(np.finfo(np.float32).max)


def _with_scale(t: BlockPagedTensor, slot: int, scale: float) -> BlockPagedTensor:
    """``t`` (per-block-affine, float32 scales) with slot ``slot``'s scale replaced: built
    from rows, as a writer that checks nothing builds one."""
    scales = t.quant_params[0].view("<f4").copy()
    scales[slot] = scale
    return t.derive(t.pool_rows, params=(scales.view(np.uint8), *t.quant_params[1:]))


def _huge_file(tmp_path, scale: float, slot: int = 5, symmetric: bool = True):
    """A real .hrry file of one layer whose value member's scale ``slot`` is ``scale``,
    written by the encoder (checksums over what it holds, so only the scale is wrong)."""
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((3, 4, 2, 8)).astype(np.float32)
    members = []
    for role in ("key", "value"):
        t = BlockPagedTensor(pool, [0, 1, 2], [0, 3], [12], kv_role=role, layer_index=0)
        q = t.quantize("per_block_affine", "int8" if symmetric else "uint8",
                       symmetric=symmetric)
        members.append(_with_scale(q, slot, scale) if role == "value" else q)
    path = tmp_path / "huge.hrry"
    hk.save_snapshot(hk.KVCacheSnapshot.from_tensors(members, model="m"), path)
    return path, members[1]


def test_a_huge_finite_scale_is_refused_by_validate_load_and_decode(tmp_path):
    # 3e38 * 128 (int8's code farthest from a zero-point of 0) overflows float32: the
    # value would decode to -inf without a word
    path, unchecked = _huge_file(tmp_path, 3e38)
    out = subprocess.run([sys.executable, "-m", "hurraykv.cli", "validate", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out
    assert "layers.0.value" in out.stderr and "scales[5] at index 5: found 3e+38" in \
        out.stderr and "within float32" in out.stderr, out.stderr
    snap = hk.load_snapshot(path)
    assert np.isfinite(snap.tensor(0, "key").decode_pages(0, 3)).all()
    with pytest.raises(hk.QuantizationError, match=r"layers\.0\.value: scales\[5\]"):
        snap.tensor(0, "value")
    for decode in (lambda t: t.decode_pages(0, 3), lambda t: t.dequantize(),
                   lambda t: t.gather(0, dequantize=True),
                   lambda t: t.to_dense(dequantize=True)):
        with pytest.raises(hk.QuantizationError, match=r"scales\[5\] at index 5: found "
                                                       r"3e\+38.*128 steps"):
            decode(unchecked)


def test_a_scale_just_under_the_limit_decodes_finitely_and_one_step_more_is_refused(tmp_path):
    limit = np.float32(F32_MAX / 128)  # exact: 128 is a power of two
    path, unchecked = _huge_file(tmp_path, float(limit))
    values = hk.load_snapshot(path).tensor(0, "value").decode_pages(0, 3)
    assert np.isfinite(values).all() and np.isfinite(unchecked.decode_pages(0, 3)).all()
    over = float(np.nextafter(limit, np.float32(np.inf)))
    with pytest.raises(hk.QuantizationError, match=r"scales\[5\]"):
        _with_scale(unchecked, 5, over).decode_pages(0, 3)
    # asymmetric: the farthest code from slot 5's own zero-point is what counts
    path, asym = _huge_file(tmp_path, 1.0, symmetric=False)
    zp = int(asym.quant_params[1].view("<i4")[5])
    far = max(255 - zp, zp)
    fits = np.float32(F32_MAX) / np.float32(far)
    assert np.isfinite(_with_scale(asym, 5, float(fits)).decode_pages(0, 3)).all()
    with pytest.raises(hk.QuantizationError, match=rf"{far} steps"):
        _with_scale(asym, 5, float(np.nextafter(fits, np.float32(np.inf)))).decode_pages(0, 3)


def test_per_tensor_and_per_channel_scales_that_overflow_are_refused_on_load():
    _, t = batch(dtype=np.float32)
    q = t.quantize("per_tensor", "int8")
    bufs = [bytes(b) for b in q.buffers()]
    huge = q.descriptor()
    huge = replace(huge, quantization=replace(huge.quantization, scale=3e38))
    with pytest.raises(hk.QuantizationError, match=r"q\.scale.*found 3e\+38.*128 steps"):
        BlockPagedTensor.from_descriptor(huge, bufs, q.seq_lens)
    with pytest.raises(hk.QuantizationError, match=r"q\.scale.*found 3e\+38"):
        decode_descriptor(huge.encode())
    c = t.quantize("per_channel", "int8", axis=2)
    bufs = [bytearray(b) for b in c.buffers()]
    bufs[3][4:8] = struct.pack("<f", 3e38)
    with pytest.raises(hk.QuantizationError, match=r"layers\.1\.value: scales\[1\] at "
                                                   r"index 1: found 3e\+38"):
        BlockPagedTensor.from_descriptor(c.descriptor(), [bytes(b) for b in bufs], c.seq_lens)


@pytest.mark.parametrize("compiled", [True, False])
def test_quantize_refuses_a_symmetric_scale_whose_lowest_code_would_overflow(
        compiled, monkeypatch):
    # absmax / 127 is the scale; times int8's -128 (which a file may hold beside it) it
    # overflows float32: written, the tensor would be refused on load, so it is not written
    from hurraykv import kernels

    monkeypatch.setattr(kernels, "ENABLED", compiled)
    pool = np.zeros((1, 4, 2, 8), np.float32)
    pool[0, 2, 0, 0] = np.float32(F32_MAX * 0.999)  # its scale times 127 fits, 128 not
    t = BlockPagedTensor(pool, [0], [0, 1], [4])
    with pytest.raises(hk.QuantizationError, match=r"page_pool slot at index 2.*128 steps"):
        t.quantize("per_block_affine", "int8")
    pool[0, 2, 0, 0] = np.float32(F32_MAX / 128 * 126)  # its scale times 128: just under
    back = BlockPagedTensor(pool, [0], [0, 1], [4]).quantize("per_block_affine", "int8")
    assert np.isfinite(back.decode_pages(0, 1)).all()
