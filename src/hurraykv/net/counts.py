"""What a ``hurraykv serve`` counts as it runs (``KVServer.counts``): pushes, pulls, bytes,
ERROR messages by code and request latencies; bumped by the connections, read by ``hurraykv
stat`` and the metrics endpoint."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .messages import ErrorCode

# seconds: a small control request is well under a millisecond, a push or pull of a few
# GiB takes seconds over a fast link
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0)


class Latencies:
    """Seconds from a request's arrival to its answer, per request (``requests``: the
    server gives ``handlers.REQUESTS``: push, pull, and the private messages answered at
    once, by name), in ``LATENCY_BUCKETS``: a push from its first TENSOR_PUT to its ACK, a
    pull from its TENSOR_REQUEST to its last TENSOR_DATA_END, any other request from its
    message to its reply.  Requests answered with ERROR are counted by ``Counts.errors``
    instead.  Bumped on the event loop; a scrape copies one request's buckets at a time."""

    def __init__(self, requests: Iterable[str] = ()) -> None:
        self.requests = tuple(requests)
        self.buckets = {name: [0] * (len(LATENCY_BUCKETS) + 1) for name in self.requests}
        self.sums = dict.fromkeys(self.requests, 0.0)

    def observe(self, request: str, seconds: float) -> None:
        self.buckets[request][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sums[request] += seconds

    def read(self, request: str) -> tuple[list[int], float]:
        """``request``'s count per bucket (the last: over every bound) and their sum."""
        return list(self.buckets[request]), self.sums[request]


@dataclass
class Counts:
    """What the server counts as it runs: plain integers bumped on the event loop where
    the work is done (a scrape reads them from another thread: each read is one value)."""

    pushes: int = 0  # PUTs acknowledged
    pulls: int = 0  # objects sent whole
    bytes_received: int = 0  # on every connection, framing included
    bytes_sent: int = 0
    errors: Counter[int] = field(default_factory=Counter)  # ERROR messages sent, by code
    latencies: Latencies = field(default_factory=Latencies)

    def as_dict(self) -> dict[str, Any]:
        errors = dict(self.errors)  # one copy: the loop may add a code meanwhile
        return {"pushes": self.pushes, "pulls": self.pulls,
                "bytes_received": self.bytes_received, "bytes_sent": self.bytes_sent,
                "errors": {code_name(c): n for c, n in sorted(errors.items())}}


def code_name(code: int) -> str:
    """An ERROR code as ``hurraykv stat`` and the metrics name it: its ErrorCode name, or
    ``0x..`` for a code this server does not know."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"0x{code:02x}"
