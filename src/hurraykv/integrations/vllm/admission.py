"""Admission of newly computed chunks into the store (issue 32): ``store_threshold``.

A burst of one-off prompts evicts a hot prefix from a capped store as readily as
anything else (LRU has no memory of what came back).  With ``store_threshold`` N >= 2 a
chunk is stored the Nth time a request of this engine computes it, as vLLM's
``OffloadingConnector`` does (``vllm/v1/kv_offload/cpu/manager.py``: ``store_threshold``,
counted per offer in an LRU table of ``max_tracker_size`` keys): a prompt seen once
costs the store nothing, one seen again is stored.  The table is this engine's only (an
engine restarted counts anew), and bounded: the least recently offered key leaves it.

With tiers each tier has a threshold of its own (issue 49): a chunk's computations are
counted once, and each tier takes it once the count reaches its threshold (``mem://`` at
1, ``s3://`` at 2: a one-off prompt is kept in memory and out of the bucket).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class Admission:
    """``thresholds``: each tier's, fastest first (one store: one)."""

    def __init__(self, thresholds: Sequence[int], max_tracked: int) -> None:
        self.thresholds, self.max_tracked = tuple(thresholds), max_tracked
        self.threshold = max(self.thresholds)  # counting is needed only past 1
        self._every = tuple(range(len(self.thresholds)))
        self._counts: OrderedDict[str, int] = OrderedDict()

    def offer(self, keys: Sequence[str]) -> list[tuple[int, ...]]:
        """Count one more computation of each chunk key; for each, the tiers that may
        store it now (none: not stored)."""
        if self.threshold <= 1:
            return [self._every] * len(keys)
        out = []
        for key in keys:  # a step's new chunks: a handful, whatever the prompt's length
            count = self._counts.pop(key, 0) + 1
            self._counts[key] = count  # most recent last
            out.append(tuple(t for t, n in enumerate(self.thresholds) if count >= n))
        while len(self._counts) > self.max_tracked:
            self._counts.popitem(last=False)
        return out


__all__ = ["Admission"]
