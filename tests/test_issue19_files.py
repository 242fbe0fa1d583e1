"""Regression tests for issue 19 (outside reliability campaign): outputs NumPy cannot
shape, stale temporaries of killed saves, temporaries created through planted symlinks.
Each test failed on the code before its fix."""

from __future__ import annotations

import numpy as np
import pytest

import hurraykv as hk
from hurraykv.wire.buffers import BufferHandle
from hurraykv.wire.layouts import BlockPaged


# ------------------------------------------------------------------- 12 output shapes
def _tensor(shape):
    layout = BlockPaged(page_size=1, num_pages=0, num_seqs=1, kv_role=0, layer_index=0,
                        index_type=0)
    desc = hk.TensorDescriptor(0x01, shape, layout, (  # float16
        BufferHandle(0, 64), BufferHandle(0, 64), BufferHandle(8, 64)))
    decoded = hk.decode_descriptor(desc.encode())  # strictly valid
    return hk.BlockPagedTensor.from_descriptor(decoded, [b"", b"", bytes(8)],
                                               seq_lens=np.zeros(1, np.int64))


def test_an_output_numpy_cannot_shape_is_a_hurray_error_naming_it():
    t = _tensor((0, 4683743612465315842, 0))
    for read in (t.to_dense, lambda: t.gather(0), lambda: t.to_dense(dequantize=True)):
        with pytest.raises(hk.UnsupportedError,
                           match=r"shape: found \[0, 4683743612465315842, 0\].*2\^63-1"):
            read()
    # 3 * 2^60 float16 elements fit NumPy's limit, as float32 they do not
    t = _tensor((0, 3 << 60, 1))
    assert t.to_dense().shape == (0, 3 << 60, 1)
    with pytest.raises(hk.UnsupportedError, match=rf"shape: found \[0, {3 << 60}, 1\]"):
        t.gather(0, dequantize=True)
    # a page row of 2^62 float16 elements is 2^63 bytes: refused when the tensor is built
    with pytest.raises(hk.UnsupportedError, match=rf"shape: found \[1, {1 << 62}, 1\]"):
        _tensor((0, 1 << 62, 1))
