"""One pass from a segment file into the engine's blocks (``io.scatter``).

A load whose segments are files (``file://``), stored in the engine's own dtype (store
format ``auto``), into a model of attention layers only (no Mamba states, no sliding
window groups) whose caches are host memory laid out by strides (CPU_ATTN's VEC
layout, or the NHD/HND caches of FlashAttention, FlashInfer and the other split
backends): each layer's pages are read from the file a stage at a time, hashed while
the stage sits in the core's L2 cache, and placed into their blocks by the strides of
the engine's view (a row copy, or CPU_ATTN's key transpose), in one compiled call per
core.  A page that does not match its checksum is never written: its segment is
reported damaged at that layer, as a segment read whole and checked by layer is
(``load_job.py``).  Anything else (another store, a quantized format, a hybrid model,
AMX tiles, a GPU cache) reads the segment whole first.
"""

from __future__ import annotations

from typing import Any

from ...io.checksums import KEY, ChecksumError
from ...io.scatter import Destination, PageSource, Scatter
from ...snapshot_members import member_name


def destinations(layers: list[tuple[str, Any]]) -> list[list[Destination]] | None:
    """Every layer's parts' destinations, or None when one layer has none."""
    out = []
    for _, view in layers:
        dests = view.destinations() if hasattr(view, "destinations") else None
        if dests is None:
            return None
        out.append(dests)
    return out


def scatter_layer(job: Any, target: Any, layer: int
                  ) -> tuple[int, dict[str, ChecksumError]]:
    """Read, verify and place layer ``layer`` of every run of ``job`` (a ``LoadJob``
    of ``target``, load_job.py) whose segment is a ``PageSource``: the bytes placed, and
    the segments with a page that was not (damaged, or cut short in the file)."""
    dests = target.destinations[layer]
    scatter = Scatter()
    for run in job.runs:
        source = job.sources.get(run.name)
        if source is None:
            continue
        for role, dest in zip(run.snap.roles, dests, strict=True):
            scatter.add(source, member_name(layer, role), run.first, run.blocks, dest,
                        run.name)
    if not scatter.nbytes:
        return 0, {}
    failed = scatter.run()
    return scatter.nbytes, {
        name: ChecksumError(f"segment {name}: page {page} of member {member} does not match "
                            "its checksum (or is cut from the file)", field=KEY,
                            value=f"{member}[0] page {page}",
                            rule="stored bytes equal those checksummed when written")
        for name, (member, page) in failed.items()}


def close(sources: dict[str, PageSource]) -> None:
    for source in sources.values():
        source.close()
    sources.clear()


__all__ = ["close", "destinations", "scatter_layer"]
