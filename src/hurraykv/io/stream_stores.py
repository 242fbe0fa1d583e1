"""Streaming (non-temporal) stores for the compiled copies into an engine's blocks.

A load writes each byte of its destination once and never reads it back; ordinary stores
first read every cache line they write into the cache (read for ownership), which
doubles the memory traffic of a copy into memory that is not cached.  Stores marked
non-temporal skip that read and go to memory through write-combining buffers.  Measured
here (256-byte rows from a 256 KiB stage in L2 into every other 256 bytes of a 128 MiB
buffer, as a K|V cache is written): ``memcpy`` a row 0.82x of a 1-thread ``np.copyto``
of the same bytes, streaming stores 1.88x, and 0.63x where the rows did not start on a
cache line (each partial line is a slow partial write), so ``copy_row`` streams whole
lines only, and uses ``memcpy`` elsewhere.  A ``fence`` after the last one
makes the stores visible to every core before the caller goes on.

``build(memcpy)`` returns the numba functions (inlined into the caller's compiled loop)
or None without numba; on CPUs without streaming stores LLVM emits ordinary ones.
"""

from __future__ import annotations

from typing import Any

LINE = 64  # a cache line: streaming stores of part of one are flushed as slow partial writes


def build(memcpy: Any) -> tuple[Any, Any] | None:
    """``(copy_row, fence)``: ``copy_row(dst, src, n)`` copies ``n`` bytes between
    addresses, streaming (32 bytes a store) whole cache lines, ``memcpy`` where the
    destination is not whole lines; ``fence()`` orders the streaming stores before what
    follows."""
    try:
        import numba
        from llvmlite import ir
        from numba.core import types
        from numba.extending import intrinsic
    except ImportError:
        return None

    def nontemporal(builder: Any, store: Any) -> None:
        store.set_metadata("nontemporal",
                           builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))

    @intrinsic
    def stream32(typingctx, dst, src):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            vector = ir.VectorType(ir.IntType(64), 4)
            value = builder.load(builder.inttoptr(args[1], ir.PointerType(vector)), align=1)
            nontemporal(builder, builder.store(
                value, builder.inttoptr(args[0], ir.PointerType(vector)), align=32))
            return context.get_dummy_value()
        return types.void(types.intp, types.intp), codegen

    @intrinsic
    def fence(typingctx):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            builder.fence("seq_cst")
            return context.get_dummy_value()
        return types.void(), codegen

    @numba.njit(nogil=True, inline="always")
    def copy_row(dst, src, n):  # pragma: no cover - compiled
        if dst % LINE == 0 and n % LINE == 0:
            for i in range(0, n, 32):
                stream32(dst + i, src + i)
        else:
            memcpy(dst, src, n)

    return copy_row, fence


__all__ = ["build"]
