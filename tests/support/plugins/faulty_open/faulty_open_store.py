"""Store plugins that register but fail at ``open``: ``failing:///DIR`` raises (a
dependency's own error), ``stuck:///DIR`` never returns (a connection that hangs),
``slow:///DIR`` returns after a second.  hurraykv names the first in a HurrayError, gives
up on the others after the timeout ``open_store`` was given, and closes what opens late."""

import threading
import time
import types

from hurraykv.chunks.registry import ChunkStore

FOREVER = threading.Event()  # never set
LATE_CLOSED = threading.Event()  # set when the store slow:// opened late is closed


class FailingChunks(ChunkStore):
    SCHEMES = ("failing",)
    FORM = "failing:///DIR"
    LOCAL = True

    @classmethod
    def open(cls, url, parsed, *, timeout, **options):
        raise RuntimeError("the acme SDK is not configured: set ACME_HOME")


class StuckChunks(ChunkStore):
    SCHEMES = ("stuck",)
    FORM = "stuck:///DIR"
    LOCAL = True

    @classmethod
    def open(cls, url, parsed, *, timeout, **options):
        FOREVER.wait(10)  # "never": far longer than any timeout a test gives it


class SlowChunks(ChunkStore):
    SCHEMES = ("slow",)
    FORM = "slow:///DIR"
    LOCAL = True

    @classmethod
    def open(cls, url, parsed, *, timeout, **options):
        time.sleep(1)
        return types.SimpleNamespace(close=LATE_CLOSED.set)  # all the test asks of it
