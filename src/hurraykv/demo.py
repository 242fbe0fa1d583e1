"""``make demo``: page a small batch with shared prefixes, show its descriptor field by
field, ship it through bytes, and check every sequence against its input."""

from __future__ import annotations

import sys

import numpy as np

from .paged import BlockPagedTensor
from .wire.annotate import format_rows
from .wire.descriptor import decode_descriptor


def main() -> int:
    rng = np.random.default_rng(2026)
    heads, dim, page_size = 2, 8, 4
    system_prompt = rng.standard_normal((8, heads, dim)).astype(np.float16)
    seqs = [
        np.concatenate([system_prompt, rng.standard_normal((5, heads, dim))]).astype(np.float16),
        np.concatenate([system_prompt, rng.standard_normal((2, heads, dim))]).astype(np.float16),
        rng.standard_normal((3, heads, dim)).astype(np.float16),
    ]
    key = BlockPagedTensor.from_sequences(seqs, page_size, kv_role="key", layer_index=3)
    print(f"{key}\n")
    print(f"seq_lens    {key.seq_lens.tolist()}")
    print(f"seq_ptr     {key.seq_ptr.tolist()}")
    print(f"block_table {key.block_table.tolist()}   shared pages: {key.shared_pages.tolist()}")
    zeroed = key.zero_unused_slots()
    print(f"zeroed {zeroed} unused page slots before the pool leaves the process\n")

    desc = key.descriptor()
    wire = desc.encode()
    print(f"descriptor, {len(wire)} bytes, field by field:")
    print(format_rows(desc))

    # What a receiver does: decode the bytes, wrap the buffers without copying them.
    received = BlockPagedTensor.from_descriptor(
        decode_descriptor(wire), [bytes(b) for b in key.buffers()], seq_lens=key.seq_lens)
    ok = True
    print()
    for s, expected in enumerate(seqs):
        same = np.array_equal(received.gather(s), expected)
        ok &= same
        print(f"sequence {s}: {len(expected):2d} tokens, "
              f"pages {received.block_table[received.seq_ptr[s]:received.seq_ptr[s + 1]]}"
              f" -> gather {'matches' if same else 'DIFFERS'}")
    dense_ok = np.array_equal(received.to_dense(), np.concatenate(seqs))
    print(f"to_dense {'matches' if dense_ok else 'DIFFERS'} the concatenated input")
    ok &= dense_ok
    print("demo OK" if ok else "demo FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
