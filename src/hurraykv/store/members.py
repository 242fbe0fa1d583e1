"""A block-paged member as the page store sees it: its pages as rows, and their digests.

A page's key is a 128-bit digest of its geometry (element type, page_size, heads,
head_dim, the quantization section) and its bytes, so identical pages of any sequence,
layer, snapshot or tenant share one key; the digest must be collision-resistant.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np

from ..paged import BlockPagedTensor, byte_view
from ..wire.descriptor import TensorDescriptor

DIGEST = 16
ZERO = bytes(DIGEST)


def page_geometry(desc: TensorDescriptor) -> bytes:
    """What a page's digest covers besides its bytes: the member's element type, page_size,
    heads, head_dim and quantization section (``fsck`` verifies stored pages by it)."""
    q = desc.quantization
    return desc.encode()[14:15] + struct.pack(
        "<III", desc.layout.page_size, desc.shape[1], desc.shape[2]) + (
            q.encode() if q is not None else b"")


def page_digest(geometry: bytes, page: Any) -> bytes:
    """The digest of one page's bytes (``page``: a buffer) under ``geometry``."""
    h = hashlib.sha256(geometry)
    h.update(page)
    return h.digest()[:DIGEST]


class Member:
    """One block-paged member as the store sees it: page values and where they go."""

    def __init__(self, t: BlockPagedTensor, zero_unused: bool = True) -> None:
        self.tensor = t
        self.desc = t.descriptor()
        q = t.quantization
        self.per_slot = q is not None and q.per_slot
        views = t.clean_buffers() if zero_unused and t.seq_lens is not None else list(
            t.buffers())
        pool_parts = len(views) - (len(t.buffers()) - 1)
        pool = np.concatenate([np.frombuffer(v, np.uint8) for v in views[:pool_parts]]) \
            if pool_parts > 1 else np.frombuffer(views[0], np.uint8)
        self.rows = pool.reshape(t.num_pages, -1) if t.num_pages else pool.reshape(0, 0)
        extra = [np.frombuffer(byte_view(p), np.uint8) for p in t.quant_params]
        if self.per_slot and q is not None:
            # scales (and zero-points) of a page travel with the page (D4)
            slot = [p.reshape(t.num_pages, -1) for p in extra]
            if q.zero_point_buffer is not None and q.zero_point_buffer == q.scale_buffer:
                half = slot[0].shape[1] // 2 if t.num_pages else 0
                slot = [np.ascontiguousarray(slot[0][:, :half]),
                        np.ascontiguousarray(slot[0][:, half:])]
            self.rows = np.concatenate([self.rows, *slot], axis=1)
            self.global_params: list[Any] = []
        else:
            self.global_params = extra
        self.referenced = np.zeros(t.num_pages, bool)
        self.referenced[t.block_table.astype(np.int64)] = True
        self.geometry = page_geometry(self.desc)

    def digests(self) -> list[bytes]:
        """One digest per page (ZERO for unreferenced pages): SHA-256 (hardware-assisted
        where the CPU has it) truncated to 128 bits.  The loop's body hashes a whole page
        in C with the GIL released, so members hash in parallel on worker threads."""
        geometry = hashlib.sha256(self.geometry)
        out = []
        for i, row in enumerate(self.rows):
            if not self.referenced[i]:
                out.append(ZERO)
                continue
            h = geometry.copy()
            h.update(row)
            out.append(h.digest()[:DIGEST])
        return out

    def skeleton(self) -> bytes:
        t = self.tensor
        parts = [self.desc.encode(), bytes(byte_view(t.block_table)), bytes(byte_view(t.seq_ptr))]
        parts += [bytes(p) for p in self.global_params]
        return b"".join(parts)
