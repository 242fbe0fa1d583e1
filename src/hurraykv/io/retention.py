"""Pins and lifetimes of stored objects, as a record in a directory: ``retention.json``
(a ``file://`` chunk store's, ``chunks/file/capacity.py``; a server's ``--persist``
directory's, ``net/keystore.py``).

A segment may be *pinned* (``Capacity`` never evicts it to make room) and may have an
*expiry* (a ``ttl_s`` counted from when it was last retained: past it the segment is a
miss, and the next scan removes it).  The record holds only the segments retained, as
one JSON object ``{"version": 1, "segments": {NAME: [pinned, expiry or null, bytes]}}``,
rewritten whole (temporary file, rename) under the directory's exclusive lock, so every
engine sharing the directory sees one record and no update is lost.  Pinned bytes are
bounded by ``max_pinned_bytes`` (default a quarter of ``max_bytes``): a pin that would
pass it is refused (``PinRefused``), so pins never fill the store.  A record that does not
parse counts as empty (pins lost, never a segment kept wrongly), and is logged.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import HurrayError
from .atomic import write_pieces

RECORD = "retention.json"
log = logging.getLogger("hurraykv.store")


class PinRefused(HurrayError):
    """A pin that would pass the store's pinned-bytes budget; nothing was pinned."""


@dataclass(frozen=True)
class Kept:
    pinned: bool
    expiry: float | None  # Unix seconds; None: kept until unpinned or evicted
    nbytes: int

    def expired(self, now: float) -> bool:
        return self.expiry is not None and self.expiry <= now


def read(directory: Path) -> dict[str, Kept]:
    """The record (empty when there is none, or it does not parse)."""
    return _read(directory)[0]


def recorded_budget(directory: Path) -> int | None:
    """The pinned budget the engines writing the record gave (for a process that has
    none of its own: ``hurraykv cache pin``)."""
    return _read(directory)[1]


def _read(directory: Path) -> tuple[dict[str, Kept], int | None]:
    try:
        raw = (directory / RECORD).read_bytes()
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        log.warning("%s: cannot read the pins (%s): none honoured", directory / RECORD,
                    e.strerror)
        return {}, None
    try:
        doc = json.loads(raw)
        budget = doc.get("max_pinned_bytes")
        return ({str(name): Kept(bool(p), None if e is None else float(e), int(n))
                 for name, (p, e, n) in doc["segments"].items()},
                int(budget) if budget is not None else None)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        log.warning("%s does not parse (%s): no pin is honoured until it is rewritten",
                    directory / RECORD, e)
        return {}, None


def write(directory: Path, kept: dict[str, Kept], budget: int | None = None) -> None:
    """Replace the record (under the exclusive lock); ``budget``: the pinned budget to
    record for processes without one."""
    doc: dict = {"version": 1, "segments": {
        name: [k.pinned, k.expiry, k.nbytes] for name, k in sorted(kept.items())}}
    if budget is not None:
        doc["max_pinned_bytes"] = budget
    text = json.dumps(doc).encode()
    write_pieces(directory / RECORD, [text], len(text))


# The longest lifetime any store can keep: 100 years.  Past it a lifetime is not one an
# operator means (keep such a segment with a pin), and a bound keeps every store's arithmetic
# finite: ``10**400`` is an int no float holds, ``1e308 * 1000`` ms is inf for Redis.
MAX_TTL_S = 100 * 365.25 * 86400


def ttl_seconds(ttl_s: object, field: str = "ttl_s") -> float:
    """``ttl_s`` as float seconds: a number (not a bool), positive, at most ``MAX_TTL_S``;
    anything else a ``HurrayError`` naming ``field``.  Compared before converting, so an
    integer too large for a float is refused, never an ``OverflowError``."""
    if not (isinstance(ttl_s, int | float) and not isinstance(ttl_s, bool)
            and 0 < ttl_s <= MAX_TTL_S):
        big = isinstance(ttl_s, int) and ttl_s.bit_length() >= 64
        # its size, not its digits: str() of an int past 4300 digits raises ValueError
        shown = (f"an integer of about {int(ttl_s.bit_length() * 0.30103) + 1} digits"
                 if big else repr(ttl_s))
        raise HurrayError(f"{field} is {shown}; it is a number of seconds, more than 0 and "
                          f"at most {MAX_TTL_S:.0f} (100 years)", field=field,
                          value=shown if big else ttl_s,
                          rule=f"0 < seconds <= {MAX_TTL_S:.0f}")
    return float(ttl_s)


def expiry_of(ttl_s: float | None, now: float | None = None) -> float | None:
    if ttl_s is None:
        return None
    return (time.time() if now is None else now) + ttl_seconds(ttl_s)


def pinned_bytes(kept: dict[str, Kept], now: float) -> int:
    return sum(k.nbytes for k in kept.values() if k.pinned and not k.expired(now))


def merged(old: Kept | None, nbytes: int, *, pin: bool | None, expiry: float | None,
           extend: bool) -> Kept | None:
    """What a segment keeps once asked (None: nothing).  *Set* (``extend`` False, an
    operator's): pinned as ``pin`` says (None: as it was), the lifetime ``expiry`` (None:
    none).  *Extend* (a request's ask): a pin is only added, a lifetime only moves later
    (a segment pinned without one keeps none; one never retained gets ``expiry``)."""
    if extend:
        pinned = bool(old and old.pinned) or pin is True
        if old is not None and (old.expiry is None or expiry is None):
            expiry = old.expiry  # kept for good, or no lifetime asked: as it was
        elif old is not None:
            expiry = max(expiry, old.expiry)
    else:
        pinned = bool(old and old.pinned) if pin is None else pin
    return Kept(pinned, expiry, nbytes) if pinned or expiry is not None else None


def updated(kept: dict[str, Kept], present: dict[str, int], *, pin: bool | None,
            ttl_s: float | None, max_pinned: int | None, now: float, extend: bool = False
            ) -> dict[str, Kept]:
    """``kept`` with the segments ``present`` (name -> bytes) retained as asked
    (``merged``), the entries of segments expired dropped (an expired entry of a segment
    stored again counts as none); ``PinRefused`` when pins added would pass
    ``max_pinned``."""
    out = {n: k for n, k in kept.items() if not k.expired(now)}
    before = pinned_bytes(out, now)
    expiry = expiry_of(ttl_s, now)
    for name, nbytes in present.items():
        k = merged(out.get(name), nbytes, pin=pin, expiry=expiry, extend=extend)
        if k is None:
            out.pop(name, None)
        else:
            out[name] = k
    total = pinned_bytes(out, now)
    if max_pinned is not None and total > max(before, max_pinned):
        asked = sum(present.values())
        raise PinRefused(
            f"pinning {len(present)} segments ({asked} bytes) would pin {total} bytes, over "
            f"max_pinned_bytes {max_pinned}: not pinned (unpin others, or raise "
            "max_pinned_bytes)", field="max_pinned_bytes", value=total,
            rule="pinned bytes stay within max_pinned_bytes")
    return out


def mtime(directory: Path) -> tuple[int, int] | None:
    """What changes with the record (to reread it only then)."""
    try:
        st = os.stat(directory / RECORD)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


__all__ = ["MAX_TTL_S", "RECORD", "Kept", "PinRefused", "expiry_of", "merged",
           "pinned_bytes", "read", "recorded_budget", "ttl_seconds", "updated", "write"]
