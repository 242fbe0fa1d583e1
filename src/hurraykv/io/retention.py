"""Pins and lifetimes of stored objects, as a record in a directory: ``retention.json``
(a ``file://`` chunk store's, ``integrations/file_capacity.py``; a server's ``--persist``
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
import math
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
    try:
        raw = (directory / RECORD).read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("%s: cannot read the pins (%s): none honoured", directory / RECORD,
                    e.strerror)
        return {}
    try:
        doc = json.loads(raw)
        return {str(name): Kept(bool(p), None if e is None else float(e), int(n))
                for name, (p, e, n) in doc["segments"].items()}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        log.warning("%s does not parse (%s): no pin is honoured until it is rewritten",
                    directory / RECORD, e)
        return {}


def write(directory: Path, kept: dict[str, Kept]) -> None:
    """Replace the record (under the exclusive lock)."""
    text = json.dumps({"version": 1, "segments": {
        name: [k.pinned, k.expiry, k.nbytes] for name, k in sorted(kept.items())}}).encode()
    write_pieces(directory / RECORD, [text], len(text))


def expiry_of(ttl_s: float | None, now: float | None = None) -> float | None:
    if ttl_s is None:
        return None
    if not (isinstance(ttl_s, int | float) and not isinstance(ttl_s, bool)
            and 0 < ttl_s < math.inf):
        raise HurrayError(f"ttl_s {ttl_s!r} is not a positive number of seconds",
                          field="ttl_s", value=ttl_s, rule="seconds > 0, finite")
    return (time.time() if now is None else now) + float(ttl_s)


def pinned_bytes(kept: dict[str, Kept], now: float) -> int:
    return sum(k.nbytes for k in kept.values() if k.pinned and not k.expired(now))


def updated(kept: dict[str, Kept], present: dict[str, int], *, pin: bool,
            ttl_s: float | None, max_pinned: int | None, now: float) -> dict[str, Kept]:
    """``kept`` with the segments ``present`` (name -> bytes) retained as asked, and the
    entries of segments gone or expired dropped; ``PinRefused`` when the pins would pass
    ``max_pinned``.  ``pin=False, ttl_s=None`` releases them."""
    out = {n: k for n, k in kept.items() if n in present or not k.expired(now)}
    expiry = expiry_of(ttl_s, now)
    for name, nbytes in present.items():
        if pin or expiry is not None:
            out[name] = Kept(pin, expiry, nbytes)
        else:
            out.pop(name, None)
    if pin and max_pinned is not None:
        total = pinned_bytes(out, now)
        if total > max_pinned:
            asked = sum(present.values())
            raise PinRefused(
                f"pinning {len(present)} segments ({asked} bytes) would pin {total} bytes, "
                f"over max_pinned_bytes {max_pinned}: not pinned (unpin others, or raise "
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


__all__ = ["RECORD", "Kept", "PinRefused", "expiry_of", "pinned_bytes", "read", "updated",
           "write"]
