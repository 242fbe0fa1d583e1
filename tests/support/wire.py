"""Wire-format helpers shared by the tests."""

from __future__ import annotations


def split_stream(data: bytes):
    """Descriptor bytes followed by each buffer's bytes (the streaming form, D8)."""
    from hurraykv.wire.descriptor import decode_descriptor

    desc = decode_descriptor(data)
    pos = len(desc.encode())
    buffers = []
    for h in desc.buffers:
        buffers.append(data[pos:pos + h.byte_size])
        pos += h.byte_size
    return desc, buffers
