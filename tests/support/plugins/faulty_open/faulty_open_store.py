"""Store plugins that register but fail at ``open``: ``failing:///DIR`` raises (a
dependency's own error), ``stuck:///DIR`` never returns (a connection that hangs).
hurraykv names the first in a HurrayError and gives up on the second after the timeout
``open_store`` was given."""

import threading

from hurraykv.integrations.chunks import ChunkStore

FOREVER = threading.Event()  # never set


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
        FOREVER.wait(60)  # "never": longer than any timeout a test gives it
