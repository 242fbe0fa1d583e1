"""A request as the connector's scheduler part knows it (``RequestState``): its chunk
keys, what the store holds of its prompt, what it loads, its blocks, what of it is known
stored, and its retention (``scheduler.py`` keeps one per request it was asked about;
``save_plans.py`` reads it to plan the request's saves)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...chunks.keys import ChunkKeys


@dataclass
class RequestState:
    request: Any
    keys: ChunkKeys
    local: int = 0  # tokens vLLM had cached itself when matching
    matched: int = 0  # tokens the store holds for this prompt
    load: int = 0  # tokens to load (0: none)
    located: list[str] = field(default_factory=list)  # segment of each matched chunk
    tiers: list[int | None] = field(default_factory=list)  # with tiers: each one's tier
    # per chunk its lookup asked about (this engine's keys): whether the store lacked it,
    # believed by the plan of the step that asked (``absent_plan``) and no later one
    absent: list[bool] = field(default_factory=list)
    absent_plan: int = 0
    blocks: list[int] = field(default_factory=list)  # of the (first) full-attention group
    groups: list[list[int]] = field(default_factory=list)  # every group's (hybrid models)
    computed: int = 0
    stored: int = 0  # chunks known to be in the store
    rewrite: bool = False  # a load from the store failed: store again, present or not
    # keys of the accepted store formats other than this engine's own (accept_store_dtypes)
    others: list[ChunkKeys] = field(default_factory=list)
    foreign: bool = False  # matched in another format: nothing of it is stored as ours
    asked: list[str] | None = None  # the keys of its lookup (hashed once)
    counted: bool = False  # its lookup's outcome is counted
    async_load: bool = False  # the tokens matched are loaded across steps
    load_failed: bool = False  # a load of it failed: it is not offered one again
    keep: Any = None  # retention.Keep: its kv_transfer_params' pin and ttl_s


__all__ = ["RequestState"]
