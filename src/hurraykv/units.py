"""One unit system for everything the command line prints: binary multiples (bytes, KiB,
MiB, GiB, TiB) for sizes and for rates (per second, in the unit that fits the number:
``512 bytes/s``, ``3.20 MiB/s``, ``1.91 GiB/s``), thousands separators for counts, and a
noun that agrees with its count (``1 key``, ``2 keys``)."""

from __future__ import annotations

import re

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


# Numbers as text are ASCII: int() and float() also read the digits of every other
# script ('\uff11\uff12' is 12, '\u0661' is 1) and '1_000', which no config means.
_INT = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)
_FLOAT = re.compile(r"\s*[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*",
                    re.ASCII)
_SIZE = re.compile(r"\s*([+-]?[0-9]+(?:\.[0-9]+)?)\s*(?:([KMGT])I?)?B?\s*", re.ASCII)
_MULTIPLES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_int(text: str) -> int:
    """A whole number written in ASCII digits (a sign and spaces around allowed);
    ValueError for anything else."""
    if not isinstance(text, str) or _INT.fullmatch(text) is None:
        raise ValueError(f"{text!r} is not a whole number in ASCII digits")
    return int(text)


def parse_float(text: str) -> float:
    """A decimal number written in ASCII (``2000``, ``0.5``, ``1e3``); ValueError for
    anything else (``inf`` and ``nan`` included)."""
    if not isinstance(text, str) or _FLOAT.fullmatch(text) is None:
        raise ValueError(f"{text!r} is not a number in ASCII digits")
    return float(text)


def parse_size(text: str) -> int:
    """``8G``, ``512M``, ``64K``, ``1.5GiB`` or a plain byte count (binary multiples), in
    ASCII digits; ValueError for anything else."""
    m = _SIZE.fullmatch(text.upper()) if isinstance(text, str) else None
    if m is None or ("." in m[1] and not m[2]):  # "1.5" bytes is no size
        raise ValueError(f"{text!r} is not a size: ASCII digits, then K, M, G or T")
    return int(float(m[1]) * _MULTIPLES[m[2]]) if m[2] else int(m[1])
