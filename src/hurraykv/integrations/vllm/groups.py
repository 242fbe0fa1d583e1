"""vLLM's KV cache groups as the connector stores them (issue 31; no vLLM import).

With its hybrid KV cache manager on (the connector is a ``SupportsHMA``), vLLM hands a
connector one *group* per kind of layer, each with its own block ids
(``kv_cache_config.kv_cache_groups``; ``KVCacheBlocks.get_block_ids()`` is a tuple of
one list per group):

* ``full``: full attention.  A hit of ``N`` tokens needs every page before ``N``.
* ``sliding_window``: attention over the last ``window`` tokens.  A hit of ``N`` tokens
  needs only the pages of tokens ``[N - window + 1, N)``: vLLM allocates null blocks for
  the others (``SlidingWindowManager.get_num_skipped_tokens`` in
  ``vllm/v1/core/single_type_kv_cache_manager.py``), so ``need`` blocks before ``N``.
* ``mamba``: a recurrent state per layer (Mamba, Gated DeltaNet: conv and SSM states)
  in one block per state.  Under vLLM's prefix caching (``mamba_cache_mode`` align)
  block ``i`` holds the state after token ``(i + 1) * block_size`` of a step that ended
  there (``MambaManager.reachable_block_mask``); a hit of ``N`` tokens needs the state
  at ``N``, written into block ``N / block_size - 1``, and nothing else.

A segment stores, for the chunks it holds: every page of the full groups; the pages a
hit at one of its chunk ends needs of the sliding groups (``kept``); the state at its
end of the mamba groups (only a segment ending where a step ended has one, so a hit
ends at the end of a segment: ``scheduler.py``).  Their form in the file is in
``docs/spec-decisions.md`` (H92); ``hybrid.py`` builds and reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

FULL, SLIDING, MAMBA = "full", "sliding_window", "mamba"
# vLLM's null block: the first block of the pool (BlockPool takes it out of its free queue
# at start, vllm/v1/core/block_pool.py); a group's skipped positions name it
NULL_BLOCK = 0
# vLLM's names of the kinds (KVCacheSpecKind, vllm/v1/kv_cache_interface.py), for events
SPEC_KINDS = {FULL: "full_attention", SLIDING: "sliding_window", MAMBA: "mamba"}
METADATA_KEY = "kv_cache_groups"  # the group map in a segment's info metadata (JSON)
STATE_KEY = "kv_cache_states"  # whether a segment holds the Mamba states at its end


@dataclass(frozen=True)
class KVGroup:
    index: int  # vLLM's group index
    kind: str
    layers: tuple[str, ...]  # vLLM's layer names
    block_size: int
    window: int = 0  # sliding_window: tokens attended (the current one included)
    retained: int = 0  # sliding_window: extra trailing tokens vLLM keeps
    shapes: tuple[tuple[int, ...], ...] = ()  # mamba: each state's shape per block
    dtypes: tuple[str, ...] = ()  # mamba: each state's dtype ("bfloat16", "float32")

    @property
    def need(self) -> int:
        """Blocks before a hit's end that a hit needs (0: all of them; mamba: 1)."""
        if self.kind == SLIDING:
            return -(-(self.window - 1 + self.retained) // self.block_size)
        return 1 if self.kind == MAMBA else 0

    def kept(self, first_block: int, n_blocks: int, per: int) -> np.ndarray:
        """Which of blocks ``[first_block, first_block + n_blocks)`` of a segment this
        group stores: a hit may end at any chunk end (every ``per`` blocks) inside it."""
        index = np.arange(first_block, first_block + n_blocks)
        if self.kind != SLIDING:
            return np.ones(n_blocks, bool)
        end = (index // per + 1) * per  # the chunk end each block comes before
        return end - index <= self.need

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "layers": list(self.layers)}
        if self.kind == SLIDING:
            out["window"] = self.window
            if self.retained:  # it moves the pages kept: part of what a segment means
                out["retained"] = self.retained
        if self.kind == MAMBA:
            out["states"] = [{"shape": list(s), "dtype": d}
                             for s, d in zip(self.shapes, self.dtypes, strict=True)]
        return out


@dataclass(frozen=True)
class GroupLayout:
    groups: tuple[KVGroup, ...]
    unsupported: str = ""  # why this layout cannot be stored ("": it can)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def ref(self) -> int:
        """The group whose blocks count the request's tokens: the first of full attention,
        else the first sliding window's (all its blocks are there, the null ones too)."""
        return next((g.index for kind in (FULL, SLIDING) for g in self.groups
                     if g.kind == kind), 0)

    @property
    def mamba(self) -> bool:
        return any(g.kind == MAMBA for g in self.groups)

    @property
    def plain(self) -> bool:
        """One full-attention group: stored as every release before hybrid models did."""
        return len(self.groups) == 1 and self.groups[0].kind == FULL

    def first_storable(self, blocks: list[list[int]], first: int, chunks: int,
                       per: int) -> int:
        """The first chunk of ``[first, chunks)`` from which a segment's pages exist: after
        the last chunk a page of which vLLM holds in its null block (a sliding window's
        blocks before the tokens its own prefix cache found: it never computed them)."""
        start = first
        for g in self.groups:
            if g.kind == MAMBA:
                continue
            ids = np.asarray(blocks[g.index][first * per:chunks * per], np.int64)
            bad = np.flatnonzero(g.kept(first * per, len(ids), per) & (ids == NULL_BLOCK))
            if len(bad):
                start = max(start, first + int(bad[-1]) // per + 1)
        return start

    def states_at(self, blocks: list[list[int]], chunks: int, per: int) -> bool:
        """Every Mamba group holds a state after chunk ``chunks - 1``: its block
        ``chunks * per - 1`` is not null (vLLM: "block i ends at token (i + 1) *
        block_size", ``MambaManager.reachable_block_mask``; a step that ended there, or a
        prefill checkpoint there)."""
        at = chunks * per - 1
        return at >= 0 and all(at < len(blocks[g.index]) and blocks[g.index][at] != NULL_BLOCK
                               for g in self.groups if g.kind == MAMBA)

    def group_of(self, layer: str) -> KVGroup:
        return next(g for g in self.groups if layer in g.layers)

    def attention_layers(self, ordered: list[str]) -> list[str]:
        """The layers stored as pages (full and sliding), in ``ordered``'s order."""
        return [n for n in ordered if self.group_of(n).kind != MAMBA]

    def state_layers(self, ordered: list[str]) -> list[str]:
        return [n for n in ordered if self.group_of(n).kind == MAMBA]

    def describe(self, ordered: list[str]) -> dict[str, Any]:
        """The group map a segment's metadata carries: each group with its layers as the
        indices of its members (attention layers: ``layers.{i}.*``; mamba layers:
        ``states.{i}.*``)."""
        pages, states = self.attention_layers(ordered), self.state_layers(ordered)
        out = []
        for g in self.groups:
            d = g.describe()
            d["members"] = [(states if g.kind == MAMBA else pages).index(n)
                            for n in ordered if n in g.layers]
            d["layers"] = [n for n in ordered if n in g.layers]
            out.append(d)
        return {"block_size": self.groups[0].block_size, "groups": out}

    def identity(self, ordered: list[str]) -> str:
        """The layout in the cache identity: which layer is of which kind, windows and
        state shapes (two engines whose KV is laid out otherwise never share chunks)."""
        parts = []
        for d in self.describe(ordered)["groups"]:
            what = d["kind"] + (f"{d['window']}" if "window" in d else "")
            if "states" in d:
                what += "(" + ",".join(f"{s['dtype']}{s['shape']}" for s in d["states"]) + ")"
            parts.append(f"{what}:{','.join(str(m) for m in d['members'])}")
        return "+".join(parts).replace(" ", "")


def _spec_classes(spec: Any) -> set[str]:
    """The names of a spec's classes (vLLM's own: ``MLAAttentionSpec`` is a
    ``FullAttentionSpec``, ``SlidingWindowMLASpec`` a ``SlidingWindowSpec``)."""
    return {k.__name__ for k in type(spec).__mro__}


def _full(spec: Any) -> bool:
    """Every page allocated: a ``FullAttentionSpec`` (MLA, sinks), or vLLM's
    ``UniformTypeKVCacheSpecs`` of full-attention layers of other page sizes."""
    kinds = _spec_classes(spec)
    if "UniformTypeKVCacheSpecs" in kinds:
        inner = list((getattr(spec, "kv_cache_specs", None) or {}).values())
        return bool(inner) and all(_full(s) for s in inner)
    return "FullAttentionSpec" in kinds


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(kv_cache_config: Any, *, mamba_cache_mode: str = "none") -> GroupLayout:
    """The groups of ``kv_cache_config`` (read by attribute, as vLLM builds it), and why
    they cannot be stored, if so."""
    groups = []
    why = ""
    for i, g in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        spec = g.kv_cache_spec
        kinds = _spec_classes(spec)
        common = {"index": i, "layers": tuple(g.layer_names), "block_size": spec.block_size}
        if "SlidingWindowSpec" in kinds:
            groups.append(KVGroup(kind=SLIDING, window=int(spec.sliding_window),
                                  retained=int(getattr(spec, "extra_retained_tokens", 0) or 0),
                                  **common))
        elif "MambaSpec" in kinds:
            groups.append(KVGroup(kind=MAMBA, shapes=tuple(tuple(s) for s in spec.shapes),
                                  dtypes=tuple(_dtype_name(d) for d in spec.dtypes), **common))
            mode = getattr(spec, "mamba_cache_mode", mamba_cache_mode)
            if mode != "align" and not why:
                why = (f"Mamba layers keep their states at chunk ends only under vLLM's "
                       f"prefix caching (mamba_cache_mode align, here {mode!r}): start vLLM "
                       f"with --enable-prefix-caching")
            if getattr(spec, "num_speculative_blocks", 0) and not why:
                why = "Mamba layers with speculative decoding: not supported"
        elif _full(spec):
            # every page allocated (MLA, sinks; and a sliding window's layers when the hybrid
            # manager is off, its sliding_window set): every page stored and loaded
            groups.append(KVGroup(kind=FULL, **common))
        else:
            name = type(spec).__name__
            groups.append(KVGroup(kind=name, **common))
            why = why or f"KV cache group {i} is a {name}: not supported"
    layout = GroupLayout(tuple(groups))
    if groups and not why:
        if not any(g.kind in (FULL, SLIDING) for g in groups):
            why = "no attention layer: not supported"
        elif len({g.block_size for g in groups}) > 1:
            why = (f"KV cache groups of block sizes {sorted({g.block_size for g in groups})}: "
                   f"not supported (one block size)")
    return GroupLayout(layout.groups, why)


__all__ = ["FULL", "MAMBA", "METADATA_KEY", "NULL_BLOCK", "SLIDING", "SPEC_KINDS", "STATE_KEY",
           "GroupLayout", "KVGroup", "layout_of"]
