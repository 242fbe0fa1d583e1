"""The streaming format: byte layout, incremental writer/reader over a real pipe, limits."""

from __future__ import annotations

import io
import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hurraykv as hk
from hurraykv.io.stream import TensorStreamReader, write_tensor
from hurraykv.wire.descriptor import decode_descriptor
from tests.support.snapshots import KINDS, make_fused, make_snapshot


def stream_bytes(s) -> bytes:
    buf = io.BytesIO()
    hk.write_snapshot_stream(s, buf)
    return buf.getvalue()


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_byte_exact(kind):
    s = make_snapshot(kind)
    data = stream_bytes(s)
    back = hk.read_snapshot_stream(io.BytesIO(data))
    assert back.equal(s)
    assert stream_bytes(back) == data
    if kind == "fp8":
        np.testing.assert_array_equal(back.kv_scales, s.kv_scales)
        assert back.layer(1)[0].fp8_scale == s.layer(1)[0].fp8_scale


def test_stream_is_descriptors_and_raw_buffers_back_to_back():
    """The reference streaming format: no framing, no padding (D8)."""
    s = make_snapshot("int8", layers=2)
    expected = s.head().encode()
    for _, desc, bufs in s.members():
        expected += desc.encode() + b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    assert stream_bytes(s) == expected
    head = decode_descriptor(expected)
    # seq_lens + the info member (a model is set) + 2 layers x (key, value)
    assert (head.layout_tag, head.layout.rule, head.layout.member_count) == (0x0B, 3, 6)
    assert (head.element_type_name, head.shape, head.buffers) == ("uint8", (6,), ())


def test_incremental_writer_matches_the_one_shot_writer():
    for s in (make_snapshot("fp8"), make_fused()):
        buf = io.BytesIO()
        with hk.SnapshotStreamWriter(buf, s.seq_lens, s.num_layers, kv_scales=s.kv_scales,
                                     fused=s.fused, model=s.model,
                                     metadata=s.metadata) as w:
            for i, layer in enumerate(s):
                w.write_layer(i, *layer)
        assert buf.getvalue() == stream_bytes(s)


def test_layers_arrive_while_the_producer_is_still_writing():
    """Producer and consumer on a real pipe: the producer waits after layer 0 until the
    consumer confirms it has layer 0, so the consumer cannot have waited for the end."""
    s = make_snapshot("float16", layers=4)
    r_fd, w_fd = os.pipe()
    got_layer0 = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            with os.fdopen(w_fd, "wb") as w, hk.SnapshotStreamWriter(
                    w, s.seq_lens, s.num_layers) as writer:
                writer.write_layer(0, *s.layer(0))
                if not got_layer0.wait(timeout=20):
                    raise TimeoutError("consumer never confirmed layer 0")
                for i in range(1, s.num_layers):
                    writer.write_layer(i, *s.layer(i))
        except BaseException as e:  # reported by the consumer side
            errors.append(e)

    producer = threading.Thread(target=produce)
    producer.start()
    seen = []
    with os.fdopen(r_fd, "rb") as r:
        reader = hk.SnapshotStreamReader(r)
        for i, (key, value) in reader.layers():
            seen.append(i)
            np.testing.assert_array_equal(key.to_dense(), s.layer(i)[0].to_dense())
            np.testing.assert_array_equal(value.to_dense(), s.layer(i)[1].to_dense())
            if i == 0:
                assert not producer.join(0) and producer.is_alive()  # still mid-stream
                got_layer0.set()
    producer.join(timeout=20)
    assert not errors and seen == [0, 1, 2, 3]
    assert reader.snapshot.equal(s)


def test_plain_stream_of_block_paged_tensors():
    s = make_snapshot("float16", layers=2)
    buf = io.BytesIO()
    for t in s.tensors():
        write_tensor(buf, t.descriptor(), t.buffers())
    back = hk.read_snapshot_stream(io.BytesIO(buf.getvalue()))
    assert back.num_layers == 2 and back.seq_lens is None  # 4 ragged sequences: ambiguous
    with pytest.raises(hk.SeqLensRequiredError):
        back.layer(0)[0].gather(0)
    one = hk.KVCacheSnapshot.from_arrays([np.ones((2, 4, 1, 2), np.float16)],
                                         [np.zeros((2, 4, 1, 2), np.float16)], [0, 1], [0, 2],
                                         [7])
    buf = io.BytesIO()
    for t in one.tensors():
        write_tensor(buf, t.descriptor(), t.buffers())
    back = hk.read_snapshot_stream(io.BytesIO(buf.getvalue()))
    assert back.layer(0)[0].gather(0).shape == (7, 1, 2)  # one sequence: derived (D6)


def test_every_truncation_is_a_clear_error():
    data = stream_bytes(make_snapshot("int4", layers=2))
    cuts = sorted({0, 1, 9, 10, 50} | set(range(0, len(data), 97)) | {len(data) - 1})
    for cut in cuts:
        with pytest.raises(hk.HurrayError) as exc:
            hk.read_snapshot_stream(io.BytesIO(data[:cut]))
        assert isinstance(exc.value, hk.StreamError | hk.DescriptorError), cut


def test_torn_group_between_members():
    s = make_snapshot("float16", layers=2)
    full = stream_bytes(s)
    last = s.tensors()[-1]
    cut = len(full) - len(last.descriptor().encode()) - sum(len(b) for b in last.buffers())
    n = s.member_count()  # seq_lens, the info member (model), 2 layers x (key, value)
    with pytest.raises(hk.StreamError, match=f"torn group: the stream ended after {n - 1} of "
                                             f"{n} members"):
        hk.read_snapshot_stream(io.BytesIO(full[:cut]))


def test_limits_refuse_before_allocating(tmp_path):
    data = stream_bytes(make_snapshot("float16", layers=1))
    with pytest.raises(hk.StreamError, match="descriptors up to 100 bytes"):
        hk.read_snapshot_stream(io.BytesIO(data), max_descriptor_bytes=100)
    with pytest.raises(hk.StreamError, match="exceeds max_buffer_bytes 64"):
        hk.read_snapshot_stream(io.BytesIO(data), max_buffer_bytes=64)
    # A hostile descriptor claiming a 1 TiB buffer: on a file it is refused up front...
    huge = hk.TensorDescriptor(0x11, (1 << 40,), hk.wire.RowMajor(),
                               (hk.wire.BufferHandle(1 << 40),))
    path = tmp_path / "hostile.bin"
    path.write_bytes(huge.encode() + b"\0" * 10)
    with open(path, "rb") as f, pytest.raises(hk.StreamError, match="only 10 remain"):
        TensorStreamReader(f).read_tensor()
    # ...and on a pipe memory only grows as bytes really arrive.
    r_fd, w_fd = os.pipe()
    os.write(w_fd, huge.encode() + b"\0" * 10)
    os.close(w_fd)
    with os.fdopen(r_fd, "rb") as r, pytest.raises(hk.StreamError, match="10 of 1099511627776"):
        TensorStreamReader(r).read_tensor()


def test_writer_refuses_wrong_members_and_torn_groups():
    s = make_snapshot("float16")
    buf = io.BytesIO()
    w = hk.SnapshotStreamWriter(buf, s.seq_lens, 3)
    with pytest.raises(hk.SnapshotError, match=r"layers\.1\.key: got the key tensor of layer 0"):
        w.write_layer(1, *s.layer(0))
    with pytest.raises(hk.SnapshotError, match="takes key/value"):
        w.write_layer(0, s.layer(0)[0])
    w.write_layer(0, *s.layer(0))
    with pytest.raises(hk.SnapshotError, match="already written"):
        w.write_layer(0, *s.layer(0))
    with pytest.raises(hk.StreamError, match=r"layers \[1, 2\] were never written"):
        w.close()


def test_nested_composites_deeper_than_eight_are_refused():
    from hurraykv.wire.layouts import Composite

    one = hk.TensorDescriptor(0x11, (1,), Composite(3, 1)).encode()
    data = one * 10
    with pytest.raises(hk.StreamError, match="nests deeper than 8"):
        TensorStreamReader(io.BytesIO(data)).read_item()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_streams_raise_only_hurray_errors(data):
    raw = bytearray(_FUZZ_BASE)
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del raw[data.draw(st.integers(0, len(raw))):]
    try:
        snap = hk.read_snapshot_stream(io.BytesIO(bytes(raw)))
    except hk.HurrayError:
        return
    for t in snap.tensors():
        if t.seq_lens is not None:
            t.to_dense()


_FUZZ_BASE = stream_bytes(make_snapshot("int8", layers=2, heads=1, dim=4))


def test_empty_heads_with_huge_token_counts_cost_nothing():
    """heads = 0 makes every page 0 bytes whatever page_size and num_pages claim: nothing
    may then size an array by the claimed token count (found by the fuzz test)."""
    from hurraykv.wire.buffers import BufferHandle
    from hurraykv.wire.layouts import BlockPaged

    ps, tokens = 1 << 30, 3 << 30
    desc = hk.TensorDescriptor(0x01, (tokens, 0, 8), BlockPaged(ps, 1 << 31, 1, 2, 0),
                               (BufferHandle(0), BufferHandle(12), BufferHandle(8)))
    bufs = [b"", np.array([0, 1, 2], "<u4").tobytes(), np.array([0, 3], "<u4").tobytes()]
    t = hk.BlockPagedTensor.from_descriptor(desc, bufs)
    assert t.to_dense().shape == (tokens, 0, 8) and t.gather(0).nbytes == 0
    assert list(t.shared_pages) == [] and t.copy().zero_unused_slots() == 0
    buf = io.BytesIO()
    write_tensor(buf, desc, bufs)
    snap = hk.read_snapshot_stream(io.BytesIO(buf.getvalue()))
    assert snap.layer(0)[0].to_dense().shape == (tokens, 0, 8)
