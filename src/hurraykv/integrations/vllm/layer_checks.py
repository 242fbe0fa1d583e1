"""Checksums of loaded segments verified layer by layer, beside the forward pass.

A load reads every segment before the forward pass; hashing all of it there cost 5.5% of
the load (it is one more look at every byte, on the load's path).  So the read hashes the
small buffers and layer 0 (``FileChunks.get_checked``), and the pages of layers 1..N-1
are hashed by one thread of ours while the engine writes layer 0, computes its attention,
writes layer 1, ...: ``wait(L)`` returns once layer L of every segment is verified, just
before the worker writes it, so no byte reaches the engine's blocks unverified.  A
segment whose layer L does not match is not written from layer L on; its blocks are
reported failed, so vLLM recomputes them (the layers already written held verified bytes
and are overwritten by the recompute).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from ...errors import HurrayError
from ...io.checksums import Pending
from ...snapshot_members import member_name

ROLES = ("key", "value", "fused")


def later_members(layers: int) -> frozenset[str]:
    """The members a read may leave to ``LayerChecks``: every layer's but layer 0's."""
    return frozenset(member_name(layer, role) for layer in range(1, layers) for role in ROLES)


class LayerChecks:
    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hurraykv-verify")
        self._layers: dict[int, Future] = {}

    def start(self, pending: dict[str, Pending], layers: int) -> None:
        """Check ``pending`` (segment name -> what its read left) layer by layer, in order."""
        self.settle()
        if not pending:
            return
        for layer in range(1, layers):
            members = frozenset(member_name(layer, role) for role in ROLES)
            self._layers[layer] = self._thread.submit(self._check, pending, members)

    @staticmethod
    def _check(pending: dict[str, Pending], members: frozenset[str]
               ) -> list[tuple[str, HurrayError]]:
        bad = []
        for name, p in pending.items():
            try:
                p.check(members)
            except HurrayError as e:
                bad.append((name, e))
        return bad

    def wait(self, layer: int) -> tuple[list[tuple[str, HurrayError]], float]:
        """The segments whose layer ``layer`` does not match (with why), and the seconds
        this call waited for the check (what verification added to the load's path)."""
        future = self._layers.pop(layer, None)
        if future is None:
            return [], 0.0
        started = time.perf_counter()
        bad = future.result()
        return bad, time.perf_counter() - started

    def settle(self) -> None:
        """Forget the checks of an earlier step (waited for: they hold its segments)."""
        for future in self._layers.values():
            future.result()
        self._layers.clear()

    def close(self) -> None:
        self.settle()
        self._thread.shutdown(wait=False)


__all__ = ["LayerChecks", "later_members"]
