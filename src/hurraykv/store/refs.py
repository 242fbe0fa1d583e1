"""Page references of the page store (floor 4): pipelined script calls over many pages.

A page's references are the generations in its owner set (``scripts.py``): ``add`` and
``drop`` are idempotent per generation, so a put or a release that is repeated, after a
crash or by two clients at once, never counts a manifest twice or drops another's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import StoreError, require
from .scripts import MANY, SCRIPTS, STATS, Pipe, Script, legacy_ref_key, owners_key, page_key

BATCH_BYTES = 64 << 20  # bytes per pipeline round trip


@contextlib.contextmanager
def refusing_legacy(error: Callable[[], StoreError]) -> Iterator[None]:
    """A script's HKVLEGACY reply (it met a store of counted references) raised as
    ``error()``; any other Redis error as it is."""
    redis = require("redis", "redis", "the Redis page store")
    try:
        yield
    except redis.ResponseError as e:
        if "HKVLEGACY" not in str(e):
            raise
        raise error() from None


class Refs:
    def __init__(self, client: Any) -> None:
        self.client = client
        self.cluster = hasattr(client, "get_primaries")
        self.scripts = {name: Script(client, lua) for name, lua in SCRIPTS.items()}

    # -- pipelines ---------------------------------------------------------------------
    def pipe(self) -> Pipe:
        """A pipeline whose script calls are sent again where Redis lost its scripts."""
        return Pipe(self.client, self.scripts)

    def batched(self, keys: Sequence[Any], sizes: Sequence[int],
                run: Callable[[Any, Any], Any]) -> list[Any]:
        """Run ``run(pipe, key)`` for every key in pipelines of ~BATCH_BYTES each."""
        out: list[Any] = []
        pipe, pending = self.pipe(), 0
        for key, size in zip(keys, sizes, strict=True):
            run(pipe, key)
            pending += size + 64
            if pending >= BATCH_BYTES:
                out += pipe.execute()
                pipe, pending = self.pipe(), 0
        out += pipe.execute()
        return out

    def _per_page(self, name: str, digests: list[bytes], args: list[Any],
                  keys: Callable[[bytes], list[str]]) -> list[int]:
        """``name`` over every page: one script call per page on a cluster (its keys share
        a slot), hundreds per call on a single server."""
        if self.cluster:
            one = self.scripts[name]
            return [int(n) for n in self.batched(digests, [0] * len(digests), lambda p, d: one(
                keys=keys(d), args=args, client=p))]
        many = self.scripts[name + "_many"]
        groups = [digests[a:a + MANY] for a in range(0, len(digests), MANY)]
        out = self.batched(groups, [0] * len(groups), lambda p, g: many(
            keys=[k for d in g for k in keys(d)], args=args, client=p))
        return [int(n) for group in out for n in group]

    # -- references --------------------------------------------------------------------
    def exists_all(self, digests: list[bytes]) -> list[int]:
        if self.cluster:
            return self.batched(digests, [0] * len(digests), lambda p, d: p.exists(page_key(d)))
        groups = [digests[a:a + MANY] for a in range(0, len(digests), MANY)]
        many = self.scripts["exists_many"]
        out = self.batched(groups, [0] * len(groups), lambda p, g: many(
            keys=[page_key(d) for d in g], client=p))
        return [int(n) for group in out for n in group]

    def add_all(self, digests: list[bytes], generation: bytes) -> list[int]:
        """Add ``generation``'s reference to each page: the owners it then has (0: the
        page is not stored, nothing was added)."""
        with refusing_legacy(lambda: StoreError(
                "a page of this snapshot is also in a snapshot stored by a hurraykv that "
                "counted references without generations: run `hurraykv store fsck URL` once "
                "to upgrade the store", field="page",
                rule="references are generations (manifest version 2)")):
            return self._per_page("addref", digests, [generation], lambda d: [
                page_key(d), owners_key(d), legacy_ref_key(d)])

    def drop_all(self, digests: list[bytes], generation: bytes) -> list[int]:
        """Drop ``generation``'s reference from each page: -1 - size for a page this call
        freed (its last reference), else the owners left."""
        return self._per_page("dropref", digests, [generation],
                              lambda d: [page_key(d), owners_key(d)])

    def release(self, digests: list[bytes], generation: bytes) -> Any:
        """``drop_all``, with what it freed taken off the statistics: a pipeline holding
        those decrements, to run (with whatever the caller adds to it)."""
        freed = [-1 - r for r in self.drop_all(digests, generation) if r < 0]
        pipe = self.pipe()
        pipe.hincrby(STATS, "stored_bytes", -sum(freed))
        pipe.hincrby(STATS, "pages", -len(freed))
        return pipe

    # -- statistics --------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """The statistics hash (``hkv:stats``), each of its four counts there (0 if
        absent); a damaged hash (not a hash, a field not an integer) is ``StoreError``
        naming it (``fsck`` rewrites it)."""
        counts, problem = self.read_stats()
        if problem:
            raise StoreError(f"the statistics are damaged: {problem}; `hurraykv store fsck "
                             "URL` recomputes them", field=STATS, value=problem,
                             rule="a hash of integers")
        return counts

    def read_stats(self) -> tuple[dict[str, int], str]:
        """(the statistics that read as integers, what is wrong with the rest: "" when
        nothing is), never an error for a damaged hash."""
        redis = require("redis", "redis", "the Redis page store")
        try:
            raw = self.client.hgetall(STATS)
        except redis.ResponseError as e:
            if "WRONGTYPE" not in str(e):
                raise
            kind = self.client.type(STATS)
            kind = kind.decode() if isinstance(kind, bytes) else kind
            return dict.fromkeys(STAT_FIELDS, 0), f"{STATS} is a {kind}, not a hash"
        out: dict[str, int] = {}
        problems = []
        for k, v in raw.items():
            name = k.decode(errors="replace") if isinstance(k, bytes) else k
            try:
                out[name] = int(v)
            except ValueError:
                problems.append(f"field {name!r} holds {bytes(v)[:40]!r}, not an integer")
        for k in STAT_FIELDS:
            out.setdefault(k, 0)
        return out, "; ".join(problems)


STAT_FIELDS = ("logical_bytes", "stored_bytes", "pages", "snapshots")
