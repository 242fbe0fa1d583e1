"""One unit system for everything the command line prints: binary multiples (bytes, KiB,
MiB, GiB, TiB) for sizes and for rates (per second, in the unit that fits the number:
``512 bytes/s``, ``3.20 MiB/s``, ``1.91 GiB/s``), thousands separators for counts, and a
noun that agrees with its count (``1 key``, ``2 keys``)."""

from __future__ import annotations

_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")


def size(n: float) -> str:
    """``1536`` -> ``1.50 KiB``; under 1 KiB the exact byte count."""
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} bytes"
    for unit in _UNITS[1:]:
        n /= 1024
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


def rate(nbytes: float, seconds: float) -> str:
    """Bytes per second in the binary unit that fits: ``size(nbytes / seconds) + "/s"``
    (a small transfer is ``12.50 KiB/s``, never ``0.00 GiB/s``)."""
    return size(nbytes / max(seconds, 1e-9)) + "/s"


def count(n: int) -> str:
    return f"{n:,}"


_IRREGULAR = {"identity": "identities"}


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``plural(1, "key")`` -> ``1 key``; ``plural(1234, "key")`` -> ``1,234 keys``
    (``many``: the plural, when it is not the noun with an s)."""
    if n == 1:
        return f"{count(n)} {noun}"
    if many is None:
        many = _IRREGULAR.get(noun) or (noun + "es" if noun.endswith(("s", "sh", "ch", "x"))
                                        else noun + "s")
    return f"{count(n)} {many}"


def parse_size(text: str) -> int:
    """``8G``, ``512M``, ``64K``, ``1.5GiB`` or a plain byte count (binary multiples);
    ValueError for anything else."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except OverflowError:  # "infG", "1e400G": not a size
        raise ValueError(f"{text!r} is not a finite size") from None
