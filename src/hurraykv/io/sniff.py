"""What a file that is not the expected Hurray form looks like, from its first bytes:
the errors for the mistakes people make name the format they were handed."""

from __future__ import annotations

import struct

HRRY_FILE = b"HRRYFILE"
DESCRIPTOR = b"HRRY"


def looks_like(head: bytes, size: int | None = None) -> str | None:
    """A short description of a known format starting with ``head`` (16+ bytes when
    available), or None."""
    if size == 0 or (size is None and not head):
        return "an empty file"
    if head.startswith(HRRY_FILE):
        return "a .hrry file"
    if head.startswith(DESCRIPTOR) and head[4:5] == b"\x01":  # descriptor version 1
        return "a Hurray stream (it starts with a tensor descriptor)"
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy .npy file"
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (a NumPy .npz or a torch.save checkpoint)"
    if head.startswith(b"GGUF"):
        return "a GGUF model file"
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return "an HDF5 file"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "a Python pickle (a legacy torch.save file?)"
    if len(head) >= 9 and head[8:9] == b"{":
        (n,) = struct.unpack_from("<Q", head)
        if 2 <= n < (100 << 20) and (size is None or 8 + n <= size):
            return "a safetensors file"
    return None


def not_expected(head: bytes, size: int | None, expected: str, other: str, hint: str
                 ) -> str | None:
    """The message for ``expected`` given something recognisably else, or None; ``hint``
    is added when it is the ``other`` Hurray form."""
    what = looks_like(head, size)
    if what is None or what.startswith(expected):
        return None
    return f"this is {what}, not {expected}" + (hint if what.startswith(other) else "")
