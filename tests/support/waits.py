"""Waiting for what another thread does, bounded (a test never hangs on it)."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(check: Callable[[], bool], seconds: float = 10.0, every: float = 0.01) -> bool:
    """Whether ``check()`` came true within ``seconds`` (asked every ``every``)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True
