"""Segments of a hybrid model (issue 31): what ``groups.py`` says is stored, as a
KVCacheSnapshot any Hurray reader opens (decision H92 in ``docs/spec-decisions.md``).

* One block-paged member per attention layer (``layers.{i}.key``/``value``, ``i`` the
  layer's rank among the model's attention layers), all of one sequence of the
  segment's tokens, as in a one-group segment.  A sliding-window layer keeps only the
  pages a hit needs (``KVGroup.kept``): its ``page_pool`` holds them in token order and,
  when any page is left out, one zero page last, which every left-out block of its
  ``block_table`` names (aliasing, as prefix sharing does).  So ``seq_ptr``, ``seq_lens``
  and the element type are those of the other members, the snapshot's rules hold, and a
  reader sees zeros where nothing was kept.
* One row-major member per state of a Mamba layer at the segment's end
  (``states.{j}.{k}``: layer ``j`` among the model's Mamba layers, state ``k``), of the
  engine's own dtype and shape: states are exact, whatever ``store_dtype`` says (a
  recurrent state carries every earlier token: an error in it never fades).
* The group map in the info metadata: ``kv_cache_groups``, a JSON object (metadata
  values are scalars) of each group's kind, layers, window or state shapes; and
  ``kv_cache_states``: whether this segment holds end states.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import HurrayError
from ...paged import BlockPagedTensor
from ...snapshot import KVCacheSnapshot
from ...snapshot_members import row_major_member
from ...wire.descriptor import TensorDescriptor
from ...wire.dtypes import element_type
from .groups import METADATA_KEY, STATE_KEY
from .store_format import StoreFormat


def state_name(layer: int, part: int) -> str:
    return f"states.{layer}.{part}"


def page_table(kept: np.ndarray) -> np.ndarray | None:
    """The ``block_table`` of a member keeping pages ``kept`` (None: all, in order)."""
    if kept.all():
        return None
    table = np.full(len(kept), int(kept.sum()), np.int64)  # the zero page, last
    table[kept] = np.arange(int(kept.sum()))
    return table


def encode_layer(fmt: StoreFormat, parts: Sequence[np.ndarray], kept: np.ndarray,
                 layer: int) -> list[BlockPagedTensor]:
    """One attention layer's kept pages (``parts``: key and value, or fused) as the
    members of a segment."""
    roles = ("fused",) if len(parts) == 1 else ("key", "value")
    table = page_table(kept)
    out = []
    for pages, role in zip(parts, roles, strict=True):
        if table is not None:  # the zero page every left-out block names
            pages = np.concatenate([pages, np.zeros((1, *pages.shape[1:]), pages.dtype)])
        out.append(fmt.encode(pages, role, layer, table))
    return out


def state_member(name: str, state: np.ndarray) -> tuple[str, TensorDescriptor, Any]:
    return (name, *row_major_member(state, element_type(state.dtype).tag))


def segment(tensors: Sequence[BlockPagedTensor], states: Sequence[Sequence[np.ndarray]] | None,
            groups: dict[str, Any], identity: str, tokens: int, kv_scales: Any = None
            ) -> KVCacheSnapshot:
    """A hybrid segment of ``tokens`` tokens: the attention members, the end states
    (None: none), the group map; ``kv_scales``: an fp8 cache's, per attention layer."""
    meta = {METADATA_KEY: json.dumps(groups, sort_keys=True, separators=(",", ":")),
            STATE_KEY: states is not None}
    extras = [state_member(state_name(j, k), s) for j, layer in enumerate(states or ())
              for k, s in enumerate(layer)]
    return KVCacheSnapshot.from_tensors(tensors, [tokens], kv_scales, model=identity,
                                        metadata=meta, extras=extras)


def has_states(snap: KVCacheSnapshot) -> bool:
    return snap.metadata.get(STATE_KEY) is True


def groups_of(snap: KVCacheSnapshot) -> dict[str, Any] | None:
    """A segment's group map (None: none, or not JSON)."""
    try:
        found = json.loads(snap.metadata.get(METADATA_KEY, "null"))
    except (TypeError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def states_of(snap: KVCacheSnapshot, layers: Sequence[tuple[Sequence[Sequence[int]],
                                                            Sequence[str]]]
              ) -> list[list[np.ndarray]]:
    """The end states of a segment, ``[layer][part]`` as stored; ``layers``: each Mamba
    layer's ``(shapes, dtypes)`` of its states.  Members are told by their fields and
    order, never by name (D7: a transport may not keep names): the members that are not
    block-paged, in order, each of the dtype and shape its layer's group gives it."""
    found = list(snap.extras)
    need = sum(len(shapes) for shapes, _ in layers)
    if len(found) != need:
        raise HurrayError(f"a stored segment of identity {snap.model!r} holds {len(found)} "
                          f"state members, this engine's {len(layers)} Mamba layers need "
                          f"{need}", field="segment.members", value=len(found),
                          rule="a hybrid segment's end states")
    out = []
    at = 0
    for j, (shapes, dtypes) in enumerate(layers):
        row = []
        for k, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
            _, desc, bufs = found[at]
            at += 1
            where = state_name(j, k)
            et = element_type(desc.type_tag)
            if (et.name, tuple(desc.shape)) != (element_type(dtype).name, tuple(shape)):
                raise HurrayError(f"state member {where} is {et.name} {list(desc.shape)}, "
                                  f"the group map says {dtype} {list(shape)}",
                                  field=f"{where}.shape", value=list(desc.shape),
                                  rule="a hybrid segment's end states")
            raw = np.frombuffer(memoryview(bufs[0]).cast("B"), np.uint8) if len(bufs) else \
                np.zeros(0, np.uint8)
            need = et.nbytes(int(np.prod(desc.shape)))
            if raw.nbytes != need:
                raise HurrayError(f"state member {where} holds {raw.nbytes} bytes, its "
                                  f"{et.name} {list(desc.shape)} need {need}",
                                  field=f"{where}.buffers[0]", value=raw.nbytes,
                                  rule="a state's bytes")
            row.append(raw.view(et.numpy).reshape(desc.shape))
        out.append(row)
    return out


def physical_run(t: BlockPagedTensor, first: int, n: int) -> int | None:
    """The page of ``t``'s pool holding logical page ``first``, when pages ``first ..
    first + n`` are kept there in order (None: they are not)."""
    lo, hi = int(t.seq_ptr[0]) + first, int(t.seq_ptr[0]) + first + n
    table = np.asarray(t.block_table[lo:hi], np.int64)
    if len(table) != n or (n and not np.array_equal(table, table[0] + np.arange(n))):
        return None
    if n and int(table[-1]) >= t.num_pages:
        return None
    return int(table[0]) if n else 0


__all__ = ["encode_layer", "groups_of", "has_states", "page_table", "physical_run", "segment",
           "state_member", "state_name", "states_of"]
