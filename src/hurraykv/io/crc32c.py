"""CRC-32C (Castagnoli): reflected polynomial 0x82F63B78, init and final XOR 0xFFFFFFFF.

Used for the .hrry index, which is small (tens of bytes per tensor), so pure Python is
enough and keeps the package free of compiled dependencies; slicing-by-8 tables fold
eight bytes per step.
"""

from __future__ import annotations

import struct


def _tables() -> list[list[int]]:
    t0 = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        t0.append(c)
    tables = [t0]
    for _ in range(7):
        prev = tables[-1]
        tables.append([(prev[i] >> 8) ^ t0[prev[i] & 0xFF] for i in range(256)])
    return tables


_T = _tables()


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    data = bytes(data)
    c = crc ^ 0xFFFFFFFF
    t0, t1, t2, t3, t4, t5, t6, t7 = _T
    n8 = len(data) - len(data) % 8
    for lo, hi in struct.iter_unpack("<II", data[:n8]):
        lo ^= c
        c = (t7[lo & 0xFF] ^ t6[(lo >> 8) & 0xFF] ^ t5[(lo >> 16) & 0xFF] ^ t4[lo >> 24]
             ^ t3[hi & 0xFF] ^ t2[(hi >> 8) & 0xFF] ^ t1[(hi >> 16) & 0xFF] ^ t0[hi >> 24])
    for b in data[n8:]:
        c = t0[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF
