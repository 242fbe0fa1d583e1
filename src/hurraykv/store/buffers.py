"""Read buffers recycled between gets (floor 4): a get of a snapshot receives every page
into one buffer taken here, and a buffer is taken again once nothing but this pool refers
to its memory (the snapshots over it are gone), so a steady stream of gets receives into
memory already faulted in (a fresh 64 MiB costs more page faults and zeroing than a
copy of it) instead of fresh pages every time.

"Refers to it" is counted on the array that owns the memory: a large buffer is an array
over an anonymous mapping (``alloc.empty``), and NumPy gives every view sliced from it
that array as its base, so its count rises with every view a snapshot holds."""

from __future__ import annotations

import sys
import threading

import numpy as np

from .. import alloc


class ReadBuffers:
    """At most ``keep`` buffers, each handed out again once it is idle."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.recycled = 0  # takes served by an idle buffer
        self._free: list[list] = []  # [buffer, the owner of its memory, idle count]
        self._lock = threading.Lock()  # two gets at once must not take one idle buffer

    def take(self, size: int) -> np.ndarray:
        """``size`` bytes, faulted in: a recycled buffer where one is idle and large
        enough, else a new one (the oldest kept one dropped past ``keep``)."""
        with self._lock:
            for buf, owner, idle in self._free:
                if len(buf) >= size and sys.getrefcount(owner) <= idle:
                    self.recycled += 1
                    return buf[:size]
            buf = alloc.empty((size,), np.uint8)
            # faulted in now: a huge page faulted while a reply lands is zeroed in the
            # middle of the receive, evicting the pages just received before they are hashed
            buf[::4096] = 0
            if len(self._free) >= self.keep:
                self._free.pop(0)
            owner = buf if buf.base is None else buf.base
            entry = [buf, owner, 0]
            self._free.append(entry)
            # what refers to the owner when no view does, counted as the loop above
            # counts: this entry, the names buf and owner, getrefcount's argument, and
            # buf's reference to its base
            entry[2] = sys.getrefcount(owner)
            return buf[:size]
