"""CRC-32C (Castagnoli): reflected polynomial 0x82F63B78, init and final XOR 0xFFFFFFFF.

Used for the .hrry index, which is small (tens of bytes per tensor), so a table-driven
pure-Python loop is plenty and keeps the package free of compiled dependencies.
"""

from __future__ import annotations


def _table() -> tuple[int, ...]:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        out.append(c)
    return tuple(out)


_TABLE = _table()


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    c = crc ^ 0xFFFFFFFF
    table = _TABLE
    for b in bytes(data):
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF
