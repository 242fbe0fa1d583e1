"""Imported once by the fork server of this suite's engine processes (``engine_run.run``,
after ``hurraykv.integrations._engine_preload``; ``conftest.py`` adds it): the compiled
read and checksum kernels the connector builds when it registers an engine's KV cache,
built here once, so that every forked engine finds them built instead of compiling them
again (some 5 s of each engine's start on 2 cores; the compiled code holds addresses of
libraries the fork inherits at the same place, which is why numba cannot cache it on
disk).  Only compiled: no thread is started (``scatter.warm`` starts the readers'
threads, which a fork would not carry), so each engine still warms its own threads.

Which variants: the element widths of float32 and 16-bit caches with the transposer that
declines every page, and the 16-bit key transposer of the tiny Llama's CPU_ATTN pages
(32 rows x 2 heads x 32 dims).  Any other is compiled by the engine that meets it, as
without this module."""

from hurraykv import kernels
from hurraykv.io import checksums, page_hash, scatter

checksums.warm()
kernels.warm()
for _width, _fast in ((4, page_hash.transposer(0, 0, 0)), (2, page_hash.transposer(0, 0, 0)),
                      (2, page_hash.transposer(32, 2, 32))):
    scatter.compile_reader(_width, _fast)
