"""One unit system for everything the command line prints: binary multiples (KiB, MiB,
GiB, TiB) for sizes, GiB/s for rates, thousands separators for counts."""

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
    return f"{nbytes / max(seconds, 1e-9) / (1 << 30):.2f} GiB/s"


def count(n: int) -> str:
    return f"{n:,}"


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
