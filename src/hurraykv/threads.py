"""Splitting large row-wise work over the machine's cores (floor 1).

NumPy releases the GIL inside ``take``, ``copyto`` and friends, and the compiled
kernels run with ``nogil``: a copy split into one contiguous band of rows per core
runs on every core at once.  Work below ``PARALLEL_BYTES`` stays on the calling thread,
where a thread hand-off would cost more than it saves.  ``HURRAYKV_THREADS`` caps
the worker count (1 turns threading off).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

PARALLEL_BYTES = 8 << 20  # below this a hand-off costs more than a second core saves
_pool: ThreadPoolExecutor | None = None


def workers() -> int:
    """Threads used for large copies: the cores this process may run on, capped."""
    env = os.environ.get("HURRAYKV_THREADS")
    if env is not None and env.strip().isascii() and env.strip().isdigit() and int(env) > 0:
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def executor() -> ThreadPoolExecutor:
    """The process's worker threads (one per core), for leaf work that releases the GIL:
    copy bands, kernels, page hashing.  Work on them must not wait for other work on
    them."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="hurraykv")
    return _pool


def bands(rows: int, nbytes: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` row bands, one per worker when ``nbytes`` is large."""
    n = workers() if nbytes >= PARALLEL_BYTES else 1
    n = max(1, min(n, rows))
    edges = [rows * i // n for i in range(n + 1)]
    return [(edges[i], edges[i + 1]) for i in range(n)]


def run_bands(fn: Callable[[int, int], object], rows: int, nbytes: int) -> None:
    """Call ``fn(start, stop)`` for every band, the last on this thread; re-raises the
    first failure after every band has finished (no band is left writing behind it)."""
    parts = bands(rows, nbytes)
    if len(parts) == 1:
        fn(*parts[0])
        return
    futures = [executor().submit(fn, a, b) for a, b in parts[:-1]]
    error: BaseException | None = None
    try:
        fn(*parts[-1])
    except BaseException as exc:
        error = exc
    for f in futures:
        exc = f.exception()
        if error is None and exc is not None:
            error = exc
    if error is not None:
        raise error
