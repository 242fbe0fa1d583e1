"""``mem://[NAME]``: segments held in this process's own memory, under a byte cap.

The fastest tier a connector can have: a hit never leaves the process.  Every store
opened on the same URL in one process shares one pool (``mem://`` and ``mem://NAME`` are
two pools), so the scheduler's lookups and the worker's loads of one engine process meet
there; another process (another engine, a tensor-parallel worker of its own) has its
own, empty, pool: nothing is shared between processes, nothing survives a restart.

*What it holds.*  A segment is copied at ``put`` into one allocation of its own (the
caller's buffers, a saver's recycled copy-out buffers, may change once ``put`` returns),
as the members of a KVCacheSnapshot: every page pool, ``seq_lens``, ``kv_scales``, the
info member (its identity and the put's metadata) and the checksums written with it.
``get`` hands out zero-copy views of that allocation; ``get_verified`` checks them
against the checksums, as every store does.  ``get_pages`` hands a load the page pools
where they are held, to be placed into the engine's blocks in one pass without hashing
them again (``scatter.memory_source``): what is here was hashed on its way in (a save
hashes the engine's blocks it copied; a copy from another tier is read verified) and
never left the process.

*As the engine holds them.*  An engine whose blocks hold a role's pages transposed
(CPU_ATTN's keys: each head's ``[dims, rows]``) says so once (``hold_as``, by its
connector's worker when it registers its cache); the pool then holds that role's pools
so, transposed at ``put`` (off a hit's path: a save's, a promotion's), and a hit's pages
are copies head by head, as ExampleConnector's and vLLM's CPU tier's are.  Everything
that hands a segment on (``get``, a write-back) transposes them back first: a segment
leaves the pool as the one that came in, checksums and all.  A segment held in another
form than the pool's current one (an engine of another layout registered since) is
read whole (``get_pages`` answers None).

*Capacity.*  ``max_bytes`` is required: a memory tier without a bound is a process that
runs out of memory.  A segment's bytes are its members' (``KVCacheSnapshot.nbytes``).
Past the cap the least recently used segments (a load is a use) go first; those past
their lifetime go whatever the total; a pinned one never goes to make room, and pins hold
at most ``max_pinned_bytes`` (default a quarter of ``max_bytes``).  A segment that cannot
fit (larger than the cap, or the pins leave no room) is refused, a ``HurrayError`` naming
``max_bytes``: the save is dropped, nothing stored is lost.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import ParseResult, unquote, urlparse

import numpy as np

from ..errors import ConfigError, HurrayError
from ..io import retention, scatter
from ..io.scatter import PageSource
from ..snapshot import KVCacheSnapshot
from ..snapshot_members import member_name
from .keys import check_name, identity_key, segment_name
from .registry import ChunkStore, Stored
from .settings import Option


@dataclass
class _Held:
    snapshot: KVCacheSnapshot
    keys: tuple[str, ...]
    nbytes: int
    created: float
    used: float
    version: int
    arena: np.ndarray  # the one allocation the snapshot's members are views of
    # members whose pools ``snapshot`` holds in an engine's form (``hold_as``), not the
    # segment's: ``segment()`` gives them back as they came
    held_as: dict[str, tuple[int, int, int, int]]

    def segment(self) -> KVCacheSnapshot:
        if not self.held_as:
            return self.snapshot
        back = {p.ctypes.data: form for _, p, form in _held_pools(self.snapshot,
                                                                   self.held_as)}

        def unheld(b: Any) -> Any:
            a = np.frombuffer(memoryview(b).cast("B"), np.uint8)
            form = back.get(a.ctypes.data) if len(a) else None
            return b if form is None else memoryview(_segment_form(b, form))

        return KVCacheSnapshot.from_members(
            [(name, desc, [unheld(b) for b in bufs])
             for name, desc, bufs in self.snapshot.members()], owner=self.arena)


class _Pool:
    """One URL's segments, shared by every store opened on it in this process."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.segments: OrderedDict[str, _Held] = OrderedDict()  # oldest use first
        self.aliases: dict[str, str] = {}  # chunk key -> segment name
        self.kept: dict[str, retention.Kept] = {}
        self.total = 0
        self.versions = 0
        self.forms: dict[str, tuple[int, int, int, int]] = {}  # role -> hold_as's form


NAME = re.compile(r"[A-Za-z0-9._-]{0,64}")
_POOLS: dict[str, _Pool] = {}
_POOLS_LOCK = threading.Lock()


def _pool(name: str) -> _Pool:
    with _POOLS_LOCK:
        return _POOLS.setdefault(name, _Pool())


# what a watch of a pool's evictions is handed: makes the segment as it came (None: one
# whose lifetime ended)
Evicted = Callable[[], KVCacheSnapshot] | None


def hold_as(url: str, forms: dict[str, tuple[int, int, int, int]]) -> None:
    """The pool of ``url`` (nothing, for another scheme) holds the page pools of each
    role of ``forms`` in that ``scatter.engine_form`` from its next ``put`` on (an empty
    ``forms``: as segments); the process's engine says so when it registers its cache."""
    parsed = urlparse(url)
    if parsed.scheme == "mem":
        _pool(unquote(parsed.netloc)).forms = dict(forms)


def _held_pools(snapshot: KVCacheSnapshot, forms: dict[str, tuple[int, int, int, int]]
                ) -> list[tuple[str, np.ndarray, tuple[int, int, int, int]]]:
    """The page pools of ``snapshot`` to hold in an engine's form, with their member's
    name: ``forms`` by member name (a pool that is not that form's pages is held as it
    is)."""
    out = []
    for layer in range(snapshot.num_layers):
        for role, t in zip(snapshot.roles, snapshot.layer(layer), strict=True):
            form = forms.get(member_name(layer, role))
            pool = t.page_pool
            if form is not None and pool.flags.c_contiguous and pool.ndim == 4 and \
                    tuple(pool.shape[1:]) == form[:3] and pool.itemsize == form[3]:
                out.append((member_name(layer, role), pool, form))
    return out


def _into_form(out: np.ndarray, pool: np.ndarray, form: tuple[int, int, int, int]) -> None:
    """The pages of ``pool`` (bytes) written into ``out`` (bytes) in ``form``: by the
    compiled reader, as a load transposes a segment's pages into CPU_ATTN's blocks (3x
    NumPy's strided copy: a save's time), else by NumPy."""
    rows, heads, dims, elem = form
    size = rows * heads * dims * elem
    if not scatter.available() or pool.ctypes.data % 8:
        typed = scatter.WIDTHS[elem]
        out.view(typed).reshape(-1, heads, dims, rows)[...] = \
            pool.view(typed).reshape(-1, rows, heads, dims).transpose(0, 2, 3, 1)
        return
    pages = len(pool) // size
    dest = scatter.destination(out, 0, size, (rows, heads, dims * elem, elem, elem,
                                              rows * dims * elem, rows * elem), pages)
    run = scatter.Scatter()
    run.add(scatter.memory_source("put", pool, {"pages": (0, size, pages)}), "pages", 0,
            range(pages), dest, None)
    run.run()


def _segment_form(held: Any, form: tuple[int, int, int, int]) -> np.ndarray:
    """Pages held in ``form`` (each head's ``[dims, rows]``) copied back into the
    segment's ``[rows, heads, dims]``."""
    rows, heads, dims, elem = form
    a = np.frombuffer(memoryview(held).cast("B"), scatter.WIDTHS[elem])
    return a.reshape(-1, heads, dims, rows).transpose(0, 3, 1, 2).copy()


ALIGN = 64  # each buffer's start in a segment's allocation: a cache line


def copied(snapshot: KVCacheSnapshot, forms: dict[str, tuple[int, int, int, int]]
           | None = None) -> tuple[KVCacheSnapshot, int, np.ndarray,
                                   dict[str, tuple[int, int, int, int]]]:
    """``snapshot`` with every member's bytes copied into one allocation, each buffer on
    a cache line (``ALIGN``: a load copies a page's rows from where they are held), as
    read-only views (its pages are placed unhashed: nothing may change them); the page
    pools of ``forms``' members (``_held_pools``) transposed into that form on the way.
    Its bytes (the members', as ``KVCacheSnapshot.nbytes``: the padding, under ``ALIGN``
    a buffer, is not counted), the allocation, and the members held transposed."""
    held = _held_pools(snapshot, forms or {})
    transposed = {p.ctypes.data: form for _, p, form in held}
    members = list(snapshot.members())
    sizes = [[memoryview(b).nbytes for b in bufs] for _, _, bufs in members]
    total = sum(map(sum, sizes))
    room = sum(-(-n // ALIGN) * ALIGN for n in (x for row in sizes for x in row))
    arena = np.empty(max(room, 1) + ALIGN, np.uint8)
    start = -arena.ctypes.data % ALIGN
    at, spans = start, []
    for (_, _, bufs), lengths in zip(members, sizes, strict=True):
        for b, n in zip(bufs, lengths, strict=True):
            src = np.frombuffer(memoryview(b).cast("B"), np.uint8)
            form = transposed.get(src.ctypes.data) if n else None
            if form is None:
                arena[at:at + n] = src
            else:
                _into_form(arena[at:at + n], src, form)
            spans.append((at, n))
            at += -(-n // ALIGN) * ALIGN
    frozen = arena.view()
    frozen.flags.writeable = False
    placed = iter(spans)
    items = [(name, desc, [memoryview(frozen[a:a + n]) for a, n in
                           (next(placed) for _ in lengths)])
             for (name, desc, _), lengths in zip(members, sizes, strict=True)]
    return (KVCacheSnapshot.from_members(items, owner=arena), total, arena,
            {member: form for member, _, form in held})


class MemoryChunks(ChunkStore):
    """``mem://[NAME]``: this process's memory (the module docstring)."""

    SCHEMES = ("mem",)
    FORM = "mem://[NAME]"
    LOCAL = True
    IN_PROCESS = True
    BOUNDED = True
    OPTIONS = (
        Option("max_bytes", "size", "Capacity of a ``mem://`` tier (``\"8G\"`` or bytes), "
               "required: past it the least recently used segments are dropped."),
        Option("max_pinned_bytes", "size", "Of a ``mem://`` tier's ``max_bytes``, the most "
               "that pinned segments may hold.  Default: a quarter of ``max_bytes``."),
    )
    CAPACITY = "max_bytes"

    def __init__(self, name: str = "", *, max_bytes: int,
                 max_pinned_bytes: int | None = None) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
            raise HurrayError(f"a mem:// store's max_bytes is {max_bytes!r}; it is a "
                              "positive number of bytes (a memory tier is bounded)",
                              field="max_bytes", value=max_bytes, rule="max_bytes > 0")
        self.url = f"mem://{name}"
        self.max_bytes = max_bytes
        self.max_pinned = max_pinned_bytes if max_pinned_bytes is not None \
            else max_bytes // 4
        self._pool = _pool(name)
        self.evictions = 0
        self.evicted_bytes = 0
        self._evicted: Callable[[tuple[str, ...], int, Evicted], None] | None = None

    @classmethod
    def url_problem(cls, parsed: ParseResult) -> str:
        if parsed.path not in ("", "/"):
            return (f"a mem:// pool is named by its host part only (mem://NAME), not the "
                    f"path {parsed.path!r}")
        if NAME.fullmatch(parsed.netloc) is None:
            return (f"its pool name {parsed.netloc[:80]!r} is not 0-64 letters, digits, "
                    "'.', '_' or '-'")
        return ""

    @classmethod
    def check_options(cls, options: Any, named: Callable[[str], str]) -> None:
        if "max_bytes" not in options:
            raise ConfigError(f"a mem:// store needs {named('max_bytes')}: a memory tier "
                              "without a bound is a process that runs out of memory",
                              field="max_bytes", rule="max_bytes is set for mem://")

    @classmethod
    def open(cls, url: str, parsed: ParseResult, *, timeout: float | None,
             **options: Any) -> MemoryChunks:
        return cls(unquote(parsed.netloc), **options)

    def watch_evictions(self, callback: Callable[[tuple[str, ...], int, Evicted], None]
                        ) -> bool:
        """Tell ``callback`` of each segment this store drops (its keys, its first chunk,
        and ``Evicted``: what makes the segment as it came, for a stack's ``write_back`` to
        send down a tier, made only if called; None for one whose lifetime ended, gone for
        good), after the put that dropped it."""
        self._evicted = callback
        return True

    # -- lookups and reads ---------------------------------------------------------------
    def _live(self, name: str, now: float) -> _Held | None:
        held = self._pool.segments.get(name)
        k = self._pool.kept.get(name)
        if held is None or (k is not None and k.expired(now)):
            return None
        return held

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        pool, now = self._pool, time.time()
        with pool.lock:
            out = []
            for key in keys:
                name = pool.aliases.get(key)
                out.append(name if name is not None and self._live(name, now) else None)
            return out

    def _used(self, name: str) -> _Held:
        pool = self._pool
        with pool.lock:
            held = self._live(name, time.time())
            if held is None:
                raise HurrayError(f"segment {name} is not in {self.url}", field="segment",
                                  value=name, rule="a stored segment")
            held.used = time.time()
            pool.segments.move_to_end(name)  # a load is a use
            return held

    def get(self, name: str) -> KVCacheSnapshot:
        return self._used(name).segment()

    def get_pages(self, name: str, members: frozenset[str]
                  ) -> tuple[KVCacheSnapshot, PageSource] | None:
        """Segment ``name`` and the page pools of ``members`` where they are held, for
        ``io.scatter`` to place straight into an engine's blocks, unhashed
        (``scatter.memory_source`` says why); None without the compiled reader."""
        if not scatter.available():
            return None
        held = self._used(name)
        if held.held_as and any(self._pool.forms.get(m.rsplit(".", 1)[-1]) != f
                                for m, f in held.held_as.items()):
            return None  # held for an engine of another layout: read whole (get)
        snap, base = held.snapshot, held.arena.ctypes.data
        places = {}
        for layer in range(snap.num_layers):
            for role, t in zip(snap.roles, snap.layer(layer), strict=True):
                member = member_name(layer, role)
                pool = t.page_pool
                if member in members and pool.flags.c_contiguous and len(pool):
                    places[member] = (pool.ctypes.data - base, pool.nbytes // len(pool),
                                      len(pool))
        return snap, scatter.memory_source(name, held.arena, places, held.held_as)

    def exists(self, names: Sequence[str]) -> list[bool]:
        now = time.time()
        with self._pool.lock:
            return [self._live(n, now) is not None for n in names]

    def catalog(self) -> list[Stored]:
        pool, now = self._pool, time.time()
        with pool.lock:
            out = []
            for name, held in pool.segments.items():
                k = pool.kept.get(name)
                if k is not None and k.expired(now):
                    continue
                model = held.snapshot.model
                out.append(Stored(name, held.nbytes, identity_key(model) if model else None,
                                  model, created=held.created, used=held.used,
                                  pinned=bool(k and k.pinned),
                                  expiry=k.expiry if k else None, version=held.version))
            return out

    # -- writes ---------------------------------------------------------------------------
    def put(self, keys: Sequence[str], first: int, snapshot: KVCacheSnapshot,
            metadata: dict[str, Any]) -> None:
        name = check_name(segment_name(keys, first))
        forms = {member_name(layer, role): form for role, form in self._pool.forms.items()
                 for layer in range(snapshot.num_layers)}
        snap, nbytes, arena, held_as = copied(snapshot.with_info(metadata=metadata), forms)
        if nbytes > self.max_bytes:
            raise HurrayError(f"segment {name} of {nbytes} bytes is larger than max_bytes "
                              f"{self.max_bytes}: not stored", field="max_bytes",
                              value=nbytes, rule="a segment fits in max_bytes")
        pool, now = self._pool, time.time()
        with pool.lock:
            old = pool.kept.get(name)
            if old is not None and old.expired(now):  # stored again: a new segment
                del pool.kept[name]
            dropped = self._make_room(nbytes, name, now)
            self._drop(name)
            pool.versions += 1
            pool.segments[name] = _Held(snap, tuple(keys), nbytes, now, now, pool.versions,
                                        arena, held_as)
            pool.total += nbytes
            pool.aliases.update((key, name) for key in keys)
        if self._evicted is not None:  # outside the pool's lock
            for held, victim, expired in dropped:
                self._evicted(held.keys, int(victim.rsplit("-", 1)[1]),
                              None if expired else held.segment)

    def _make_room(self, nbytes: int, keep: str, now: float
                   ) -> list[tuple[_Held, str, bool]]:
        """Drop what is past its lifetime, then the least recently used unpinned
        segments, until ``nbytes`` more fit (under the pool's lock); those dropped to
        make room."""
        pool = self._pool
        dropped = []  # (segment, name, past its lifetime)
        for name in [n for n, k in pool.kept.items() if k.expired(now) and n != keep]:
            if name in pool.segments:
                dropped.append((pool.segments[name], name, True))
            self._drop(name)
            del pool.kept[name]
        replaced = pool.segments[keep].nbytes if keep in pool.segments else 0
        need = pool.total - replaced + nbytes - self.max_bytes
        if need <= 0:
            return dropped
        victims, freed = [], 0
        for name, held in pool.segments.items():  # oldest use first
            k = pool.kept.get(name)
            if name == keep or (k is not None and k.pinned):
                continue  # pinned: never dropped to make room
            victims.append(name)
            freed += held.nbytes
            if freed >= need:
                break
        if freed < need:
            raise HurrayError(f"no room for segment {keep} of {nbytes} bytes in max_bytes "
                              f"{self.max_bytes}: pinned segments hold the rest; not stored",
                              field="max_bytes", value=nbytes,
                              rule="pinned segments and a new one fit in max_bytes")
        for name in victims:
            dropped.append((pool.segments[name], name, False))
            self.evicted_bytes += pool.segments[name].nbytes
            self._drop(name)
            self.evictions += 1
        return dropped

    def _drop(self, name: str) -> bool:
        """Forget segment ``name`` (its aliases then reach nothing: a miss)."""
        pool = self._pool
        held = pool.segments.pop(name, None)
        if held is None:
            return False
        pool.total -= held.nbytes
        for key in held.keys:  # those another segment took over since stay its
            if pool.aliases.get(key) == name:
                del pool.aliases[key]
        return True

    def remove(self, name: str) -> bool:
        with self._pool.lock:
            self._pool.kept.pop(name, None)
            return self._drop(name)

    def discard(self, name: str) -> None:
        self.remove(name)

    def retain(self, names: Sequence[str], *, pin: bool | None, ttl_s: float | None,
               extend: bool = False) -> list[str]:
        pool, now = self._pool, time.time()
        with pool.lock:
            present = {}
            for name in dict.fromkeys(names):
                held = self._live(name, now)
                if held is not None:
                    present[name] = held.nbytes
            pool.kept = retention.updated(pool.kept, present, pin=pin, ttl_s=ttl_s,
                                          max_pinned=self.max_pinned, now=now,
                                          extend=extend)
            return list(present)


__all__ = ["MemoryChunks"]
